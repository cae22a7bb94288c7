"""A simulated decode worker, advanced in closed form between membership changes.

Stepping a decode worker one iteration at a time costs 10^5-10^6 Python steps per
simulated hour, so the simulator fast-forwards it instead. Between two membership
changes (a member finishing, a request admitted) the batch ``B`` is constant and
every member's context grows by one token per iteration, so the KV reads of the
iterations grow by exactly ``B`` each:

    reads_j = S + B * j                                  (j = 0, 1, ... in the epoch)
    T_j     = t0 + t_tok * B + t_kv * reads_j            (seconds, the profile's model)
    time of the k-th boundary = start + k * (t0 + t_tok * B)
                                + t_kv * (k * S + B * k * (k - 1) / 2)

which is what ``boundary_time_s`` computes. The worker therefore jumps straight to
the next boundary that matters. This is exactly what stepping
``workers.scheduler.Scheduler`` once per iteration gives (a test checks it token by
token): a member admitted with a prompt of ``P`` tokens reads ``P + 1`` entries in
its first iteration (its context including the token it decodes) and leaves after
its ``output_tokens - 1``-th iteration; KV blocks for ``P + output_tokens`` tokens
are reserved at admission, as the scheduler does.

Iteration counts are kept as exact integers: ``iteration`` counts every iteration
the worker has completed, and the reads of iteration ``n`` are
``kv_offset_sum + batch * n`` with ``kv_offset_sum = sum(P_i + 1 - n_i)`` over the
members (``n_i`` the iteration at which member ``i`` was admitted).
"""

from __future__ import annotations

import heapq
import math

from queueing.profile import IterationProfile
from workers.kv_cache import PagedKVCache


class DecodeWorker:
    """One decode worker's batch; the caller (the cluster) owns time and events.

    Admissions happen only at a boundary: the current one (``epoch_start_s``) when
    busy, or ``now_s`` when idle. ``advance(k)`` moves to the ``k``-th next boundary
    and returns the requests whose last token came out there.
    """

    def __init__(
        self,
        *,
        profile: IterationProfile,
        max_batch: int,
        kv_cache: PagedKVCache,
        record_token_times: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        self._t0_s = profile.t0_s
        self._t_tok_s = profile.t_tok_s
        self._t_kv_s = profile.t_kv_s
        self.max_batch = max_batch
        self.kv_cache = kv_cache
        # Heap of (finish_iteration, request, kv_offset): the member that leaves first on top.
        self._members: list[tuple[int, int, int]] = []
        self.batch = 0
        self._kv_offset_sum = 0
        self.iteration = 0
        self.epoch_start_s = 0.0
        # Bumped whenever a pending wake-up is replaced, so stale events are ignored.
        self.version = 0
        self.wake_iteration: int | None = None
        self.busy_s = 0.0
        self.batch_token_total = 0
        self.token_times_s: dict[int, list[float]] | None = {} if record_token_times else None

    # -- admission -------------------------------------------------------------------

    def has_room(self, *, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether a request fits now: a batch slot, and KV for prompt + output tokens."""
        if self.batch >= self.max_batch:
            return False
        needed = self.kv_cache.blocks_needed(prompt_tokens + output_tokens)
        return needed <= self.kv_cache.num_free_blocks

    def admit(self, request: int, *, prompt_tokens: int, output_tokens: int, now_s: float) -> None:
        """Add a request (its first token already made) at the current boundary.

        ``output_tokens`` must be >= 2 (it then needs ``output_tokens - 1`` iterations).
        Raises ``RuntimeError`` if it does not fit (check ``has_room`` first).
        """
        if output_tokens < 2:
            raise ValueError(f"output_tokens: a decode needs >= 2, got {output_tokens}")
        if self.batch >= self.max_batch or (
            self.kv_cache.allocate(request, prompt_tokens + output_tokens) is None
        ):
            raise RuntimeError(f"request {request}: admitted to a decode worker without room")
        if self.batch == 0:
            self.epoch_start_s = now_s
        offset = prompt_tokens + 1 - self.iteration
        heapq.heappush(self._members, (self.iteration + output_tokens - 1, request, offset))
        self.batch += 1
        self._kv_offset_sum += offset
        if self.token_times_s is not None:
            self.token_times_s[request] = []

    # -- time --------------------------------------------------------------------------

    def boundary_time_s(self, k: int) -> float:
        """Time of the ``k``-th boundary after the current one (``k = 0`` is now)."""
        b = self.batch
        first_reads = self._kv_offset_sum + b * self.iteration
        return self.epoch_start_s + (
            k * (self._t0_s + self._t_tok_s * b)
            + self._t_kv_s * (k * first_reads + b * (k * (k - 1) // 2))
        )

    def first_boundary_at_or_after(self, time_s: float) -> int:
        """Smallest ``k >= 0`` with ``boundary_time_s(k) >= time_s`` (batch must be > 0)."""
        if self.batch == 0:
            raise RuntimeError("first_boundary_at_or_after: an idle worker has no boundaries")
        span_s = time_s - self.epoch_start_s
        if span_s <= 0:
            return 0
        # boundary_time_s(k) - start = q k^2 + l k, with q >= 0 and l > 0: solve the
        # quadratic (in the cancellation-free form), then settle on the exact integer.
        b = self.batch
        q = self._t_kv_s * b / 2
        lin = (
            self._t0_s
            + self._t_tok_s * b
            + self._t_kv_s * (self._kv_offset_sum + b * self.iteration)
            - q
        )
        k = math.ceil(2 * span_s / (lin + math.sqrt(lin * lin + 4 * q * span_s)))
        while self.boundary_time_s(k) < time_s:
            k += 1
        while k > 0 and self.boundary_time_s(k - 1) >= time_s:
            k -= 1
        return k

    def next_finish_k(self) -> int:
        """Iterations until the next member leaves (batch must be > 0)."""
        return self._members[0][0] - self.iteration

    def plan_wake(self, k: int) -> tuple[float, int]:
        """Make boundary ``k`` the pending wake-up; returns (its time, the new version)."""
        self.version += 1
        self.wake_iteration = self.iteration + k
        return self.boundary_time_s(k), self.version

    def clear_wake(self) -> None:
        self.version += 1
        self.wake_iteration = None

    def advance(self, k: int) -> list[int]:
        """Run ``k`` iterations (no member may finish before the last); returns who finished.

        Finished members leave the batch and their KV blocks are freed; the new epoch
        starts at the boundary reached.
        """
        if self.batch == 0:
            if k:
                raise RuntimeError("advance: an idle worker runs no iterations")
            return []
        if not 0 <= k <= self.next_finish_k():
            raise ValueError(f"k: must be in [0, {self.next_finish_k()}], got {k}")
        end_s = self.boundary_time_s(k)
        if self.token_times_s is not None:
            times = [self.boundary_time_s(j) for j in range(1, k + 1)]
            for _, request, _ in self._members:
                self.token_times_s[request].extend(times)
        self.busy_s += end_s - self.epoch_start_s
        self.batch_token_total += self.batch * k
        self.iteration += k
        self.epoch_start_s = end_s
        finished: list[int] = []
        members = self._members
        while members and members[0][0] == self.iteration:
            _, request, offset = heapq.heappop(members)
            self.batch -= 1
            self._kv_offset_sum -= offset
            self.kv_cache.free(request)
            finished.append(request)
        return finished
