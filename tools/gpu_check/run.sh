#!/usr/bin/env bash
# Runs the CUDA checks from the folder `cargo xtask gpu-check` prepared: ./run.sh OUT [check.py args]
# The CUDA 13 (or 12) NVRTC and cuBLAS libraries are found in PyTorch's nvidia-* pip packages when
# they are not on the library path already; the driver's libcuda.so.1 comes from the system.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh OUT [check.py args]}"
shift
python="${PYTHON:-python3}"
libs="$("$python" - <<'PY'
import glob, os, site
dirs = set()
for root in site.getsitepackages() + [site.getusersitepackages()]:
    for pattern in ("nvidia/*/lib/libnvrtc.so*", "nvidia/*/lib/libcublas.so*", "nvidia/cu*/lib/libnvrtc.so*",
                    "nvidia/cu*/lib/libcublas*.so*"):
        dirs.update(os.path.dirname(p) for p in glob.glob(os.path.join(root, pattern)))
print(":".join(sorted(dirs)))
PY
)"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
mkdir -p "$out"
exec "$python" "$here/check.py" --out "$out" "$@"
