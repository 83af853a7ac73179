"""`kvlens serve` driven by the official `openai` Python client, as users drive vLLM.

Run by server/tests/serve_openai.rs (inside `cargo xtask test`, which installs the client venv):

    python tools/serve_tests/openai_suite.py --kvlens BIN --work DIR [--only NAME ...]

Each check starts the server it needs on a tiny random checkpoint (the golden fixtures' own, rebuilt
with `kvlens random-checkpoint` from the recorded command) and asserts what the issue asks for:
usage numbers, batching-invariant greedy tokens, encoder-cache reuse under 64 concurrent requests,
clean memory after disconnects and bad input, and `/reset_encoder_cache` returning bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import openai
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "engine" / "tests" / "fixtures" / "golden"
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


# ---------------------------------------------------------------------------------------------
# Server process


# Arguments every server of this run gets (`--serve-arg`, e.g. the backend).
SERVE_ARGS: list[str] = []


class Server:
    """A `kvlens serve` child process on a free port; its stderr is kept for failure reports."""

    def __init__(self, kvlens: str, model: Path, name: str, *extra: str):
        self.name = name
        args = [kvlens, "serve", "--model", str(model), "--served-model-name", name, "--port", "0",
                "--cpu-memory-gib", "1", "--playground-dir", str(model / "no-playground"), *SERVE_ARGS, *extra]
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log: list[str] = []
        self.port: int | None = None
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                m = re.search(r"Starting vLLM API server on http://[^:\s]+:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(120) or self.port is None:
            self.stop()
            raise AssertionError("server did not report its port:\n" + "\n".join(self.log[-30:]))
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("server exited:\n" + "\n".join(self.log[-30:]))
            status, _ = self.http("GET", "/health")
            if status == 200:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("server never became healthy")
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=600)

    def aclient(self) -> openai.AsyncOpenAI:
        """An async client for one `asyncio.run` (its connections belong to that event loop)."""
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=600)

    def http(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError):
            return 0, b""

    def json(self, method: str, path: str, payload: object | None = None) -> tuple[int, dict]:
        body = None if payload is None else json.dumps(payload).encode()
        status, data = self.http(method, path, body, {"Content-Type": "application/json"})
        try:
            return status, json.loads(data) if data else {}
        except json.JSONDecodeError:
            return status, {"raw": data.decode(errors="replace")}

    def memory(self) -> dict:
        status, mem = self.json("GET", "/v1/memory")
        assert status == 200, (status, mem)
        return mem

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise AssertionError("server did not stop within 30 s of SIGINT")
            assert self.proc.returncode == 0, f"server exited with {self.proc.returncode} on SIGINT"

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------
# Inputs


def png_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def file_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def noise_image(seed: int, w: int = 96, h: int = 80) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (w, h), bytes(rng.randrange(256) for _ in range(w * h * 3)))


def image_message(url: str, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def fixture(family: str) -> dict:
    return json.loads((FIXTURES / f"{family}.json").read_text())


def checkpoint(kvlens: str, family: str, work: Path) -> Path:
    """Rebuilds the golden fixture's checkpoint from its recorded command (same seed, same bytes)."""
    out = work / f"ckpt-{family}"
    cmd = fixture(family)["checkpoint"]["command"].split()[1:]
    cmd = [str(out) if a == "DIR" else a for a in cmd]
    subprocess.run([kvlens, *cmd], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def case_messages(case: dict) -> list[dict]:
    """The fixture's messages with image paths turned into data URLs (as a client sends them)."""
    msgs = json.loads(json.dumps(case["messages"]))
    for m in msgs:
        if isinstance(m["content"], list):
            for p in m["content"]:
                if p.get("type") == "image_url":
                    p["image_url"]["url"] = file_url(FIXTURES / p["image_url"]["url"])
    return msgs


def ledger(mem: dict) -> dict[str, int]:
    return {e["category"]: e["bytes"] for e in mem["ledger"]}


# ---------------------------------------------------------------------------------------------
# Checks


def check_openai_basics(kvlens: str, work: Path) -> None:
    """/v1/models, a non-streamed and a streamed chat completion with an image, usage = token counts."""
    with Server(kvlens, checkpoint(kvlens, "qwen3_vl", work), "tiny-qwen3") as s:
        models = s.client.models.list()
        assert [m.id for m in models.data] == ["tiny-qwen3"], models
        # 256×256 fits the checkpoint's 65,536-pixel limit: 16×16 patches, 8×8 = 64 image tokens.
        msgs = image_message(png_url(noise_image(1, 256, 256)), "Describe this image.")
        extra = {"return_token_ids": True, "ignore_eos": True}
        r = s.client.chat.completions.create(model="tiny-qwen3", messages=msgs, max_tokens=9, temperature=0,
                                             extra_body=extra)
        d = r.model_dump()
        assert r.object == "chat.completion" and r.choices[0].finish_reason == "length", d
        assert r.usage.prompt_tokens == len(d["prompt_token_ids"]), d["usage"]
        assert r.usage.completion_tokens == len(d["choices"][0]["token_ids"]) == 9, d["usage"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + 9
        text_only = s.client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": [{"type": "text", "text": "Describe this image."}]}],
            max_tokens=1, temperature=0)
        # The image adds <|vision_start|>, 64 × <|image_pad|> and <|vision_end|>.
        assert r.usage.prompt_tokens - text_only.usage.prompt_tokens == 66, (r.usage, text_only.usage)

        stream = s.client.chat.completions.create(model="tiny-qwen3", messages=msgs, max_tokens=9, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body=extra)
        text, ids, usage, finish = "", [], None, None
        for chunk in stream:
            c = chunk.model_dump()
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                ids += c["choices"][0].get("token_ids") or []
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None, "include_usage sends a usage chunk"
        assert usage.completion_tokens == len(ids) == 9, (usage, ids)
        assert usage.prompt_tokens == r.usage.prompt_tokens
        assert ids == d["choices"][0]["token_ids"], "greedy: streamed tokens equal the non-streamed ones"
        assert text == r.choices[0].message.content
        assert finish == "length"

        c = s.client.completions.create(model="tiny-qwen3", prompt="The KV cache", max_tokens=5, temperature=0,
                                        extra_body=extra)
        cd = c.model_dump()
        assert c.usage.completion_tokens == len(cd["choices"][0]["token_ids"]) == 5, cd
        assert c.usage.prompt_tokens == len(cd["prompt_token_ids"])


def greedy_matches(family: str, case: dict, got_prompt: list[int], got: list[int]) -> int:
    """Asserts the golden test's rule: same prompt, same tokens wherever the reference margin is clear,
    until the first divergence. Returns the number of tokens compared."""
    assert got_prompt == case["prompt_token_ids"], f"{family}/{case['name']}: prompt ids"
    want = case["token_ids"]
    compared = 0
    for i, step in enumerate(case["steps"]):
        if step["margin"] > 1e-3:
            assert got[i] == want[i], f"{family}/{case['name']}: token {i}: {got} vs {want}"
            compared += 1
        if got[i] != want[i]:
            break
    return compared


def check_golden_batching(kvlens: str, work: Path) -> None:
    """The golden fixtures' greedy tokens through the server, 1 and 16 requests at a time."""
    for family in FAMILIES:
        fx = fixture(family)
        with Server(kvlens, checkpoint(kvlens, family, work), family) as s:
            def ask(case: dict) -> dict:
                return dict(model=family, messages=case_messages(case), max_tokens=len(case["token_ids"]),
                            temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})

            compared = 0
            for case in fx["cases"]:
                d = s.client.chat.completions.create(**ask(case)).model_dump()
                compared += greedy_matches(family, case, d["prompt_token_ids"], d["choices"][0]["token_ids"])
            assert compared >= 10, f"{family}: only {compared} clear-margin tokens"

            cases = [fx["cases"][i % len(fx["cases"])] for i in range(16)]

            async def burst() -> list[dict]:
                async with s.aclient() as ac:
                    rs = await asyncio.gather(*(ac.chat.completions.create(**ask(c)) for c in cases))
                return [r.model_dump() for r in rs]

            for case, d in zip(cases, asyncio.run(burst())):
                greedy_matches(family, case, d["prompt_token_ids"], d["choices"][0]["token_ids"])
            stats = s.memory()["counters"]
            print(f"  {family}: 1 and 16 concurrent match the golden tokens; counters {stats}")


