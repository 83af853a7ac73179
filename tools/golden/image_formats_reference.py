"""Reference RGB pixels for the image formats kvlens decodes besides PNG and JPEG.

Writes small WebP, GIF, BMP and TIFF files with Pillow into engine/tests/fixtures/input/formats/,
each next to `<file>.rgb.png`: what transformers' `convert_to_rgb` makes of the file as Pillow opens
it (first frame; alpha composited onto white). engine/tests/input_image.rs checks that kvlens
decodes every file to exactly those pixels. Needs only Pillow, e.g. the client venv:

    ~/.cache/kvlens/client-venv/bin/python tools/golden/image_formats_reference.py
"""

import io
import pathlib
import random

import PIL
from PIL import Image

OUT = pathlib.Path(__file__).resolve().parents[2] / "engine" / "tests" / "fixtures" / "input" / "formats"
W, H = 37, 29


def convert_to_rgb(image):
    """transformers.image_transforms.convert_to_rgb."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def noise(mode, seed):
    rng = random.Random(seed)
    img = Image.new("RGBA", (W, H))
    img.putdata(
        [(rng.randrange(256), rng.randrange(256), rng.randrange(256), rng.choice([0, 60, 128, 255]))
         for _ in range(W * H)]
    )
    return img if mode == "RGBA" else img.convert(mode)


def gif_with_small_first_frame(transparency):
    """A 6×5 GIF whose first (2×2) frame sits at (1, 2): Pillow fills the rest of its canvas
    with palette index 0, or with the transparent index."""
    frame = Image.new("P", (2, 2))
    frame.putpalette([255, 0, 0, 0, 0, 255, 0, 255, 0] + [0] * (253 * 3))
    frame.putdata([0, 1, 2, 0])
    buf = io.BytesIO()
    frame.save(buf, "GIF", **({"transparency": 1} if transparency else {}))
    data = bytearray(buf.getvalue())
    data[6:10] = (6).to_bytes(2, "little") + (5).to_bytes(2, "little")  # logical screen
    data[11] = 2  # background colour index (Pillow does not use it for the first frame)
    at = data.index(b",")  # image descriptor
    data[at + 1:at + 5] = (1).to_bytes(2, "little") + (2).to_bytes(2, "little")
    return bytes(data)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rgb, rgba = noise("RGB", 1), noise("RGBA", 2)
    palette = rgb.quantize(200)
    second = Image.new("RGB", (W, H), (200, 10, 30))
    saves = {
        "lossy_q90.webp": lambda f: rgb.save(f, quality=90),
        "lossless_rgba.webp": lambda f: rgba.save(f, lossless=True),
        "animated.webp": lambda f: rgb.save(f, save_all=True, append_images=[second], lossless=True),
        "palette.gif": lambda f: palette.save(f),
        "transparent.gif": lambda f: palette.save(f, transparency=3),
        "animated.gif": lambda f: palette.save(f, save_all=True, append_images=[second]),
        "small_frame.gif": lambda f: f.write_bytes(gif_with_small_first_frame(False)),
        "small_frame_transparent.gif": lambda f: f.write_bytes(gif_with_small_first_frame(True)),
        "rgb.bmp": lambda f: rgb.save(f),
        "palette.bmp": lambda f: palette.save(f),
        "one_bit.bmp": lambda f: rgb.convert("1").save(f),
        "rgba.tif": lambda f: rgba.save(f),
        "rgb_lzw.tif": lambda f: rgb.save(f, compression="tiff_lzw"),
        "cmyk.tif": lambda f: rgb.convert("CMYK").save(f),
        "gray.tif": lambda f: rgb.convert("L").save(f),
        "gray16.tif": lambda f: gray16().save(f),
    }
    for name, save in saves.items():
        path = OUT / name
        save(path)
        convert_to_rgb(Image.open(path)).save(OUT / f"{name}.rgb.png")
    print(f"wrote {len(saves)} files and their references to {OUT} (Pillow {PIL.__version__})")


def gray16():
    rng = random.Random(3)
    img = Image.new("I;16", (W, H))
    # Half of the values above 255, which Pillow clips when converting.
    img.putdata([rng.randrange(65536) if rng.random() < 0.5 else rng.randrange(256) for _ in range(W * H)])
    return img


if __name__ == "__main__":
    main()
