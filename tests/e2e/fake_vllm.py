#!/usr/bin/env python3
"""A stand-in for a vLLM server's Prometheus endpoint, for the playground's server mode.

Serves tests/e2e/fixtures/vllm_metrics.txt (a two-engine vLLM scrape in prometheus_client's
layout) on GET /metrics with `Access-Control-Allow-Origin: *`, as vLLM's default
`--allowed-origins ["*"]` does; every other path is vLLM's JSON 404. With --advance, each scrape
after the first moves the counters, the KV usage and the running requests on, so a page polling it
sees the figures change. Standard library only.

    python3 tests/e2e/fake_vllm.py --port 8100 [--advance]

prints `fake vLLM metrics on http://HOST:PORT/metrics` once it listens (--port 0 picks a port).
"""

import argparse
import math
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vllm_metrics.txt"

# name -> added per scrape (counters, per engine series).
COUNTER_STEPS = {
    "vllm:prefix_cache_queries_total": 4096.0,
    "vllm:prefix_cache_hits_total": 1536.0,
    "vllm:mm_cache_queries_total": 4.0,
    "vllm:mm_cache_hits_total": 1.0,
    "vllm:prompt_tokens_total": 4096.0,
    "vllm:generation_tokens_total": 256.0,
    "vllm:num_preemptions_total": 0.2,
}
# KV usage is the fixture's times these, in turn; running requests are the fixture's plus these.
USAGE_FACTORS = [1.0, 1.5, 2.0, 1.5]
RUNNING_EXTRA = [0, 1, 2, 1]

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$")


def go_float(d: float) -> str:
    """A float as prometheus_client writes it (Go's style: exponents past six integer digits)."""
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(float(d))
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def scrape(text: str, n: int) -> str:
    """The fixture as it reads at scrape `n` (0: unchanged)."""
    if n == 0:
        return text
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            if name in COUNTER_STEPS:
                value = math.floor(value + n * COUNTER_STEPS[name])
            elif name == "vllm:kv_cache_usage_perc":
                value = min(1.0, value * USAGE_FACTORS[n % len(USAGE_FACTORS)])
            elif name == "vllm:num_requests_running":
                value += RUNNING_EXTRA[n % len(RUNNING_EXTRA)]
            else:
                out.append(line)
                continue
            line = f"{name}{labels} {go_float(value)}"
        out.append(line)
    return "\n".join(out) + "\n"


def handler(text: str, advance: bool):
    scrapes = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            pass

        def answer(self, status: int, content_type: str, body: bytes):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Access-Control-Allow-Origin", "*")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self):
            if self.path.split("?")[0] != "/metrics":
                self.answer(404, "application/json", b'{"detail":"Not Found"}')
                return
            with lock:
                n = scrapes[0]
                if advance:
                    scrapes[0] += 1
            body = scrape(text, n).encode()
            self.answer(200, "text/plain; version=0.0.4; charset=utf-8", body)

        do_HEAD = do_GET

        def do_OPTIONS(self):
            self.send_response(200)
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", self.headers.get("Access-Control-Request-Headers", "*"))
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    parser.add_argument("--fixture", type=Path, default=FIXTURE, help="the scrape to serve")
    parser.add_argument("--advance", action="store_true", help="move the figures on at every scrape")
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), handler(args.fixture.read_text(), args.advance))
    host, port = server.server_address[:2]
    print(f"fake vLLM metrics on http://{host}:{port}/metrics", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
