"""`kvlens serve`'s KV cache events read by vLLM's own subscriber classes, and its /metrics read by
prometheus_client's parser.

Run by server/tests/kv_events.rs (inside `cargo xtask test`, which installs the client venv with
msgspec, pyzmq and prometheus_client):

    python tools/serve_tests/kv_events_suite.py --kvlens BIN --work DIR [--only NAME ...]

The event classes are vLLM's (vllm_kv_events.py), decoded with msgspec exactly as vLLM's consumers
do.
"""

from __future__ import annotations

import asyncio
import collections
import re
import threading
import time
from pathlib import Path
from typing import Any

import zmq
from msgspec.msgpack import Decoder
from prometheus_client.parser import text_string_to_metric_families

import openai_suite
from openai_suite import Server, checkpoint, image_message, noise_image, png_url, wait_idle
from vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

IMAGE_PAD = 151655
TOPIC = "kv-events"


def kv_events_flag() -> str:
    return ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0", '
            f'"replay_endpoint": "tcp://*:0", "topic": "{TOPIC}"}}')


def event_ports(s: Server) -> tuple[int, int]:
    """The PUB and ROUTER ports the server's log names (it binds port 0: free ones)."""
    for line in s.log:
        m = re.search(r"KV cache events published on tcp://[^:]+:(\d+) \(replay on tcp://[^:]+:(\d+)\)", line)
        if m:
            return int(m.group(1)), int(m.group(2))
    raise AssertionError("no KV events line in the log:\n" + "\n".join(s.log[-20:]))


