"""Benchmark: `kvlens serve` against `llama-server` on the CPU, the same GGUF pair, the same threads
and the same KV memory, driven by the same client in the same run (`cargo xtask bench
peers-serve`, which builds llama.cpp from the llama-cpp-python sdist and passes its binaries here).

The files are peers_cpu.py's (a Qwen3-VL-2B-shaped random checkpoint, quantized by llama.cpp's own
`llama-quantize`; Q4_0 by default, the F16 projector). Each server is started once, as a
deployment would be: 16 sequences at most (`--max-num-seqs 16`, llama-server's `--parallel 16`,
its continuous batching on), 2048 tokens a sequence, KV memory for 16 × 2048 tokens in both
(`--kv-cache-memory-bytes`, llama-server's `-c 32768`), images at most `--image-tokens` tokens
(`--mm-processor-kwargs max_pixels`, llama-server's `--image-max-tokens`).

Against each, `kvlens bench serve` (vLLM's `bench serve` client: streaming chat completions,
`ignore_eos`, TTFT from the first chunk, TPOT and ITL from the rest) runs at every `--concurrency`
(all prompts sent at once, at most that many in flight) on two datasets: `random` text prompts and
`synthetic-vision` (one image each, 20 % reused). Both servers are up at once and each case runs
against one, then the other. Then each server's resident memory (now and peak, from /proc). Prints one table with kvlens ÷ llama-server ratios and writes it, with the
versions, as JSON under the work folder."""

import contextlib
import json
import os
import sys
import time

from peers_cpu import FORMATS, cpu_model, files, free_port, peers_args, running, sh

SLOTS = 16
SLOT_TOKENS = 2048
# K and V, f16, for Qwen3-VL-2B: 28 layers × 8 KV heads × 128 dims × 2 × 2 bytes a token.
KV_BYTES_PER_TOKEN = 28 * 8 * 128 * 2 * 2
# One merged vision token covers 32 × 32 pixels in Qwen3-VL (16-pixel patches, 2 × 2 merge).
PIXELS_PER_IMAGE_TOKEN = 32 * 32
DATASETS = {
    "text": ["--dataset-name", "random"],
    "vision": ["--dataset-name", "synthetic-vision"],
}


def kvlens_server(args, pair, port):
    cmd = [args.kvlens, "serve", "--model", pair[0], "--mmproj", pair[1], "--port", str(port),
           "--max-num-seqs", str(SLOTS), "--max-model-len", str(SLOT_TOKENS),
           "--kv-cache-memory-bytes", str(SLOTS * SLOT_TOKENS * KV_BYTES_PER_TOKEN),
           "--mm-processor-kwargs", json.dumps({"max_pixels": args.image_tokens * PIXELS_PER_IMAGE_TOKEN}),
           "--playground-dir", "no-playground"]
    # candle's thread pool, which every CPU kernel of kvlens runs on, takes its size from here.
    return cmd, dict(os.environ, RAYON_NUM_THREADS=str(args.threads))


def llama_server(args, pair, port):
    t = str(args.threads)
    cmd = [args.llama_bin / "llama-server", "-m", pair[0], "--mmproj", pair[1], "--port", str(port), "-t", t,
           "-tb", t, "--parallel", str(SLOTS), "-c", str(SLOTS * SLOT_TOKENS), "--cont-batching",
           "--image-max-tokens", str(args.image_tokens), "--no-webui"]
    return cmd, None


