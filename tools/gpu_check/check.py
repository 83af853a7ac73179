"""The CUDA backend's checks and measurements on a GPU machine, from the folder `cargo xtask
gpu-check` prepares (the release kvlens built with --features cuda, the engine's CUDA tests, the
golden fixtures, this script). Needs Python with torch and transformers (for the anchor) and the
CUDA 13 (or 12) libraries: run.sh finds them in PyTorch's nvidia-* packages.

Every step writes its result into OUT as it finishes, and a failing step is recorded, not fatal,
so a run cut short still brings back what it measured. OUT/summary.md collects the figures.
"""

import argparse
import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
KVLENS = os.path.join(HERE, "kvlens")
TOKENIZER = os.path.join(HERE, "tokenizer.json")
FIXTURES = os.path.join(HERE, "fixtures", "golden")

# As server/tests/golden.rs: the f32 path must follow transformers float32 as the CPU does; bf16
# weights get the bound the wgpu f16 path documents, to be tightened from what this measures.
GOLDEN_RUNS = {
    "float32": {"logprob_tol": 1e-3, "min_margin": 1e-3},
    "bfloat16": {"logprob_tol": 0.25, "min_margin": 0.5},
}


def log(msg):
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save(out, name, value):
    with open(os.path.join(out, name), "w") as f:
        json.dump(value, f, indent=1)


