"""How often every prefill worker is busy, when queued prompts are admitted early.

A worker of a chunked-prefill pool takes queued prompts at any iteration boundary
whose running work leaves budget over (``workers/scheduler.py``): at the end of
its prompt, at the start of a multi-chunk prompt's last chunk, and it takes as
many as fit. So a prompt that finds every worker busy is not kept in a shared queue
until a worker frees, as in an M/G/N queue: it is *absorbed* by the first busy
worker that reaches such a boundary, beside or behind that worker's own work. Two
things follow, and both are measured in the simulator
(``bench/model_fidelity.py --random --probe-wait``, docs/model.md, prefill step 3):

* **The queue's excursions are short.** A queue that forms while every worker is
  busy empties at the next boundary with budget to spare, which admits the head and
  every further prompt whose tokens fit in what is left: a bulk-service queue
  (``excursion_ratio``), not the one-by-one drain of a token stream;
* **Absorbed prompts keep only their own worker busy.** A worker that absorbed a
  prompt beside its own cannot go idle until both are done, but the others can:
  the pool leaves the all-busy state when any worker that holds one prompt
  finishes. The prompts an excursion leaves beyond its head ride beside the head,
  on the one worker whose boundary took them (``excursion_extras``). The chain of
  ``all_busy_probability`` counts busy workers and the workers so loaded.

These are numerical, not closed forms; both are small (at most the pool's size
squared states, solved once per pool state and kept by the caller).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
from scipy import linalg as linalg_dense
from scipy import optimize

from queueing.erlang import erlang_b

FloatArray = npt.NDArray[np.float64]

# The admitted count's law is kept up to this many prompts per boundary (the rest
# lumped there): beyond it r**K is negligible for the excursion's root.
MAX_ADMITTED = 64
# Tokens are binned on a grid of this many cells per budget to add lengths up.
_GRID_CELLS = 512
# Busy-worker levels are kept down to where Erlang's mass is e^-28 (7e-13) of the
# largest.
_LEVELS_SPAN = 28.0


def admitted_pmf(
    prompt_tokens: FloatArray, token_budget: int, *, room_tokens: FloatArray
) -> FloatArray:
    """The law of K, the prompts a boundary admits from a long queue: the head
    always (a prompt longer than the room is split, its first chunk taking the
    rest), then each next prompt while the tokens before it leave room:
    P(K >= k + 1) = P(L_1 + ... + L_k < R) for queued lengths L_i drawn from the mix
    and R the boundary's room, drawn from ``room_tokens`` (equally weighted).
    Index k of the result is P(K = k); K >= ``MAX_ADMITTED`` is lumped at the end.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget: must be >= 1, got {token_budget!r}")
    lengths = np.asarray(prompt_tokens, dtype=np.float64)
    rooms = np.asarray(room_tokens, dtype=np.float64)
    if lengths.size == 0 or rooms.size == 0:
        raise ValueError("prompt_tokens and room_tokens: must not be empty")
    cell = token_budget / _GRID_CELLS
    # Lengths at or beyond the budget never leave room for another prompt: their
    # mass drops out of the partial sums (it is kept as 1 - the sums' total).
    bins = np.floor(lengths / cell).astype(np.int64)
    one = np.bincount(bins[bins < _GRID_CELLS], minlength=_GRID_CELLS) / lengths.size
    room_bins = np.minimum(np.floor(rooms / cell).astype(np.int64), _GRID_CELLS)
    room_law = np.bincount(room_bins, minlength=_GRID_CELLS + 1) / rooms.size
    # P(S < R) = sum over the room's cells of P(S in a cell below it).
    room_above = np.cumsum(room_law[::-1])[::-1][1:]  # P(R cell > j), j = 0..cells-1
    at_least = np.ones(MAX_ADMITTED + 1)  # P(K >= k)
    partial = one.copy()
    for k in range(1, MAX_ADMITTED):
        at_least[k + 1] = float(partial @ room_above)
        if at_least[k + 1] < 1e-12:
            at_least[k + 2 :] = 0.0
            break
        partial = np.convolve(partial, one)[:_GRID_CELLS]
    pmf = np.zeros(MAX_ADMITTED + 1)
    pmf[1:MAX_ADMITTED] = at_least[1:MAX_ADMITTED] - at_least[2 : MAX_ADMITTED + 1]
    pmf[MAX_ADMITTED] = at_least[MAX_ADMITTED]
    return pmf


