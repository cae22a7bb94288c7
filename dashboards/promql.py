"""PromQL shared by the dashboard and the rules.

The builders take label matchers and windows as text, so the dashboard passes its
template variables (``namespace=~"$namespace"``, ``$__rate_interval``) and the rules
pass literals (``5m``).

The SLO attainment SLI counts a request as good when its latency is at most the SLO:
the rate of the histogram bucket whose upper bound ``le`` *equals* the SLO, divided by
the rate of all observations. That is exact only when the SLO is a bucket bound, so
``bucket_bound`` refuses any other value, and it writes the bound the way the router's
client library writes ``le`` (``2.0``, ``0.1``): a label matcher compares text, and
``le="2"`` would match nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from workers.router_metrics import TPOT_BUCKETS_S, TTFT_BUCKETS_S, Outcome

TTFT_METRIC = "sara_ttft_seconds"
TPOT_METRIC = "sara_tpot_seconds"
OUTCOMES_METRIC = "sara_request_outcomes_total"

# Outcomes that count against the service (the pools did not serve a valid request).
# ``invalid`` is the client's fault and leaves the denominator too; ``cancelled``
# (the client went away) stays in the denominator only.
FAILED_OUTCOMES: tuple[str, ...] = tuple(
    o.value for o in (Outcome.REJECTED, Outcome.UNAVAILABLE, Outcome.TIMEOUT, Outcome.ERROR)
)
EXCLUDED_OUTCOMES: tuple[str, ...] = (Outcome.INVALID.value,)


def selector(matchers: Sequence[str]) -> str:
    """``{a, b}`` for the matchers, or nothing when there are none."""
    return "{" + ", ".join(matchers) + "}" if matchers else ""


def aggregate(op: str, inner: str, by: Sequence[str] = ()) -> str:
    """``op by (labels) (inner)``, or ``op(inner)`` without grouping labels."""
    return f"{op} by ({', '.join(by)}) ({inner})" if by else f"{op}({inner})"


def rate(metric: str, matchers: Sequence[str], window: str) -> str:
    return f"rate({metric}{selector(matchers)}[{window}])"


def histogram_p99(
    metric: str, *, matchers: Sequence[str], window: str, by: Sequence[str] = ()
) -> str:
    """P99 of a classic histogram over ``window``, per ``by`` group (seconds for ours)."""
    buckets = aggregate("sum", rate(f"{metric}_bucket", matchers, window), (*by, "le"))
    return f"histogram_quantile(0.99, {buckets})"


def histogram_mean(
    metric: str, *, matchers: Sequence[str], window: str, by: Sequence[str] = ()
) -> str:
    """Mean observation of a histogram over ``window`` (sum / count), per ``by`` group."""
    total = aggregate("sum", rate(f"{metric}_sum", matchers, window), by)
    count = aggregate("sum", rate(f"{metric}_count", matchers, window), by)
    return f"{total} / {count}"


def _ratio(numerator: str, denominator: str, split: bool) -> str:
    """``a / b``, or on three lines when ``split`` (for the rule file)."""
    return f"{numerator}\n/\n{denominator}" if split else f"{numerator} / {denominator}"


def attainment(
    metric: str,
    *,
    le: str,
    matchers: Sequence[str],
    window: str,
    by: Sequence[str] = (),
    split: bool = False,
) -> str:
    """Fraction (0..1) of observations at most ``le`` over ``window``; NaN without any.

    ``le`` is the bucket label text (see ``bucket_bound``) or a template variable;
    ``split`` puts numerator and denominator on lines of their own.
    """
    good = aggregate("sum", rate(f"{metric}_bucket", [*matchers, f'le="{le}"'], window), by)
    total = aggregate("sum", rate(f"{metric}_count", matchers, window), by)
    return _ratio(good, total, split)


def error_ratio(
    *, matchers: Sequence[str], window: str, by: Sequence[str] = (), split: bool = False
) -> str:
    """Fraction of valid requests that ended in a failure (``FAILED_OUTCOMES``)."""
    failed = f'outcome=~"{"|".join(FAILED_OUTCOMES)}"'
    counted = f'outcome!~"{"|".join(EXCLUDED_OUTCOMES)}"'
    bad = aggregate("sum", rate(OUTCOMES_METRIC, [*matchers, failed], window), by)
    total = aggregate("sum", rate(OUTCOMES_METRIC, [*matchers, counted], window), by)
    return _ratio(bad, total, split)


def burn_rate(attainment_expr: str, *, objective: str) -> str:
    """How fast the error budget burns: bad fraction / allowed bad fraction (1 = on budget)."""
    return f"(1 - ({attainment_expr})) / (1 - {objective})"


def le_text(bound: float) -> str:
    """A finite bucket bound as the router's client library writes ``le`` (``2.0``, ``0.1``).

    That is Python's shortest round-trip repr for the bounds the router uses
    (0.5 ms to 300 s); tests/dashboards check it against the router's own exposition.
    """
    return repr(float(bound))


def bucket_bound(value_s: float, buckets: Sequence[float], *, name: str) -> str:
    """The ``le`` label text of the bucket whose upper bound is ``value_s``.

    Raises ``ValueError`` naming ``name`` when ``value_s`` is not one of ``buckets``:
    the attainment SLI would then silently count against a different threshold.
    """
    for bound in buckets:
        if math.isclose(value_s, bound, rel_tol=1e-9):
            return le_text(bound)
    choices = ", ".join(le_text(b) for b in buckets)
    raise ValueError(f"{name}: {value_s!r} s is not a histogram bucket bound; use one of {choices}")


def ttft_bound(slo_s: float) -> str:
    """``le`` text of a TTFT SLO (one of the router's ``TTFT_BUCKETS_S``)."""
    return bucket_bound(slo_s, TTFT_BUCKETS_S, name="ttft_slo_s")


def tpot_bound(slo_s: float) -> str:
    """``le`` text of a TPOT SLO (one of the router's ``TPOT_BUCKETS_S``)."""
    return bucket_bound(slo_s, TPOT_BUCKETS_S, name="tpot_slo_s")


def bounds_between(buckets: Sequence[float], low: float, high: float) -> tuple[str, ...]:
    """The ``le`` texts of the bucket bounds in ``[low, high]``, ascending."""
    return tuple(le_text(b) for b in buckets if low <= b <= high)