def replay(port: int, start: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
    """Asks the ROUTER for every kept batch from `start` on; returns (seq, payload) up to the end
    marker. A DEALER, not vLLM example's REQ: a REQ socket takes one reply per request, and a
    replay answers with many."""
    with zmq.Context.instance().socket(zmq.DEALER) as d:
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert d.poll(timeout_ms), "the replay did not end"
            _, seq, payload = d.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if not payload:
                assert seq == -1, seq
                return got
            got.append((seq, payload))


class Subscriber:
    """vLLM example's loop on a thread: SUB on the topic, and on a gap a replay from the last seen
    sequence. `lose` lists live batches to drop as if the network had lost them."""

    def __init__(self, pub: int, replay_port: int, lose: set[int] = frozenset()):
        self.decoder = Decoder(type=KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}
        self.replayed: list[int] = []
        self.lose = set(lose)
        self.replay_port = replay_port
        self.stop = threading.Event()
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(f"tcp://127.0.0.1:{pub}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        last_seq = -1
        while not self.stop.is_set():
            if not self.sub.poll(50):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode(), topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq in self.lose:
                self.lose.discard(seq)
                continue
            if last_seq >= 0 and seq > last_seq + 1:
                for replay_seq, replay_payload in replay(self.replay_port, last_seq + 1):
                    if last_seq < replay_seq < seq:
                        self.batches[replay_seq] = self.decoder.decode(replay_payload)
                        self.replayed.append(replay_seq)
            self.batches[seq] = self.decoder.decode(payload)
            last_seq = seq

    def wait_for(self, seq: int, seconds: float = 60) -> None:
        deadline = time.time() + seconds
        while max(self.batches, default=-1) < seq:
            assert time.time() < deadline, f"batch {seq} never arrived (have {sorted(self.batches)[-5:]})"
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sub.close()


def resident_after(batches: dict[int, KVEventBatch]) -> collections.Counter:
    """Applies the batches in order; every removal must meet a stored copy of its hash."""
    resident: collections.Counter = collections.Counter()
    assert sorted(batches) == list(range(len(batches))), f"sequence gaps: {sorted(batches)}"
    for seq in sorted(batches):
        for e in batches[seq].events:
            if isinstance(e, BlockStored):
                resident.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert resident[h] > 0, f"batch {seq} removes {h:016x}, which no BlockStored stored"
                    resident[h] -= 1
                    if resident[h] == 0:
                        del resident[h]
            else:
                resident.clear()
    return resident


def memory_hashes(mem: dict) -> collections.Counter:
    """The hashes /v1/memory shows for its blocks (16 hex digits), as the events' ints."""
    return collections.Counter(int(h, 16) for h in mem["kv"]["hashes"].values())


def check_events(kvlens: str, work: Path) -> None:
    """48 requests, half with one of 4 images, through 65 KV blocks: every store and removal arrives,
    the resident set is /v1/memory's, image blocks carry their image hash, lost and late batches
    come back through replay, /reset_prefix_cache clears."""
    with Server(kvlens, checkpoint(kvlens, "qwen3_vl", work), "tiny", "--max-num-seqs", "8",
                "--max-model-len", "1024", "--kv-cache-memory-bytes", "800000",
                "--kv-events-config", kv_events_flag()) as s:
        pub, replay_port = event_ports(s)
        num_blocks = s.memory()["kv"]["num_blocks"]
        assert num_blocks <= 128, f"{num_blocks} blocks: too many to see evictions"
        live = Subscriber(pub, replay_port, lose={3, 4, 5})
        time.sleep(0.5)  # a SUB socket's subscription reaches the PUB after the connection
        urls = [png_url(noise_image(300 + i, 64 + 32 * i, 64)) for i in range(4)]

        def req(ac, i: int):
            msgs = (image_message(urls[(i // 2) % 4], f"Question {i}: what is shown?") if i % 2 == 0
                    else [{"role": "user", "content": f"Question {i}: tell me about caches and blocks."}])
            return ac.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True})

        async def burst():
            async with s.aclient() as ac:
                return await asyncio.gather(*(req(ac, i) for i in range(48)))

        results = asyncio.run(burst())
        assert all(r.usage.completion_tokens == 24 for r in results)
        mem = wait_idle(s)
        # The last batch: what a late subscriber replays from 0 ends there.
        late = replay(replay_port, 0)
        assert [seq for seq, _ in late] == list(range(len(late))), "replay kept every batch"
        last = late[-1][0]
        live.wait_for(last)
        assert live.replayed == [3, 4, 5], f"the lost batches came back through replay: {live.replayed}"
        decoder = Decoder(type=KVEventBatch)
        late_batches = {seq: decoder.decode(p) for seq, p in late}
        assert late_batches == live.batches, "the late subscriber rebuilt the same stream"

        resident = resident_after(live.batches)
        assert resident == memory_hashes(mem), "the events' resident set is /v1/memory's blocks"
        stored = [e for b in live.batches.values() for e in b.events if isinstance(e, BlockStored)]
        removed = [e for b in live.batches.values() for e in b.events if isinstance(e, BlockRemoved)]
        num_stored = sum(len(e.block_hashes) for e in stored)
        assert num_stored > num_blocks and removed, f"{num_stored} stored, {len(removed)} removed: no eviction"
        assert len(removed) == mem["kv"]["num_evictions"], (len(removed), mem["kv"]["num_evictions"])
        images = {e["mm_hash"] for e in mem["processor_cache"]["entries"]}
        assert len(images) == 4, images
        image_blocks = 0
        for e in stored:
            assert e.block_size == 16 and e.medium == "GPU" and len(e.token_ids) == 16 * len(e.block_hashes)
            assert e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes)
            for i, keys in enumerate(e.extra_keys):
                tokens = e.token_ids[16 * i:16 * (i + 1)]
                if IMAGE_PAD in tokens:
                    assert keys is not None and set(keys) <= images, (tokens, keys)
                    image_blocks += 1
                else:
                    assert keys is None, (tokens, keys)
        assert image_blocks > 0

        status, _ = s.json("POST", "/reset_prefix_cache")
        assert status == 200, status
        live.wait_for(last + 1)
        assert any(isinstance(e, AllBlocksCleared) for e in live.batches[last + 1].events)
        assert resident_after(live.batches) == collections.Counter()
        deadline = time.time() + 60  # /v1/memory shows the snapshot published after the reset
        while memory_hashes(s.memory()):
            assert time.time() < deadline, "the reset never reached /v1/memory"
            time.sleep(0.05)
        live.close()
        print(f"  {len(live.batches)} batches: {num_stored} blocks stored, {len(removed)} removed "
              f"through {num_blocks} blocks, {image_blocks} image blocks, batches 3-5 replayed")


def scrape(s: Server) -> dict[str, Any]:
    """/metrics through prometheus_client's parser: {sample name + sorted labels: value}."""
    status, text = s.http("GET", "/metrics")
    assert status == 200, status
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            out[sample.name + (str(sorted(labels.items())) if labels else "")] = sample.value
            if family.name == "vllm:cache_config_info":
                out["cache_config"] = labels
    return out


def settle(s: Server, done, seconds: float = 60) -> dict[str, Any]:
    """Scrapes until `done(scrape)`: the engine's figures are those of its last published snapshot,
    which can trail a finished request by one publication."""
    deadline = time.time() + seconds
    while True:
        m = scrape(s)
        if done(m) or time.time() > deadline:
            return m
        time.sleep(0.05)


def check_metrics(kvlens: str, work: Path) -> None:
    """Each 2026 metric, and kvlens's own KV bytes, moved by what should move it."""
    with Server(kvlens, checkpoint(kvlens, "qwen3_vl", work), "tiny", "--max-num-seqs", "1",
                "--max-model-len", "1024", "--kv-cache-memory-bytes", "800000", "--block-size", "16",
                "--kv-cache-metrics", "--kv-cache-metrics-sample", "1") as s:
        m0 = scrape(s)
        mem = s.memory()
        ledger = openai_suite.ledger(mem)
        assert m0["vllm:model_weights_memory_bytes"] == ledger["weights"] > 0
        kv = mem["kv"]
        # Every block but the null block is free.
        free_idle = ledger["kv_cache"] * (kv["num_blocks"] - 1) // kv["num_blocks"]
        assert m0["kvlens:kv_cache_memory_bytes"] == ledger["kv_cache"]
        assert m0["kvlens:kv_cache_free_bytes"] == free_idle
        info = m0["cache_config"]
        assert info["block_size"] == "16" and info["enable_prefix_caching"] == "True", info
        assert info["num_gpu_blocks"] == str(mem["kv"]["num_blocks"]) and info["kv_cache_memory_bytes"] == "800000"

        # The same image three times: the processor cache is queried three times and hit twice, and
        # the prompt's full blocks are prefix-cache hits the second and third time.
        url = png_url(noise_image(7, 96, 80))
        prompts = []
        for _ in range(3):
            r = s.client.chat.completions.create(model="tiny", messages=image_message(url, "Describe it."),
                                                 max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
            prompts.append(r.usage.prompt_tokens)
        hit = (prompts[1] - 1) // 16 * 16
        by = lambda m, src: m[f"vllm:prompt_tokens_by_source_total[('source', '{src}')]"]
        m1 = settle(s, lambda m: by(m, "local_cache_hit") - by(m0, "local_cache_hit") == 2 * hit)
        # The encoder cache (which vLLM does not export) holds the image's output until a reset.
        enc = s.memory()["encoder_cache"]
        assert m1["kvlens:encoder_cache_entries"] == len(enc["entries"]) == 1
        assert m1["kvlens:encoder_cache_used_bytes"] == enc["used_bytes"] > 0
        assert m0["kvlens:encoder_cache_used_bytes"] == 0
        assert m1["vllm:mm_cache_queries_total"] - m0["vllm:mm_cache_queries_total"] == 3
        assert m1["vllm:mm_cache_hits_total"] - m0["vllm:mm_cache_hits_total"] == 2
        assert by(m1, "local_cache_hit") - by(m0, "local_cache_hit") == 2 * hit > 0
        assert by(m1, "local_compute") - by(m0, "local_compute") == sum(prompts) - 2 * hit
        assert by(m1, "external_kv_transfer") == 0
        assert m1["vllm:prompt_tokens_cached_total"] == by(m1, "local_cache_hit")

        # While one long request runs (--max-num-seqs 1), two wait for capacity, and blocks are held.
        def stream(i: int):
            long_prompt = [{"role": "user", "content": f"{i}: " + "Tell me everything about memory. " * 30}]
            return s.client.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=200,
                                                    temperature=0.8, seed=i, stream=True,
                                                    extra_body={"ignore_eos": True})
        streams = [stream(i) for i in range(1)]
        next(streams[0])
        waiting = [threading.Thread(target=lambda i=i: list(stream(i)), daemon=True) for i in (1, 2)]
        for t in waiting:
            t.start()
        deadline = time.time() + 60
        while True:
            m = scrape(s)
            if m["vllm:num_requests_waiting"] == 2:
                break
            assert time.time() < deadline, "two requests never waited"
            time.sleep(0.05)
        assert m["vllm:num_requests_waiting_by_reason[('reason', 'capacity')]"] == 2
        assert m["vllm:num_requests_waiting_by_reason[('reason', 'deferred')]"] == 0
        assert m["kvlens:kv_cache_free_bytes"] < free_idle and m["vllm:kv_cache_usage_perc"] > 0
        assert m["vllm:num_requests_running"] == 1
        for _ in streams[0]:
            pass
        for t in waiting:
            t.join()
        wait_idle(s)

        # Evictions: the long requests overran the 65 blocks, so cached blocks were reallocated;
        # every block is followed (sample 1), so each eviction is one lifetime observation.
        evictions = s.memory()["kv"]["num_evictions"]
        m2 = settle(s, lambda m: m["vllm:kv_block_lifetime_seconds_count"] == evictions)
        assert evictions > 0
        assert m2["vllm:kv_block_lifetime_seconds_count"] == evictions, (m2["vllm:kv_block_lifetime_seconds_count"], evictions)
        assert m2["vllm:kv_block_idle_before_evict_seconds_count"] == evictions
        assert m2["vllm:kv_block_lifetime_seconds_sum"] >= m2["vllm:kv_block_idle_before_evict_seconds_sum"] > 0
        # The image prompt's full block was hit twice before the long requests evicted it: one gap.
        assert m2["vllm:kv_block_reuse_gap_seconds_count"] == 1, m2["vllm:kv_block_reuse_gap_seconds_count"]
        assert m2["kvlens:kv_cache_free_bytes"] == free_idle and m2["vllm:kv_cache_usage_perc"] == 0
        status, _ = s.json("POST", "/reset_encoder_cache")
        assert status == 200
        m3 = settle(s, lambda m: m["kvlens:encoder_cache_entries"] == 0)
        assert m3["kvlens:encoder_cache_entries"] == m3["kvlens:encoder_cache_used_bytes"] == 0
        print(f"  {evictions} evictions observed; prefix hit {hit} of {prompts[1]} tokens; mm cache 3 queries, 2 hits")


CHECKS = {
    "events": check_events,
    "metrics": check_metrics,
}

if __name__ == "__main__":
    import os
    import sys

    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    sys.exit(openai_suite.main(CHECKS, __doc__))