def excursion_ratio(
    *, arrival_rate_rps: float, boundary_rate_per_s: float, admitted: FloatArray
) -> float:
    """X = P(every worker busy, prompts queued) / P(every worker busy, none queued).

    While every worker is busy, prompts arrive at rate lambda and boundaries with
    budget to spare come at rate beta; each admits min(q, K) of the q queued, K of
    law ``admitted``. The queue length is then geometric, P(q = j) ~ r^j, with r the
    root in (0, 1) of (lambda + beta) r = lambda + beta r E[r^K] (substitute r^j into
    the balance of state j), and X = r / (1 - r). K = 1 gives M/M/1's lambda / (beta -
    lambda); K unbounded (every boundary empties the queue) gives lambda / beta.
    Infinite when beta E[K] <= lambda (no root below 1).
    """
    lam, beta = arrival_rate_rps, boundary_rate_per_s
    if lam <= 0.0:
        return 0.0
    if beta <= 0.0:
        raise ValueError(f"boundary_rate_per_s: must be > 0, got {beta!r}")
    ks = np.arange(admitted.size, dtype=np.float64)
    if beta * float(admitted @ ks) <= lam:
        return math.inf

    def balance(r: float) -> float:
        return (lam + beta) * r - lam - beta * r * float(admitted @ r**ks)

    # balance(0) = -lambda < 0 and balance(1) = 0 with a negative slope there (the
    # stability above), so it is positive just below 1 and the root is inside.
    hi = 1.0 - 1e-12
    while balance(hi) <= 0.0:
        hi = 1.0 - (1.0 - hi) * 1e3
        if hi <= 0.0:
            return math.inf
    r = float(optimize.brentq(balance, 0.0, hi, xtol=1e-14))
    return r / (1.0 - r)


def excursion_extras(*, excursion: float, admitted: FloatArray) -> tuple[float, float]:
    """What one excursion leaves beside the prompt that ends it: (the chance that it
    leaves any extras, their mean number when it does).

    An excursion starts with the prompt that finds every worker busy and no queue;
    the prompts that arrive before a boundary takes it, J of them, queue behind it.
    The boundary that ends it is a finished prompt's: the head takes that prompt's
    place and the prompts behind it ride beside the head in the same iteration, as
    many as the boundary's room admits, K - 1 (``admitted``). So the extras are
    min(J, K - 1), all on one worker. J is geometric with the queue's ratio
    r = X / (1 + X) (``excursion_ratio``: P(J >= j) = r^j, exact when a boundary
    admits everything, where r = lambda / (lambda + beta)), so
    P(extras >= 1) = r P(K >= 2) and E[extras] = sum_j r^j P(K >= j + 1).
    (0, 1) when no boundary admits more than the head."""
    if not excursion >= 0.0:
        raise ValueError(f"excursion: must be >= 0, got {excursion!r}")
    ratio = 1.0 if math.isinf(excursion) else excursion / (1.0 + excursion)
    at_least = np.cumsum(admitted[::-1])[::-1]  # P(K >= k), k = 0..MAX_ADMITTED
    behind = np.arange(1, at_least.size - 1)
    mean = float(np.sum(ratio**behind * at_least[behind + 1]))
    some = ratio * float(at_least[2]) if at_least.size > 2 else 0.0
    if some <= 0.0 or mean <= 0.0:
        return 0.0, 1.0
    return some, mean / some


