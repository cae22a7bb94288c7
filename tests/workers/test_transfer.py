"""KV transfer: the payload format, the Redis transport against a private redis-server,
and the torch.distributed transport (gloo) between two real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.transfer import (
    KvPayload,
    KvTransferCorruptError,
    KvTransferError,
    KvTransferTimeoutError,
    KvTransport,
    KvTransportUnavailableError,
    MiB,
    RedisKvTransport,
    TransportKind,
)
from workers.transfer_nccl import LinkRole, TorchDistributedKvTransport

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        probe = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        probe.close()
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client(redis_port: int) -> Iterator[redis.Redis]:
    c = redis.Redis(port=redis_port)
    c.flushall()
    yield c
    c.close()


def make_payload(
    request_id: str,
    *,
    layers: int = 2,
    tokens: int = 5,
    heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> KvPayload:
    """Random bit patterns (NaNs and infinities included): equality must be bit-exact."""
    shape = (layers, 2, tokens, heads, head_dim)
    nbytes = layers * 2 * tokens * heads * head_dim * dtype.itemsize
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return KvPayload(request_id=request_id, kv=raw.view(dtype).view(shape))


def tokens_for(nbytes: int, dtype: torch.dtype) -> int:
    """Tokens of a 4-layer, 8-head, 64-dim model that make about ``nbytes`` of KV."""
    return max(1, nbytes // (4 * 2 * 8 * 64 * dtype.itemsize))


def same_bits(a: KvPayload, b: KvPayload) -> bool:
    return (
        a.request_id == b.request_id
        and a.dtype == b.dtype
        and a.kv.shape == b.kv.shape
        and torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
    )


def keys(client: redis.Redis) -> list[bytes]:
    return sorted(client.scan_iter(match="sara:kv:*"))


# -- the payload -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn])
@pytest.mark.parametrize("tokens", [1, 17])
def test_a_payload_survives_its_byte_form_bit_for_bit(dtype: torch.dtype, tokens: int) -> None:
    payload = make_payload("req-1", tokens=tokens, dtype=dtype)
    back = KvPayload.from_bytes(payload.to_bytes())
    assert same_bits(back, payload)
    assert back.num_tokens == tokens and back.nbytes == payload.nbytes


def test_k_and_v_in_the_engine_layout_convert_both_ways() -> None:
    key, value = torch.randn(3, 7, 2, 4), torch.randn(3, 7, 2, 4)
    payload = KvPayload.from_kv("seq-9", key=key, value=value)
    assert payload.kv.shape == (3, 2, 7, 2, 4) and payload.kv.is_contiguous()
    assert torch.equal(payload.key, key) and torch.equal(payload.value, value)
    assert payload.nbytes == 2 * key.numel() * 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": "", "kv": torch.zeros(1, 2, 1, 1, 1)}, "request_id"),
        ({"request_id": "a b", "kv": torch.zeros(1, 2, 1, 1, 1)}, "request_id"),
        ({"request_id": "{x}", "kv": torch.zeros(1, 2, 1, 1, 1)}, "request_id"),
        ({"request_id": "r", "kv": torch.zeros(1, 3, 1, 1, 1)}, "kv"),
        ({"request_id": "r", "kv": torch.zeros(1, 2, 0, 1, 1)}, "kv"),
        ({"request_id": "r", "kv": torch.zeros(1, 2, 1, 1, dtype=torch.int32)}, "kv"),
        ({"request_id": "r", "kv": torch.zeros(1, 2, 1, 1, 1, dtype=torch.int32)}, "kv"),
        ({"request_id": "r", "kv": torch.zeros(1, 2, 3, 1, 2).transpose(2, 4)}, "kv"),
    ],
)
def test_a_malformed_payload_is_rejected_naming_the_field(kwargs: Any, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        KvPayload(**kwargs)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b[:10], "header"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "CRC"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "CRC"),
    ],
    ids=["short body", "short header", "magic", "body bit", "header bit"],
)
def test_damaged_bytes_never_become_a_payload(damage: Any, message: str) -> None:
    data = make_payload("req-1", tokens=9).to_bytes()
    with pytest.raises(KvTransferCorruptError, match=message):
        KvPayload.from_bytes(damage(data))


# -- over Redis --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("nbytes", "chunk_bytes"),
    [(4096, 4 * MiB), (3 * MiB, MiB), (5 * MiB + 4096, MiB), (40 * MiB, 4 * MiB)],
    ids=["one small chunk", "exact chunks", "ragged last chunk", "40 MiB"],
)
def test_a_payload_crosses_redis_bit_for_bit(
    client: redis.Redis, dtype: torch.dtype, nbytes: int, chunk_bytes: int
) -> None:
    transport = RedisKvTransport(client, chunk_bytes=chunk_bytes)
    assert isinstance(transport, KvTransport)
    payload = make_payload(
        "req-7",
        layers=4,
        tokens=tokens_for(nbytes, dtype),
        heads=8,
        head_dim=64,
        dtype=dtype,
        seed=nbytes,
    )
    receipt = transport.send(payload)
    assert receipt.transport is TransportKind.REDIS and receipt.nbytes == payload.nbytes
    assert receipt.num_chunks == -(-payload.nbytes // chunk_bytes)
    assert same_bits(transport.receive("req-7", timeout_s=5), payload)


def test_keys_carry_the_ttl_until_received_and_are_gone_after(client: redis.Redis) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000, ttl_s=30)
    transport.send(make_payload("req-1", tokens=20))  # 5120 bytes: 6 chunks
    stored = keys(client)
    assert len(stored) == 6 + 2  # chunks, manifest, wake-up list
    assert all(0 < client.pttl(k) <= 30_000 for k in stored)
    transport.receive("req-1", timeout_s=5)
    assert keys(client) == []


def test_a_transfer_bigger_than_a_read_batch_is_taken_in_several(client: redis.Redis) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000, read_batch_bytes=2000)
    payload = make_payload("req-1", tokens=20)  # 6 chunks: 2 with the manifest, then 2 + 2
    transport.send(payload)
    assert same_bits(transport.receive("req-1", timeout_s=5), payload)
    assert keys(client) == []


@pytest.mark.parametrize("chunk", [0, 3, 5])
def test_a_flipped_byte_is_caught_in_any_batch_and_nothing_is_left(
    client: redis.Redis, chunk: int
) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000, read_batch_bytes=2000)
    transport.send(make_payload("req-1", tokens=20))
    key = transport.chunk_key("req-1", chunk)
    client.setrange(key, 7, bytes([cast(bytes, client.getrange(key, 7, 7))[0] ^ 1]))
    with pytest.raises(KvTransferCorruptError, match=f"chunk {chunk} of 6 fails its CRC"):
        transport.receive("req-1", timeout_s=5)
    assert keys(client) == []


def test_a_flipped_byte_in_a_chunk_is_caught_and_the_transfer_dropped(
    client: redis.Redis,
) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000)
    transport.send(make_payload("req-1", tokens=20))
    chunk = next(k for k in keys(client) if k.endswith(b":3"))
    byte = cast(bytes, client.getrange(chunk, 500, 500))
    client.setrange(chunk, 500, bytes([byte[0] ^ 0x40]))
    with pytest.raises(KvTransferCorruptError, match="chunk 3 of 6 fails its CRC"):
        transport.receive("req-1", timeout_s=5)
    assert keys(client) == []


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda c, k: c.delete(k), "chunk 2 of 6 is missing"),
        (lambda c, k: c.set(k, c.get(k)[:-1]), "chunk 2 has 999 bytes, expected 1000"),
    ],
    ids=["missing chunk", "short chunk"],
)
def test_a_missing_or_short_chunk_is_an_error_not_a_short_cache(
    client: redis.Redis, damage: Any, message: str
) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000)
    transport.send(make_payload("req-1", tokens=20))
    damage(client, next(k for k in keys(client) if k.endswith(b":2")))
    with pytest.raises(KvTransferCorruptError, match=message):
        transport.receive("req-1", timeout_s=5)


def test_a_damaged_manifest_is_an_error(client: redis.Redis) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000)
    transport.send(make_payload("req-1", tokens=20))
    client.setrange(transport.manifest_key("req-1"), 30, b"\xff")
    with pytest.raises(KvTransferCorruptError, match="manifest"):
        transport.receive("req-1", timeout_s=5)


def test_an_expired_transfer_is_an_error_and_leaves_nothing(client: redis.Redis) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000, ttl_s=0.2)
    transport.send(make_payload("req-1", tokens=20))
    time.sleep(0.4)
    with pytest.raises(KvTransferError, match=r"expired after ttl_s=0\.2") as caught:
        transport.receive("req-1", timeout_s=0.2)
    assert isinstance(caught.value, KvTransferTimeoutError)
    assert keys(client) == []


class BlpopSpy:
    """The real client, except that ``blpop`` is recorded; with ``clock`` given it
    does not block either: it advances that fake clock by the timeout it was asked for
    (nothing was sent, so a real BLPOP would have slept that long and returned None)."""

    def __init__(
        self,
        client: redis.Redis,
        clock: FakeClock | None = None,
        on_first_blpop: Any = None,
    ) -> None:
        self._client = client
        self._clock = clock
        self._on_first_blpop = on_first_blpop
        self.calls: list[tuple[float, Any]] = []  # (timeout asked, what it returned)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def blpop(self, keys: list[str], timeout: float) -> Any:
        if not self.calls and self._on_first_blpop is not None:
            self._on_first_blpop()
        if self._clock is not None:
            self._clock.now_s += timeout
            got = None
        else:
            got = self._client.blpop(keys, timeout=timeout)
        self.calls.append((timeout, got))
        return got


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.parametrize(("timeout_s", "slices"), [(0.3, [0.3]), (2.5, [1.0, 1.0, 0.5])])
def test_a_receive_with_nothing_sent_times_out_on_time(
    client: redis.Redis, timeout_s: float, slices: list[float]
) -> None:
    # On the transport's own (fake) clock: it waits exactly its timeout, in BLPOP slices
    # of at most 1 s, and gives up then -- not before, not after another slice.
    clock = FakeClock()
    spy = BlpopSpy(client, clock)
    transport = RedisKvTransport(cast(redis.Redis, spy), clock=clock)
    with pytest.raises(
        KvTransferTimeoutError, match=rf"no KV arrived within {timeout_s:g} s"
    ) as caught:
        transport.receive("never-sent", timeout_s=timeout_s)
    assert [t for t, _ in spy.calls] == pytest.approx(slices)
    assert clock.now_s - 100.0 == pytest.approx(timeout_s)
    assert caught.value.retryable


def test_a_waiting_receive_wakes_as_soon_as_the_send_lands(client: redis.Redis) -> None:
    payload = make_payload("req-1")
    sender = RedisKvTransport(client)
    # The send is started once the receiver found nothing and is about to wait, so it
    # always lands during that wait.
    timer = threading.Timer(0.05, sender.send, args=(payload,))
    spy = BlpopSpy(client, on_first_blpop=timer.start)
    got = RedisKvTransport(cast(redis.Redis, spy)).receive("req-1", timeout_s=30)
    timer.join()
    assert same_bits(got, payload)
    # Woken by the ready list, not by polling: the wait that ended it was a BLPOP that
    # returned the sender's push (any before it, on a stalled machine, timed out empty).
    *before, (_, last) = spy.calls
    assert last is not None
    assert all(got is None for _, got in before)


def test_a_second_send_replaces_the_first(client: redis.Redis) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000)
    transport.send(make_payload("req-1", tokens=20, seed=1))
    second = make_payload("req-1", tokens=12, seed=2)
    transport.send(second)
    assert same_bits(transport.receive("req-1", timeout_s=5), second)


def test_discard_deletes_a_transfer_and_tolerates_none(client: redis.Redis) -> None:
    transport = RedisKvTransport(client, chunk_bytes=1000)
    transport.send(make_payload("req-1", tokens=20))
    transport.discard("req-1")
    transport.discard("never-sent")
    assert keys(client) == []


def test_an_unreachable_redis_is_a_retryable_unavailable_error() -> None:
    dead = redis.Redis(port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    transport = RedisKvTransport(dead)
    with pytest.raises(KvTransportUnavailableError, match="Redis unreachable") as caught:
        transport.send(make_payload("req-1"))
    assert caught.value.retryable


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": 512 * MiB}, "chunk_bytes"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"key_prefix": ""}, "key_prefix"),
    ],
)
def test_bad_settings_are_rejected_naming_the_field(
    client: redis.Redis, kwargs: Any, field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        RedisKvTransport(client, **kwargs)


def test_a_client_that_decodes_responses_is_rejected(redis_port: int) -> None:
    with pytest.raises(ValueError, match=r"^client:"):
        RedisKvTransport(redis.Redis(port=redis_port, decode_responses=True))


# -- over torch.distributed (gloo), between two processes --------------------------------------

SPECS = [  # request id, dtype, bytes
    ("g-1", torch.float32, 64 * 1024),
    ("g-2", torch.bfloat16, 3 * MiB),
    ("g-3", torch.float16, 512),
    ("g-4", torch.float32, 8 * 1024),
]


def link_payload(request_id: str, dtype: torch.dtype, nbytes: int) -> KvPayload:
    return make_payload(
        request_id,
        layers=4,
        tokens=tokens_for(nbytes, dtype),
        heads=8,
        head_dim=64,
        dtype=dtype,
        seed=len(request_id) + nbytes,
    )


def _prefill_end(port: int, link_id: str, done: Any) -> None:
    client = redis.Redis(port=port)
    with TorchDistributedKvTransport.connect(
        client, link_id=link_id, role=LinkRole.PREFILL, rendezvous_timeout_s=60
    ) as link:
        for spec in SPECS:
            receipt = link.send(link_payload(*spec))
            assert receipt.transport is TransportKind.GLOO
        done.wait(60)


def _decode_end_that_dies(port: int, link_id: str) -> None:
    client = redis.Redis(port=port)
    TorchDistributedKvTransport.connect(
        client, link_id=link_id, role=LinkRole.DECODE, rendezvous_timeout_s=60
    )
    os._exit(3)  # a killed decode worker: no close, no goodbye


def spawn(target: Any, *args: Any) -> Any:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def stop(proc: Any) -> int:
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return int(proc.exitcode)


def test_a_payload_crosses_a_gloo_link_between_processes_bit_for_bit(
    client: redis.Redis, redis_port: int
) -> None:
    done = mp.get_context("spawn").Event()
    child = spawn(_prefill_end, redis_port, "link-a", done)
    try:
        with TorchDistributedKvTransport.connect(
            client, link_id="link-a", role=LinkRole.DECODE, rendezvous_timeout_s=60
        ) as link:
            # Out of order, as decode workers pick requests: later payloads wait in the inbox.
            assert same_bits(link.receive("g-3", timeout_s=30), link_payload(*SPECS[2]))
            link.discard("g-1")
            with pytest.raises(KvTransferTimeoutError, match="no KV arrived"):
                link.receive("g-1", timeout_s=0.2)
            assert same_bits(link.receive("g-2", timeout_s=30), link_payload(*SPECS[1]))
            assert same_bits(link.receive("g-4", timeout_s=30), link_payload(*SPECS[3]))
            # It gives up (the error), and not before its timeout on the link's clock
            # (time.monotonic here); how soon after is no business of a unit test.
            started = time.monotonic()
            with pytest.raises(KvTransferTimeoutError, match="no KV arrived"):
                link.receive("never-sent", timeout_s=0.3)
            assert time.monotonic() - started >= 0.3
            with pytest.raises(ValueError, match=r"^role:"):
                link.send(link_payload(*SPECS[0]))
    finally:
        done.set()
        assert stop(child) == 0
    assert keys(client) == []  # the rendezvous record and the metadata list are gone


def test_a_send_to_a_dead_decode_end_fails_fast_and_ends_the_link(
    client: redis.Redis, redis_port: int
) -> None:
    transfer_timeout_s = 30.0
    child = spawn(_decode_end_that_dies, redis_port, "link-b")
    try:
        with TorchDistributedKvTransport.connect(
            client,
            link_id="link-b",
            role=LinkRole.PREFILL,
            rendezvous_timeout_s=60,
            transfer_timeout_s=transfer_timeout_s,
        ) as link:
            assert stop(child) == 3
            # The timeout fails a send the same way (KvTransportUnavailableError), so
            # what tells "noticed the dead peer" from "waited out the timeout" is the
            # time, measured against the configured timeout, not an absolute target.
            started = time.monotonic()
            with pytest.raises(KvTransportUnavailableError):
                link.send(link_payload(*SPECS[1]))
            assert time.monotonic() - started < transfer_timeout_s
            with pytest.raises(KvTransportUnavailableError, match="failed"):
                link.send(link_payload(*SPECS[2]))
    finally:
        stop(child)


@pytest.mark.parametrize(
    ("role", "message"),
    [(LinkRole.DECODE, "no prefill end published"), (LinkRole.PREFILL, "did not join")],
)
def test_a_link_with_no_peer_gives_up_after_the_rendezvous_timeout(
    client: redis.Redis, role: LinkRole, message: str
) -> None:
    # It gives up (the error naming the missing end), and only once its rendezvous
    # timeout has passed (less 10 ms for torch's store rounding its timeout).
    started = time.monotonic()
    with pytest.raises(KvTransferTimeoutError, match=message):
        TorchDistributedKvTransport.connect(
            client, link_id="lonely", role=role, rendezvous_timeout_s=0.5
        )
    assert time.monotonic() - started >= 0.5 - 0.01
    assert keys(client) == []


# -- the hand-off: prefill in one process, decode in another -----------------------------------

PROMPTS = {"over-redis": list(range(3, 40)), "over-gloo": list(range(100, 121))}
MAX_TOKENS = 12


def tiny_engine(**kwargs: Any) -> Any:
    from workers.checkpoint import random_weights, tiny_config
    from workers.engine import Engine
    from workers.model import LlamaForCausalLM

    config = tiny_config()
    model = LlamaForCausalLM(config, device="cpu")
    model.load_state_dict(random_weights(config, seed=0))
    return Engine(model, token_budget=16, num_blocks=64, **kwargs)


def _prefill_worker(port: int, firsts: Any, done: Any) -> None:
    """Prefill both prompts (in chunks), send each KV over its transport with the first token."""
    from workers.sampling import SamplingParams

    torch.set_num_threads(1)
    client = redis.Redis(port=port)
    engine = tiny_engine(keep_finished_kv=True)
    ids = {
        rid: engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        for rid, prompt in PROMPTS.items()
    }
    while engine.has_unfinished:
        engine.step()
    first = {f.seq_id: f.output_token_ids for f in engine.take_finished()}

    def payload(rid: str) -> KvPayload:
        snapshot = engine.export_kv(ids[rid])
        return KvPayload.from_kv(rid, key=snapshot.key, value=snapshot.value)

    RedisKvTransport(client).send(payload("over-redis"))
    with TorchDistributedKvTransport.connect(
        client, link_id="handoff", role=LinkRole.PREFILL, rendezvous_timeout_s=60
    ) as link:
        link.send(payload("over-gloo"))
        firsts.put({rid: list(first[ids[rid]]) for rid in PROMPTS})
        done.wait(60)


def test_a_request_prefilled_in_one_process_decodes_exactly_in_another_over_each_transport(
    client: redis.Redis, redis_port: int
) -> None:
    from workers.paged_attention import KvSnapshot
    from workers.sampling import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = tiny_engine().generate(list(PROMPTS.values()), params)
    ctx = mp.get_context("spawn")
    firsts, done = ctx.Queue(), ctx.Event()
    child = spawn(_prefill_worker, redis_port, firsts, done)
    try:
        with TorchDistributedKvTransport.connect(
            client, link_id="handoff", role=LinkRole.DECODE, rendezvous_timeout_s=60
        ) as link:
            received = {
                "over-redis": RedisKvTransport(client).receive("over-redis", timeout_s=60),
                "over-gloo": link.receive("over-gloo", timeout_s=60),
            }
            first = firsts.get(timeout=60)
        decoder = tiny_engine()
        for seq_id, (rid, kv) in enumerate(received.items()):
            decoder.import_kv(
                seq_id, KvSnapshot(key=kv.key, value=kv.value), kv.num_tokens,
                prompt_token_ids=PROMPTS[rid], output_token_ids=first[rid], params=params,
            )  # fmt: skip
        outputs: dict[int, list[int]] = {0: [], 1: []}
        while decoder.has_unfinished:
            for seq_id, token in decoder.step():
                outputs[seq_id].append(token)
        for seq_id, rid in enumerate(received):
            assert first[rid] + outputs[seq_id] == reference[seq_id], rid
    finally:
        done.set()
        assert stop(child) == 0
