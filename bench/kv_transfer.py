"""KV transfer over Redis: the transport's throughput beside raw redis-py SET/GET.

For KV caches of 1 MiB to 256 MiB (Llama-3-8B's shape in bf16: 32 layers, 8 KV heads
of 128, so 128 KiB per token), against a private ``redis-server`` on a free loopback
port, both measured in the same run and interleaved rep by rep:

- transport: ``RedisKvTransport.send`` (CRC-32, manifest, chunked pipelined SETs with
  a TTL) and ``receive`` (manifest, pipelined GETs, verification, assembly into one
  tensor, deletion of the keys);
- raw: the same bytes cut into the same chunks, one pipeline of SETs with the same TTL
  and one pipeline of GETs, nothing else (no checksum, no assembly, no deletion).

It prints MB/s each way (1 MB = 10^6 bytes) and the transport/raw ratios (the median
over the reps of each). Target: round trip >= 50 % of raw at every size.

With ``--gloo`` it also times the torch.distributed transport (gloo, CPU) between this
process and a spawned prefill process over loopback, for reference (no target).

    .venv/bin/python bench/kv_transfer.py [--sizes-mib 1 4 16 64 256] [--chunk-mib 4] [--gloo]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.transfer import KvPayload, MiB, RedisKvTransport
from workers.transfer_nccl import LinkRole, TorchDistributedKvTransport

TARGET_RATIO = 0.5
LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # 128 KiB


@contextmanager
def private_redis() -> Iterator[redis.Redis]:
    """A ``redis-server`` on a free loopback port, no persistence; killed on the way out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kv_of(size_mib: int, seed: int) -> KvPayload:
    tokens = size_mib * MiB // TOKEN_BYTES
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (tokens * TOKEN_BYTES,), dtype=torch.uint8, generator=gen)
    kv = raw.view(DTYPE).view(LAYERS, 2, tokens, KV_HEADS, HEAD_DIM)
    return KvPayload(request_id=f"bench-{size_mib}", kv=kv)


def raw_round_trip(client: redis.Redis, payload: KvPayload, chunk_bytes: int,
                   ttl_ms: int) -> tuple[float, float]:  # fmt: skip
    """Seconds for one pipeline of chunk SETs and one of chunk GETs (keys removed after)."""
    body = payload.body()
    keys = [f"raw:{{{payload.request_id}}}:{i}" for i in range(-(-len(body) // chunk_bytes))]
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, key in enumerate(keys):
        pipe.set(key, body[i * chunk_bytes : (i + 1) * chunk_bytes], px=ttl_ms)
    pipe.execute()
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    values = pipe.execute()
    read_s = time.perf_counter() - started
    assert sum(len(v) for v in values) == len(body)
    client.unlink(*keys)
    return write_s, read_s


def transport_round_trip(transport: RedisKvTransport, payload: KvPayload,
                         check: bool) -> tuple[float, float]:  # fmt: skip
    started = time.perf_counter()
    transport.send(payload)
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    got = transport.receive(payload.request_id, timeout_s=60)
    read_s = time.perf_counter() - started
    if check:
        assert torch.equal(got.kv.view(torch.uint8), payload.kv.view(torch.uint8))
    return write_s, read_s


def gloo_sender(
    port: int, sizes_mib: list[int], reps: int, results: mp.Queue[Any], done: Any
) -> None:
    client = redis.Redis(port=port)
    with TorchDistributedKvTransport.connect(
        client, link_id="bench", role=LinkRole.PREFILL, rendezvous_timeout_s=60
    ) as link:
        for size_mib in sizes_mib:
            payload = kv_of(size_mib, seed=size_mib)
            times = []
            for rep in range(reps + 1):
                receipt = link.send(KvPayload(request_id=f"g-{size_mib}-{rep}", kv=payload.kv))
                times.append(receipt.duration_s)
            results.put((size_mib, payload.nbytes, statistics.median(times[1:])))
        done.wait(120)  # until the decode end has everything


def bench_gloo(client: redis.Redis, sizes_mib: list[int]) -> None:
    port = int(client.connection_pool.connection_kwargs["port"])
    reps = 3
    ctx = mp.get_context("spawn")
    results: mp.Queue[Any] = ctx.Queue()
    done = ctx.Event()
    child = ctx.Process(
        target=gloo_sender, args=(port, sizes_mib, reps, results, done), daemon=True
    )
    child.start()
    try:
        with TorchDistributedKvTransport.connect(
            client, link_id="bench", role=LinkRole.DECODE, rendezvous_timeout_s=60
        ) as link:
            print(f"gloo link over loopback (send until received, median of {reps}):")
            for size_mib in sizes_mib:
                for rep in range(reps + 1):
                    link.receive(f"g-{size_mib}-{rep}", timeout_s=120)
                _, nbytes, send_s = results.get(timeout=120)
                print(f"{size_mib:>4} MiB {nbytes / send_s / 1e6:>10.0f} MB/s")
    finally:
        done.set()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--gloo", action="store_true", help="also time the gloo link")
    args = parser.parse_args()
    chunk_bytes = args.chunk_mib * MiB
    print(f"KV shape: {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}, {DTYPE} "
          f"({TOKEN_BYTES // 1024} KiB/token); chunks of {args.chunk_mib} MiB; "
          f"private redis-server on loopback; MB/s = 10^6 bytes/s, median of the reps")  # fmt: skip
    print(f"{'size':>8} {'tokens':>6} {'reps':>4} | {'write MB/s':>10} {'raw':>6} {'ratio':>5} | "
          f"{'read MB/s':>9} {'raw':>6} {'ratio':>5} | {'round trip':>10}")  # fmt: skip
    worst = float("inf")
    started = time.monotonic()
    with private_redis() as client:
        transport = RedisKvTransport(client, chunk_bytes=chunk_bytes)
        for size_mib in args.sizes_mib:
            payload = kv_of(size_mib, seed=size_mib)
            reps = max(3, min(15, 64 // size_mib))
            ours, raws = [], []
            transport_round_trip(transport, payload, check=True)  # warm-up and exactness
            raw_round_trip(client, payload, chunk_bytes, transport._ttl_ms)
            for _ in range(reps):  # interleaved, so drift hits both alike
                ours.append(transport_round_trip(transport, payload, check=False))
                raws.append(raw_round_trip(client, payload, chunk_bytes, transport._ttl_ms))
            mb = payload.nbytes / 1e6
            w, r = (statistics.median(x[i] for x in ours) for i in (0, 1))
            rw, rr = (statistics.median(x[i] for x in raws) for i in (0, 1))
            trip = (rw + rr) / (w + r)
            worst = min(worst, trip)
            print(f"{size_mib:>4} MiB {payload.num_tokens:>6} {reps:>4} | {mb / w:>10.0f} "
                  f"{mb / rw:>6.0f} {rw / w:>5.2f} | {mb / r:>9.0f} {mb / rr:>6.0f} "
                  f"{rr / r:>5.2f} | {trip:>10.2f}")  # fmt: skip
        assert not list(client.scan_iter(match="*")), "keys left behind"
        if args.gloo:
            bench_gloo(client, args.sizes_mib)
    verdict = "PASS" if worst >= TARGET_RATIO else "FAIL"
    print(f"worst round-trip ratio {worst:.2f} (target >= {TARGET_RATIO:.2f}): {verdict}; "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