def all_busy_probability(
    *,
    workers: int,
    arrival_rate_rps: float,
    solo_s: float,
    packed_s: float,
    absorbed_s: float,
    excursion: float,
    extra_share: float,
) -> float:
    """P(every worker busy) of a pool that absorbs queued prompts at boundaries.

    States (b, e): b busy workers, e of them loaded with extras absorbed beside their
    own prompt. An arrival with an idle worker starts on it (b + 1); one that finds
    every worker busy and no queue starts an excursion (``excursion_extras``), which
    leaves a batch of extras on the worker whose boundary ends it with probability
    ``extra_share`` (otherwise its prompts only take the place of one that just
    finished). A loaded worker runs its batch, done after ``absorbed_s`` (e - 1), and
    each of the b - min(e, b) workers holding only its own prompt frees at rate
    1 / ``solo_s`` (b - 1). The time the queue is non-empty, ``excursion``
    (``excursion_ratio``) times the all-busy time without a queue, is all-busy too:
    P = P_N (1 + X) / (1 + P_N X), P_N the chain's mass at b = N.

    Without extras (``extra_share`` 0) the chain is Erlang's loss system, so P_N is
    Erlang B at the solo load, whatever the solo times' law; with them the pool stays
    all-busy longer than Erlang B says, but not as long as a queue drained at the
    packed rate, ``packed_s`` (which lets any worker take any queued work; it stands
    in where more workers hold extras than the chain keeps). P = 1 once the extras
    alone outgrow the pool (lambda x ``absorbed_s`` >= N); short of that a lone
    prompt frees at its solo rate whatever the backlog, so near the packed capacity
    P stays somewhat below one (the wait's rate, which vanishes there, carries the
    saturation).
    """
    if workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers!r}")
    for name, value in (("solo_s", solo_s), ("packed_s", packed_s), ("absorbed_s", absorbed_s)):
        if not value > 0.0:
            raise ValueError(f"{name}: must be > 0, got {value!r}")
    if not 0.0 <= extra_share <= 1.0:
        raise ValueError(f"extra_share: must be in [0, 1], got {extra_share!r}")
    if arrival_rate_rps <= 0.0:
        return 0.0
    if math.isinf(excursion):
        return 1.0
    n = workers
    load = arrival_rate_rps * solo_s
    blocking = erlang_b(n, load)
    if blocking < _NEGLIGIBLE or extra_share == 0.0:
        # Extras are then too rare to matter (and a linear solve could not resolve a
        # probability this small): Erlang's loss system with the queue's excursions.
        all_busy = blocking
    else:
        mass = _all_busy_mass(n, arrival_rate_rps, solo_s, absorbed_s, extra_share)
        if mass is None:
            # More extras than the chain keeps: most workers hold absorbed work, and
            # the queue is in effect shared by all, the token stream's chain (drained
            # at the packed rate once every worker is busy), on the safe side.
            packed_load = arrival_rate_rps * packed_s / n
            return blocking / (1.0 - packed_load + packed_load * blocking)
        all_busy = mass
    return all_busy * (1.0 + excursion) / (1.0 + all_busy * excursion)


# Below this, a probability does not move a P99 (and is beyond a linear solve's reach).
_NEGLIGIBLE = 1e-10
# Extras kept at first (doubled while the last holds mass, up to the pool's size or
# at most ``_EXTRAS_MAX``).
_EXTRAS_KEPT = 8
_EXTRAS_MAX = 32
# The last kept extras' share of the all-busy mass below which more are not needed.
_EXTRAS_TAIL = 1e-7


def _all_busy_mass(
    n: int, lam: float, solo_s: float, absorbed_s: float, extra_share: float
) -> float | None:
    """The chain's mass at b = N, with as many extras as hold mass.

    With N or more extras every worker holds one, so none frees: from (N, N) on the
    chain only moves in e, up at lambda x and down at N / ``absorbed_s``, a
    geometric tail joined to the rest at (N, N) alone. Cutting it there keeps the
    other states' ratios, and its mass is (N, N)'s times 1 / (1 - r), r = lambda x
    ``absorbed_s`` / N (all of it when r >= 1: the extras outgrow the pool).
    None when more than ``_EXTRAS_MAX`` extras hold mass in a larger pool.
    """
    extras = min(n, _EXTRAS_KEPT)
    while True:
        masses = _chain(n, lam, solo_s, absorbed_s, extra_share, extras)
        if extras == n:
            ratio = lam * extra_share * absorbed_s / n
            if ratio >= 1.0:
                return 1.0
            masses[-1, -1] /= 1.0 - ratio
            return float(masses[-1].sum() / masses.sum())
        if masses[:, -1].sum() <= _EXTRAS_TAIL * masses[-1].sum():
            return float(masses[-1].sum())
        if extras >= _EXTRAS_MAX:
            return None
        extras = min(n, 2 * extras)


