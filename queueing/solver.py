"""The capacity solver: the fewest prefill and decode workers that meet both SLOs.

Each pool is searched on its own (DESIGN §3.4): the prefill pool sets TTFT, the
decode pool TPOT. The decode pool's arrivals are the prefill pool's departures, which
a loaded prefill pool smooths (``CapacityModel.arrival_scv``), so the prefill pool is
sized first and the decode pool at the arrival SCV that pool passes on; the prefill
prediction does not depend on the decode pool (it applies no back-pressure). A count
is *feasible* when the pool is stable, its predicted P99 is at most the SLO divided
by (1 + headroom), and (decode) the P99 of its batch and reserved KV fit the worker.
Feasibility only improves as workers are added (property-tested), so the search
brackets the answer by galloping up from the smallest stable count and then bisects;
both loops are capped by ``max_workers``.

"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from queueing.budget import BudgetInfeasibleError, token_budget
from queueing.decode import DecodeModel
from queueing.lengths import LengthSamples
from queueing.pools import Pool
from queueing.prefill import PrefillModel
from queueing.profile import IterationProfile, exceeds_context

DEFAULT_QUANTILE = 0.99
DEFAULT_MAX_WORKERS = 100_000


class BindingConstraint(enum.Enum):
    """Why a pool cannot have one worker fewer."""

    MINIMUM = "minimum"  # one worker is enough
    STABILITY = "stability"  # one fewer cannot keep up with the load at all
    TTFT_SLO = "ttft_slo"
    TPOT_SLO = "tpot_slo"
    KV_CAPACITY = "kv_capacity"
    BATCH_LIMIT = "batch_limit"


class InfeasibleSLOError(ValueError):
    """No worker count can meet an SLO; names the SLO and the floor that blocks it."""

    def __init__(self, *, slo_name: str, target_s: float, floor_s: float, reason: str) -> None:
        super().__init__(
            f"{slo_name}: target {target_s:.4g} s (after headroom) cannot be met: {reason} "
            f"(floor {floor_s:.4g} s)"
        )
        self.slo_name = slo_name
        self.target_s = target_s
        self.floor_s = floor_s


@dataclass(frozen=True, kw_only=True)
class SloTargets:
    """P-quantile latency targets in seconds (P99 by default)."""

    ttft_p99_s: float
    tpot_p99_s: float
    quantile: float = DEFAULT_QUANTILE

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "tpot_p99_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if not (0.5 <= self.quantile < 1.0):
            raise ValueError(f"quantile: must be in [0.5, 1), got {self.quantile!r}")

    def of(self, pool: Pool) -> float:
        """The pool's target: TTFT for prefill, TPOT for decode."""
        return self.ttft_p99_s if pool is Pool.PREFILL else self.tpot_p99_s


@dataclass(frozen=True, kw_only=True)
class KvLink:
    """The prefill-to-decode link: handoff = latency + bytes / bandwidth."""

    bytes_per_s: float = 50e9  # a 400 Gb/s RDMA NIC
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"bytes_per_s: must be a finite number > 0, got {self.bytes_per_s!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s: must be a finite number >= 0, got {self.latency_s!r}")