def memory_kib(pid):
    """Resident memory now and at its peak (VmRSS, VmHWM), KiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(l.split(":", 1) for l in f)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def bench(args, port, engine, dataset, concurrency):
    name = f"{engine}-{dataset}-c{concurrency}.json"
    out_dir = args.work / "serve"
    sh([args.kvlens, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", *DATASETS[dataset],
        "--tokenizer", args.work / "ckpt", "--random-input-len", str(args.input_len),
        "--num-prompts", str(max(args.min_prompts, args.prompts_per_slot * concurrency)),
        "--max-concurrency", str(concurrency), "--output-len", str(args.output_len), "--ignore-eos",
        "--metric-percentiles", "50,99", "--seed", "0", "--disable-tqdm", "--save-result",
        "--result-dir", out_dir, "--result-filename", name])
    r = json.loads((out_dir / name).read_text())
    if r["completed"] != r["num_prompts"]:
        sys.exit(f"{engine} {dataset} c={concurrency}: {r['completed']} of {r['num_prompts']} completed")
    keys = ["num_prompts", "output_throughput", "total_input_tokens", "total_input_image_tokens",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "duration"]
    return {k: r.get(k) for k in keys}


def run_both(args, pair):
    """Both servers up at once (an idle one waits on its socket), each case run against one and
    then the other, so that a drift in the shared machine's speed over the run hits both alike
    (run one after the other, llama-server's own figures moved by up to 2× between two runs of the
    day: text at concurrency 4, 8.0 and 15.7 output tok/s)."""
    makers = {"kvlens": kvlens_server, "llama_server": llama_server}
    rows = {e: {} for e in makers}
    with contextlib.ExitStack() as stack:
        ports, servers = {}, {}
        for engine, make in makers.items():
            ports[engine] = free_port()
            cmd, env = make(args, pair, ports[engine])
            log = stack.enter_context(open(args.work / "serve" / f"{engine}-server.log", "w"))
            servers[engine] = stack.enter_context(running(cmd, ports[engine], env, log))
        for dataset in args.datasets.split(","):
            for c in args.concurrency:
                for engine in makers:
                    rows[engine][f"{dataset}-c{c}"] = bench(args, ports[engine], engine, dataset, c)
                    print(engine, dataset, c, json.dumps(rows[engine][f"{dataset}-c{c}"]), flush=True)
        memory = {e: memory_kib(servers[e].pid) for e in makers}
    return {e: {"runs": rows[e], "rss_gib": memory[e][0] / 2**20, "peak_rss_gib": memory[e][1] / 2**20}
            for e in makers}


def main():
    ap = peers_args(__doc__)
    ap.add_argument("--format", default="Q4_0", choices=FORMATS)
    ap.add_argument("--concurrency", default="1,4,16", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--datasets", default="text,vision")
    ap.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per unit of concurrency")
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256, help="tokens of a random text prompt")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--image-tokens", type=int, default=256, help="most tokens of one image")
    args = ap.parse_args()
    if max(args.concurrency) > SLOTS:
        sys.exit(f"--concurrency goes up to {SLOTS}, the servers' sequences")
    (args.work / "serve").mkdir(parents=True, exist_ok=True)
    pair = files(args)[args.format]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "threads": args.threads,
        "format": args.format,
        "llama_cpp_commit": args.llama_commit,
        "settings": {k: getattr(args, k) for k in ("input_len", "output_len", "image_tokens",
                                                    "prompts_per_slot", "min_prompts")},
        **run_both(args, pair),
    }
    (args.work / f"peers-serve-{args.format}.json").write_text(json.dumps(report, indent=1))
    ours, theirs = report["kvlens"], report["llama_server"]
    print(f"\n{report['cpu']}, {args.threads} threads, {args.format}, llama.cpp {args.llama_commit[:10]}")
    print("| prompts | concurrency | output tok/s kvlens | llama-server | ratio | TTFT p50 / p99 ms kvlens "
          "| llama-server | TPOT p50 / p99 ms kvlens | llama-server |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, a in ours["runs"].items():
        b = theirs["runs"][key]
        dataset, c = key.rsplit("-c", 1)
        print(f"| {dataset} ({a['num_prompts']}) | {c} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} "
              f"| {a['output_throughput'] / b['output_throughput']:.2f}× "
              f"| {a['median_ttft_ms']:.0f} / {a['p99_ttft_ms']:.0f} | {b['median_ttft_ms']:.0f} / {b['p99_ttft_ms']:.0f} "
              f"| {a['median_tpot_ms']:.0f} / {a['p99_tpot_ms']:.0f} | {b['median_tpot_ms']:.0f} / {b['p99_tpot_ms']:.0f} |")
    print(f"resident memory at the end (peak): kvlens {ours['rss_gib']:.2f} GiB ({ours['peak_rss_gib']:.2f}), "
          f"llama-server {theirs['rss_gib']:.2f} GiB ({theirs['peak_rss_gib']:.2f})")


if __name__ == "__main__":
    main()
