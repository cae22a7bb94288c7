"""The solver's answer at each pool's planning rate, with headroom and calibration."""

from __future__ import annotations

from controller.config import ControllerConfig
from controller.policy.vocabulary import Reason, ReasonEntry, Stage
from queueing.pools import PerPool
from queueing.solver import CapacityModel, InfeasibleSLOError, SloTargets, size_pools

# An infeasible SLO is planned for at this multiple of the floor that blocks it.
ABOVE_FLOOR = 1.2


def recommend(
    model: CapacityModel,
    rates_rps: PerPool[float],
    ca2: float,
    config: ControllerConfig,
    factors: PerPool[float],
) -> tuple[PerPool[int], SloTargets, ReasonEntry]:
    """The solver's answer at each pool's planning rate (the pools' lead times
    differ, so may their rates), the (calibrated, possibly relaxed) SLO it aimed at —
    the safety stage judges scale-downs against the same targets — and the reason."""
    if rates_rps.prefill == rates_rps.decode:
        return _recommend(model, rates_rps.prefill, ca2, config, factors)
    both = PerPool.build(lambda pool: _recommend(model, rates_rps[pool], ca2, config, factors))
    workers = PerPool(prefill=both.prefill[0].prefill, decode=both.decode[0].decode)
    aimed = SloTargets(
        ttft_p99_s=both.prefill[1].ttft_p99_s,
        tpot_p99_s=both.decode[1].tpot_p99_s,
        quantile=both.prefill[1].quantile,
    )
    first, second = both.prefill[2], both.decode[2]
    reason = (
        Reason.SLO_INFEASIBLE
        if Reason.SLO_INFEASIBLE in (first.reason, second.reason)
        else Reason.RECOMMENDED
    )
    return (
        workers,
        aimed,
        ReasonEntry(
            stage=Stage.RECOMMEND,
            reason=reason,
            pool=None,
            detail=f"prefill at {rates_rps.prefill:.3g} req/s: {first.detail}; "
            f"decode at {rates_rps.decode:.3g} req/s: {second.detail}",
        ),
    )


def _recommend(
    model: CapacityModel,
    rate_rps: float,
    ca2: float,
    config: ControllerConfig,
    factors: PerPool[float],
) -> tuple[PerPool[int], SloTargets, ReasonEntry]:
    """The solver's answer for both pools at one rate."""
    slo = SloTargets(
        ttft_p99_s=config.slo.ttft_p99_s / factors.prefill,
        tpot_p99_s=config.slo.tpot_p99_s / factors.decode,
    )
    if rate_rps <= 0:
        return (
            PerPool(prefill=config.prefill.min_replicas, decode=config.decode.min_replicas),
            slo,
            ReasonEntry(
                stage=Stage.RECOMMEND,
                reason=Reason.RECOMMENDED,
                pool=None,
                detail="no traffic: the minimum of each pool",
            ),
        )
    try:
        result = size_pools(
            model, arrival_rate_rps=rate_rps, ca2=ca2, slo=slo, headroom=config.headroom
        )
    except InfeasibleSLOError as exc:
        # Best effort: plan for just above the floor that blocks the SLO, which still
        # sizes the pools for stability and KV room, and say so. The solver divides
        # its target by (1 + headroom), so the relaxed target carries that factor: the
        # solver then aims at 1.2 x the floor whatever the headroom (without it, a
        # headroom above 20 % would put the aim below the floor again, and the plan
        # would fall through to the maximum).
        above_floor = ABOVE_FLOOR * (1.0 + config.headroom)
        relaxed = SloTargets(
            ttft_p99_s=max(slo.ttft_p99_s, model.prefill.floor_quantile_s(0.99) * above_floor),
            tpot_p99_s=max(slo.tpot_p99_s, model.decode.floor_quantile_s(0.99) * above_floor),
        )
        try:
            result = size_pools(
                model, arrival_rate_rps=rate_rps, ca2=ca2, slo=relaxed, headroom=config.headroom
            )
        except InfeasibleSLOError:
            return (
                PerPool(prefill=config.prefill.max_replicas, decode=config.decode.max_replicas),
                relaxed,
                ReasonEntry(
                    stage=Stage.RECOMMEND,
                    reason=Reason.SLO_INFEASIBLE,
                    pool=None,
                    detail=f"{exc}; planning for the maximum",
                ),
            )
        return (
            PerPool(prefill=result.prefill_workers, decode=result.decode_workers),
            relaxed,
            ReasonEntry(
                stage=Stage.RECOMMEND,
                reason=Reason.SLO_INFEASIBLE,
                pool=None,
                detail=f"{exc}; planning for {ABOVE_FLOOR:g} x the floor instead",
            ),
        )
    return (
        PerPool(prefill=result.prefill_workers, decode=result.decode_workers),
        slo,
        ReasonEntry(
            stage=Stage.RECOMMEND,
            reason=Reason.RECOMMENDED,
            pool=None,
            detail=f"{result.prefill_workers} prefill ({result.prefill_bound.value}), "
            f"{result.decode_workers} decode ({result.decode_bound.value}) at {rate_rps:.3g} req/s",
        ),
    )
