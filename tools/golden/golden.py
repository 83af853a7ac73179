#!/usr/bin/env python3
"""Golden reference outputs of Hugging Face transformers for kvlens' tiny random Qwen-VL checkpoints.

For each family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) this script

1. writes a tiny checkpoint with kvlens' own `random-checkpoint` (float32, seed 0, small image limits), so that
   transformers and the Rust engine see bit-identical weights;
2. loads it with `AutoProcessor` and `AutoModelForImageTextToText` (float32, eager attention): that the
   processor and the model load our files at all proves the checkpoint layout is the published one;
3. runs a handful of chat cases (text only, one image that needs resizing, two images of different sizes, a
   multi-turn conversation, an image already at a fixed-point size) through
   `processor.apply_chat_template(..., tokenize=True, return_dict=True)` and greedy `model.generate`, and
4. writes engine/tests/fixtures/golden/<family>.json: messages, prompt token ids, image grids, M-RoPE position
   ids and rope_deltas, greedy token ids, per-step top-5 log-probabilities and the top-2 margin.

Images are small deterministic PNGs under engine/tests/fixtures/golden/images/ (made here from a seeded RNG).
The image processor is the PIL one (Pillow's bicubic resize); the torchvision one's pixel values are compared and
the largest difference is recorded.

Run: ~/.cache/kvlens/golden-venv/bin/python tools/golden/golden.py [--kvlens PATH/TO/kvlens]
(or `cargo xtask golden`, which creates the venv and builds kvlens first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import PIL
import torch
import transformers
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).resolve().parent / "configs"
FIXTURES = ROOT / "engine" / "tests" / "fixtures" / "golden"
IMAGES = FIXTURES / "images"

SEED = 0
MAX_NEW_TOKENS = 12
TOP_K = 5

# (file name, width, height, RNG seed). 67x93 needs resizing; the others differ in size and aspect.
IMAGE_SPECS = [
    ("a_67x93.png", 67, 93, 1),
    ("b_120x80.png", 120, 80, 2),
    ("c_150x150.png", 150, 150, 3),
    # Already multiples of 28 (Qwen2/2.5: grid 1x4x6) and of 32 (Qwen3: grid 1x4x6), inside the limits.
    ("fixed_84x56.png", 84, 56, 4),
    ("fixed_96x64.png", 96, 64, 5),
]

# Family -> (tiny config, image limits MIN,MAX written to preprocessor_config.json, fixed-point image).
FAMILIES = {
    "qwen2_vl": ("qwen2_vl_tiny.json", (3136, 28 * 28 * 64), "fixed_84x56.png"),
    "qwen2_5_vl": ("qwen2_5_vl_tiny.json", (3136, 28 * 28 * 64), "fixed_84x56.png"),
    "qwen3_vl": ("qwen3_vl_tiny.json", (1024, 32 * 32 * 64), "fixed_96x64.png"),
    # 8 experts, 2 per token, stored transposed as Qwen3-VL-MoE was published.
    "qwen3_vl_moe": ("qwen3_vl_moe_tiny.json", (1024, 32 * 32 * 64), "fixed_96x64.png"),
    # With the Qwen3 tokenizer and its special-token ids (the real Qwen3.5 tokenizer comes with real checkpoints).
    "qwen3_5": ("qwen3_5_tiny.json", (1024, 32 * 32 * 64), "fixed_96x64.png"),
    # 8 experts, 2 per token, and the shared expert.
    "qwen3_5_moe": ("qwen3_5_moe_tiny.json", (1024, 32 * 32 * 64), "fixed_96x64.png"),
}

# Families with a recurrent state (Gated DeltaNet) also run prompts long enough to cross several of
# transformers' 64-token chunks of the chunked delta rule and several KV blocks.
LONG_PROMPT_FAMILIES = {"qwen3_5", "qwen3_5_moe"}
LONG_TEXT = (
    "Key-value caches hold the keys and values of every token a transformer has seen, so that each new "
    "token attends to them without recomputing the prompt. Their size grows with the context: layers times "
    "heads times the head width times two, for every token of every running request. Linear attention keeps "
    "a state of fixed size instead, updated token by token with a decay and a delta rule, so a long document "
    "costs it no more memory than a short one. Hybrid models put a few layers of full attention between "
    "many layers of linear attention and so keep a little of both. Explain, in three short paragraphs, which "
    "of the two a serving engine should budget for first when the context reaches a hundred thousand tokens, "
    "and why the answer changes when many requests run at once."
)


def make_image(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour waves plus noise: content that resizing changes, yet compresses to a few KB."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    channels = []
    for _ in range(3):
        fx, fy = rng.uniform(0.03, 0.25, size=2)
        px, py = rng.uniform(0, 2 * np.pi, size=2)
        ramp = rng.uniform(-80, 80)
        channels.append(128 + 70 * np.sin(fx * x + px) * np.cos(fy * y + py) + ramp * (x / width - 0.5))
    img = np.stack(channels, axis=-1) + rng.normal(0, 10, size=(height, width, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_images() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name, w, h, seed in IMAGE_SPECS:
        pixels = make_image(w, h, seed)
        path = IMAGES / name
        if path.exists() and np.array_equal(np.asarray(Image.open(path).convert("RGB")), pixels):
            continue  # unchanged: keep the committed bytes
        Image.fromarray(pixels, mode="RGB").save(path, optimize=True)


def cases(fixed_image: str, long_prompts: bool = False) -> list[tuple[str, list[dict]]]:
    """(case name, OpenAI-style messages with image paths relative to the fixtures directory)."""

    def image(name: str) -> dict:
        return {"type": "image_url", "image_url": {"url": f"images/{name}"}}

    def text(t: str) -> dict:
        return {"type": "text", "text": t}

    return [
        ("text_only", [{"role": "user", "content": [text("Write a haiku about key-value caches.")]}]),
        ("one_image_resized", [{"role": "user", "content": [image("a_67x93.png"), text("Describe this image.")]}]),
        (
            "two_images",
            [
                {
                    "role": "user",
                    "content": [
                        image("b_120x80.png"),
                        image("c_150x150.png"),
                        text("What differs between these two pictures?"),
                    ],
                }
            ],
        ),
        (
            "multi_turn",
            [
                {"role": "user", "content": [image("c_150x150.png"), text("What is in the picture?")]},
                {"role": "assistant", "content": [text("Colourful waves with some noise.")]},
                {"role": "user", "content": [text("Which colour dominates?")]},
            ],
        ),
        ("fixed_size_image", [{"role": "user", "content": [image(fixed_image), text("Describe this image.")]}]),
    ] + (
        [
            ("long_text", [{"role": "user", "content": [text(LONG_TEXT)]}]),
            ("long_text_and_image", [{"role": "user", "content": [image("c_150x150.png"), text(LONG_TEXT)]}]),
        ]
        if long_prompts
        else []
    )


def to_hf_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-style image_url parts -> transformers' {"type": "image", "image": PIL.Image}."""
    out = []
    for m in messages:
        content = []
        for part in m["content"]:
            if part["type"] == "image_url":
                img = Image.open(FIXTURES / part["image_url"]["url"]).convert("RGB")
                content.append({"type": "image", "image": img})
            else:
                content.append(part)
        out.append({"role": m["role"], "content": content})
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def random_checkpoint(kvlens: list[str], config: Path, limits: tuple[int, int], out: Path) -> list[str]:
    args = [
        "random-checkpoint",
        "--config",
        str(config.relative_to(ROOT)),
        "--out",
        str(out),
        "--dtype",
        "f32",
        "--seed",
        str(SEED),
        "--image-limits",
        f"{limits[0]},{limits[1]}",
        "--force",
    ]
    subprocess.run(kvlens + args, cwd=ROOT, check=True)
    return args


