"""Reference pixel_values for kvlens' image preprocessing (engine/src/input/image.rs).

Writes small deterministic PNG test images and what transformers' PIL image processor
(`Qwen2VLImageProcessorPil`: Pillow BICUBIC resize, rescale, normalize, patchify) makes of them,
into engine/tests/fixtures/input/: the PNGs, one little-endian f32 file per case and
`reference.json` describing the cases. Run with the golden venv:

    ~/.cache/kvlens/golden-venv/bin/python tools/golden/input_reference.py
"""

import json
import pathlib

import numpy as np
import PIL
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

OUT = pathlib.Path(__file__).resolve().parents[2] / "engine" / "tests" / "fixtures" / "input"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def gradient_noise(width, height, channels, seed):
    """Horizontal/vertical gradients plus seeded noise, uint8, (height, width, channels)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = [255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1), 127 + 100 * np.sin((x + y) / 7)]
    base.append(255 * (x + y) / max(width + height - 2, 1))
    img = np.stack(base[:channels], axis=-1) + rng.normal(0, 40, (height, width, channels))
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def image(name, width, height, mode, seed):
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "JPEG": 3}[mode]
    arr = gradient_noise(width, height, channels, seed)
    if mode == "RGBA":
        # Alpha from fully transparent to opaque, so compositing onto white is exercised.
        arr[..., 3] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
        arr[: height // 4, :, 3] = 0
    if mode == "JPEG":
        # Pillow's default for quality 90: 4:2:0 chroma subsampling, decoded by libjpeg-turbo.
        Image.fromarray(arr, "RGB").save(OUT / name, quality=90)
        return name
    img = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
    img.save(OUT / name)
    return name


# (name, image file, min_pixels, max_pixels, patch_size, mean, std); merge 2, temporal 2 throughout.
QWEN2 = (14, CLIP_MEAN, CLIP_STD)
QWEN3 = (16, [0.5] * 3, [0.5] * 3)
CASES = [
    # 93×67 (width×height) → 84×56: a mild downscale in both directions.
    ("rgb_93x67_qwen2", image("rgb_93x67.png", 93, 67, "RGB", 1), 3136, 28 * 28 * 16, *QWEN2),
    # 240×160 RGBA → 96×64: a 2.5× downscale, alpha composited onto white.
    ("rgba_240x160_qwen3", image("rgba_240x160.png", 240, 160, "RGBA", 2), 1024, 32 * 32 * 6, *QWEN3),
    # 30×20 grayscale → 84×56 by the min_pixels rule: an upscale.
    ("gray_30x20_qwen2", image("gray_30x20.png", 30, 20, "L", 3), 3136, 28 * 28 * 16, *QWEN2),
    # 84×56 is a smart_resize fixed point: no resampling at all.
    ("rgb_84x56_fixed_qwen2", image("rgb_84x56.png", 84, 56, "RGB", 4), 3136, 28 * 28 * 16, *QWEN2),
    # A 4:2:0 JPEG at a fixed point: only the JPEG decoders (libjpeg-turbo vs zune-jpeg) differ.
    ("jpeg_84x56_fixed_qwen2", image("jpeg_84x56.jpg", 84, 56, "JPEG", 5), 3136, 28 * 28 * 16, *QWEN2),
]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, png, min_pixels, max_pixels, patch, mean, std in CASES:
        proc = Qwen2VLImageProcessorPil(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
            patch_size=patch,
            merge_size=2,
            temporal_patch_size=2,
            image_mean=mean,
            image_std=std,
        )
        with Image.open(OUT / png) as img:
            out = proc(images=[img], return_tensors="np")
        pixel_values = np.ascontiguousarray(out["pixel_values"], dtype="<f4")
        grid = [int(v) for v in out["image_grid_thw"][0]]
        (OUT / f"{name}.f32").write_bytes(pixel_values.tobytes())
        cases.append(
            {
                "name": name,
                "image": png,
                "min_pixels": min_pixels,
                "max_pixels": max_pixels,
                "patch_size": patch,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "image_mean": mean,
                "image_std": std,
                "grid_thw": grid,
                "shape": list(pixel_values.shape),
                "pixel_values": f"{name}.f32",
            }
        )
    meta = {
        "generator": "tools/golden/input_reference.py",
        "transformers": transformers.__version__,
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "cases": cases,
    }
    (OUT / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
