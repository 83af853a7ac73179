"""The GPU checks and measurements, from the folder `cargo xtask gpu-check` prepares (the release
kvlens built with --features cuda, the engine's CUDA tests, the golden fixtures, this script, and
Debian's Vulkan loader). One call of run.sh does, in this order, each step bounded by what is left
of --deadline-s, while the random checkpoints are written in the background from the start:

  device   the GPU's name, memory and measured device copy bandwidth (the rooflines' divisor)
  golden   the golden fixtures through `kvlens generate --backend cuda`, f32 and bf16 (where they
           fail, again with the decode kernels of before gemv_bf16 and split attention,
           PLAIN_DECODE, which the later steps then use if those pass); then f32 with the
           tiled attention kernels (KVLENS_CUDA_ATTENTION=tiled), which the later CUDA steps
           use where it passed
  each step for every model in turn (Qwen3-VL-2B, then 8B; random bf16 checkpoints written there):
    anchor   `kvlens generate --backend cuda` against transformers bf16 generate on the same GPU,
             and the same generate with the other decode kernels (PLAIN_DECODE or not)
    serve    `kvlens serve --backend cuda` (images capped at SERVE_MAX_PIXELS): start-up lines,
             planned vs measured, and `kvlens bench serve` with synthetic-vision prompts at
             request rates 2 and 8
    wgpu     the anchor's prompt through `--backend wgpu` on the GPU's Vulkan driver, decode
             beside CUDA's
  vulkan   the golden fixtures through `--backend wgpu`, and `kvlens bench kernels` (GEMV in GB/s
           against the copy bandwidth, GEMM in GFLOP/s against the f32/f16 peaks per weight format)
  suite    the engine's CUDA tests

A failing step is recorded, not fatal. OUT holds summary.json (every figure, rewritten after each
step) and details.tar.gz (logs and raw results), so a run cut short still brings back what it
measured. `--dry-run` runs the same steps on a machine without a GPU (the CUDA steps then report
"no device", the wgpu ones run on whatever adapter there is, on tiny checkpoints): `cargo xtask
test` runs it so that this script cannot rot while no GPU is available.

Needs only Python's standard library; torch (for the bandwidth and the transformers anchor) is
imported where it is used.
"""

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

# As server/tests/golden.rs: the f32 path must follow transformers float32 as the CPU does. bf16
# weights (8 significant bits; CUDA also rounds the activations it multiplies) get the CPU bf16
# path's bound (CPU_BF16 there: largest differences 0.47, 1.20, 0.12 on the CPU; 0.84, 0.92, 0.10
# measured on the H200 on 2026-11-28); tokens must agree where the reference's margin exceeds 0.5
# (14/14, 13/13 and 20/20 did there).
# On wgpu, "bfloat16" loads f16 weights, whose bound (WGPU_F16) is far tighter.
GOLDEN_RUNS = {
    "float32": {"logprob_tol": 1e-3, "min_margin": 1e-3},
    "bfloat16": {"logprob_tol": 1.5, "min_margin": 0.5},
}
WGPU_F16 = {"logprob_tol": 0.25, "min_margin": 0.5}

# Nominal dense peaks (vendor datasheets) for the wgpu kernels' "% of peak": CUDA cores, not tensor
# cores, since WGSL has no matrix instructions. H100 and H200 SXM share the chip.
PEAK_TFLOPS = {"H200": {"f32": 66.9, "f16": 133.8}, "H100": {"f32": 66.9, "f16": 133.8}}

NO_DEVICE = "no device"

# The CUDA decode kernels before 2026-12-06: cuBLAS for every product (after a bf16 copy of the
# rows), one attention block per row and head, no fused kernels. The default since: gemv_bf16,
# split attention and the fused kernels (add_rms_norm, norm_rope, gemv_bf16_glu).
PLAIN_DECODE = {"KVLENS_CUDA_GEMV": "cublas", "KVLENS_CUDA_DECODE_ATTENTION": "rows", "KVLENS_CUDA_FUSED": "off"}


