"""Benchmark: kvlens against llama.cpp on the CPU, one request, the same GGUF files, the same thread
count, measured in the same run (`cargo xtask bench peers`, which builds llama.cpp from the
llama-cpp-python sdist and passes its binaries here).

The files: a Qwen3-VL-2B-Instruct-shaped random checkpoint (bf16) written by
`kvlens random-checkpoint`, as F16 by `kvlens to-gguf` (the layout llama.cpp's converter writes:
docs/GGUF.md), and Q8_0, Q4_0 and Q4_K_M by llama.cpp's own `llama-quantize` from that F16 file. The
projector stays F16.

Per format: prompt processing (a 519-token text prompt; llama-bench's pp at that length) and decode
(128 tokens after a short prompt; llama-bench's tg128), with kvlens's decode roofline (the read
bandwidth over the bytes a step reads). For F16, the greedy tokens of both on the same prompt ids
(llama-server's /completion, top-k 1). For the `--image` formats (Q4_0 by default), one 1024×768
image prompt through the projector to the first token: kvlens's own clock (`prefill_s`: the
request's image encode, prefill and first token) against llama-mtmd-cli's, from its timestamped
"encoding mtmd batch" line to its exit after one token (its log names no end of the prefill).
Each figure is the median of `--reps` rounds, the two engines run in turn in each round; each ratio
the median of the rounds' own ratios. Prints one table with kvlens ÷ llama.cpp ratios and writes
it, with the versions, as JSON under the work folder."""

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import re
import struct
import urllib.request
import zlib
from pathlib import Path

PROMPT_SENTENCE = "The quick brown fox jumps over the lazy dog while the farmer watches from the barn. "
SHORT_PROMPT = "Write a long story about a lighthouse keeper."
FORMATS = ["F16", "Q8_0", "Q4_0", "Q4_K_M"]
IMAGE_PROMPT = "Describe this image."


def write_image(path, width=1024, height=768):
    """A deterministic photo-like PNG (gradients plus pseudo-random noise), with no imaging library."""
    rows = bytearray()
    state = 1
    for y in range(height):
        rows.append(0)
        for x in range(width):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            noise = (state >> 16) % 25 - 12
            for v in (x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)):
                rows.append(min(255, max(0, v + noise)))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(rows)))
                     + chunk(b"IEND", b""))


