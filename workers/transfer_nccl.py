"""KV transfer over ``torch.distributed`` point-to-point: NCCL GPU to GPU, gloo on CPU.

A *link* joins one prefill process (rank 0, sends) to one decode process (rank 1,
receives): a two-rank process group of its own, built directly on a ``TCPStore``
(``ProcessGroupNCCL``/``ProcessGroupGloo``, as vLLM's stateless groups do), not
``init_process_group``. Why: the default group is one per process and its world is
fixed, while a worker in an elastic pool must be able to hold a link to each of
several peers and to drop one when its peer goes away; ``new_group`` would need
every worker of both pools in one world from the start.

Rendezvous through Redis: the prefill side starts the ``TCPStore`` on a free port and
publishes ``{host, port, backend, ranks, nonce}`` under ``{prefix}:link:{link_id}:rv``;
the decode side reads (and consumes) it, joins the store, and both build the group.

Per transfer, the metadata goes first, over Redis: the payload header (request id,
dtype, shape) is pushed on the link's list ``{prefix}:link:{link_id}:{nonce}:meta``,
then the body follows as one ``uint8`` tensor over the group. The decode side runs
one thread that pops the metadata, posts the matching ``recv`` and files the payload
in an inbox that ``receive`` reads, so a send never waits for the decode worker to
ask for that request, and a ``receive`` for a request that never comes times out
without touching the group. No group operation is ever left pending while the link
is idle: a gloo or NCCL timeout is fatal to the group, so the only timeouts on it are
those of a transfer whose peer died or hung, and those end the link.

What must stay true: the sender pushes a header and sends its body under one lock,
so headers and bodies pair up in order on the link.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from functools import partial
from typing import Any, cast

import redis
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from workers.transfer import (
    KvPayload,
    KvTransferError,
    KvTransferTimeoutError,
    KvTransportUnavailableError,
    TransferReceipt,
    TransportKind,
    check_request_id,
    decode_header,
    encode_header,
)

_TAG = 0
_POLL_S = 0.5  # how often the receiver thread looks up from its BLPOP to check for close()


class LinkRole(Enum):
    PREFILL = "prefill"  # rank 0: sends
    DECODE = "decode"  # rank 1: receives


RANKS = {LinkRole.PREFILL: 0, LinkRole.DECODE: 1}


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """What the prefill side publishes: where its store listens and how to join."""

    host: str
    port: int
    backend: TransportKind
    nonce: str  # one per link incarnation: prefixes the store keys and the metadata list

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": 1,
                "host": self.host,
                "port": self.port,
                "backend": self.backend.value,
                "nonce": self.nonce,
                "world_size": 2,
                "ranks": {role.value: rank for role, rank in RANKS.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Rendezvous:
        try:
            doc = json.loads(text)
            return cls(
                host=str(doc["host"]),
                port=int(doc["port"]),
                backend=TransportKind(doc["backend"]),
                nonce=str(doc["nonce"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise KvTransferError(f"rendezvous: malformed record ({exc})") from exc


def backend_for(device: torch.device) -> TransportKind:
    """NCCL for a CUDA device, gloo for the CPU."""
    return TransportKind.NCCL if device.type == "cuda" else TransportKind.GLOO


def _make_group(
    backend: TransportKind,
    store: Any,
    rank: int,
    host: str,
    device: torch.device,
    timeout: timedelta,
) -> Any:
    if backend is TransportKind.GLOO:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise KvTransportUnavailableError("device: this torch build has no NCCL")
    options = nccl.Options()
    options._timeout = timeout
    group = nccl(store, rank, 2, options)
    group.eager_connect_single_device(device)  # pay NCCL's set-up now, not on the first send
    return group


class TorchDistributedKvTransport:
    """One end of a prefill→decode link. Build it with ``connect``; ``close`` it.

    ``send`` only on the ``PREFILL`` end, ``receive``/``discard`` only on the ``DECODE``
    end (``ValueError`` otherwise). Received payloads are on the decode end's device;
    one not collected within ``ttl_s`` is dropped. Any failure of the group (the peer
    died, or a transfer outlived ``transfer_timeout_s``) ends the link: later calls raise
    ``KvTransportUnavailableError`` and the workers must ``connect`` a new one.
    """

    def __init__(
        self,
        *,
        client: redis.Redis,
        role: LinkRole,
        group: Any,
        store: Any,
        device: torch.device,
        rendezvous: Rendezvous,
        meta_key: str,
        rendezvous_key: str,
        transfer_timeout_s: float,
        ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.client = client
        self.role = role
        self.device = device
        self.rendezvous = rendezvous
        self.transport = rendezvous.backend
        self.transfer_timeout_s = transfer_timeout_s
        self.ttl_s = ttl_s
        self.clock = clock
        self._group = group
        self._store = store  # the group talks through it: keep it alive as long as the group
        self._meta_key = meta_key
        self._rendezvous_key = rendezvous_key
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._inbox: dict[str, tuple[KvPayload, float]] = {}
        self._discarded: dict[str, float] = {}
        self._failure: KvTransferError | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        if role is LinkRole.DECODE:
            self._thread = threading.Thread(
                target=self._receive_loop, daemon=True, name=f"kv-link-{meta_key}"
            )
            self._thread.start()

    @classmethod
    def connect(
        cls,
        client: redis.Redis,
        *,
        link_id: str,
        role: LinkRole,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        key_prefix: str = "sara:kv",
        rendezvous_timeout_s: float = 60.0,
        transfer_timeout_s: float = 60.0,
        ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> TorchDistributedKvTransport:
        """Establish the link ``link_id`` (both ends call this; it returns once both joined).

        ``host``: this process's address, reachable from the peer (the prefill end's
        store listens there; gloo binds its pairs to it). Raises
        ``KvTransferTimeoutError`` when the other end does not show up within
        ``rendezvous_timeout_s``, ``KvTransportUnavailableError`` when joining fails.
        """
        check_request_id(link_id)
        for name, value in (
            ("rendezvous_timeout_s", rendezvous_timeout_s),
            ("transfer_timeout_s", transfer_timeout_s),
            ("ttl_s", ttl_s),
        ):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # NCCL needs the index
            device = torch.device("cuda", torch.cuda.current_device())
        backend = backend_for(device)
        rendezvous_key = f"{key_prefix}:link:{link_id}:rv"
        wait = timedelta(seconds=rendezvous_timeout_s)
        try:
            if role is LinkRole.PREFILL:
                store = TCPStore(host, 0, 2, True, timeout=wait, wait_for_workers=False)
                rendezvous = Rendezvous(
                    host=host, port=int(store.port), backend=backend, nonce=secrets.token_hex(8)
                )
                client.set(
                    rendezvous_key, rendezvous.to_json(), px=round(rendezvous_timeout_s * 1000)
                )
            else:
                rendezvous = cls._read_rendezvous(
                    client, rendezvous_key, clock, rendezvous_timeout_s
                )
                if rendezvous.backend is not backend:
                    raise KvTransferError(
                        f"device: {device} means {backend.value}, the prefill end uses "
                        f"{rendezvous.backend.value}"
                    )
                store = TCPStore(rendezvous.host, rendezvous.port, 2, False, timeout=wait)
            # The group's own timeout also bounds its wait for the peer: the rendezvous one
            # while joining, the transfer one for every operation after.
            group = _make_group(
                backend, PrefixStore(rendezvous.nonce, store), RANKS[role], host, device, wait
            )
            group.set_timeout(timedelta(seconds=transfer_timeout_s))
        except redis.RedisError as exc:
            raise KvTransportUnavailableError(f"link {link_id}: Redis ({exc})") from exc
        except dist.DistStoreError as exc:  # the store's wait for the other end timed out
            raise KvTransferTimeoutError(
                f"link {link_id}: the {role.value} end waited {rendezvous_timeout_s:g} s "
                f"and the other end did not join ({exc})"
            ) from exc
        except RuntimeError as exc:  # torch's other store and group errors
            if isinstance(exc, KvTransferError):
                raise
            raise KvTransportUnavailableError(f"link {link_id}: joining failed ({exc})") from exc
        finally:
            if role is LinkRole.PREFILL:  # joined or failed: nobody else may use the record
                with contextlib.suppress(redis.RedisError):  # else it expires by itself
                    client.delete(rendezvous_key)
        return cls(
            client=client,
            role=role,
            group=group,
            store=store,
            device=device,
            rendezvous=rendezvous,
            meta_key=f"{key_prefix}:link:{link_id}:{rendezvous.nonce}:meta",
            rendezvous_key=rendezvous_key,
            transfer_timeout_s=transfer_timeout_s,
            ttl_s=ttl_s,
            clock=clock,
        )

    @staticmethod
    def _read_rendezvous(
        client: redis.Redis, key: str, clock: Callable[[], float], timeout_s: float
    ) -> Rendezvous:
        deadline = clock() + timeout_s
        while (raw := client.get(key)) is None:
            if clock() >= deadline:
                raise KvTransferTimeoutError(
                    f"{key}: no prefill end published the link within {timeout_s:g} s"
                )
            time.sleep(0.05)
        return Rendezvous.from_json(cast(bytes, raw))

    # -- the interface -----------------------------------------------------------------------

    def send(self, payload: KvPayload) -> TransferReceipt:
        """Push the header, send the body; returns once the body is out (the decode end
        had posted its receive: gloo and NCCL do not send before that)."""
        self._require(LinkRole.PREFILL, "send")
        started = self.clock()
        body = payload.kv.to(self.device).reshape(-1).view(torch.uint8)
        header = encode_header(payload, body_crc=None)  # TCP/NVLink: no checksum to pay
        with self._send_lock:
            self._raise_if_failed()
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.rpush(self._meta_key, header)
                pipe.pexpire(self._meta_key, self._ttl_ms)
                pipe.execute()
            except redis.RedisError as exc:
                what = f"send {payload.request_id!r}: Redis unreachable ({exc})"
                raise KvTransportUnavailableError(what) from exc
            self._complete(
                partial(self._group.send, [body], RANKS[LinkRole.DECODE], _TAG),
                f"send {payload.request_id!r}",
            )
        return TransferReceipt(
            request_id=payload.request_id,
            transport=self.transport,
            nbytes=payload.nbytes,
            num_chunks=1,
            duration_s=self.clock() - started,
        )

    def receive(self, request_id: str, *, timeout_s: float) -> KvPayload:
        """The payload for ``request_id`` once it has arrived, on this end's device."""
        self._require(LinkRole.DECODE, "receive")
        check_request_id(request_id)
        deadline = self.clock() + timeout_s
        with self._cond:
            while True:
                self._sweep()
                entry = self._inbox.pop(request_id, None)
                if entry is not None:
                    return entry[0]
                self._raise_if_failed()
                remaining_s = deadline - self.clock()
                if remaining_s <= 0:
                    raise KvTransferTimeoutError(
                        f"request {request_id!r}: no KV arrived on link "
                        f"{self._meta_key} within {timeout_s:g} s"
                    )
                self._cond.wait(remaining_s)

    def discard(self, request_id: str) -> None:
        """Drop the payload for ``request_id``, now or when it arrives (within ``ttl_s``)."""
        self._require(LinkRole.DECODE, "discard")
        with self._cond:
            if self._inbox.pop(request_id, None) is None:
                self._discarded[request_id] = self.clock()

    def close(self) -> None:
        """Stop receiving and let go of the group. Idempotent."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=self.transfer_timeout_s + 2 * _POLL_S)
        if self.role is LinkRole.PREFILL:
            with contextlib.suppress(redis.RedisError):  # else the list expires by itself
                self.client.delete(self._meta_key)
        self._fail(KvTransportUnavailableError(f"link {self._meta_key}: closed"))
        self._group = None
        self._store = None

    def __enter__(self) -> TorchDistributedKvTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _require(self, role: LinkRole, what: str) -> None:
        if self.role is not role:
            raise ValueError(f"role: {what} needs the {role.value} end, this is {self.role.value}")

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))

    def _fail(self, error: KvTransferError) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def _complete(self, start: Callable[[], Any], what: str) -> None:
        """Start one group operation and wait for it; any failure ends the link."""
        try:
            work = start()
            if self.transport is TransportKind.NCCL:
                # NCCL's wait() only orders streams; poll the CPU-side completion instead.
                deadline = self.clock() + self.transfer_timeout_s
                while not work.is_completed():
                    if self.clock() >= deadline:
                        raise RuntimeError(f"timed out after {self.transfer_timeout_s:g} s")
                    time.sleep(0.0002)
            else:
                work.wait(timedelta(seconds=self.transfer_timeout_s))
        except RuntimeError as exc:
            error = KvTransportUnavailableError(f"{what}: link {self._meta_key} failed ({exc})")
            self._fail(error)
            raise error from exc

    def _sweep(self) -> None:
        cutoff = self.clock() - self.ttl_s
        for rid in [r for r, (_, t) in self._inbox.items() if t < cutoff]:
            del self._inbox[rid]
        for rid in [r for r, t in self._discarded.items() if t < cutoff]:
            del self._discarded[rid]

    def _receive_loop(self) -> None:
        while not self._closing.is_set() and self._failure is None:
            try:
                item = self.client.blpop([self._meta_key], timeout=_POLL_S)
            except redis.RedisError:
                time.sleep(_POLL_S)  # no metadata can come either; the sender sees the error
                continue
            if item is None:
                with self._cond:
                    self._sweep()
                continue
            try:
                header, _ = decode_header(memoryview(cast(bytes, item[1])))
            except KvTransferError as exc:  # the body that follows cannot be sized
                self._fail(KvTransportUnavailableError(f"link {self._meta_key}: {exc}"))
                return
            try:
                body = torch.empty(header.body_nbytes, dtype=torch.uint8, device=self.device)
            except RuntimeError as exc:  # out of memory: the body can go nowhere
                self._fail(KvTransportUnavailableError(f"link {self._meta_key}: {exc}"))
                return
            try:
                self._complete(
                    partial(self._group.recv, [body], RANKS[LinkRole.PREFILL], _TAG),
                    f"receive {header.request_id!r}",
                )
            except KvTransportUnavailableError:
                return  # _complete recorded the failure for every receive()
            with self._cond:
                if self._discarded.pop(header.request_id, None) is None:
                    self._inbox[header.request_id] = (header.payload_from(body), self.clock())
                self._cond.notify_all()
