"""Whether a pool is in the steady state its capacity model describes.

The model predicts the P99 of a pool serving a stationary load with every worker
up. Two things break that, and the pipeline treats them apart: serving workers
falling behind the load (``overloaded``: plan for the measured rate) and any
transient at all (``transient``: do not learn the model's bias from this window).
"""

from __future__ import annotations

import math

from controller.observation import Observation, usable
from queueing.pools import Pool
from queueing.solver import CapacityModel


def overloaded(
    pool: Pool,
    observation: Observation,
    model: CapacityModel,
    predicted_p99_s: float | None,
    *,
    ca2: float = 1.0,
    window_s: float | None = None,
    z: float = 0.0,
) -> str | None:
    """Why the pool's serving workers are falling behind, or None.

    - the measured rate beyond what the serving workers can process (the queue grows
      without bound, which no stationary P99 describes), by more than the window's
      counting noise: a renewal process of gap SCV ``ca2`` counts over ``window_s``
      with a variance of about rate x window x ca2, so the rate must be beyond the
      capacity even ``z`` standard deviations below what was measured (a bursty
      window above the capacity by chance is ordinary traffic, not an overload; with
      ``window_s`` None the measured rate itself is judged);
    - (prefill) a backlog: the queue at the end of the window would take the serving
      workers longer to clear than the whole predicted P99 TTFT (``predicted_p99_s``,
      the last tick's), which a stationary queue shows less than 1 % of the time.
    """
    seen = observation.replicas(pool)
    rate = observation.arrival_rate_rps
    if seen.ready_replicas == 0 or rate is None or not usable(rate) or rate == 0:
        return None
    lower = rate
    if window_s is not None and window_s > 0:
        lower = rate - z * math.sqrt(rate * max(ca2, 1e-6) / window_s)
    if lower > 0 and not model.of(pool).is_stable(
        workers=seen.ready_replicas, arrival_rate_rps=lower
    ):
        return (
            f"{rate:.3g} req/s (at least {lower:.3g} within the counting noise) is beyond "
            f"the capacity of {seen.ready_replicas} serving workers"
        )
    queue = observation.prefill_queue_depth
    if pool is Pool.PREFILL and usable(queue) and queue is not None and predicted_p99_s is not None:
        drain_s = queue * model.prefill.packed_service_s / seen.ready_replicas
        if drain_s > predicted_p99_s:
            return (
                f"backlog of {queue:.0f} prompts takes {drain_s:.2f} s to clear "
                f"(> the predicted P99 {predicted_p99_s:.2f} s)"
            )
    return None


def transient(pool: Pool, observation: Observation, behind: str | None) -> str | None:
    """Why the pool is not in the steady state its model describes, or None.

    Workers still starting (the prediction counts them, but they served nothing)
    and serving workers falling behind (``behind``, from ``overloaded``) break it,
    and a P99 observed during them says nothing about the model's bias.
    """
    seen = observation.replicas(pool)
    if seen.ready_replicas < seen.current_replicas:
        starting = seen.current_replicas - seen.ready_replicas
        return f"{starting} of {seen.current_replicas} workers starting"
    return behind