@dataclass(frozen=True, kw_only=True, eq=False)
class CapacityModel:
    """Both pool models for one length mix, profile and TPOT SLO (which sets the budget).

    Requests longer than the profile's context are rejected before they reach a pool
    (``queueing.profile.exceeds_context``), so the models are built on the others;
    ``rejected_share`` is the share of the mix left out. Every ``arrival_rate_rps``
    the models and the solver take is the rate of the requests the pools serve, as
    the router counts demand (a rejected request is not counted); a caller holding
    the demand including too-long requests converts it with ``admitted_rate_rps``.
    """

    prefill: PrefillModel
    decode: DecodeModel
    token_budget: int
    profile: IterationProfile
    rejected_share: float = 0.0

    def admitted_rate_rps(self, demand_rps: float) -> float:
        """The rate the pools serve out of ``demand_rps`` requests per second of this
        mix, the too-long ones included: they are rejected and take no capacity."""
        return demand_rps * (1.0 - self.rejected_share)

    def arrival_scv(
        self, pool: Pool, *, prefill_workers: int, arrival_rate_rps: float, ca2: float
    ) -> float:
        """The SCV of the gaps between the arrivals ``pool`` sees, when requests arrive
        with gap SCV ``ca2`` at ``arrival_rate_rps`` and ``prefill_workers`` prefill
        them: the requests' own for the prefill pool, the prefill pool's departures'
        for the decode pool (``PrefillModel.departure_scv``)."""
        if pool is Pool.PREFILL:
            return ca2
        return self.prefill.departure_scv(
            workers=prefill_workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2
        )

    def of(self, pool: Pool) -> PrefillModel | DecodeModel:
        """The pool's model (both answer ``is_stable``, ``min_stable_workers`` and
        ``floor_quantile_s``)."""
        return self.prefill if pool is Pool.PREFILL else self.decode

    @classmethod
    def build(
        cls,
        samples: LengthSamples,
        profile: IterationProfile,
        *,
        tpot_slo_s: float,
        link: KvLink | None = None,
        block_size_tokens: int = 16,
    ) -> CapacityModel:
        """Raises ``InfeasibleSLOError`` when not even a minimal iteration fits the TPOT SLO."""
        link = link or KvLink()
        try:
            budget = token_budget(profile, tpot_slo_s=tpot_slo_s)
        except BudgetInfeasibleError as exc:
            raise InfeasibleSLOError(
                slo_name="tpot_p99_s",
                target_s=tpot_slo_s,
                floor_s=exc.floor_s,
                reason="one iteration of the smallest batch is already slower",
            ) from exc
        too_long = exceeds_context(
            samples.prompt_tokens, samples.output_tokens, profile.max_context_tokens
        )
        rejected_share = float(too_long.mean())
        if too_long.all():
            raise ValueError(
                f"max_context_tokens: every request of {samples.source} is longer than the "
                f"{profile.max_context_tokens}-token context of profile {profile.name}"
            )
        if too_long.any():
            samples = LengthSamples(
                prompt_tokens=samples.prompt_tokens[~too_long],
                output_tokens=samples.output_tokens[~too_long],
                source=samples.source,
            )
        longest = int((samples.prompt_tokens + samples.output_tokens).max())
        if longest > profile.kv_capacity_tokens:
            raise ValueError(
                f"kv_capacity_tokens: {profile.kv_capacity_tokens} of profile {profile.name} "
                f"cannot hold the longest request ({longest} tokens)"
            )
        return cls(
            prefill=PrefillModel.build(samples, profile, token_budget=budget),
            decode=DecodeModel.build(
                samples,
                profile,
                max_batch=budget,
                prefill_token_budget=budget,
                kv_link_bytes_per_s=link.bytes_per_s,
                kv_link_latency_s=link.latency_s,
                block_size_tokens=block_size_tokens,
            ),
            token_budget=budget,
            profile=profile,
            rejected_share=rejected_share,
        )


@dataclass(frozen=True, kw_only=True)
class PoolPrediction:
    """One pool at one size: its predicted P99 (None when unstable) and health."""

    workers: int
    p99_s: float | None
    utilisation: float
    meets_slo: bool


@dataclass(frozen=True, kw_only=True)
class SolveResult:
    prefill_workers: int
    decode_workers: int
    ttft_p99_s: float
    tpot_p99_s: float
    token_budget: int
    prefill_utilisation: float
    decode_mean_batch: float
    decode_kv_utilisation: float
    prefill_bound: BindingConstraint
    decode_bound: BindingConstraint
    feasible: bool = True

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["prefill_bound"] = self.prefill_bound.value
        data["decode_bound"] = self.decode_bound.value
        return data


def _prefill_check(
    model: CapacityModel, workers: int, rate: float, ca2: float, target_s: float, q: float
) -> BindingConstraint | None:
    """None when ``workers`` meets the TTFT target, else what stops it."""
    if not model.prefill.is_stable(workers=workers, arrival_rate_rps=rate):
        return BindingConstraint.STABILITY
    survival = model.prefill.ttft_survival(
        workers=workers, arrival_rate_rps=rate, ca2=ca2, ttft_s=target_s
    )
    return None if survival <= 1.0 - q else BindingConstraint.TTFT_SLO


def _decode_check(
    model: CapacityModel, workers: int, rate: float, ca2: float, target_s: float, q: float
) -> BindingConstraint | None:
    decode = model.decode
    if not decode.is_stable(workers=workers, arrival_rate_rps=rate):
        return BindingConstraint.STABILITY
    state = decode.load(workers=workers, arrival_rate_rps=rate, ca2=ca2, quantile=q)
    if state.kv_blocks_p99 > decode.kv_capacity_blocks:
        return BindingConstraint.KV_CAPACITY
    if state.batch_p99 > decode.max_batch:
        return BindingConstraint.BATCH_LIMIT
    survival = decode.tpot_survival(
        workers=workers, arrival_rate_rps=rate, ca2=ca2, tpot_s=target_s
    )
    return None if survival <= 1.0 - q else BindingConstraint.TPOT_SLO