def log(msg):
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """The run's settings, its deadline, and where its files go."""

    def __init__(self, a):
        self.a = a
        self.kvlens = a.kvlens or os.path.join(HERE, "kvlens")
        self.tokenizer = a.tokenizer or os.path.join(HERE, "tokenizer.json")
        self.fixtures = a.fixtures or os.path.join(HERE, "fixtures", "golden")
        self.out = a.out
        self.work = a.work
        self.details = os.path.join(a.work, "details")
        self.end = time.time() + a.deadline_s
        self.summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": a.dry_run,
                        "deadline_s": a.deadline_s, "steps": {}}
        self.cuda = False
        self.writers = {}
        # The environment of the CUDA steps: the row kernels, then KVLENS_CUDA_ATTENTION=tiled
        # once the tiled kernels have passed the golden fixtures here.
        self.cuda_env = {k: v for k, v in os.environ.items()
                         if k != "KVLENS_CUDA_ATTENTION" and k not in PLAIN_DECODE}
        self.bandwidth_gb_s = None
        self.device_name = NO_DEVICE

    def tokenizer_args(self):
        """The real Qwen tokenizer for new checkpoints where the folder has one."""
        return ["--tokenizer", self.tokenizer] if os.path.exists(self.tokenizer) else []

    def left(self):
        return self.end - time.time()

    def detail(self, name):
        return os.path.join(self.details, name)

    def save(self):
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=1)
        with tarfile.open(os.path.join(self.out, "details.tar.gz"), "w:gz") as t:
            t.add(self.details, arcname="details")

    def cmd(self, args, cap_s, **kw):
        """Runs args for at most cap_s seconds and what is left of the deadline; never raises on a
        timeout (the result then has returncode None)."""
        timeout = max(1.0, min(cap_s, self.left()))
        log("+ " + " ".join(args) + f"   (at most {timeout:.0f} s)")
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            return subprocess.CompletedProcess(args, None, out, err + f"\n[timed out after {timeout:.0f} s]")

    def step(self, name, fn, need_s=5):
        """Runs one step, recording its result or its error and its seconds, then saves."""
        started = time.time()
        if self.left() < need_s:
            entry = {"skipped": f"out of time ({self.left():.0f} s left, needs {need_s})"}
        else:
            log(f"step {name} ({self.left():.0f} s left)")
            try:
                entry = {"result": fn()}
            except Exception as e:
                entry = {"error": f"{type(e).__name__}: {e}"[-3000:]}
        entry["seconds"] = round(time.time() - started, 1)
        self.summary["steps"][name] = entry
        log(f"step {name}: " + ("error" if "error" in entry else "skipped" if "skipped" in entry else "ok")
            + f" in {entry['seconds']} s")
        self.save()
        return entry.get("result")


def failure(p, what):
    tail = (p.stdout[-1500:] + "\n" + p.stderr[-2500:]).strip()
    return RuntimeError(f"{what} exited {p.returncode}: {tail}")


def device_step(r):
    """The GPU's name and memory (nvidia-smi) and the device-to-device copy bandwidth (torch)."""
    if r.a.dry_run:
        return {"device": NO_DEVICE}
    found = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        p = r.cmd([smi, "--query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max,"
                   "clocks.max.sm,clocks.max.memory,power.limit", "--format=csv"], 30)
        found["nvidia_smi"] = p.stdout.strip()
    import torch  # the checks themselves do not need torch; the bandwidth does

    if not torch.cuda.is_available():
        found["device"] = NO_DEVICE
        return found
    r.cuda = True
    props = torch.cuda.get_device_properties(0)
    r.device_name = props.name
    # Beside this script in gpu-check/; in tools/bench/ in the repository.
    sys.path.insert(0, HERE if os.path.exists(os.path.join(HERE, "generate_vs_transformers.py"))
                    else os.path.join(HERE, "..", "bench"))
    from generate_vs_transformers import cuda_copy_bandwidth_gb_s

    best = cuda_copy_bandwidth_gb_s(reps=10)
    torch.cuda.empty_cache()
    r.bandwidth_gb_s = best
    found.update({
        "device": props.name, "memory_bytes": props.total_memory, "multiprocessors": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
        "copy_bandwidth_gb_s": best, "copy_bandwidth_kind": "device-to-device copy of 1 GiB, read + write "
                                                            "bytes over the time, best of ten",
        "form_factor": "PCIe/NVL" if re.search(r"PCIe|NVL", props.name) else "SXM (by name)",
    })
    return found


