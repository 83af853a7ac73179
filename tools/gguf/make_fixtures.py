"""Writes engine/tests/fixtures/gguf/: GGUF files made by llama.cpp's own gguf-py, and the values
gguf-py dequantizes their tensors to, for the GGUF reader's tests (run once; the outputs are
committed, so CI needs no Python for them).

gguf-py ships inside the llama-cpp-python sdist on PyPI (vendor/llama.cpp/gguf-py); it needs numpy:

    curl -L -o llama.tar.gz <the llama-cpp-python 0.3.36 sdist URL from https://pypi.org/pypi/llama-cpp-python/json>
    tar xzf llama.tar.gz --wildcards '*/vendor/llama.cpp/gguf-py/*'
    python3 -m venv venv && venv/bin/pip install numpy pyyaml
    PYTHONPATH=llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py venv/bin/python tools/gguf/make_fixtures.py

types.gguf holds one 2×512 tensor of every type the reader supports and metadata of every value
type. F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 tensors are quantized by gguf-py from the same
values; gguf-py only dequantizes the K-quants, so their blocks are random bytes with their f16
scales drawn in a sane range. types.f32 is every tensor dequantized by gguf-py, in file order, as
little-endian f32.
"""

import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "engine", "tests", "fixtures", "gguf")
ROWS, COLS = 2, 512
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


def k_quant_blocks(qtype, rng):
    """Random blocks of a K-quant with every f16 scale in [-0.5, 0.5] (random bits make infinities)."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(ROWS * COLS // block_values, block_bytes), dtype=np.uint8)
    scale = lambda n: rng.uniform(-0.5, 0.5, size=(blocks.shape[0], n)).astype(np.float16).view(np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):
        blocks[:, 0:4] = scale(2)  # d, dmin first
    elif qtype == T.Q6_K:
        blocks[:, -2:] = scale(1)  # d last
    return blocks.reshape(ROWS, -1)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(7)
    values = rng.uniform(-1.0, 1.0, size=(ROWS, COLS)).astype(np.float32)
    writer = gguf.GGUFWriter(os.path.join(OUT, "types.gguf"), "kvlens-fixture")
    writer.add_string("kvlens.fixture.note", "every tensor type and metadata value type")
    writer.add_uint8("kvlens.fixture.u8", 200)
    writer.add_int8("kvlens.fixture.i8", -100)
    writer.add_uint16("kvlens.fixture.u16", 60000)
    writer.add_int16("kvlens.fixture.i16", -30000)
    writer.add_uint32("kvlens.fixture.u32", 4000000000)
    writer.add_int32("kvlens.fixture.i32", -2000000000)
    writer.add_float32("kvlens.fixture.f32", 0.25)
    writer.add_uint64("kvlens.fixture.u64", 2**40 + 3)
    writer.add_int64("kvlens.fixture.i64", -(2**40))
    writer.add_float64("kvlens.fixture.f64", -1.5)
    writer.add_bool("kvlens.fixture.bool", True)
    writer.add_array("kvlens.fixture.strings", ["a", "bé", "漢字 🙂"])
    writer.add_array("kvlens.fixture.ints", [1, -2, 3])
    dequantized = []
    for qtype in TYPES:
        if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
            data = k_quant_blocks(qtype, rng)
        else:
            data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(f"t.{qtype.name.lower()}", data, raw_dtype=qtype)
        back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(ROWS, COLS)
        assert np.isfinite(back).all(), qtype.name
        dequantized.append(back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    np.concatenate([d.ravel() for d in dequantized]).astype("<f4").tofile(os.path.join(OUT, "types.f32"))
    print(f"wrote {OUT}/types.gguf and types.f32 ({len(TYPES)} tensors)", file=sys.stderr)


if __name__ == "__main__":
    main()
