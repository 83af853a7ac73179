#!/usr/bin/env bash
# Runs the GPU checks from the folder `cargo xtask gpu-check` prepared: ./run.sh OUT [check.py args]
# (see check.py for the steps). The CUDA 13 (or 12) NVRTC and cuBLAS libraries are found in
# PyTorch's nvidia-* pip packages when they are not on the library path already; the driver's
# libcuda.so.1 comes from the system. Where the system has no Vulkan loader, the Debian packages in
# vulkan/ are unpacked into / (the GPU machine runs this as root) and the NVIDIA ICD is named.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh OUT [check.py args]}"
shift
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
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
if ! ldconfig -p | grep -q 'libvulkan\.so\.1' && [ "$(id -u)" = 0 ] && ls "$here"/vulkan/*.deb >/dev/null 2>&1; then
    for f in "$here"/vulkan/*.deb; do dpkg -x "$f" /; done
    ldconfig
    echo "unpacked the Vulkan loader from $here/vulkan"
fi
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ]; then
    export VK_DRIVER_FILES="$icd"
    echo "VK_DRIVER_FILES=$icd"
fi
# The binaries and the tokenizer travel gzipped (the working tree travels with them, 64 MiB in all).
for f in kvlens engine-cuda-tests tokenizer.json; do
    if [ -f "$here/$f.gz" ] && [ ! -f "$here/$f" ]; then
        gunzip -kf "$here/$f.gz"
        [ "$f" = tokenizer.json ] || chmod +x "$here/$f"
    fi
done
export PYTHONUNBUFFERED=1
exec "$python" "$here/check.py" --out "$out" "$@"
