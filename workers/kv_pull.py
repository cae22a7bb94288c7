"""KV over ``torch.distributed`` links between worker processes: the decode side pulls.

The Redis transport stores a hand-off's KV where any decode worker can take it, so the
decode pool stays one shared queue. A point-to-point link (NCCL between GPUs, gloo on
CPU) needs both ends to be known before the bytes move; to keep the shared queue, the
*decode* worker that takes a hand-off names the end:

- the prefill worker parks the exported KV in memory (``KvPullServer.send``: returns
  at once) and hands the request off as usual, naming itself in ``prefill_worker``;
- the decode worker that takes the hand-off asks that prefill worker for it
  (``KvPullClient.receive_from``): an entry on the prefill worker's pull list in Redis,
  then the link ``{prefill}--{decode}`` (set up once, rendezvous through Redis, then
  reused) carries the payload;
- the prefill worker's server thread answers pulls in order; parked KV that nobody
  pulls within ``ttl_s`` is dropped.

Failures: a prefill worker that died (not in the registry), a link that breaks, or a
pull that is not answered in time raise ``KvTransferError`` on the decode side — not
the retryable "Redis is down" error — so the decode worker recomputes the KV (see
``workers.decode_worker``). A draining prefill worker keeps answering pulls until
nothing is parked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

import redis
import torch

from queueing.pools import Pool
from workers.protocol import KeySpace
from workers.registry import Registry
from workers.transfer import (
    KvPayload,
    KvTransferError,
    KvTransportUnavailableError,
    TransferReceipt,
)
from workers.transfer_nccl import LinkRole, TorchDistributedKvTransport, backend_for

logger = logging.getLogger(__name__)

_POLL_S = 0.5
Transferred = Callable[[int, float], None]  # (nbytes, seconds) of one transfer


def link_id(prefill_worker: str, decode_worker: str) -> str:
    return f"{prefill_worker}--{decode_worker}"


def pull_key(keys: KeySpace, prefill_worker: str) -> str:
    return f"{keys.prefix}:kv:pull:{prefill_worker}"


def _open_link(
    client: redis.Redis,
    keys: KeySpace,
    link: str,
    role: LinkRole,
    device: torch.device,
    host: str,
    rendezvous_timeout_s: float,
) -> TorchDistributedKvTransport:
    return TorchDistributedKvTransport.connect(
        client,
        link_id=link,
        role=role,
        device=device,
        host=host,
        key_prefix=f"{keys.prefix}:kv",
        rendezvous_timeout_s=rendezvous_timeout_s,
    )


class KvPullServer:
    """The prefill side: parks payloads, sends each when its decode worker asks."""

    deferred = True  # send() only parks: the transfer, and its metrics, come later

    def __init__(
        self,
        client: redis.Redis,
        *,
        worker_id: str,
        keys: KeySpace,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        ttl_s: float = 60.0,
        rendezvous_timeout_s: float = 10.0,
        on_transfer: Transferred | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.keys = keys
        self.device = torch.device(device)
        self.transport = backend_for(self.device)
        self.host = host
        self.ttl_s = ttl_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.on_transfer = on_transfer
        self.clock = clock
        self._parked: dict[str, tuple[KvPayload, float]] = {}
        self._links: dict[str, TorchDistributedKvTransport] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sara-kv-pull", daemon=True)

    def start(self) -> KvPullServer:
        self._thread.start()
        return self

    @property
    def pending(self) -> int:
        """Payloads parked and not yet pulled (nor expired)."""
        with self._lock:
            self._sweep()
            return len(self._parked)

    def send(self, payload: KvPayload) -> TransferReceipt:
        with self._lock:
            self._parked[payload.request_id] = (payload.to(self.device), self.clock())
        return TransferReceipt(
            request_id=payload.request_id,
            transport=self.transport,
            nbytes=payload.nbytes,
            num_chunks=0,
            duration_s=0.0,
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.rendezvous_timeout_s + 2 * _POLL_S)
        for link in self._links.values():
            link.close()
        self._links.clear()

    def _sweep(self) -> None:
        cutoff = self.clock() - self.ttl_s
        for rid in [r for r, (_, t) in self._parked.items() if t < cutoff]:
            del self._parked[rid]

    def _serve(self) -> None:
        key = pull_key(self.keys, self.worker_id)
        while not self._stop.is_set():
            try:
                item = self.client.blpop([key], timeout=_POLL_S)
            except redis.RedisError:
                time.sleep(_POLL_S)
                continue
            if item is None:
                continue
            try:
                ask = json.loads(item[1])
                self._answer(str(ask["link_id"]), str(ask["request_id"]))
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("malformed KV pull %r: %s", item[1], exc)

    def _answer(self, link: str, request_id: str) -> None:
        with self._lock:
            self._sweep()
            entry = self._parked.pop(request_id, None)
        if entry is None:  # expired, or pulled already: the decode side times out, recomputes
            logger.warning("KV pull for %s: nothing parked", request_id)
            return
        try:
            transport = self._links.get(link)
            if transport is None:
                transport = _open_link(
                    self.client, self.keys, link, LinkRole.PREFILL, self.device, self.host,
                    self.rendezvous_timeout_s,
                )  # fmt: skip
                self._links[link] = transport
            receipt = transport.send(entry[0])
        except KvTransferError as exc:
            logger.warning("KV link %s failed: %s", link, exc)
            stale = self._links.pop(link, None)
            if stale is not None:
                stale.close()
            return
        if self.on_transfer is not None:
            self.on_transfer(receipt.nbytes, receipt.duration_s)


class KvPullClient:
    """The decode side: asks the hand-off's prefill worker for its KV, over a link."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        worker_id: str,
        keys: KeySpace,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        rendezvous_timeout_s: float = 10.0,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.keys = keys
        self.device = torch.device(device)
        self.transport = backend_for(self.device)
        self.host = host
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self._registry = Registry(client, keys)
        self._links: dict[str, TorchDistributedKvTransport] = {}

    def receive_from(self, prefill_worker: str, request_id: str, *, timeout_s: float) -> KvPayload:
        """The KV the prefill worker parked for ``request_id``; ``KvTransferError`` when it
        cannot come (the worker is gone, the link broke, no answer within ``timeout_s``)."""
        live = {w.worker_id for w in self._registry.live(Pool.PREFILL)}
        if prefill_worker not in live:
            raise KvTransferError(f"prefill worker {prefill_worker} is gone with the KV")
        link = link_id(prefill_worker, self.worker_id)
        ask = json.dumps({"link_id": link, "request_id": request_id})
        key = pull_key(self.keys, prefill_worker)
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(key, ask)
        pipe.expire(key, 600)
        pipe.execute()
        try:
            transport = self._links.get(link)
            if transport is None:
                transport = _open_link(
                    self.client, self.keys, link, LinkRole.DECODE, self.device, self.host,
                    min(timeout_s, self.rendezvous_timeout_s),
                )  # fmt: skip
                self._links[link] = transport
            return transport.receive(request_id, timeout_s=timeout_s)
        except KvTransportUnavailableError as exc:
            # The link, not Redis: the peer died or the group failed. Retrying would not
            # help; the caller recomputes.
            stale = self._links.pop(link, None)
            if stale is not None:
                stale.close()
            raise KvTransferError(str(exc)) from exc

    def close(self) -> None:
        for link in self._links.values():
            with contextlib.suppress(KvTransferError):
                link.close()
        self._links.clear()