def sh(cmd, env=None, **kw):
    """Runs `cmd`, returns its stdout; its stderr is kept for the error message."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    if out.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out


def cpu_model():
    with open("/proc/cpuinfo") as f:
        return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))


def files(args):
    """The GGUF pair of each format (text model, projector), made when missing."""
    work, k = args.work, args.kvlens
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        sh([k, "random-checkpoint", "--config", "Qwen3-VL-2B-Instruct", "--out", ckpt, "--dtype", "bf16",
            "--seed", "0", "--force"])
    f16 = work / "F16" / "ckpt-F16.gguf"
    mmproj = work / "F16" / "mmproj-ckpt-F16.gguf"
    if not f16.is_file():
        sh([k, "to-gguf", "--model", ckpt, "--outtype", "f16", "--out", work / "F16"])
    pairs = {"F16": (f16, mmproj)}
    for fmt in FORMATS[1:]:
        out = work / fmt / f"ckpt-{fmt}.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            sh([args.llama_bin / "llama-quantize", f16, out, fmt, str(args.threads)])
        pairs[fmt] = (out, mmproj)
    return pairs


def kvlens_generate(args, pair, prompt, max_tokens, image=None):
    cmd = [args.kvlens, "generate", "--model", pair[0], "--mmproj", pair[1], "--prompt", prompt,
           "--max-tokens", str(max_tokens), "--ignore-eos", "--json"]
    if image:
        cmd += ["--image", image]
    # candle's thread pool, which every CPU kernel of kvlens runs on, takes its size from here.
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    if args.cpu_isa:
        env["KVLENS_CPU_ISA"] = args.cpu_isa
    return json.loads(sh(cmd, env=env).stdout.strip().splitlines()[-1])


def llama_bench(args, pair, prompt_tokens):
    out = sh([args.llama_bin / "llama-bench", "-m", pair[0], "-p", str(prompt_tokens), "-n", str(args.decode_tokens),
              "-t", str(args.threads), "-r", "1", "-o", "json"])
    rows = json.loads(out.stdout)
    pp = next(r for r in rows if r["n_prompt"] > 0)
    tg = next(r for r in rows if r["n_gen"] > 0)
    return pp, tg


def rounds(args, pair, long_prompt):
    """`args.reps` rounds, each kvlens's prompt and decode runs and llama-bench's (one repetition of
    each), the order swapped every round (kvlens first in the first): a change in the machine's
    load between rounds (a shared VM's neighbours) hits both engines alike, and neither always
    runs on the heels of the other. Returns the per-round samples, kvlens's last prompt and decode
    runs and llama-bench's last decode row."""
    samples = {"kvlens_pp": [], "llama_pp": [], "kvlens_tg": [], "llama_tg": []}
    prompt_tokens = None
    for rep in range(args.reps):
        if rep % 2 == 1:
            pp, tg = llama_bench(args, pair, prompt_tokens)
        pre = kvlens_generate(args, pair, long_prompt, 1)
        dec = kvlens_generate(args, pair, SHORT_PROMPT, args.decode_tokens)
        prompt_tokens = len(pre["prompt_token_ids"])
        if rep % 2 == 0:
            pp, tg = llama_bench(args, pair, prompt_tokens)
        for key, value in [("kvlens_pp", pre["timing"]["prefill_tokens_per_s"]), ("llama_pp", pp["avg_ts"]),
                           ("kvlens_tg", dec["timing"]["decode_tokens_per_s"]), ("llama_tg", tg["avg_ts"])]:
            samples[key].append(value)
    return samples, pre, dec, tg


def image_first_token_llama(args, pair, image):
    """llama-mtmd-cli on one image and one new token: seconds from its "encoding mtmd batch" line to
    its exit, its own encode time, and the image's tokens."""
    start = time.perf_counter()
    out = sh([args.llama_bin / "llama-mtmd-cli", "-m", pair[0], "--mmproj", pair[1], "--image", image, "-p",
              IMAGE_PROMPT, "-n", "1", "-t", str(args.threads), "--temp", "0", "-c", "4096", "-v"])
    wall = time.perf_counter() - start
    log = out.stderr

    def stamp(pattern):
        m = re.search(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I " + pattern, log, re.M)
        if not m:
            sys.exit(f"llama-mtmd-cli's log has no line {pattern!r}")
        minutes, seconds, ms, us = map(int, m.groups())
        return minutes * 60 + seconds + ms / 1e3 + us / 1e6

    encode_ms = re.search(r"mtmd batch encoding done in (\d+) ms", log)
    nx, ny = (int(re.search(rf"image_tokens->{k} = (\d+)", log).group(1)) for k in ("nx", "ny"))
    return wall - stamp("encoding mtmd batch"), int(encode_ms.group(1)) / 1e3 if encode_ms else None, nx * ny


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running(cmd, port, env=None, log=subprocess.DEVNULL, timeout=600):
    """Starts a server and yields its process once GET /health on `port` answers 200 (both
    llama-server and kvlens serve answer 503 while they load); stops it on the way out."""
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline or server.poll() is not None:
                sys.exit(f"{cmd[0]} did not become healthy on port {port}")
            time.sleep(0.5)
        yield server
    finally:
        server.terminate()
        server.wait()


def greedy_tokens_llama(args, pair, prompt_ids, n):
    """llama-server's greedy tokens for `prompt_ids` (top-k 1, no template)."""
    port = free_port()
    with running([args.llama_bin / "llama-server", "-m", pair[0], "--port", str(port), "-t", str(args.threads),
                  "-c", "2048", "--parallel", "1"], port):
        body = json.dumps({"prompt": prompt_ids, "n_predict": n, "samplers": ["top_k"], "top_k": 1,
                           "ignore_eos": True, "return_tokens": True, "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)["tokens"]


def peers_args(description):
    """The arguments both peers benchmarks take (`cargo xtask bench peers` passes the first four)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvlens", type=Path, required=True)
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build/bin")
    ap.add_argument("--llama-commit", default="unknown")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    return ap


def main():
    ap = peers_args(__doc__)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--reps", type=int, default=4,
                    help="rounds of both engines' runs, interleaved, each engine first in every other "
                         "round (an even count puts each first equally often, so a drift of the "
                         "machine's speed over the run favours neither); the table gives each one's "
                         "median and the median of the rounds' ratios")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--cpu-isa", help="KVLENS_CPU_ISA for the kvlens runs (avx2, portable)")
    ap.add_argument("--image", default="Q4_0",
                    help="formats to time a 1024x768 image prompt in, comma-separated, or none")
    ap.add_argument("--files-only", action="store_true",
                    help="make the GGUF files when missing and stop (`cargo xtask bench peers-browser`)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    pairs = files(args)
    if args.files_only:
        return
    image = args.work / "photo_1024x768.png"
    if not image.exists():
        write_image(image)
    long_prompt = PROMPT_SENTENCE * 30
    bandwidth = json.loads(sh([args.kvlens, "bench", "bandwidth", "--json"]).stdout)
    rows = []
    for fmt in args.formats.split(","):
        pair = pairs[fmt]
        samples, pre, dec, tg = rounds(args, pair, long_prompt)
        row = {
            "format": fmt,
            "prompt_tokens": len(pre["prompt_token_ids"]),
            **{key: statistics.median(values) for key, values in samples.items()},
            # The median of the rounds' own ratios: each compares two runs a minute apart.
            **{f"{step}_ratio": statistics.median(a / b for a, b in zip(samples[f"kvlens_{step}"],
                                                                         samples[f"llama_{step}"]))
               for step in ("pp", "tg")},
            "samples": samples,
            "cpu_kernels": dec["timing"].get("cpu_kernels"),
            # The decode roofline: the read bandwidth over the bytes one step reads.
            "kvlens_tg_roofline": bandwidth["read_gb_s"] * 1e9
            / (dec["weights"]["decode_read_bytes_per_token"] + dec["weights"]["decode_kv_read_bytes_per_token"]),
            "llama_cpu_info": tg.get("cpu_info"),
            "llama_build": tg.get("build_commit"),
        }
        if fmt == "F16":
            ours = kvlens_generate(args, pair, SHORT_PROMPT, 16)
            theirs = greedy_tokens_llama(args, pair, ours["prompt_token_ids"], 16)
            both = list(zip(ours["token_ids"], theirs))
            agree = next((i for i, (a, b) in enumerate(both) if a != b), len(both))
            row.update(greedy_kvlens=ours["token_ids"], greedy_llama=theirs, greedy_agree=agree)
        if fmt in args.image.split(","):
            ours = kvlens_generate(args, pair, IMAGE_PROMPT, 1, image)
            theirs, encode_s, image_tokens = image_first_token_llama(args, pair, image)
            grid = ours["image_grid_thw"][0]
            row.update(image_kvlens_s=ours["timing"]["prefill_s"], image_llama_s=theirs,
                       image_llama_encode_s=encode_s, image_tokens_llama=image_tokens,
                       image_tokens_kvlens=grid[1] * grid[2] // 4, image_prompt_tokens=len(ours["prompt_token_ids"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "threads": args.threads,
        "llama_cpp_commit": args.llama_commit,
        "llama_cpp_build": args.llama_bin.parent.name,
        "kvlens_cpu_isa": args.cpu_isa or "detected",
        "read_gb_s": bandwidth["read_gb_s"],
        "rows": rows,
    }
    name = f"peers-cpu-{args.cpu_isa}.json" if args.cpu_isa else "peers-cpu.json"
    (args.work / name).write_text(json.dumps(report, indent=1))
    print(f"\n{report['cpu']}, {args.threads} threads, llama.cpp {args.llama_commit[:10]}, kvlens kernels: "
          f"{rows[0]['cpu_kernels']}")
    print(f"read bandwidth {bandwidth['read_gb_s']:.1f} GB/s")
    print("| format | prompt tok/s kvlens | llama.cpp | ratio | decode tok/s kvlens | llama.cpp | ratio "
          "| kvlens decode / roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['kvlens_pp']:.1f} | {r['llama_pp']:.1f} | {r['pp_ratio']:.2f}× "
              f"| {r['kvlens_tg']:.2f} | {r['llama_tg']:.2f} | {r['tg_ratio']:.2f}× "
              f"| {100 * r['kvlens_tg'] / r['kvlens_tg_roofline']:.0f} % |")
    for r in rows:
        if "image_kvlens_s" in r:
            print(f"{r['format']} image prompt (1024x768, {r['image_tokens_kvlens']} image tokens in kvlens, "
                  f"{r['image_tokens_llama']} in llama.cpp), encode + prefill + first token: kvlens "
                  f"{r['image_kvlens_s']:.1f} s, llama-mtmd-cli {r['image_llama_s']:.1f} s (its encode "
                  f"{r['image_llama_encode_s']:.1f} s): {r['image_llama_s'] / r['image_kvlens_s']:.2f}× as fast")
        if "greedy_agree" in r:
            print(f"{r['format']} greedy: {r['greedy_agree']} of 16 tokens agree "
                  f"(kvlens {r['greedy_kvlens']}, llama.cpp {r['greedy_llama']})")


if __name__ == "__main__":
    main()
