"""The Sarathi token budget from the TPOT SLO."""

from __future__ import annotations

import pytest

from queueing.budget import BudgetInfeasibleError, token_budget
from queueing.profile import IterationProfile, attention_pairs


def iteration(profile: IterationProfile, n: int, batch: int, ctx: float) -> float:
    return (
        profile.t0_s
        + profile.t_tok_s * n
        + profile.t_kv_s * batch * ctx
        + profile.t_attn_s * attention_pairs(n - batch, 0)
    )


@pytest.mark.parametrize(
    ("slo_s", "batch", "ctx"),
    [(0.02, 0, 0.0), (0.05, 0, 0.0), (0.05, 64, 1500.0), (0.1, 200, 3000.0)],
)
def test_the_budget_fits_the_slo_and_one_granule_more_does_not(
    profile: IterationProfile, slo_s: float, batch: int, ctx: float
) -> None:
    tau = token_budget(
        profile,
        tpot_slo_s=slo_s,
        decode_batch=batch,
        mean_context_tokens=ctx,
        max_budget_tokens=1 << 20,
    )
    assert tau % 16 == 0
    assert iteration(profile, tau, batch, ctx) <= slo_s
    assert iteration(profile, tau + 16, batch, ctx) > slo_s


def test_a_generous_slo_gets_the_maximum_budget(profile: IterationProfile) -> None:
    assert token_budget(profile, tpot_slo_s=10.0, max_budget_tokens=4096) == 4096


def test_an_slo_below_the_weight_read_floor_is_infeasible(profile: IterationProfile) -> None:
    with pytest.raises(BudgetInfeasibleError, match="tpot_p99_s"):
        token_budget(profile, tpot_slo_s=profile.t0_s * 0.9)
