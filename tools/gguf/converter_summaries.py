#!/usr/bin/env python3
"""Summaries of the GGUF files llama.cpp's own converter writes for kvlens' tiny random checkpoints,
for server/tests/gguf.rs to hold `kvlens to-gguf` against (run once; the small JSON outputs are
committed, so CI needs neither torch nor the converter).

For each family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) this writes the tiny checkpoint with
`kvlens random-checkpoint` (float32, seed 0, the golden image limits), converts it with
`convert_hf_to_gguf.py` (text) and `convert_hf_to_gguf.py --mmproj` (projector) at f32, f16, bf16
and q8_0, and writes engine/tests/fixtures/gguf/<family>.converter.json: for each file every
metadata entry (arrays longer than 16 as their length and a SHA-256 of their items) and every
tensor's type, dimensions and the SHA-256 of its bytes. `general.name` and `general.size_label`
are left out: the converter makes them from the folder's name.

The converter maps `visual.merger.mlp.{bid}` only for bid below the vision block count, so the
tiny checkpoints' 2-block towers cannot map `mlp.2`; this script widens the name map to 4 blocks
(real towers have 24 or more), nothing else.

Needs the llama-cpp-python sdist's vendor/llama.cpp (convert_hf_to_gguf.py, conversion/, gguf-py)
and a venv with torch and transformers (the golden venv):

    PYTHONPATH=$LLAMA/gguf-py:$LLAMA ~/.cache/kvlens/golden-venv/bin/python tools/gguf/converter_summaries.py \
        --llama $LLAMA --kvlens target/debug/kvlens
"""

from __future__ import annotations

import argparse
import hashlib
import json
import runpy
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "engine" / "tests" / "fixtures" / "gguf"
FAMILIES = {
    "qwen2_vl": ("qwen2_vl_tiny.json", "3136,50176"),
    "qwen2_5_vl": ("qwen2_5_vl_tiny.json", "3136,50176"),
    "qwen3_vl": ("qwen3_vl_tiny.json", "1024,65536"),
}
OUTTYPES = ["f32", "f16", "bf16", "q8_0"]
SKIPPED = {"general.name", "general.size_label"}
PACK = {"UINT8": "<B", "INT8": "<b", "UINT16": "<H", "INT16": "<h", "UINT32": "<I", "INT32": "<i",
        "FLOAT32": "<f", "BOOL": "<?", "UINT64": "<Q", "INT64": "<q", "FLOAT64": "<d"}


def item_bytes(kind: str, value) -> bytes:
    """One array item as hashed: a string's UTF-8 bytes and a NUL, a number packed as stored."""
    if kind == "STRING":
        return value.encode() + b"\0"
    return struct.pack(PACK[kind], value)


def summarize(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in SKIPPED:
            continue
        kinds = [t.name for t in field.types]
        value = field.contents()
        if kinds[0] == "ARRAY" and len(value) > 16:
            digest = hashlib.sha256(b"".join(item_bytes(kinds[1], v) for v in value)).hexdigest()
            value = {"len": len(value), "sha256": digest}
        metadata[key] = {"type": "/".join(kinds), "value": value}
    tensors = {
        t.name: {
            "type": t.tensor_type.name,
            "ne": [int(n) for n in t.shape],
            "sha256": hashlib.sha256(t.data.tobytes()).hexdigest(),
        }
        for t in reader.tensors
    }
    return {"metadata": metadata, "tensors": tensors}


def convert(llama: Path, ckpt: Path, outtype: str, out: Path, mmproj: bool) -> None:
    args = [str(ckpt), "--outtype", outtype, "--outfile", str(out)] + (["--mmproj"] if mmproj else [])
    code = (
        "import sys, runpy, gguf\n"
        "orig = gguf.get_tensor_name_map\n"
        "gguf.get_tensor_name_map = lambda arch, n: orig(arch, max(n, 4))\n"
        f"sys.argv = ['convert_hf_to_gguf.py'] + {args!r}\n"
        "runpy.run_path('convert_hf_to_gguf.py', run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=llama, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama", type=Path, required=True, help="the sdist's vendor/llama.cpp")
    ap.add_argument("--kvlens", required=True, help="a built kvlens binary")
    args = ap.parse_args()
    version = args.llama.resolve().parents[1].name.removeprefix("llama_cpp_python-")
    with tempfile.TemporaryDirectory(prefix="kvlens-gguf-") as work:
        work = Path(work)
        for family, (config, limits) in FAMILIES.items():
            ckpt = work / family
            subprocess.run([args.kvlens, "random-checkpoint", "--config", f"tools/golden/configs/{config}",
                            "--out", str(ckpt), "--dtype", "f32", "--seed", "0", "--image-limits", limits, "--force"],
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            files = {}
            for outtype in OUTTYPES:
                pair = {}
                for part, mmproj in [("text", False), ("mmproj", True)]:
                    out = work / f"{family}.{part}.{outtype}.gguf"
                    convert(args.llama, ckpt, outtype, out, mmproj)
                    pair[part] = summarize(out)
                files[outtype] = pair
            summary = {
                "family": family,
                "generated_by": "tools/gguf/converter_summaries.py",
                "converter": f"convert_hf_to_gguf.py of llama-cpp-python {version} (vendor/llama.cpp)",
                "checkpoint": f"kvlens random-checkpoint --config tools/golden/configs/{config} --dtype f32 --seed 0 --image-limits {limits}",
                "files": files,
            }
            (OUT / f"{family}.converter.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
            print(f"{family}: {sum(len(p['text']['tensors']) + len(p['mmproj']['tensors']) for p in files.values())} tensors")


if __name__ == "__main__":
    main()