def _smallest_feasible(
    check: Callable[[int], BindingConstraint | None], start: int, max_workers: int
) -> tuple[int, BindingConstraint] | None:
    """The smallest n >= start with check(n) None, and what blocked n - 1.

    The answer is usually a few workers above the stability bound ``start``, so the
    bracket grows by galloping (start + 1, + 2, + 4, ...) before bisecting.
    """
    if check(start) is None:
        blocked = check(start - 1) if start > 1 else None
        return start, blocked or BindingConstraint.MINIMUM
    lo, step = start, 1  # invariant: check(lo) fails
    while True:
        hi = min(max_workers, lo + step)
        if check(hi) is None:
            break
        if hi == max_workers:
            return None
        lo, step = hi, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid) is None:
            hi = mid
        else:
            lo = mid
    blocked = check(lo)
    assert blocked is not None
    return hi, blocked


# What sets each pool's latency floor, the P99 that unlimited workers still give.
_FLOOR_REASONS = {
    Pool.PREFILL: "the prefill of the longest prompts alone takes longer",
    Pool.DECODE: "a lone request's decode steps plus its KV handoff already take longer",
}


def _slo_name(pool: Pool) -> str:
    return "ttft_p99_s" if pool is Pool.PREFILL else "tpot_p99_s"


def _check_floor(model: CapacityModel, pool: Pool, target_s: float, q: float) -> None:
    floor_s = model.of(pool).floor_quantile_s(q)
    if floor_s > target_s:
        raise InfeasibleSLOError(
            slo_name=_slo_name(pool),
            target_s=target_s,
            floor_s=floor_s,
            reason=_FLOOR_REASONS[pool],
        )


def _smallest_decode(
    model: CapacityModel,
    rate: float,
    decode_ca2: float,
    target_s: float,
    q: float,
    max_workers: int,
) -> tuple[int, BindingConstraint]:
    """The fewest decode workers meeting ``target_s`` at the decode pool's own
    arrival SCV, and what blocks one fewer."""

    def decode_check(m: int) -> BindingConstraint | None:
        return _decode_check(model, m, rate, decode_ca2, target_s, q)

    return _search(
        model, Pool.DECODE, decode_check, rate, target_s=target_s, q=q, max_workers=max_workers
    )


def _search(
    model: CapacityModel,
    pool: Pool,
    check: Callable[[int], BindingConstraint | None],
    rate: float,
    *,
    target_s: float,
    q: float,
    max_workers: int,
) -> tuple[int, BindingConstraint]:
    """``_smallest_feasible`` from the pool's stability bound; ``InfeasibleSLOError``
    naming the pool's SLO when ``max_workers`` is not enough."""
    start = min(max_workers, model.of(pool).min_stable_workers(rate))
    found = _smallest_feasible(check, start, max_workers)
    if found is None:
        raise InfeasibleSLOError(
            slo_name=_slo_name(pool),
            target_s=target_s,
            floor_s=model.of(pool).floor_quantile_s(q),
            reason=f"more than max_workers={max_workers} {pool.value} workers would be needed",
        )
    return found