def pixel_summary(pixel_values: torch.Tensor) -> dict:
    flat = pixel_values.to(torch.float64).flatten()
    return {
        "shape": list(pixel_values.shape),
        "sum": float(flat.sum()),
        "abs_sum": float(flat.abs().sum()),
        "first": [round(float(v), 6) for v in flat[:8]],
    }


def run_case(model, processor, tv_image_processor, name: str, messages: list[dict]) -> dict:
    hf_messages = to_hf_messages(messages)
    prompt = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor.apply_chat_template(
        hf_messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    has_mm = "mm_token_type_ids" in inputs
    if not has_mm:
        raise SystemExit(f"{name}: the processor did not return mm_token_type_ids; M-RoPE would be skipped")
    input_ids = inputs["input_ids"]
    grid = inputs.get("image_grid_thw")
    record: dict = {
        "name": name,
        "messages": messages,
        "prompt": prompt,
        "prompt_token_ids": input_ids[0].tolist(),
        "image_grid_thw": grid.tolist() if grid is not None else [],
        "processor_returned_mm_token_type_ids": has_mm,
    }
    if grid is not None:
        record["pixel_values"] = pixel_summary(inputs["pixel_values"])
        images = [p["image"] for m in hf_messages for p in m["content"] if p["type"] == "image"]
        tv = tv_image_processor(images=images, return_tensors="pt")
        record["torchvision_pixel_values_max_abs_diff"] = float(
            (tv["pixel_values"].to(torch.float64) - inputs["pixel_values"].to(torch.float64)).abs().max()
        )
        assert tv["image_grid_thw"].tolist() == grid.tolist()

    with torch.no_grad():
        position_ids, rope_deltas = model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=grid,
            attention_mask=inputs["attention_mask"],
        )
        out = model.generate(
            **inputs,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, input_ids.shape[1] :].tolist()
    steps = []
    for logits in out.logits:
        logprobs = torch.log_softmax(logits[0].to(torch.float32), dim=-1)
        top = torch.topk(logprobs, TOP_K)
        pairs = [[int(i), float(v)] for v, i in zip(top.values, top.indices)]
        steps.append({"top": pairs, "margin": pairs[0][1] - pairs[1][1]})
    assert [s["top"][0][0] for s in steps] == generated, "greedy tokens differ from the argmax of the logits"
    record.update(
        {
            "mrope_position_ids": position_ids[:, 0, :].tolist(),
            "rope_deltas": int(rope_deltas.flatten()[0]),
            "rope_deltas_after_generate": int(model.model.rope_deltas.flatten()[0])
            if model.model.rope_deltas is not None
            else None,
            "token_ids": generated,
            "steps": steps,
        }
    )
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvlens", help="path to a built kvlens binary (default: cargo run -q -p kvlens --)")
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append", help="only these families")
    ap.add_argument("--keep", help="write the checkpoints under this directory and keep them")
    args = ap.parse_args()
    kvlens = [args.kvlens] if args.kvlens else ["cargo", "run", "-q", "-p", "kvlens", "--"]
    write_images()

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvlens-golden-"))
    try:
        for family in args.family or list(FAMILIES):
            config_file, limits, fixed_image = FAMILIES[family]
            ckpt = work / family
            cli_args = random_checkpoint(kvlens, CONFIGS / config_file, limits, ckpt)
            processor = AutoProcessor.from_pretrained(ckpt)
            tv_image_processor = processor.image_processor
            # PIL backend: Pillow's bicubic resize, which the Rust engine reproduces.
            processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(ckpt)
            model, loading = AutoModelForImageTextToText.from_pretrained(
                ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
            )
            model.eval()
            problems = {k: v for k, v in loading.items() if v}
            if problems:
                raise SystemExit(f"{family}: transformers did not load the checkpoint cleanly: {problems}")
            fixture = {
                "family": family,
                "generated_by": "tools/golden/golden.py",
                "checkpoint": {
                    "command": "kvlens " + " ".join(a if a != str(ckpt) else "DIR" for a in cli_args),
                    "config": str((CONFIGS / config_file).relative_to(ROOT)),
                    "dtype": "f32",
                    "seed": SEED,
                    "image_limits": list(limits),
                    "model_safetensors_sha256": sha256(ckpt / "model.safetensors"),
                },
                "reference": {
                    "model_class": type(model).__name__,
                    "processor_class": type(processor).__name__,
                    "image_processor_class": type(processor.image_processor).__name__,
                    "attn_implementation": "eager",
                    "dtype": "float32",
                    "generate": {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False},
                },
                "versions": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "numpy": np.__version__,
                    "pillow": PIL.__version__,
                },
                "cases": [
                    run_case(model, processor, tv_image_processor, name, messages)
                    for name, messages in cases(fixed_image, family in LONG_PROMPT_FAMILIES)
                ],
            }
            path = FIXTURES / f"{family}.json"
            path.write_text(json.dumps(fixture, indent=1) + "\n")
            deltas = {c["name"]: c["rope_deltas"] for c in fixture["cases"]}
            print(f"{family}: wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes); rope_deltas {deltas}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
