"""KV transfer from a prefill worker to a decode worker: one payload, one interface.

``KvPayload`` is one sequence's K and V for every layer, in token order and
independent of any block layout: a contiguous ``[num_layers, 2, num_tokens,
num_kv_heads, head_dim]`` tensor (index 0 of dim 1 is K, 1 is V). The engine's
``export_kv`` snapshot converts into one (``from_kv``) and back (``key``/``value``).

``KvTransport`` is what the workers use: ``send`` on the prefill side, ``receive``
on the decode side, ``discard`` when the decode side gives a request up. Two
transports implement it: ``RedisKvTransport`` here (any machine that reaches Redis)
and ``TorchDistributedKvTransport`` in ``workers.transfer_nccl`` (NCCL GPU to GPU,
gloo on CPU). The format, the keys and the failure behaviour are in
``docs/kv_transfer.md``.

What must stay true:
- a receive returns exactly the bytes that were sent, or raises ``KvTransferError``:
  never a truncated, mixed or silently wrong cache (every chunk is checked against
  the manifest's running CRC-32 before the payload is built);
- nothing a transfer writes to Redis outlives its TTL, whoever dies.
"""

from __future__ import annotations

import re
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import redis
import torch

MiB = 1 << 20
REDIS_MAX_VALUE_BYTES = 512 * MiB  # Redis's proto-max-bulk-len default: why chunks exist

FORMAT_VERSION = 1
_PAYLOAD_MAGIC = b"SKV1"
_MANIFEST_MAGIC = b"SKVM"
# magic, version, dtype code, flags, shape (5 x u64), body bytes, body CRC-32, id length
_HEADER = struct.Struct("<4sHBB5QQIH")
# magic, version, chunk bytes, number of chunks
_MANIFEST = struct.Struct("<4sHQI")
_CRC = struct.Struct("<I")
FLAG_BODY_CRC = 1  # the header's body CRC is meaningful (the torch transport sends none)

_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.float8_e4m3fn,
    6: torch.float8_e5m2,
}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class KvTransferError(RuntimeError):
    """A KV transfer failed. ``retryable`` says whether trying again can succeed."""

    retryable: ClassVar[bool] = False


class KvTransferTimeoutError(KvTransferError):
    """Nothing arrived for the request in time: not sent yet, never sent, expired
    (TTL) or already received. Retryable while the sender may still be coming."""

    retryable = True


class KvTransferCorruptError(KvTransferError):
    """What arrived is not the payload that was sent (bad checksum, missing or short
    chunk, malformed manifest). Permanent: the request must be prefilled again."""


class KvTransportUnavailableError(KvTransferError):
    """The medium is gone: Redis unreachable, or the peer of a torch link died.
    Retryable after reconnecting (a torch link must be established again)."""

    retryable = True


class TransportKind(Enum):
    REDIS = "redis"
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True, kw_only=True)
class TransferReceipt:
    """What ``send`` did: ``nbytes`` of KV in ``num_chunks`` pieces over ``duration_s``."""

    request_id: str
    transport: TransportKind
    nbytes: int
    num_chunks: int
    duration_s: float


def check_request_id(request_id: str) -> str:
    """``request_id`` names Redis keys: 1-128 of ``A-Z a-z 0-9 . _ : -``. ValueError if not."""
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise ValueError(
            f"request_id: expected 1-128 characters of [A-Za-z0-9._:-], got {request_id!r}"
        )
    return request_id