def suite_step(r):
    """The engine's CUDA tests (the backend suite and the op-by-op checks against the CPU)."""
    tests = os.path.join(HERE, "engine-cuda-tests")
    if not r.cuda:
        return {"skipped": NO_DEVICE}
    p = r.cmd([tests, "--ignored", "--test-threads", "1", "backend::cuda"], 150)
    with open(r.detail("suite.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    m = re.findall(r"test result: \w+\. (\d+) passed; (\d+) failed", p.stdout)
    failed = re.findall(r"^test (\S+) \.\.\. FAILED", p.stdout, re.M)
    return {"passed": sum(int(a) for a, _ in m), "failed": sum(int(b) for _, b in m), "exit": p.returncode,
            "failed_tests": failed}


def golden_checkpoint(r, fixture):
    args = fixture["checkpoint"]["command"].split()[1:]
    ckpt = os.path.join(r.work, "golden-" + os.path.basename(fixture["checkpoint"]["config"]).replace(".json", ""))
    if os.path.exists(os.path.join(ckpt, "model.safetensors")):
        return ckpt
    args = [ckpt if a == "DIR" else os.path.join(r.a.root, a) if a.startswith("tools/") else a for a in args]
    p = r.cmd([r.kvlens] + args + r.tokenizer_args(), 120)
    if p.returncode != 0:
        raise failure(p, "random-checkpoint")
    with open(os.path.join(ckpt, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    if sha != fixture["checkpoint"]["model_safetensors_sha256"]:
        raise RuntimeError(f"{ckpt}: the regenerated checkpoint differs from the fixture's")
    return ckpt


def golden_step(r, backend, dtypes, cap_s, env=None, key=None, only=None):
    """Each fixture (Qwen3-VL first) through `kvlens generate --backend BACKEND`, against
    transformers' float32 numbers, for at most cap_s seconds; a fixture's result is kept as soon as
    it is known."""
    results = {}
    key = key or f"golden-{backend}"
    end = time.time() + cap_s
    paths = sorted(glob.glob(os.path.join(r.fixtures, "*.json")), key=lambda p: (not p.endswith("qwen3_vl.json"), p))
    for path in paths:
        name = os.path.basename(path)[:-5]
        if r.a.fixtures_only and name not in r.a.fixtures_only.split(",") or only and name not in only:
            continue
        if time.time() > end:
            results.setdefault("not_run", []).append(name)
            continue
        fixture = json.load(open(path))
        ckpt = golden_checkpoint(r, fixture)
        for dtype in dtypes:
            tol = WGPU_F16 if backend == "wgpu" and dtype == "bfloat16" else GOLDEN_RUNS[dtype]
            worst, compared, agreed, errors = 0.0, 0, 0, []
            for case in fixture["cases"]:
                if r.left() < 10 or time.time() > end + 30:
                    errors.append("out of time")
                    break
                msgs = json.loads(json.dumps(case["messages"]))
                for m in msgs:
                    for part in m["content"] if isinstance(m["content"], list) else []:
                        if "image_url" in part:
                            part["image_url"]["url"] = os.path.join(r.fixtures, part["image_url"]["url"])
                mpath = os.path.join(r.work, f"{name}-{case['name']}.json")
                json.dump(msgs, open(mpath, "w"))
                want = case["token_ids"]
                p = r.cmd([r.kvlens, "generate", "--model", ckpt, "--messages", mpath, "--backend", backend,
                           "--dtype", dtype, "--max-tokens", str(len(want)), "--ignore-eos", "--logprobs", "5",
                           "--json"], 120, env=env)
                if p.returncode != 0:
                    errors.append(f"{case['name']}: exit {p.returncode}: {p.stderr[-1500:]}")
                    break  # the next cases would fail the same way
                try:
                    got = json.loads(p.stdout)
                    if got["prompt_token_ids"] != case["prompt_token_ids"]:
                        errors.append(f"{case['name']}: prompt ids differ")
                    for i, step in enumerate(case["steps"]):
                        top = dict((t[0], t[1]) for t in got["top_logprobs"][i])
                        for tid, lp in step["top"]:
                            if tid in top:
                                # A NaN log-probability reaches JSON as null: no bound holds it.
                                worst = max(worst, float("inf") if top[tid] is None else abs(top[tid] - lp))
                        if step["margin"] > tol["min_margin"]:
                            compared += 1
                            agreed += got["token_ids"][i] == want[i]
                        if got["token_ids"][i] != want[i]:
                            break
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    errors.append(f"{case['name']}: unreadable output ({type(e).__name__}: {e}): {p.stdout[-500:]}")
                    break
            ok = not errors and compared >= 10 and agreed == compared and worst < tol["logprob_tol"]
            results[f"{name}/{dtype}"] = {"ok": ok, "tokens_compared": compared, "tokens_agreeing": agreed,
                                          "largest_logprob_difference": worst, "bound": tol, "errors": errors}
            with open(r.detail(f"{key}.json"), "w") as f:
                json.dump(results, f, indent=1)
    not_run = results.pop("not_run", [])
    if not results:
        raise RuntimeError(f"no golden fixture run from {r.fixtures}")
    return {"all_ok": all(v["ok"] for v in results.values()), "runs": results, "not_run": not_run}


# The fixtures that must pass with the tiled kernels before the later CUDA steps use them: the
# vision towers' full-image and windowed segments, and prompts long enough to prefill in tiles.
TILED_FIXTURES = ["qwen3_vl", "qwen2_5_vl", "qwen2_vl"]


def plain_decode_step(r):
    """Where the golden fixtures failed on CUDA with the default decode kernels: the same with
    PLAIN_DECODE; where those pass, every later CUDA step runs with them."""
    golden = r.summary["steps"].get("golden/cuda") or {}
    # A step that raised (no result) failed as surely as one whose fixtures disagreed.
    if not r.cuda or (golden.get("result") or {}).get("all_ok") is True:
        return {"skipped": NO_DEVICE if not r.cuda else "the default decode kernels passed"}
    env = dict(r.cuda_env, **PLAIN_DECODE)
    result = golden_step(r, "cuda", list(GOLDEN_RUNS), r.a.golden_s, env=env, key="golden-cuda-plain-decode")
    if result["all_ok"]:
        r.cuda_env = env
    result["later_cuda_steps"] = "plain decode" if result["all_ok"] else "default decode"
    return result


def decode_kernels(env):
    if env.get("KVLENS_CUDA_GEMV") == "cublas":
        return "plain (cuBLAS, one block per row)"
    return "gemv_bf16 and split attention" + (" unfused" if env.get("KVLENS_CUDA_FUSED") == "off" else ", fused")


def tiled_step(r):
    """TILED_FIXTURES in f32 through the tiled attention kernels (KVLENS_CUDA_ATTENTION=tiled);
    where every one ran and passed, every later CUDA step runs with them (the row kernels' start-up
    profile of the 2B took 204 s)."""
    if not r.cuda:
        return {"skipped": NO_DEVICE}
    env = dict(r.cuda_env, KVLENS_CUDA_ATTENTION="tiled")
    result = golden_step(r, "cuda", ["float32"], r.a.golden_s, env=env, key="golden-cuda-tiled",
                         only=TILED_FIXTURES)
    passed = result["all_ok"] and not result["not_run"] and len(result["runs"]) == len(TILED_FIXTURES)
    if passed:
        r.cuda_env = env
    result["later_cuda_steps"] = "tiled" if passed else "rows"
    return result


def wgpu_env(r):
    env = dict(os.environ)
    if r.a.wgpu_adapter:
        env["KVLENS_WGPU_ADAPTER"] = r.a.wgpu_adapter
    return env


def kernels_step(r):
    """`kvlens bench kernels` on the wgpu adapter: GEMV GB/s against the measured copy bandwidth,
    GEMM GFLOP/s against the nominal f32/f16 peaks."""
    args = [r.kvlens, "bench", "kernels", "--no-cpu", "--reps", "3", "--max-case-s", str(r.a.kernel_case_s)]
    if r.a.dry_run:
        args += ["--quick", "--gemv-mib", "4", "--only", "gemv"]
    p = r.cmd(args, 150, env=wgpu_env(r))
    with open(r.detail("bench-kernels.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        raise failure(p, "kvlens bench kernels")
    adapter = next((ln.split(":", 1)[1].strip() for ln in p.stdout.splitlines() if ln.startswith("wgpu:")), None)
    rows = []
    header = None
    for ln in p.stdout.splitlines():
        if not ln.startswith("|") or ln.startswith("|--") or ln.startswith("|---"):
            continue
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        rows.append(dict(zip(header, cells)))
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in r.device_name), None)
    for row in rows:
        for k, v in list(row.items()):
            m = re.match(r"([\d.]+) (GB/s|GFLOP/s)\b", v)
            if not m:
                continue
            x = float(m.group(1))
            if m.group(2) == "GB/s" and r.bandwidth_gb_s:
                row[k + " % of copy bandwidth"] = round(100 * x / r.bandwidth_gb_s, 1)
            if m.group(2) == "GFLOP/s" and peak:
                row[k + " % of f32 peak"] = round(100 * x / (peak["f32"] * 1e3), 1)
                row[k + " % of f16 peak"] = round(100 * x / (peak["f16"] * 1e3), 1)
    if not rows:
        raise RuntimeError("kvlens bench kernels printed no table:\n" + p.stdout[-2000:])
    return {"adapter": adapter, "peaks_tflops": peak, "rows": rows}


def label(config):
    """A config's name in step and file names: a published model's, or a config file's stem."""
    return os.path.basename(config).removesuffix(".json")


def start_checkpoints(r, configs):
    """Starts writing a random bf16 checkpoint of each config's shapes (a published model's name or
    a config.json) in the background, so the GPU steps before they are needed overlap them."""
    for config in configs:
        ckpt = os.path.join(r.work, label(config) + "-random-bf16")
        if os.path.exists(os.path.join(ckpt, "config.json")):
            continue
        args = [r.kvlens, "random-checkpoint", "--out", ckpt, "--dtype", "bf16", "--seed", "0", "--force",
                "--config", config] + r.tokenizer_args()
        if config.endswith(".json"):  # a tiny config (the dry run): small images
            args += ["--image-limits", "1024,65536"]
        log("+ " + " ".join(args) + "   (in the background)")
        logf = open(r.detail(f"random-checkpoint-{label(config)}.log"), "w")
        r.writers[config] = (subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT), time.time())


def checkpoint(r, config):
    """The config's random checkpoint, once its writer has finished."""
    ckpt = os.path.join(r.work, label(config) + "-random-bf16")
    if config in r.writers:
        proc, started = r.writers[config]
        try:
            code = proc.wait(max(1.0, r.left()))
        except subprocess.TimeoutExpired:
            proc.kill()
            shutil.rmtree(ckpt, ignore_errors=True)
            raise RuntimeError("random-checkpoint did not finish before the deadline")
        r.summary.setdefault("checkpoints", {})[label(config)] = {"exit": code,
                                                                  "seconds": round(time.time() - started, 1)}
        del r.writers[config]
        if code != 0:
            shutil.rmtree(ckpt, ignore_errors=True)
            tail = open(r.detail(f"random-checkpoint-{label(config)}.log")).read()[-2500:]
            raise RuntimeError(f"random-checkpoint exited {code}: {tail}")
    return ckpt


def anchor_step(r, config):
    """`kvlens generate --backend cuda` against transformers bf16 generate on the same GPU."""
    if not r.cuda:
        return {"skipped": NO_DEVICE}
    ckpt = checkpoint(r, config)
    path = r.detail(f"generate-vs-transformers-{label(config)}.json")
    p = r.cmd([sys.executable, os.path.join(HERE, "generate_vs_transformers.py"), "--kvlens", r.kvlens,
               "--work", r.work, "--config", config, "--device", "cuda", "--anchors", "bf16",
               "--max-tokens", str(r.a.max_tokens), "--out", path], 300, env=r.cuda_env)
    with open(r.detail(f"generate-vs-transformers-{label(config)}.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        raise failure(p, "generate_vs_transformers.py")
    res = json.load(open(path))
    k = next(iter(res["kvlens"].values()))
    t = res["transformers_bf16"]
    # The other decode kernels on the same prompt, for the ratio measured in the same call.
    other_env = {key: v for key, v in r.cuda_env.items() if key not in PLAIN_DECODE} \
        if r.cuda_env.get("KVLENS_CUDA_GEMV") == "cublas" else dict(r.cuda_env, **PLAIN_DECODE)
    other = cuda_generate_or_error(r, ckpt, other_env)
    # With the default kernels, also without the fused ones: what the fusing alone gave.
    unfused = cuda_generate_or_error(r, ckpt, dict(r.cuda_env, KVLENS_CUDA_FUSED="off")) \
        if r.cuda_env.get("KVLENS_CUDA_GEMV") != "cublas" else {}
    # The default kernels' decode broken down by kernel (slower: every launch timed).
    profiled = cuda_generate_or_error(r, ckpt, dict(r.cuda_env, KVLENS_CUDA_PROFILE="1"))
    breakdown = {"error": profiled["error"]} if "error" in profiled else kernel_breakdown(profiled["cuda_kernels"])
    if "error" not in breakdown and k["timing"]["decode_tokens_per_s"] > 0:
        breakdown["step_us_measured"] = round(1e6 / k["timing"]["decode_tokens_per_s"], 1)
    return {
        "checkpoint": ckpt,
        "decode_kernel_breakdown": breakdown,
        "kvlens_prefill_tokens_per_s": k["timing"]["prefill_tokens_per_s"],
        "kvlens_decode_tokens_per_s": k["timing"]["decode_tokens_per_s"],
        # Near 1: decode is bound by the host recording the steps, not by the GPU.
        "kvlens_decode_record_share": k["timing"].get("decode_record_share"),
        "decode_read_gb_per_token": (k["weights"]["decode_read_bytes_per_token"]
                                     + k["weights"].get("decode_kv_read_bytes_per_token", 0)) / 1e9,
        "roofline_decode_tokens_per_s": k.get("roofline_decode_tokens_per_s"),
        "of_roofline": k["timing"]["decode_tokens_per_s"] / k["roofline_decode_tokens_per_s"],
        "transformers_bf16_prefill_tokens_per_s": t["prefill_tokens_per_s"],
        "transformers_bf16_decode_tokens_per_s": t["decode_tokens_per_s"],
        "decode_ratio": k["timing"]["decode_tokens_per_s"] / t["decode_tokens_per_s"],
        "prefill_ratio": k["timing"]["prefill_tokens_per_s"] / t["prefill_tokens_per_s"],
        "tokens_equal_transformers": k["token_ids"] == t["token_ids"],
        "cuda_attention": r.cuda_env.get("KVLENS_CUDA_ATTENTION", "rows"),
        "decode_kernels": decode_kernels(r.cuda_env),
        "other_decode_kernels": decode_kernels(other_env),
        "other_decode_tokens_per_s": other.get("decode_tokens_per_s"),
        "other_decode_record_share": other.get("decode_record_share"),
        # Information, not a check: gemv_bf16 multiplies f32 rows where cuBLAS took them rounded
        # to bf16, so near-ties on a random checkpoint may go either way.
        "other_tokens_equal": other.get("token_ids") == k["token_ids"] if "token_ids" in other else None,
        "other_error": other.get("error"),
        "unfused_decode_tokens_per_s": unfused.get("decode_tokens_per_s"),
        "unfused_decode_record_share": unfused.get("decode_record_share"),
        # Information, not a check: norm_rope sums a head's squares in another order than
        # rms_norm (add_rms_norm and gemv_bf16_glu are their parts to the bit), so near-ties may flip.
        "unfused_tokens_equal": unfused.get("token_ids") == k["token_ids"] if "token_ids" in unfused else None,
        "unfused_error": unfused.get("error"),
        "load_s": k.get("load_s"),
    }


def generate_once(r, ckpt, backend, dtype, env=None, cap_s=180):
    """One `kvlens generate` of the bench's image prompt; its timing and tokens."""
    image = os.path.join(r.work, "photo_1024x768.png")
    if not os.path.exists(image):
        shutil.copy(os.path.join(r.fixtures, "images", sorted(os.listdir(os.path.join(r.fixtures, "images")))[0]),
                    image)
    p = r.cmd([r.kvlens, "generate", "--model", ckpt, "--prompt", "Describe this image in detail.", "--image", image,
               "--max-tokens", str(r.a.max_tokens), "--ignore-eos", "--json", "--backend", backend,
               "--dtype", dtype], cap_s, env=env)
    with open(r.detail(f"generate-{backend}-{os.path.basename(ckpt)}.log"), "w") as f:
        f.write(p.stderr)
    if p.returncode != 0:
        raise failure(p, f"kvlens generate --backend {backend}")
    got = json.loads(p.stdout)
    return {"prompt_tokens": len(got["prompt_token_ids"]), "token_ids": got["token_ids"],
            "prefill_tokens_per_s": got["timing"]["prefill_tokens_per_s"],
            "decode_tokens_per_s": got["timing"]["decode_tokens_per_s"],
            "decode_record_share": got["timing"].get("decode_record_share"),
            "cuda_kernels": got["timing"].get("cuda_kernels")}


def cuda_generate_or_error(r, ckpt, env):
    """generate_once on CUDA in bf16, or {"error": …} where it failed."""
    try:
        return generate_once(r, ckpt, "cuda", "bfloat16", env=env)
    except (RuntimeError, ValueError, KeyError) as e:
        return {"error": str(e)[-1500:]}


def kernel_breakdown(profile):
    """A decode step's launches, GPU time and host launch time by kernel (KVLENS_CUDA_PROFILE=1),
    and their sums. The kernels run back to back behind a hold, so gpu_us is their own time: its sum
    near the unprofiled step's time means kernel-bound; far below it, launches and gaps."""
    steps = (profile or {}).get("decode_steps") or 0
    if not steps or not profile.get("decode"):
        return {"error": f"no decode steps profiled: {profile!r}"[:1500]}
    kernels = {name: {"launches": round(t["launches"] / steps, 2), "gpu_us": round(1e3 * t["gpu_ms"] / steps, 1),
                      "host_us": round(1e6 * t["host_s"] / steps, 1), "unmeasured": t.get("unmeasured", 0)}
               for name, t in profile["decode"].items()}
    return {"decode_steps": steps, "kernels": kernels,
            **{f"{key}_per_step": round(sum(k[key] for k in kernels.values()), 1)
               for key in ("launches", "gpu_us", "host_us")}}


def wgpu_decode_step(r, config):
    """The anchor's prompt through `--backend wgpu` (f16 weights from the bf16 checkpoint), with
    CUDA's decode beside it when the anchor step measured one."""
    ckpt = checkpoint(r, config)
    w = generate_once(r, ckpt, "wgpu", "bfloat16", env=wgpu_env(r))
    anchor = (r.summary["steps"].get(f"anchor/{label(config)}") or {}).get("result") or {}
    if "kvlens_decode_tokens_per_s" in anchor:
        w["cuda_decode_tokens_per_s"] = anchor["kvlens_decode_tokens_per_s"]
        w["wgpu_over_cuda_decode"] = w["decode_tokens_per_s"] / anchor["kvlens_decode_tokens_per_s"]
    return w


GIB_LINES = {
    "weights_gib": r"Loading model weights took ([\d.]+) GiB",
    "activation_peak_gib": r"torch peak memory increase: ([\d.]+) GiB",
    "non_torch_gib": r"non-torch forward increase memory: ([\d.]+) GiB",
    "available_kv_gib": r"Available KV cache memory: ([\d.]+) GiB",
}
PLAN_KEYS = {"weights_gib": "weights_bytes", "activation_peak_gib": "activation_peak_bytes",
             "non_torch_gib": "non_torch_bytes", "available_kv_gib": "available_kv_bytes"}


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


def wait_ready(r, url, proc, cap_s):
    """Polls url until it answers 200, the server exits, or the time runs out."""
    end = time.time() + min(cap_s, r.left())
    while time.time() < end:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


# Images' largest size in the serve step on CUDA: 1,024 tokens of 32×32. The vision tower's
# attention runs on CUDA cores, not tensor cores: the row kernels took 204 s to profile the 2B's
# largest image (16,384 tokens, 65,536 patches) and minutes per phone photo, and the tiled ones
# still do every patch pair's 2·64 multiply-adds per head and layer in f32 (~420 TFLOP for that
# image), so at full size neither the profile nor the rates would fit the run.
SERVE_MAX_PIXELS = 1 << 20


def plan_device(name):
    return "h200-141g" if "H200" in name else "h100-80g"


def serve_step(r, config, port):
    """The checkpoint served on the GPU: start-up lines, planned vs measured, and `kvlens bench
    serve` with synthetic-vision prompts at request rates 2 and 8."""
    ckpt = checkpoint(r, config)
    logfile = r.detail(f"serve-{label(config)}.log")
    backend = "cuda" if r.cuda or not r.a.dry_run else r.a.dry_run_serve_backend
    attention = r.cuda_env.get("KVLENS_CUDA_ATTENTION", "rows")
    result = {"backend": backend, "cuda_attention": attention}
    plan_args = ["--max-model-len", str(r.a.max_model_len), "--limit-mm-per-prompt", "image=1,video=0"]
    if backend == "cuda":
        # Served and planned with the same largest image (the profile's and the plan's).
        plan_args += ["--mm-processor-kwargs", json.dumps({"max_pixels": SERVE_MAX_PIXELS})]
        result["max_pixels"] = SERVE_MAX_PIXELS
    with open(logfile, "w") as logf:
        server = subprocess.Popen([r.kvlens, "serve", "--model", ckpt, "--backend", backend, "--dtype", "bfloat16",
                                   "--port", str(port)] + plan_args, stdout=logf,
                                  stderr=subprocess.STDOUT,
                                  env=r.cuda_env)
        try:
            ready = wait_ready(r, f"http://127.0.0.1:{port}/health", server, 240)
            text = open(logfile).read()
            result["ready"] = ready
            if not ready:
                raise RuntimeError(f"kvlens serve --backend {backend} did not become ready "
                                   f"(exit {server.poll()}): {text[-2500:]}")
            result["startup_lines"] = [ln for ln in text.splitlines()
                                       if re.search(r"GiB|KV cache|CUDA|device|Maximum concurrency", ln)][:30]
            measured = measured_from_log(text)
            result["measured"] = measured
            p = r.cmd([r.kvlens, "plan", "--from-log", logfile, "--json"], 60)
            if p.returncode == 0:
                result["plan_from_log"] = json.loads(p.stdout)
            device = plan_device(r.device_name)
            p = r.cmd([r.kvlens, "plan", "--model", ckpt, "--device", device, "--dtype", "bfloat16",
                       "--kv-cache-dtype", r.a.kv_cache_dtype, "--json"] + plan_args, 60)
            if p.returncode == 0:
                plan = json.loads(p.stdout)
                result["plan_estimate"] = {"device": device, **{k: plan.get(k) for k in PLAN_KEYS.values()},
                                           "kv_cache_tokens": plan.get("kv_cache_tokens")}
                result["planned_over_measured"] = {
                    k: plan[v] / (1 << 30) / measured[k] for k, v in PLAN_KEYS.items()
                    if measured.get(k) and plan.get(v) is not None}
            output_len = ["--output-len", str(r.a.bench_output_len)] if r.a.bench_output_len else []
            for rate, prompts in ((2, r.a.prompts_rate2), (8, r.a.prompts_rate8)):
                name = f"bench-{label(config)}-rate{rate}.json"
                p = r.cmd([r.kvlens, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                           "--dataset-name", "synthetic-vision", "--num-prompts", str(prompts),
                           "--request-rate", str(rate), "--save-result", "--result-dir", r.details,
                           "--result-filename", name, "--disable-tqdm"] + output_len, 180)
                entry = {"prompts": prompts, "exit": p.returncode}
                path = os.path.join(r.details, name)
                if p.returncode == 0 and os.path.exists(path):
                    b = json.load(open(path))
                    entry.update({k: v for k, v in b.items() if re.match(
                        r"(completed|failed|duration|request_throughput|output_throughput|total_token_throughput|"
                        r"(mean|median|p99)_(ttft|tpot|itl|e2el)_ms)$", k)})
                else:
                    entry["tail"] = (p.stdout + p.stderr)[-2000:]
                result[f"bench_rate{rate}"] = entry
                r.save()
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/kvlens-gpu-check")
    ap.add_argument("--deadline-s", type=float, default=510,
                    help="every step ends by then (the device call's limit less the start-up)")
    ap.add_argument("--steps", default="device,suite,golden,vulkan,anchor,wgpu,serve",
                    help="comma-separated: device, suite, golden, vulkan, anchor, wgpu, serve")
    ap.add_argument("--configs", default="Qwen3-VL-2B-Instruct,Qwen3-VL-8B-Instruct")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per generate")
    ap.add_argument("--prompts-rate2", type=int, default=30)
    ap.add_argument("--prompts-rate8", type=int, default=60)
    ap.add_argument("--bench-output-len", type=int, default=None,
                    help="output tokens per bench serve request [default: the dataset's]")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--kv-cache-dtype", default="float32", help="what the CUDA backend keeps its KV cache in")
    ap.add_argument("--kernel-case-s", type=float, default=1.5)
    ap.add_argument("--golden-s", type=float, default=60, help="seconds for each golden step's fixtures")
    ap.add_argument("--wgpu-adapter", default="NVIDIA", help="KVLENS_WGPU_ADAPTER for the wgpu steps")
    ap.add_argument("--fixtures-only", default=None, help="comma-separated fixture names (default: all)")
    ap.add_argument("--kvlens", default=None, help="the kvlens binary [default: beside this script]")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--fixtures", default=None)
    ap.add_argument("--root", default=HERE, help="where the fixtures' tools/ paths are [default: beside this script]")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: the CUDA steps report 'no device', serve runs on --dry-run-serve-backend")
    ap.add_argument("--dry-run-serve-backend", default="cpu")
    a = ap.parse_args()
    r = Run(a)
    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(r.details, ignore_errors=True)
    os.makedirs(r.details)
    steps = a.steps.split(",")
    unknown = set(steps) - {"device", "suite", "golden", "vulkan", "anchor", "wgpu", "serve"}
    if unknown:
        sys.exit(f"unknown steps: {', '.join(sorted(unknown))}")

    configs = a.configs.split(",")
    if {"anchor", "wgpu", "serve"} & set(steps):
        start_checkpoints(r, configs)
    r.step("device", lambda: device_step(r), need_s=1)
    if "golden" in steps:
        r.step("golden/cuda", lambda: golden_step(r, "cuda", list(GOLDEN_RUNS), a.golden_s, env=r.cuda_env)
               if r.cuda else {"skipped": NO_DEVICE})
        r.step("golden/cuda-plain-decode", lambda: plain_decode_step(r))
        r.step("golden/cuda-tiled", lambda: tiled_step(r))
    # Every model's decode against transformers first (the 8B's is issue 32's roofline goal), then
    # serving, then wgpu: a run cut short by its deadline loses the least telling steps.
    if "anchor" in steps:
        for config in configs:
            r.step(f"anchor/{label(config)}", lambda: anchor_step(r, config), need_s=60)
    if "serve" in steps:
        for i, config in enumerate(configs):
            r.step(f"serve/{label(config)}", lambda: serve_step(r, config, 8100 + i), need_s=60)
    if "wgpu" in steps:
        for config in configs:
            r.step(f"wgpu/{label(config)}", lambda: wgpu_decode_step(r, config), need_s=30)
    if "vulkan" in steps:
        r.step("vulkan/golden", lambda: golden_step(r, "wgpu", ["bfloat16"], a.golden_s, env=wgpu_env(r)),
               need_s=20)
        r.step("vulkan/kernels", lambda: kernels_step(r), need_s=30)
    if "suite" in steps:
        r.step("suite", lambda: suite_step(r))
    # A writer still running is stopped, and its half-written checkpoint removed: a later call
    # would otherwise take the folder for a finished one.
    for config, (proc, _) in r.writers.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            shutil.rmtree(os.path.join(r.work, label(config) + "-random-bf16"), ignore_errors=True)
    log("done: " + json.dumps({k: ("error" not in v) for k, v in r.summary["steps"].items()}))


if __name__ == "__main__":
    main()