def check_concurrency(kvlens: str, work: Path) -> None:
    """64 requests at once, half with one of 4 shared images: one vision pass per image, clean after."""
    with Server(kvlens, checkpoint(kvlens, "qwen3_vl", work), "tiny", "--max-num-seqs", "16") as s:
        before = s.memory()["counters"]["vision_runs"]
        urls = [png_url(noise_image(100 + i, 64 + 16 * i, 64)) for i in range(4)]

        def req(ac: openai.AsyncOpenAI, i: int):
            msgs = (image_message(urls[(i // 2) % 4], f"Question {i}: what is shown?") if i % 2 == 0
                    else [{"role": "user", "content": f"Question {i}: tell me about caches."}])
            return ac.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.7,
                                              seed=i, extra_body={"ignore_eos": True})

        async def burst():
            async with s.aclient() as ac:
                return await asyncio.gather(*(req(ac, i) for i in range(64)))

        results = asyncio.run(burst())
        assert len(results) == 64 and all(r.usage.completion_tokens == 6 for r in results)
        mem = s.memory()
        runs = mem["counters"]["vision_runs"] - before
        assert runs == 4, f"each shared image goes through the vision tower once, got {runs} runs"
        kv = mem["kv"]
        assert kv["num_in_use"] == 0, kv
        assert mem["num_running"] == 0 and mem["num_waiting"] == 0
        enc = mem["encoder_cache"]
        assert all(e["freeable"] for e in enc["entries"]), enc["entries"]
        led = ledger(mem)
        assert led["encoder_cache"] == enc["used_bytes"], (led, enc["used_bytes"])
        _, info = s.json("GET", "/server_info")
        plan = info["plan"]
        kv_bytes = kv["num_blocks"] * plan["page_size_bytes"] * plan["num_layers"]
        assert led["kv_cache"] == kv_bytes, (led["kv_cache"], kv_bytes)
        print(f"  64 requests: {runs} vision runs, {len(enc['entries'])} encoder entries "
              f"({enc['used_bytes']} B), KV {led['kv_cache']} B in {kv['num_blocks']} blocks, 0 in use")


def wait_idle(s: Server, seconds: float = 300) -> dict:
    deadline = time.time() + seconds
    while True:
        mem = s.memory()
        if mem["kv"]["num_in_use"] == 0 and mem["num_running"] == 0 and mem["num_waiting"] == 0:
            return mem
        if time.time() > deadline:
            raise AssertionError(f"blocks still in use: {mem['kv']['num_in_use']}, running {mem['num_running']}")
        time.sleep(0.1)


def check_faults(kvlens: str, work: Path) -> None:
    """20 clients that hang up after the first chunk free everything; every bad input gets its status
    code and the server keeps serving."""
    with Server(kvlens, checkpoint(kvlens, "qwen3_vl", work), "tiny", "--limit-mm-per-prompt",
                '{"image": 2}', "--max-model-len", "2048") as s:
        async def hang_up(ac: openai.AsyncOpenAI, i: int) -> None:
            msgs = image_message(png_url(noise_image(200 + i)), "Describe it at length.")
            stream = await ac.chat.completions.create(model="tiny", messages=msgs, max_tokens=500,
                                                      stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                break
            await stream.close()

        async def hang_ups():
            async with s.aclient() as ac:
                await asyncio.gather(*(hang_up(ac, i) for i in range(20)))

        asyncio.run(hang_ups())
        mem = wait_idle(s)
        assert all(e["freeable"] for e in mem["encoder_cache"]["entries"])
        print(f"  20 disconnects: 0 blocks in use, {len(mem['encoder_cache']['entries'])} encoder entries freeable")

        good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        img = png_url(noise_image(7))
        bad: list[tuple[str, int, bytes]] = [
            ("malformed JSON", 400, b'{"model": "tiny", "messages": ['),
            ("unknown model", 404, json.dumps({**good, "model": "nope"}).encode()),
            ("bad base64", 400, json.dumps({**good, "messages": image_message(
                "data:image/png;base64,!!!notbase64", "x")}).encode()),
            ("not an image", 400, json.dumps({**good, "messages": image_message(
                "data:image/png;base64," + base64.b64encode(b"plain text, not pixels").decode(), "x")}).encode()),
            ("too many images", 400, json.dumps({**good, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": img}}] * 3}]}).encode()),
            ("prompt + max_tokens over max_model_len", 400, json.dumps({**good, "max_tokens": 5000}).encode()),
            ("max_tokens at the integer limit", 400, json.dumps({**good, "max_tokens": 2**64 - 1}).encode()),
            ("negative temperature", 400, json.dumps({**good, "temperature": -1}).encode()),
            ("oversized body", 413, b'{"pad": "' + b"x" * (80 << 20) + b'"}'),
        ]
        for name, code, body in bad:
            status, data = s.http("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            assert status == code, f"{name}: {status} {data[:300]!r}"
            if code == 400:
                err = json.loads(data)["error"]
                assert err["message"] and err["code"] == 400 and err["type"], err
            r = s.client.chat.completions.create(**good)
            assert r.choices[0].message is not None, f"server stopped serving after {name}"
        wait_idle(s)
        print(f"  {len(bad)} bad inputs: each got its status code and the next request succeeded")


def check_reset_encoder_cache(kvlens: str, work: Path) -> dict:
    """/reset_mm_cache leaves the encoder cache's bytes where they are; /reset_encoder_cache returns them."""
    with Server(kvlens, checkpoint(kvlens, "qwen3_vl", work), "tiny") as s:
        async def burst():
            async with s.aclient() as ac:
                return await asyncio.gather(*(ac.chat.completions.create(
                    model="tiny", messages=image_message(png_url(noise_image(300 + i, 128, 96)), "Describe."),
                    max_tokens=4, extra_body={"ignore_eos": True}) for i in range(8)))

        asyncio.run(burst())
        after_burst = ledger(wait_idle(s))
        assert after_burst["encoder_cache"] > 0, after_burst
        status, mm = s.json("POST", "/reset_mm_cache")
        assert status == 200, (status, mm)
        after_mm = ledger(s.memory())
        assert after_mm["encoder_cache"] == after_burst["encoder_cache"], "reset_mm_cache clears the processor cache only"
        status, enc = s.json("POST", "/reset_encoder_cache")
        assert status == 200, (status, enc)
        after_enc = ledger(s.memory())
        assert after_enc["encoder_cache"] == 0, after_enc
        freed = enc.get("freed_bytes", enc.get("bytes_freed"))
        assert freed == after_burst["encoder_cache"], (enc, after_burst)
        figures = {"after_burst": after_burst["encoder_cache"], "after_reset_mm_cache": after_mm["encoder_cache"],
                   "after_reset_encoder_cache": after_enc["encoder_cache"], "freed_bytes": freed}
        print(f"  encoder cache bytes: {figures}")
        return figures


CHECKS = {
    "basics": check_openai_basics,
    "golden": check_golden_batching,
    "concurrency": check_concurrency,
    "faults": check_faults,
    "reset": check_reset_encoder_cache,
}


def main(checks: dict = CHECKS, doc: str = __doc__) -> int:
    """Runs the named checks (all by default), each reported as `ok NAME` or `FAILED NAME: why`."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--kvlens", required=True)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--only", nargs="*", choices=sorted(checks))
    ap.add_argument("--serve-arg", action="append", default=[], help="an argument for every kvlens serve")
    a = ap.parse_args()
    SERVE_ARGS.extend(a.serve_arg)
    a.work.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, check in checks.items():
        if a.only and name not in a.only:
            continue
        started = time.time()
        try:
            check(a.kvlens, a.work)
            print(f"ok {name} ({time.time() - started:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
            failed.append(name)
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"FAILED {name}: {type(e).__name__} at line {where.lineno} ({where.line}): {e}", flush=True)
    print(f"{len(failed)} failed" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    sys.exit(main())