def solve_decode(
    model: CapacityModel,
    *,
    prefill_workers: int,
    arrival_rate_rps: float,
    ca2: float,
    slo: SloTargets,
    headroom: float = 0.1,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> tuple[int, BindingConstraint]:
    """The fewest decode workers meeting the TPOT SLO (with headroom) behind a given
    prefill pool, whose departures are the decode pool's arrivals, and what blocks
    one fewer. Raises ``InfeasibleSLOError`` as ``solve`` does for TPOT."""
    whole = isinstance(prefill_workers, int) and not isinstance(prefill_workers, bool)
    if not whole or prefill_workers < 1:
        raise ValueError(f"prefill_workers: must be an integer >= 1, got {prefill_workers!r}")
    _check_inputs(arrival_rate_rps, ca2, headroom)
    target_s = slo.tpot_p99_s / (1.0 + headroom)
    _check_floor(model, Pool.DECODE, target_s, slo.quantile)
    decode_ca2 = model.arrival_scv(
        Pool.DECODE, prefill_workers=prefill_workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2
    )
    return _smallest_decode(
        model, arrival_rate_rps, decode_ca2, target_s, slo.quantile, max_workers
    )


def _check_inputs(arrival_rate_rps: float, ca2: float, headroom: float) -> None:
    if not (math.isfinite(arrival_rate_rps) and arrival_rate_rps > 0):
        raise ValueError(f"arrival_rate_rps: must be a finite number > 0, got {arrival_rate_rps!r}")
    if not (math.isfinite(ca2) and ca2 >= 0):
        raise ValueError(f"ca2: must be a finite number >= 0, got {ca2!r}")
    if not (math.isfinite(headroom) and 0 <= headroom < 10):
        raise ValueError(f"headroom: must be in [0, 10), got {headroom!r}")


@dataclass(frozen=True, kw_only=True)
class PoolSizes:
    """The solver's worker counts and what blocks one fewer in each pool, without the
    predictions at them (``solve`` adds those)."""

    prefill_workers: int
    decode_workers: int
    prefill_bound: BindingConstraint
    decode_bound: BindingConstraint
    decode_arrival_scv: float  # the SCV the decode pool was sized at (behind the prefill)


def size_pools(
    model: CapacityModel,
    *,
    arrival_rate_rps: float,
    ca2: float,
    slo: SloTargets,
    headroom: float = 0.1,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> PoolSizes:
    """``solve``'s search alone: the smallest (prefill, decode) worker counts meeting
    both SLOs with headroom, the decode pool behind the prefill pool it finds. What a
    controller tick asks for (the P99s at the answer cost as much again as the
    search). Raises as ``solve`` does."""
    _check_inputs(arrival_rate_rps, ca2, headroom)
    q = slo.quantile
    ttft_target = slo.ttft_p99_s / (1.0 + headroom)
    tpot_target = slo.tpot_p99_s / (1.0 + headroom)
    _check_floor(model, Pool.PREFILL, ttft_target, q)
    _check_floor(model, Pool.DECODE, tpot_target, q)

    def prefill_check(n: int) -> BindingConstraint | None:
        return _prefill_check(model, n, arrival_rate_rps, ca2, ttft_target, q)

    n, prefill_bound = _search(
        model,
        Pool.PREFILL,
        prefill_check,
        arrival_rate_rps,
        target_s=ttft_target,
        q=q,
        max_workers=max_workers,
    )
    decode_ca2 = model.arrival_scv(
        Pool.DECODE, prefill_workers=n, arrival_rate_rps=arrival_rate_rps, ca2=ca2
    )
    m, decode_bound = _smallest_decode(
        model, arrival_rate_rps, decode_ca2, tpot_target, q, max_workers
    )
    return PoolSizes(
        prefill_workers=n,
        decode_workers=m,
        prefill_bound=prefill_bound,
        decode_bound=decode_bound,
        decode_arrival_scv=decode_ca2,
    )


def solve(
    model: CapacityModel,
    *,
    arrival_rate_rps: float,
    ca2: float,
    slo: SloTargets,
    headroom: float = 0.1,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> SolveResult:
    """The smallest (prefill, decode) worker counts meeting both SLOs with headroom
    (``size_pools``), with the predictions at them.

    Raises ``InfeasibleSLOError`` when an SLO is below what unlimited workers give,
    or when ``max_workers`` is not enough.
    """
    sizes = size_pools(
        model,
        arrival_rate_rps=arrival_rate_rps,
        ca2=ca2,
        slo=slo,
        headroom=headroom,
        max_workers=max_workers,
    )
    q = slo.quantile
    n, m = sizes.prefill_workers, sizes.decode_workers
    decode_ca2 = sizes.decode_arrival_scv
    state = model.decode.load(
        workers=m, arrival_rate_rps=arrival_rate_rps, ca2=decode_ca2, quantile=q
    )
    return SolveResult(
        prefill_workers=n,
        decode_workers=m,
        ttft_p99_s=model.prefill.ttft_quantile_s(
            workers=n, arrival_rate_rps=arrival_rate_rps, ca2=ca2, quantile=q
        ),
        tpot_p99_s=model.decode.tpot_quantile_s(
            workers=m, arrival_rate_rps=arrival_rate_rps, ca2=decode_ca2, quantile=q
        ),
        token_budget=model.token_budget,
        prefill_utilisation=model.prefill.utilisation(
            workers=n, arrival_rate_rps=arrival_rate_rps, ca2=ca2
        ),
        decode_mean_batch=state.mean_batch,
        decode_kv_utilisation=state.kv_utilisation,
        prefill_bound=sizes.prefill_bound,
        decode_bound=sizes.decode_bound,
    )


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """Predictions for a given allocation (what-if)."""

    prefill: PoolPrediction
    decode: PoolPrediction
    token_budget: int

    @property
    def feasible(self) -> bool:
        return self.prefill.meets_slo and self.decode.meets_slo

    def of(self, pool: Pool) -> PoolPrediction:
        return self.prefill if pool is Pool.PREFILL else self.decode


def predicted_quantile_s(
    model: CapacityModel,
    pool: Pool,
    *,
    workers: int,
    arrival_rate_rps: float,
    ca2: float,
    quantile: float = DEFAULT_QUANTILE,
) -> float | None:
    """The pool's predicted latency quantile at ``workers`` (TTFT for prefill, TPOT for
    decode), None where the pool cannot keep up; ``ca2`` as in ``evaluate_pool``. The
    prediction alone, without the SLO checks (what a controller publishes and
    calibrates against every tick)."""
    if not model.of(pool).is_stable(workers=workers, arrival_rate_rps=arrival_rate_rps):
        return None
    if pool is Pool.PREFILL:
        return model.prefill.ttft_quantile_s(
            workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2, quantile=quantile
        )
    return model.decode.tpot_quantile_s(
        workers=workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2, quantile=quantile
    )


def evaluate_pool(
    model: CapacityModel,
    pool: Pool,
    *,
    workers: int,
    arrival_rate_rps: float,
    ca2: float,
    target_s: float,
    quantile: float = DEFAULT_QUANTILE,
) -> PoolPrediction:
    """One pool's predicted P-quantile latency at ``workers`` against ``target_s`` (no
    headroom): TTFT for prefill, TPOT for decode. ``ca2`` is the SCV of the pool's own
    arrivals (``CapacityModel.arrival_scv``: for decode, what the prefill pool passes
    on), so the prediction needs nothing else of the other pool."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"{pool.value}_workers: must be an integer >= 1, got {workers!r}")
    rate, q = arrival_rate_rps, quantile
    if pool is Pool.PREFILL:
        ttft = predicted_quantile_s(
            model, pool, workers=workers, arrival_rate_rps=rate, ca2=ca2, quantile=q
        )
        return PoolPrediction(
            workers=workers,
            p99_s=ttft,
            utilisation=model.prefill.utilisation(workers=workers, arrival_rate_rps=rate, ca2=ca2),
            meets_slo=ttft is not None and ttft <= target_s,
        )
    decode_problem = _decode_check(model, workers, rate, ca2, target_s, q)
    tpot = predicted_quantile_s(
        model, pool, workers=workers, arrival_rate_rps=rate, ca2=ca2, quantile=q
    )
    decode_utilisation = (
        model.decode.load(workers=workers, arrival_rate_rps=rate, ca2=ca2, quantile=q).batch_p99
        / model.decode.max_batch
        if tpot is not None
        else math.inf
    )
    return PoolPrediction(
        workers=workers,
        p99_s=tpot,
        utilisation=decode_utilisation,
        meets_slo=decode_problem is None,
    )


def evaluate(
    model: CapacityModel,
    *,
    prefill_workers: int,
    decode_workers: int,
    arrival_rate_rps: float,
    ca2: float,
    slo: SloTargets,
) -> Evaluation:
    """Predicted P99s of a given allocation against the SLOs (no headroom)."""
    workers = {Pool.PREFILL: prefill_workers, Pool.DECODE: decode_workers}
    for pool, value in workers.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{pool.value}_workers: must be an integer >= 1, got {value!r}")
    prediction = {
        pool: evaluate_pool(
            model,
            pool,
            workers=n,
            arrival_rate_rps=arrival_rate_rps,
            ca2=model.arrival_scv(
                pool, prefill_workers=prefill_workers, arrival_rate_rps=arrival_rate_rps, ca2=ca2
            ),
            target_s=slo.of(pool),
            quantile=slo.quantile,
        )
        for pool, n in workers.items()
    }
    return Evaluation(
        prefill=prediction[Pool.PREFILL],
        decode=prediction[Pool.DECODE],
        token_budget=model.token_budget,
    )