@dataclass(frozen=True, kw_only=True, eq=False)
class KvPayload:
    """One sequence's KV: ``kv`` is ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``,
    contiguous, K at ``kv[:, 0]`` and V at ``kv[:, 1]``. ValueError naming the field if not."""

    request_id: str
    kv: torch.Tensor

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        shape = tuple(self.kv.shape)
        if len(shape) != 5 or shape[1] != 2 or min(shape) < 1:
            raise ValueError(
                f"kv: expected [num_layers, 2, num_tokens, num_kv_heads, head_dim] with every "
                f"dimension >= 1, got shape {shape}"
            )
        if self.kv.dtype not in _DTYPE_CODES:
            raise ValueError(f"kv: dtype {self.kv.dtype} is not one of {list(_DTYPE_CODES)}")
        if not self.kv.is_contiguous():
            raise ValueError("kv: must be contiguous (use from_kv, or .contiguous())")

    @classmethod
    def from_kv(cls, request_id: str, *, key: torch.Tensor, value: torch.Tensor) -> KvPayload:
        """From K and V of ``[num_layers, num_tokens, num_kv_heads, head_dim]`` each (the
        engine's ``KvSnapshot`` layout). Copies once into the payload layout."""
        if key.dim() != 4 or key.shape != value.shape or key.dtype != value.dtype:
            raise ValueError(
                f"value: expected K and V of one 4-d shape and dtype, got {tuple(key.shape)} "
                f"{key.dtype} and {tuple(value.shape)} {value.dtype}"
            )
        return cls(request_id=request_id, kv=torch.stack((key, value), dim=1).contiguous())

    @property
    def key(self) -> torch.Tensor:
        """K as a ``[num_layers, num_tokens, num_kv_heads, head_dim]`` view."""
        return self.kv[:, 0]

    @property
    def value(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def to(self, device: torch.device | str) -> KvPayload:
        return KvPayload(request_id=self.request_id, kv=self.kv.to(device))

    def body(self) -> memoryview:
        """The tensor's bytes, without a copy when it is already on the CPU."""
        flat = self.kv.detach().reshape(-1).cpu().view(torch.uint8)
        return flat.numpy().data

    def to_bytes(self) -> bytes:
        """Header (magic, version, dtype, shape, CRC-32 of the body, request id) + body."""
        body = self.body()
        return encode_header(self, body_crc=zlib.crc32(body)) + body.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> KvPayload:
        """Inverse of ``to_bytes`` (a CPU tensor). ``KvTransferCorruptError`` if the bytes
        are not a whole, intact payload."""
        view = memoryview(data).cast("B")
        header, start = decode_header(view)
        body = view[start:]
        if len(body) != header.body_nbytes:
            raise KvTransferCorruptError(
                f"body: {len(body)} bytes, the header says {header.body_nbytes} (truncated?)"
            )
        if header.body_crc is not None and zlib.crc32(body) != header.body_crc:
            raise KvTransferCorruptError(f"body: CRC-32 mismatch for {header.request_id!r}")
        out = torch.empty(header.body_nbytes, dtype=torch.uint8)
        out.numpy()[:] = np.frombuffer(body, dtype=np.uint8)
        return header.payload_from(out)


@dataclass(frozen=True, kw_only=True)
class PayloadHeader:
    """The decoded header: enough to allocate the receive buffer before the body comes."""

    request_id: str
    dtype: torch.dtype
    shape: tuple[int, int, int, int, int]
    body_nbytes: int
    body_crc: int | None

    def payload_from(self, body: torch.Tensor) -> KvPayload:
        """The payload over ``body`` (``uint8``, ``body_nbytes`` long), without a copy."""
        return KvPayload(request_id=self.request_id, kv=body.view(self.dtype).view(self.shape))


def encode_header(payload: KvPayload, *, body_crc: int | None) -> bytes:
    """The header of ``payload``, itself closed by a CRC-32 of its bytes."""
    rid = payload.request_id.encode("ascii")
    flags = 0 if body_crc is None else FLAG_BODY_CRC
    head = (
        _HEADER.pack(
            _PAYLOAD_MAGIC,
            FORMAT_VERSION,
            _DTYPE_CODES[payload.dtype],
            flags,
            *payload.kv.shape,
            payload.nbytes,
            body_crc or 0,
            len(rid),
        )
        + rid
    )
    return head + _CRC.pack(zlib.crc32(head))


def decode_header(data: memoryview) -> tuple[PayloadHeader, int]:
    """The header at the start of ``data`` and where it ends. ``KvTransferCorruptError``."""
    if len(data) < _HEADER.size:
        raise KvTransferCorruptError(f"header: {len(data)} bytes, need {_HEADER.size}")
    magic, version, code, flags, *rest = _HEADER.unpack_from(data)
    shape: tuple[int, int, int, int, int] = tuple(rest[:5])
    body_nbytes, body_crc, rid_len = rest[5:]
    if magic != _PAYLOAD_MAGIC:
        raise KvTransferCorruptError(f"header: magic {bytes(magic)!r}, not a KV payload")
    if version != FORMAT_VERSION:
        raise KvTransferCorruptError(f"header: format version {version}, this is {FORMAT_VERSION}")
    end = _HEADER.size + rid_len
    if len(data) < end + _CRC.size:
        raise KvTransferCorruptError("header: truncated")
    (crc,) = _CRC.unpack_from(data, end)
    if zlib.crc32(data[:end]) != crc:
        raise KvTransferCorruptError("header: CRC-32 mismatch")
    if code not in _DTYPES:
        raise KvTransferCorruptError(f"header: unknown dtype code {code}")
    dtype = _DTYPES[code]
    if body_nbytes != int(np.prod(shape)) * dtype.itemsize:
        raise KvTransferCorruptError(f"header: {body_nbytes} bytes do not fit {shape} {dtype}")
    header = PayloadHeader(
        request_id=bytes(data[_HEADER.size : end]).decode("ascii"),
        dtype=dtype,
        shape=shape,
        body_nbytes=body_nbytes,
        body_crc=body_crc if flags & FLAG_BODY_CRC else None,
    )
    return header, end + _CRC.size


@runtime_checkable
class KvTransport(Protocol):
    """Moves a payload from the prefill side to the decode side."""

    def send(self, payload: KvPayload) -> TransferReceipt:
        """Prefill side: the payload is on its way (Redis: stored) when this returns."""
        ...

    def receive(self, request_id: str, *, timeout_s: float) -> KvPayload:
        """Decode side: the payload for ``request_id`` (CPU for Redis, the link's device
        for torch). ``KvTransferTimeoutError`` after ``timeout_s`` with nothing,
        ``KvTransferCorruptError``/``KvTransportUnavailableError`` on failure."""
        ...

    def discard(self, request_id: str) -> None:
        """Drop whatever is held for ``request_id``; no error if there is nothing."""
        ...


def _chunks(body: memoryview, chunk_bytes: int) -> Iterator[memoryview]:
    for start in range(0, len(body), chunk_bytes):
        yield body[start : start + chunk_bytes]


class RedisKvTransport:
    """KV through Redis as chunked binary values with a manifest, every key with a TTL.

    Keys, for ``{p}`` = ``key_prefix`` and ``{r}`` = the request id (in braces: a Redis
    Cluster hash tag, so one request's keys share a slot): ``{p}:{{r}}:m`` the manifest,
    ``{p}:{{r}}:c:<i>`` chunk ``i``, ``{p}:{{r}}:ready`` a list the receiver blocks on.

    ``send`` is one MULTI/EXEC round trip (chunks, manifest, wake-up): a receiver sees
    a whole transfer or none of it. ``receive`` takes the manifest, the wake-up list
    and the first chunks in one MULTI/EXEC with GETDEL, the remaining chunks (if any)
    with pipelined GETDELs: a payload up to ``read_batch_bytes`` costs one round trip
    each way, like a bare pipelined SET/GET. ``client`` must return bytes
    (``decode_responses=False``) and talk to Redis >= 6.2 (GETDEL). ``clock``
    (seconds, monotonic) times the receipts and the receive deadline.
    """

    transport = TransportKind.REDIS

    def __init__(
        self,
        client: redis.Redis,
        *,
        chunk_bytes: int = 4 * MiB,
        ttl_s: float = 120.0,
        key_prefix: str = "sara:kv",
        read_batch_bytes: int = 64 * MiB,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= chunk_bytes < REDIS_MAX_VALUE_BYTES:
            raise ValueError(f"chunk_bytes: must be in [1, 512 MiB), got {chunk_bytes}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        if not key_prefix:
            raise ValueError("key_prefix: must not be empty")
        if read_batch_bytes < 1:
            raise ValueError(f"read_batch_bytes: must be >= 1, got {read_batch_bytes}")
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("client: must return bytes (decode_responses=False)")
        self.client = client
        self.chunk_bytes = chunk_bytes
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self.read_batch_bytes = read_batch_bytes
        self.clock = clock
        self._ttl_ms = max(1, round(ttl_s * 1000))

    # -- keys --------------------------------------------------------------------------------

    def manifest_key(self, request_id: str) -> str:
        return f"{self.key_prefix}:{{{check_request_id(request_id)}}}:m"

    def ready_key(self, request_id: str) -> str:
        return f"{self.key_prefix}:{{{check_request_id(request_id)}}}:ready"

    def chunk_key(self, request_id: str, index: int) -> str:
        return f"{self.key_prefix}:{{{request_id}}}:c:{index}"

    def _batch_chunks(self, chunk_bytes: int) -> int:
        return max(1, min(self.read_batch_bytes // chunk_bytes, _MAX_BATCH_CHUNKS))

    # -- the interface -----------------------------------------------------------------------

    def send(self, payload: KvPayload) -> TransferReceipt:
        """Store ``payload`` (moved to the CPU first if it is not there) for ``ttl_s``.

        A second send for the same request id replaces the first (chunks of a longer
        first one that it does not overwrite expire on their own).
        ``KvTransportUnavailableError`` when Redis cannot be reached, ``KvTransferError``
        when it refuses (e.g. out of memory).
        """
        started = self.clock()
        rid = payload.request_id
        pieces = list(_chunks(payload.body(), self.chunk_bytes))
        running, crc = [], 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
            running.append(crc)
        manifest = _MANIFEST.pack(_MANIFEST_MAGIC, FORMAT_VERSION, self.chunk_bytes, len(pieces))
        manifest += np.asarray(running, dtype="<u4").tobytes()
        manifest += encode_header(payload, body_crc=crc)
        manifest += _CRC.pack(zlib.crc32(manifest))
        pipe = self.client.pipeline(transaction=True)
        for index, piece in enumerate(pieces):
            pipe.set(self.chunk_key(rid, index), piece, px=self._ttl_ms)
        pipe.set(self.manifest_key(rid), manifest, px=self._ttl_ms)
        pipe.rpush(self.ready_key(rid), b"1")
        pipe.pexpire(self.ready_key(rid), self._ttl_ms)
        with _redis_errors(f"send {rid!r}"):
            pipe.execute()
        return TransferReceipt(
            request_id=rid,
            transport=self.transport,
            nbytes=payload.nbytes,
            num_chunks=len(pieces),
            duration_s=self.clock() - started,
        )

    def receive(self, request_id: str, *, timeout_s: float) -> KvPayload:
        """Wait up to ``timeout_s`` for the transfer, take its keys (read and delete),
        verify every chunk, return the payload (a CPU tensor).

        Taking is final: a receiver that dies after it has lost the transfer (as it
        would lose the KV it had loaded), and a transfer that fails verification is
        gone too (it could never succeed); in both cases the request is prefilled again.
        """
        deadline = self.clock() + timeout_s
        speculative = self._batch_chunks(self.chunk_bytes)
        with _redis_errors(f"receive {request_id!r}"):
            while True:
                # Atomic with the sender's MULTI: the manifest and the first chunks come
                # from one transfer. Chunks taken with no manifest are leftovers of an
                # expired or replaced transfer.
                pipe = self.client.pipeline(transaction=True)
                pipe.getdel(self.manifest_key(request_id))
                for index in range(speculative):
                    pipe.getdel(self.chunk_key(request_id, index))
                pipe.unlink(self.ready_key(request_id))
                taken = pipe.execute()
                if taken[0] is not None:
                    break
                remaining_s = deadline - self.clock()
                if remaining_s <= 0:
                    raise KvTransferTimeoutError(
                        f"request {request_id!r}: no KV arrived within {timeout_s:g} s (not "
                        f"sent yet, never sent, expired after ttl_s={self.ttl_s:g}, or "
                        f"already received)"
                    )
                # The list only wakes us; the manifest is the truth. Slices of <= 1 s keep
                # BLPOP under any sane socket timeout, and never send 0 (= forever).
                self.client.blpop(
                    [self.ready_key(request_id)], timeout=max(0.01, min(remaining_s, 1.0))
                )
        manifest = _Manifest.decode(taken[0])
        try:
            return self._assemble(request_id, manifest, taken[1:-1])
        except KvTransferCorruptError:
            self._unlink_chunks(request_id, range(speculative, manifest.num_chunks))
            raise

    def discard(self, request_id: str) -> None:
        """Delete the manifest, the chunks it names and the wake-up list, if any."""
        pipe = self.client.pipeline(transaction=True)
        pipe.getdel(self.manifest_key(request_id))
        pipe.unlink(self.ready_key(request_id))
        with _redis_errors(f"discard {request_id!r}"):
            raw = pipe.execute()[0]
        if raw is not None:
            try:
                num_chunks = _Manifest.decode(raw).num_chunks
            except KvTransferCorruptError:
                return  # its chunks cannot be counted; their TTL removes them
            self._unlink_chunks(request_id, range(num_chunks))

    # -- receive, in steps ------------------------------------------------------------------

    def _unlink_chunks(self, request_id: str, indices: range) -> None:
        step = _MAX_BATCH_CHUNKS
        with _redis_errors(f"discard {request_id!r}"):
            for first in range(indices.start, indices.stop, step):
                last = min(first + step, indices.stop)
                self.client.unlink(*(self.chunk_key(request_id, i) for i in range(first, last)))

    def _assemble(
        self, request_id: str, manifest: _Manifest, taken: list[bytes | None]
    ) -> KvPayload:
        """Verify the chunks (those already taken, then the rest, taken in batches) and
        copy them into one tensor."""
        header = manifest.header
        if header.request_id != request_id:
            raise KvTransferCorruptError(
                f"manifest: for request {header.request_id!r}, expected {request_id!r}"
            )
        out = torch.empty(header.body_nbytes, dtype=torch.uint8)
        out_np = out.numpy()
        offset, crc = 0, 0
        batch = self._batch_chunks(manifest.chunk_bytes)
        values = iter(taken[: manifest.num_chunks])
        for index in range(manifest.num_chunks):
            value = next(values, _MISSING)
            if value is _MISSING:  # past what was taken: take the next batch
                pipe = self.client.pipeline(transaction=False)
                for later in range(index, min(index + batch, manifest.num_chunks)):
                    pipe.getdel(self.chunk_key(request_id, later))
                with _redis_errors(f"receive {request_id!r}"):
                    values = iter(pipe.execute())
                value = next(values)
            want = min(manifest.chunk_bytes, header.body_nbytes - offset)
            if value is None:
                raise KvTransferCorruptError(
                    f"request {request_id!r}: chunk {index} of {manifest.num_chunks} is "
                    f"missing (expired after ttl_s={self.ttl_s:g}, or deleted)"
                )
            assert isinstance(value, bytes)
            if len(value) != want:
                raise KvTransferCorruptError(
                    f"request {request_id!r}: chunk {index} has {len(value)} bytes, "
                    f"expected {want} (truncated)"
                )
            crc = zlib.crc32(value, crc)
            if crc != manifest.running_crcs[index]:
                raise KvTransferCorruptError(
                    f"request {request_id!r}: chunk {index} of {manifest.num_chunks} "
                    f"fails its CRC-32 (corrupted)"
                )
            out_np[offset : offset + want] = np.frombuffer(value, dtype=np.uint8)
            offset += want
        if offset != header.body_nbytes or crc != header.body_crc:
            raise KvTransferCorruptError(f"request {request_id!r}: body does not match its header")
        return header.payload_from(out)


_MISSING = object()
_MAX_BATCH_CHUNKS = 256  # commands per pipeline, however small the chunks


@dataclass(frozen=True, kw_only=True)
class _Manifest:
    chunk_bytes: int
    num_chunks: int
    running_crcs: tuple[int, ...]  # CRC-32 of the body up to the end of each chunk
    header: PayloadHeader

    @classmethod
    def decode(cls, raw: bytes) -> _Manifest:
        view = memoryview(raw)
        if len(view) < _MANIFEST.size + _CRC.size:
            raise KvTransferCorruptError(f"manifest: {len(view)} bytes, too short")
        (crc,) = _CRC.unpack_from(view, len(view) - _CRC.size)
        if zlib.crc32(view[: -_CRC.size]) != crc:
            raise KvTransferCorruptError("manifest: CRC-32 mismatch")
        magic, version, chunk_bytes, num_chunks = _MANIFEST.unpack_from(view)
        if magic != _MANIFEST_MAGIC or version != FORMAT_VERSION:
            raise KvTransferCorruptError(f"manifest: magic {magic!r} version {version}")
        crcs_end = _MANIFEST.size + 4 * num_chunks
        running = np.frombuffer(view[_MANIFEST.size : crcs_end], dtype="<u4")
        header, end = decode_header(view[crcs_end:])
        if crcs_end + end + _CRC.size != len(view) or header.body_crc is None:
            raise KvTransferCorruptError("manifest: malformed")
        if chunk_bytes < 1 or num_chunks != -(-header.body_nbytes // chunk_bytes):
            raise KvTransferCorruptError(
                f"manifest: {num_chunks} chunks of {chunk_bytes} bytes do not hold "
                f"{header.body_nbytes} bytes"
            )
        return cls(
            chunk_bytes=chunk_bytes,
            num_chunks=num_chunks,
            running_crcs=tuple(int(c) for c in running),
            header=header,
        )


@contextmanager
def _redis_errors(what: str) -> Iterator[None]:
    """Map redis-py's errors to the transfer errors, naming the operation."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise KvTransportUnavailableError(f"{what}: Redis unreachable ({exc})") from exc
    except redis.RedisError as exc:
        raise KvTransferError(f"{what}: Redis refused ({exc})") from exc
