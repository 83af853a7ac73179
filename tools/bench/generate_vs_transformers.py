"""Benchmark: `kvlens generate` against Hugging Face transformers (the anchor), same checkpoint,
same prompt and image, measured in the same run, on the CPU (`cargo xtask bench`) or on a CUDA GPU
(`--device cuda`, from the folder `cargo xtask gpu-check` prepares). Prints prefill and decode
tokens/s for each weight format, the ratios, and each format's decode roofline: the host's read
bandwidth (`kvlens bench bandwidth`) over the bytes one decode step reads. The host's bandwidth is
read right before and right after each kvlens run (its decode is the run's last phase): a shared
machine's bandwidth moves by tens of percent within minutes, so each format is held to the mean
of the two readings around it, and also shown against the highest reading of the run."""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# `--cpu-isa avx2`: both engines on the code an AVX2 laptop would run, on whatever CPU this is.
# torch's three CPU libraries read their caps when loaded, so they are set before the import: ATen's
# own kernels, oneDNN's, and MKL's GEMM (which the other two leave free to use AVX-512). kvlens
# reads KVLENS_CPU_ISA; `cargo xtask bench --cpu-isa avx2` also builds it without gemm's AVX-512.
AVX2_ENV = {"KVLENS_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
if "--cpu-isa=avx2" in sys.argv or any(a == "--cpu-isa" and b == "avx2" for a, b in zip(sys.argv, sys.argv[1:])):
    os.environ.update(AVX2_ENV)

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.generation.streamers import BaseStreamer

try:  # transformers 5.2x; the GPU machine's older transformers has the PIL processor under its own name
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
except ImportError:
    from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil

PROMPT = "Describe this image in detail."


def make_image(path, width, height):
    """A deterministic photo-like test image (smooth gradients plus noise)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(path)


def cuda_copy_bandwidth_gb_s(reps=5):
    """Sustained device-to-device copy bandwidth (read + write) of a 1 GiB array, best of reps."""
    a = torch.ones(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def host_bandwidth(kvlens):
    """Read and copy bandwidth of the host, all cores (`kvlens bench bandwidth --json`)."""
    out = subprocess.run([kvlens, "bench", "bandwidth", "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"


def run_kvlens(kvlens, ckpt, image, max_tokens, extra):
    """One `kvlens generate --json`, with its load time (from its log line) and its peak resident
    memory (the child's own maxrss, from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(
            [kvlens, "generate", "--model", ckpt, "--prompt", PROMPT, "--image", image,
             "--max-tokens", str(max_tokens), "--ignore-eos", "--json"] + extra, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        log = err.read()
        if p.returncode != 0:
            raise RuntimeError(f"kvlens generate {' '.join(extra)} failed:\n{log[-3000:]}")
        result = json.loads(out.read())
    load = re.search(r"Loading model weights took [0-9.]+ GiB and ([0-9.]+) seconds", log)
    result["load_s"] = float(load.group(1)) if load else None
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024
    return result


class TokenTimes(BaseStreamer):
    """Records when generate hands over the prompt and each new token (one generate call)."""

    def __init__(self, device):
        self.start = 0.0
        self.times = []
        self.device = device

    def put(self, value):
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_transformers(ckpt, image, max_tokens, dtype, device):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa").to(device)
    proc = AutoProcessor.from_pretrained(ckpt)
    proc.image_processor = Qwen2VLImageProcessorPil.from_pretrained(ckpt)
    msgs = [{"role": "user", "content": [{"type": "image", "url": image}, {"type": "text", "text": PROMPT}]}]
    inputs = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt").to(device)
    prompt_len = inputs["input_ids"].shape[1]
    stamps = TokenTimes(device)
    with torch.inference_mode():
        stamps.start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             streamer=stamps)
        total = time.perf_counter() - stamps.start
    generated = out.shape[1] - prompt_len
    # The streamer sees the prompt first, then each new token: prefill ends at the first new token.
    prefill = stamps.times[1] - stamps.start
    decode = total - prefill
    return {
        "prompt_tokens": prompt_len,
        "prefill_s": prefill,
        "prefill_tokens_per_s": prompt_len / prefill,
        "decode_tokens": generated - 1,
        "decode_s": decode,
        "decode_tokens_per_s": (generated - 1) / decode,
        "token_ids": out[0, prompt_len:].tolist(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvlens", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--config", default="Qwen3-VL-2B-Instruct")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: kvlens --backend cuda with bf16 weights, transformers on the GPU")
    ap.add_argument("--formats", default="none,bf16,q8_0,q4_0",
                    help="comma-separated weight formats to run kvlens with (cpu): none (f32), bf16 "
                         "(--dtype bfloat16) or a --quantization value")
    ap.add_argument("--anchors", default="f32,bf16", help="comma-separated transformers dtypes: f32, bf16")
    ap.add_argument("--cpu-isa", choices=["avx2"], help="cap both engines at AVX2 (see AVX2_ENV)")
    a = ap.parse_args()
    anchors = [f"transformers_{d}" for d in a.anchors.split(",")]
    if a.device == "cuda":
        runs = [("kvlens cuda (bf16 w)", ["--backend", "cuda", "--dtype", "bfloat16"])]
    else:
        runs = [(f"kvlens {'f32' if f == 'none' else f}",
                 ["--dtype", "bfloat16"] if f == "bf16" else ["--quantization", f]) for f in a.formats.split(",")]
    os.makedirs(a.work, exist_ok=True)
    ckpt = os.path.join(a.work, a.config + "-random-bf16")
    if not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")) and \
            not os.path.exists(os.path.join(ckpt, "model.safetensors")):
        subprocess.run([a.kvlens, "random-checkpoint", "--config", a.config, "--out", ckpt, "--dtype", "bf16",
                        "--seed", "0", "--force"], check=True)
    image = os.path.join(a.work, "photo_1024x768.png")
    make_image(image, 1024, 768)

    device = torch.cuda.get_device_name(0) if a.device == "cuda" else cpu_model()
    results = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                           "device": device, "cpu_isa_env": {k: os.environ.get(k) for k in AVX2_ENV}}}
    if a.device == "cuda":
        results["bandwidth"] = {"read_gb_s": cuda_copy_bandwidth_gb_s(), "kind": "device copy (read + write)"}
    else:
        results["bandwidth"] = dict(host_bandwidth(a.kvlens), kind="host read, all cores")
    bw = results["bandwidth"]["read_gb_s"]
    results["kvlens"] = {}
    # The device's copy bandwidth holds still; the host's is read around each run.
    read_now = (lambda: bw) if a.device == "cuda" else (lambda: host_bandwidth(a.kvlens)["read_gb_s"])
    for i, (label, extra) in enumerate(runs):
        before = bw if i == 0 else read_now()
        k = run_kvlens(a.kvlens, ckpt, image, a.max_tokens, extra)
        k["bandwidth_before_gb_s"], k["bandwidth_after_gb_s"] = before, read_now()
        k["bandwidth_gb_s"] = (before + k["bandwidth_after_gb_s"]) / 2
        results["kvlens"][label] = k
    best_bw = max([bw] + [k[f"bandwidth_{when}_gb_s"] for k in results["kvlens"].values() for when in ("before", "after")])
    for ref in anchors:
        dtype = torch.float32 if ref == "transformers_f32" else torch.bfloat16
        results[ref] = run_transformers(ckpt, image, a.max_tokens, dtype, a.device)

    print(f"{a.config} random checkpoint, one 1024x768 image, {a.max_tokens} new tokens, "
          f"{device}, {os.cpu_count()} CPUs" + (", both engines capped at AVX2" if a.cpu_isa else ""))
    print(f"bandwidth: {bw:.1f} GB/s before the runs, {best_bw:.1f} GB/s the highest reading "
          f"({results['bandwidth']['kind']})")
    print(f"{'engine':<22}{'prompt':>8}{'prefill tok/s':>15}{'decode tok/s':>14}{'weights GB':>12}"
          f"{'read/token GB':>15}{'bw before/after':>17}{'roofline tok/s':>16}{'of roofline':>13}"
          f"{'of best bw':>12}{'load s':>8}{'peak RSS GB':>13}")
    for label, k in results["kvlens"].items():
        t, w = k["timing"], k["weights"]
        # Bytes a decode step reads: the weights it multiplies and the KV cache it attends over.
        read = w["decode_read_bytes_per_token"] + w.get("decode_kv_read_bytes_per_token", 0)
        roof = k["bandwidth_gb_s"] * 1e9 / read
        k["roofline_decode_tokens_per_s"] = roof
        k["roofline_at_best_bandwidth_tokens_per_s"] = best_bw * 1e9 / read
        print(f"{label:<22}{len(k['prompt_token_ids']):>8}{t['prefill_tokens_per_s']:>15.1f}"
              f"{t['decode_tokens_per_s']:>14.2f}{w['bytes'] / 1e9:>12.2f}{read / 1e9:>15.2f}"
              f"{k['bandwidth_before_gb_s']:>9.1f}/{k['bandwidth_after_gb_s']:<7.1f}{roof:>16.2f}{t['decode_tokens_per_s'] / roof:>13.0%}"
              f"{t['decode_tokens_per_s'] * read / (best_bw * 1e9):>12.0%}{k['load_s'] or 0:>8.1f}"
              f"{k['peak_rss_bytes'] / 1e9:>13.2f}")
    kernels = next((k["timing"].get("cpu_kernels") for k in results["kvlens"].values()), None)
    if kernels:
        print(f"kvlens kernels: {kernels}")
    for ref in anchors:
        r = results[ref]
        print(f"{ref.replace('_', ' '):<22}{r['prompt_tokens']:>8}{r['prefill_tokens_per_s']:>15.1f}"
              f"{r['decode_tokens_per_s']:>14.2f}")
    for label, k in results["kvlens"].items():
        t = k["timing"]
        print(f"{label}: " + ", ".join(
            f"{t['prefill_tokens_per_s'] / results[ref]['prefill_tokens_per_s']:.2f}x prefill / "
            f"{t['decode_tokens_per_s'] / results[ref]['decode_tokens_per_s']:.2f}x decode of {ref.replace('_', ' ')}"
            for ref in anchors))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