def _chain(
    n: int, lam: float, solo_s: float, absorbed_s: float, extra_share: float, extras: int
) -> FloatArray:
    """The stationary masses of ``all_busy_probability``'s chain, levels from the
    lowest kept (far below the solo load nothing is) to N, extras 0..``extras``
    (an absorption at the last is dropped: the caller widens it while it holds
    mass). Row i is level low + i."""
    # Levels whose Erlang mass is negligible against the largest (far below the solo
    # load, or below the pool's size when the load is beyond it) are left out; the
    # lowest kept one reflects. That also keeps the solve's unknowns, scaled to the
    # first state's, within floating point's reach.
    log_mass = np.cumsum(np.log(lam * solo_s) - np.log(np.arange(1, n + 1)))
    log_mass = np.concatenate([[0.0], log_mass])
    kept = np.flatnonzero(log_mass >= log_mass.max() - _LEVELS_SPAN)
    low = int(min(kept[0], n - 1))
    levels = n - low + 1
    width = extras + 1
    count = levels * width
    index = np.arange(count)
    b = low + index // width
    e = index % width
    loaded = np.minimum(e, b)
    src: list[npt.NDArray[np.int64]] = []
    dst: list[npt.NDArray[np.int64]] = []
    rate: list[FloatArray] = []

    def add(mask: npt.NDArray[np.bool_], step: int, r: FloatArray | float) -> None:
        src.append(index[mask])
        dst.append(index[mask] + step)
        rate.append(np.broadcast_to(np.asarray(r, dtype=np.float64), (int(mask.sum()),)))

    add(b < n, width, lam)
    add((b == n) & (e < extras), 1, lam * extra_share)
    singles = b - loaded
    down = (b > low) & (singles > 0)
    add(down, -width, singles[down] / solo_s)
    done = loaded > 0
    add(done, -1, loaded[done] / absorbed_s)
    rows, cols, vals = np.concatenate(src), np.concatenate(dst), np.concatenate(rate)
    pi = _stationary(rows, cols, vals, count, width)
    masses: FloatArray = (pi / pi.sum()).reshape(levels, width)
    return masses


def _stationary(
    rows: npt.NDArray[np.int64],
    cols: npt.NDArray[np.int64],
    vals: FloatArray,
    count: int,
    width: int,
) -> FloatArray:
    """The stationary vector of the generator with the moves ``rows`` -> ``cols`` at
    ``vals``, whose moves span at most ``width`` states.

    pi Q = 0 is the transposed balance: each state's inflow equals its outflow. It is
    banded, and fixing one end state's mass and dropping its equation keeps it so
    (one banded LU, linear in the states). The first state is fixed unless the masses
    then span more than floating point can solve (the chain's mass piled at the far
    end), when the last one is.
    """
    outflow = np.bincount(rows, weights=vals, minlength=count)
    band = np.zeros((2 * width + 1, count))
    band[width + cols - rows, rows] = vals  # inflow: row ``cols``, column ``rows``
    band[width, :] = -outflow
    for fixed in (0, count - 1):
        # Equation ``fixed`` is dropped and its unknown, set to 1, moves to the right.
        rhs = np.zeros(count)
        from_fixed = rows == fixed
        rhs[cols[from_fixed]] = -vals[from_fixed]
        keep = np.arange(count) != fixed
        try:
            rest = linalg_dense.solve_banded((width, width), band[:, keep], rhs[keep])
        except np.linalg.LinAlgError:
            continue
        if np.all(np.isfinite(rest)):
            pi = np.ones(count)
            pi[keep] = np.maximum(rest, 0.0)
            if np.isfinite(pi.sum()):
                return pi
    raise np.linalg.LinAlgError("the absorbing chain's balance could not be solved")