def run(cmd, timeout, **kw):
    log("+ " + " ".join(cmd))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def suite(out):
    """The engine's CUDA tests (the backend suite and the op-by-op checks against the CPU)."""
    p = run([os.path.join(HERE, "engine-cuda-tests"), "--ignored", "--test-threads", "1", "backend::cuda"], 600)
    with open(os.path.join(out, "suite.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    m = re.findall(r"test result: \w+\. (\d+) passed; (\d+) failed", p.stdout)
    return {"passed": sum(int(a) for a, _ in m), "failed": sum(int(b) for _, b in m), "exit": p.returncode}


def golden_checkpoint(fixture, work):
    args = fixture["checkpoint"]["command"].split()[1:]
    ckpt = os.path.join(work, "golden-" + os.path.basename(fixture["checkpoint"]["config"]).replace(".json", ""))
    args = [ckpt if a == "DIR" else os.path.join(HERE, a) if a.startswith("tools/") else a for a in args]
    p = run([KVLENS] + args + ["--tokenizer", TOKENIZER], 300)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    with open(os.path.join(ckpt, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    if sha != fixture["checkpoint"]["model_safetensors_sha256"]:
        raise RuntimeError(f"{ckpt}: the regenerated checkpoint differs from the fixture's")
    return ckpt


def golden(out, work):
    """Each fixture through `kvlens generate --backend cuda`, against transformers' float32 numbers."""
    results = {}
    for path in sorted(glob.glob(os.path.join(FIXTURES, "*.json"))):
        fixture = json.load(open(path))
        name = os.path.basename(path)[:-5]
        ckpt = golden_checkpoint(fixture, work)
        for dtype, tol in GOLDEN_RUNS.items():
            worst, compared, agreed, errors = 0.0, 0, 0, []
            for case in fixture["cases"]:
                msgs = json.loads(json.dumps(case["messages"]))
                for m in msgs:
                    for part in m["content"] if isinstance(m["content"], list) else []:
                        if "image_url" in part:
                            part["image_url"]["url"] = os.path.join(FIXTURES, part["image_url"]["url"])
                mpath = os.path.join(work, f"{name}-{case['name']}.json")
                json.dump(msgs, open(mpath, "w"))
                want = case["token_ids"]
                p = run([KVLENS, "generate", "--model", ckpt, "--messages", mpath, "--backend", "cuda",
                         "--dtype", dtype, "--max-tokens", str(len(want)), "--ignore-eos", "--logprobs", "5",
                         "--json"], 300)
                if p.returncode != 0:
                    errors.append(f"{case['name']}: {p.stderr[-2000:]}")
                    continue
                got = json.loads(p.stdout)
                if got["prompt_token_ids"] != case["prompt_token_ids"]:
                    errors.append(f"{case['name']}: prompt ids differ")
                for i, step in enumerate(case["steps"]):
                    top = dict((t[0], t[1]) for t in got["top_logprobs"][i])
                    for tid, lp in step["top"]:
                        if tid in top:
                            worst = max(worst, abs(top[tid] - lp))
                    if step["margin"] > tol["min_margin"]:
                        compared += 1
                        agreed += got["token_ids"][i] == want[i]
                    if got["token_ids"][i] != want[i]:
                        break
            ok = not errors and compared >= 10 and agreed == compared and worst < tol["logprob_tol"]
            results[f"{name}/{dtype}"] = {"ok": ok, "tokens_compared": compared, "tokens_agreeing": agreed,
                                          "largest_logprob_difference": worst, "bound": tol, "errors": errors}
            save(out, "golden.json", results)
    return results


def wait_ready(url, proc, deadline_s):
    """Polls url until it answers 200, the server exits, or the deadline passes."""
    end = time.time() + deadline_s
    while time.time() < end:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1)
    return False


GIB_LINES = {
    "weights_gib": r"Loading model weights took ([\d.]+) GiB",
    "activation_peak_gib": r"torch peak memory increase: ([\d.]+) GiB",
    "non_torch_gib": r"non-torch forward increase memory: ([\d.]+) GiB",
    "available_kv_gib": r"Available KV cache memory: ([\d.]+) GiB",
}


def measured_from_log(text):
    found = {}
    for key, pattern in GIB_LINES.items():
        m = re.search(pattern, text)
        if m:
            found[key] = float(m.group(1))
    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", text)
    if m:
        found["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    return found


def serve_and_bench(out, work, config, port, prompts):
    """A full-size random checkpoint served on the GPU: start-up lines, planned vs measured, and
    `kvlens bench serve` at request rates 2 and 8."""
    ckpt = os.path.join(work, config + "-random-bf16")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        p = run([KVLENS, "random-checkpoint", "--config", config, "--out", ckpt, "--dtype", "bf16", "--seed", "0",
                 "--tokenizer", TOKENIZER, "--force"], 1200)
        if p.returncode != 0:
            raise RuntimeError(p.stderr)
    logfile = os.path.join(out, f"serve-{config}.log")
    result = {"config": config}
    with open(logfile, "w") as logf:
        server = subprocess.Popen([KVLENS, "serve", "--model", ckpt, "--backend", "cuda", "--dtype", "bfloat16",
                                   "--port", str(port), "--max-model-len", "16384",
                                   "--limit-mm-per-prompt", "image=1,video=0"],
                                  stdout=logf, stderr=subprocess.STDOUT)
        try:
            ready = wait_ready(f"http://127.0.0.1:{port}/health", server, 1200)
            result["ready"] = ready
            text = open(logfile).read()
            result["startup_lines"] = [ln for ln in text.splitlines()
                                       if re.search(r"GiB|KV cache|CUDA device|Maximum concurrency", ln)]
            result["measured"] = measured_from_log(text)
            p = run([KVLENS, "plan", "--from-log", logfile, "--json"], 120)
            if p.returncode == 0:
                result["plan_from_log"] = json.loads(p.stdout)
            p = run([KVLENS, "plan", "--model", ckpt, "--device", "h100-80g", "--dtype", "bfloat16",
                     "--kv-cache-dtype", "float32", "--max-model-len", "16384",
                     "--limit-mm-per-prompt", "image=1,video=0", "--json"], 120)
            if p.returncode == 0:
                result["plan_estimate"] = json.loads(p.stdout)
            if ready:
                for rate in (2, 8):
                    name = f"bench-{config}-rate{rate}.json"
                    p = run([KVLENS, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                             "--dataset-name", "synthetic-vision", "--num-prompts", str(prompts),
                             "--request-rate", str(rate), "--save-result", "--result-dir", out,
                             "--result-filename", name, "--disable-tqdm"], 1800)
                    result[f"bench_rate{rate}"] = {"exit": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return result


def anchor(out, work, config):
    """`kvlens generate --backend cuda` against transformers generate on the same GPU."""
    path = os.path.join(out, f"generate-vs-transformers-{config}.json")
    p = run([sys.executable, os.path.join(HERE, "generate_vs_transformers.py"), "--kvlens", KVLENS,
             "--work", work, "--config", config, "--device", "cuda", "--out", path], 1800)
    with open(os.path.join(out, f"generate-vs-transformers-{config}.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    return {"exit": p.returncode, "tail": p.stdout[-2500:]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/kvlens-gpu-check")
    ap.add_argument("--steps", default="suite,golden,anchor,serve",
                    help="comma-separated: suite, golden, anchor, serve")
    ap.add_argument("--configs", default="Qwen3-VL-2B-Instruct,Qwen3-VL-8B-Instruct")
    ap.add_argument("--prompts", type=int, default=200)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    steps = a.steps.split(",")
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    try:
        import torch
        summary["device"] = torch.cuda.get_device_name(0)
    except Exception as e:  # the checks themselves do not need torch
        summary["device"] = f"unknown ({e})"

    def step(name, fn):
        started = time.time()
        try:
            summary["steps"][name] = {"result": fn()}
        except Exception as e:
            summary["steps"][name] = {"error": repr(e)}
        summary["steps"][name]["seconds"] = round(time.time() - started, 1)
        save(a.out, "summary.json", summary)

    if "suite" in steps:
        step("suite", lambda: suite(a.out))
    if "golden" in steps:
        step("golden", lambda: golden(a.out, a.work))
    for i, config in enumerate(a.configs.split(",")):
        if "anchor" in steps:
            step(f"anchor/{config}", lambda: anchor(a.out, a.work, config))
        if "serve" in steps:
            step(f"serve/{config}", lambda: serve_and_bench(a.out, a.work, config, 8100 + i, a.prompts))
    log("done: " + json.dumps({k: ("error" not in v) for k, v in summary["steps"].items()}))


if __name__ == "__main__":
    main()
