#!/usr/bin/env python3
"""A stand-in for a vLLM server started with `--kv-events-config`, for `kvlens watch` in the e2e run.

Publishes KV cache events as vLLM's `ZmqEventPublisher` does (PUB: [topic, seq, msgpack batch];
ROUTER: a replay of kept batches from a start sequence, then [-1, ""]), encoded by msgspec from
vLLM's own event classes (tools/serve_tests/vllm_kv_events.py), and serves a recent vLLM's /metrics (fixtures/vllm_metrics_2026.txt).
Needs msgspec and pyzmq (the client venv). Driven by commands on stdin, one per line, each
answered `done CMD` on stdout:

    store N [image]   one batch storing N new blocks (with an image hash in their extra keys)
    remove N          one batch removing the N oldest resident blocks
    clear             one batch with AllBlocksCleared
    gap               the next batch is kept for replay but not published (as if lost)

    python tests/e2e/fake_vllm_events.py [--events-port P] [--replay-port R] [--metrics-port M]

prints `fake vLLM events on tcp://127.0.0.1:P replay tcp://127.0.0.1:R metrics http://127.0.0.1:M/metrics`.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
import msgspec
import zmq

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tools" / "serve_tests")]
import fake_vllm  # noqa: E402 (the metrics server beside this file)
from vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

FIXTURE = HERE / "fixtures" / "vllm_metrics_2026.txt"
TOPIC = "kv-events"
IMAGE_HASH = "2f1c9e0c7a5b4d3e8f6a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6"

class Publisher:
    """vLLM's ZmqEventPublisher, minus its queue thread: PUB and ROUTER, a buffer of sent batches."""

    def __init__(self, events_port: int, replay_port: int):
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{events_port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.ports = (int(self.pub.getsockopt(zmq.LAST_ENDPOINT).rsplit(b":", 1)[1]),
                      int(self.replay.getsockopt(zmq.LAST_ENDPOINT).rsplit(b":", 1)[1]))
        self.encoder = msgspec.msgpack.Encoder()
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=10_000)
        self.seq = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_replays, daemon=True).start()

    def publish(self, events: list, send: bool = True) -> None:
        payload = self.encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        with self.lock:
            seq = self.seq
            self.seq += 1
            if send:
                self.pub.send_multipart((TOPIC.encode(), seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))

    def serve_replays(self) -> None:
        while True:
            client, _, start = self.replay.recv_multipart()
            start = int.from_bytes(start, "big")
            with self.lock:
                kept = [(s, p) for s, p in self.buffer if s >= start]
            for seq, payload in kept:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events-port", type=int, default=0)
    ap.add_argument("--replay-port", type=int, default=0)
    ap.add_argument("--metrics-port", type=int, default=0)
    a = ap.parse_args()
    publisher = Publisher(a.events_port, a.replay_port)
    server = ThreadingHTTPServer(("127.0.0.1", a.metrics_port), fake_vllm.handler(FIXTURE.read_text(), False))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    events_port, replay_port = publisher.ports
    print(f"fake vLLM events on tcp://127.0.0.1:{events_port} replay tcp://127.0.0.1:{replay_port} "
          f"metrics http://127.0.0.1:{server.server_address[1]}/metrics", flush=True)
    # Hashes as vLLM sends them (ints); a new process starts from another base, as a restarted
    # server's blocks are new blocks.
    next_hash = (time.time_ns() & 0xFFFF_FFFF) << 24
    resident: collections.deque[int] = collections.deque()
    skip_next = False
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "gap":
            skip_next = True
        else:
            if cmd[0] == "store":
                n = int(cmd[1])
                hashes = [next_hash + i for i in range(n)]
                next_hash += n
                keys = [(IMAGE_HASH,) if "image" in cmd[2:] else None for _ in hashes]
                parent = resident[-1] if resident else None
                event = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[0] * (16 * n),
                                    block_size=16, lora_id=None, medium="GPU", lora_name=None, extra_keys=keys)
                resident.extend(hashes)
            elif cmd[0] == "remove":
                gone = [resident.popleft() for _ in range(min(int(cmd[1]), len(resident)))]
                event = BlockRemoved(block_hashes=gone, medium="GPU")
            elif cmd[0] == "clear":
                resident.clear()
                event = AllBlocksCleared()
            else:
                print(f"unknown command {line.strip()!r}", flush=True)
                continue
            publisher.publish([event], send=not skip_next)
            skip_next = False
        print(f"done {line.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
