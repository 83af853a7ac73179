"""Benchmark: `kvlens generate` against Hugging Face transformers (the anchor), same checkpoint,
same prompt and image, measured in the same run, on the CPU (`cargo xtask bench`) or on a CUDA GPU
(`--device cuda`, from the folder `cargo xtask gpu-check` prepares). Prints prefill and decode
tokens/s, the ratios, and the decode memory-bandwidth roofline."""

import argparse
import json
import os
import subprocess
import time

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.generation.streamers import BaseStreamer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

PROMPT = "Describe this image in detail."


def make_image(path, width, height):
    """A deterministic photo-like test image (smooth gradients plus noise)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(path)


def memory_bandwidth_gb_s(device):
    """Sustained copy bandwidth (read + write) of a 1 GiB array, best of three."""
    if device == "cuda":
        a = torch.ones(1 << 28, dtype=torch.float32, device="cuda")
        b = torch.empty_like(a)
        best = 0.0
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            b.copy_(a)
            torch.cuda.synchronize()
            best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9)
        return best
    a = np.ones(1 << 28, dtype=np.float32)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def run_kvlens(kvlens, ckpt, image, max_tokens, extra):
    out = subprocess.run(
        [kvlens, "generate", "--model", ckpt, "--prompt", PROMPT, "--image", image,
         "--max-tokens", str(max_tokens), "--ignore-eos", "--json"] + extra,
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


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
    a = ap.parse_args()
    extra = ["--backend", "cuda", "--dtype", "bfloat16"] if a.device == "cuda" else []
    label = "kvlens cuda (bf16 w)" if a.device == "cuda" else "kvlens (f32)"
    os.makedirs(a.work, exist_ok=True)
    ckpt = os.path.join(a.work, a.config + "-random-bf16")
    if not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")) and \
            not os.path.exists(os.path.join(ckpt, "model.safetensors")):
        subprocess.run([a.kvlens, "random-checkpoint", "--config", a.config, "--out", ckpt, "--dtype", "bf16",
                        "--seed", "0", "--force"], check=True)
    image = os.path.join(a.work, "photo_1024x768.png")
    make_image(image, 1024, 768)

    results = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                           "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"}}
    results["memory_bandwidth_gb_s"] = memory_bandwidth_gb_s(a.device)
    results["kvlens"] = run_kvlens(a.kvlens, ckpt, image, a.max_tokens, extra)
    results["transformers_f32"] = run_transformers(ckpt, image, a.max_tokens, torch.float32, a.device)
    results["transformers_bf16"] = run_transformers(ckpt, image, a.max_tokens, torch.bfloat16, a.device)
    k = results["kvlens"]["timing"]
    weights = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    f32_bytes = weights * 2  # bf16 weights widened to f32
    results["roofline_decode_tokens_per_s_f32"] = results["memory_bandwidth_gb_s"] * 1e9 / f32_bytes
    results["roofline_decode_tokens_per_s_bf16"] = results["memory_bandwidth_gb_s"] * 1e9 / weights

    print(f"{a.config} random checkpoint, one 1024x768 image, {a.max_tokens} new tokens, "
          f"{results['machine']['device']}, {os.cpu_count()} CPUs")
    print(f"{'engine':<22}{'prompt':>8}{'prefill tok/s':>15}{'decode tok/s':>14}")
    for name, r in [(label, dict(k, prompt_tokens=len(results['kvlens']['prompt_token_ids']))),
                    ("transformers f32", results["transformers_f32"]),
                    ("transformers bf16", results["transformers_bf16"])]:
        print(f"{name:<22}{r['prompt_tokens']:>8}{r['prefill_tokens_per_s']:>15.1f}{r['decode_tokens_per_s']:>14.2f}")
    for ref in ("transformers_f32", "transformers_bf16"):
        r = results[ref]
        print(f"kvlens / {ref}: prefill {k['prefill_tokens_per_s'] / r['prefill_tokens_per_s']:.2f}x, "
              f"decode {k['decode_tokens_per_s'] / r['decode_tokens_per_s']:.2f}x")
    print(f"memory bandwidth {results['memory_bandwidth_gb_s']:.1f} GB/s; decode roofline "
          f"{results['roofline_decode_tokens_per_s_f32']:.2f} tok/s at f32 weights, "
          f"{results['roofline_decode_tokens_per_s_bf16']:.2f} at bf16")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
