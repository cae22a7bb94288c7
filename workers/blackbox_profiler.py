"""The iteration-time profile of any OpenAI-compatible server, measured from outside.

``sara profile --openai-url URL --model NAME`` has no access to the engine: it sees
only HTTP. It measures two things with the official ``openai`` client, one at a time
so that nothing queues:

- **TTFT against the prompt length**: single streamed completions of ``L`` prompt
  tokens and one output token. A prompt of ``L`` tokens is one prefill (in
  ``ceil(L / chunk_tokens)`` chunks when the engine chunks it), so

      TTFT(L) = h + x * L + k(L) * t0_s + t_tok_s * L + t_attn_s * L (L + 1) / 2

  where ``h`` is what the path adds whatever the length: HTTP, the server's
  tokenisation and queues, the P/D proxy, the KV hand-off's latency.
- **inter-token latency against concurrency and context**: ``B`` streams at once of
  ``C``-token prompts; while all ``B`` are decoding, each step decodes ``B`` tokens and
  reads every sequence's context, so the gap between two tokens of a stream is

      ITL(B, C, i) = t0_s + t_tok_s * B + t_kv_s * B * (C + i)

  at the ``i``-th output token. The gaps are differences of arrival times on the
  same connection: the HTTP overhead cancels.

TTFT also pays, per prompt token, for what the path does beyond the prefill's compute:
a P/D stack hands the prompt's KV cache to a decode instance before the first token
leaves (SARA's capacity model carries that as ``kv_link_gbps``, apart from the
profile), and every stack serialises the prompt. So TTFT rows get one more term,
``x * L``, and the prefill's own per-token cost ``t_tok_s`` is the one the decode steps
show (``B`` tokens per step); a single engine without a hand-off fits ``x`` near 0.

The six unknowns (four coefficients, ``h`` and ``x``) are fitted together by
non-negative least squares on the relative error, as ``workers.profiler`` fits the
torch engine's own timings; ``h`` is the HTTP overhead subtracted and ``x`` the path's
per-token cost (both reported, neither part of the profile).

Prompts are token-id lists (``/v1/completions`` accepts them) drawn at random from
``[token_low, token_high)`` so that the lengths are exact and no two prompts share a
prefix a cache could reuse.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from queueing.profile import IterationProfile


class BlackBoxError(ValueError):
    """The server could not be measured, or the measurements cannot be fitted."""


@dataclass(frozen=True, kw_only=True)
class BlackBoxGrid:
    """What is probed: prompt lengths for TTFT, concurrencies and contexts for ITL."""

    prompt_tokens: tuple[int, ...] = (16, 128, 256, 384, 512)
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    context_tokens: tuple[int, ...] = (32, 512)
    output_tokens: int = 16  # gaps measured per stream while all decode
    repeats: int = 5
    chunk_tokens: int | None = None  # the engine's prefill chunk; None: one pass

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "concurrency", "context_tokens"):
            values = getattr(self, name)
            if not values or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values
            ):
                raise ValueError(f"{name}: must be integers >= 1, got {values!r}")
        if len(set(self.prompt_tokens)) < 3:
            raise ValueError(
                f"prompt_tokens: at least 3 lengths to separate the terms, got "
                f"{self.prompt_tokens!r}"
            )
        if len(set(self.concurrency)) < 2:
            raise ValueError(f"concurrency: at least 2 levels, got {self.concurrency!r}")
        if self.output_tokens < 8:
            raise ValueError(
                f"output_tokens: at least 8 gaps per stream, got {self.output_tokens!r}"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {self.repeats!r}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {self.chunk_tokens!r}")

    def chunks(self, prompt_tokens: int) -> int:
        return 1 if self.chunk_tokens is None else math.ceil(prompt_tokens / self.chunk_tokens)


@dataclass(frozen=True, kw_only=True)
class TtftSample:
    prompt_tokens: int
    # The fastest of the repeats: what the path adds on top of the prefill (polling,
    # scheduling, a busy machine) only ever delays, so the minimum is the estimate
    # least disturbed by it.
    ttft_s: float


@dataclass(frozen=True, kw_only=True)
class ItlSample:
    concurrency: int
    context_tokens: int  # the prompt
    kv_tokens_per_sequence: float  # mean context over the gaps measured
    itl_s: float  # the median over the streams of their mean gap while every stream decodes


@dataclass(frozen=True, kw_only=True)
class BlackBoxFit:
    """The fitted coefficients, the overhead and how well they explain the samples."""

    t0_s: float
    t_tok_s: float
    t_kv_s: float
    t_attn_s: float
    overhead_s: float  # h: subtracted from every TTFT
    # x: what the path adds per prompt token beyond the prefill's compute (the KV
    # hand-off of a P/D stack, serialising the prompt), seconds per token
    path_s_per_token: float
    ttft: tuple[TtftSample, ...]
    itl: tuple[ItlSample, ...]
    relative_errors: tuple[float, ...]  # (predicted - measured) / measured, TTFT rows first
    r2: float  # of the measured times (TTFT and ITL together)
    chunk_tokens: int | None = None

    @property
    def max_relative_error(self) -> float:
        return max(abs(e) for e in self.relative_errors)

    def predicted_ttft_s(self, prompt_tokens: int) -> float:
        chunks = 1 if self.chunk_tokens is None else math.ceil(prompt_tokens / self.chunk_tokens)
        return (
            self.overhead_s
            + self.path_s_per_token * prompt_tokens
            + self.prefill_s(prompt_tokens, chunks=chunks)
        )

    def prefill_s(self, prompt_tokens: int, *, chunks: int = 1) -> float:
        pairs = prompt_tokens * (prompt_tokens + 1) / 2
        return chunks * self.t0_s + self.t_tok_s * prompt_tokens + self.t_attn_s * pairs

    def decode_step_s(self, concurrency: int, kv_tokens_per_sequence: float) -> float:
        return (
            self.t0_s
            + self.t_tok_s * concurrency
            + self.t_kv_s * concurrency * kv_tokens_per_sequence
        )


def fit_blackbox(
    ttft: Sequence[TtftSample], itl: Sequence[ItlSample], *, chunk_tokens: int | None = None
) -> BlackBoxFit:
    """Non-negative least squares of the five unknowns on the relative error."""
    if len({s.prompt_tokens for s in ttft}) < 3 or len({s.concurrency for s in itl}) < 2:
        raise BlackBoxError(
            "too few distinct shapes: 3 prompt lengths and 2 concurrencies at least"
        )
    rows, times = [], []
    for s in ttft:
        chunks = 1 if chunk_tokens is None else math.ceil(s.prompt_tokens / chunk_tokens)
        pairs = s.prompt_tokens * (s.prompt_tokens + 1) / 2
        rows.append([chunks, s.prompt_tokens, 0.0, pairs, 1.0, s.prompt_tokens])
        times.append(s.ttft_s)
    for d in itl:
        kv = d.concurrency * d.kv_tokens_per_sequence
        rows.append([1.0, d.concurrency, kv, 0.0, 0.0, 0.0])
        times.append(d.itl_s)
    a = np.asarray(rows, dtype=float)
    y = np.asarray(times, dtype=float)
    if np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise BlackBoxError("a measured time is not a positive number")
    # Columns scaled to unit size so that NNLS's tolerance treats them alike.
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    weighted = (a / scale) / y[:, None]
    x, _ = nnls(weighted, np.ones_like(y))
    coef = x / scale
    predicted = a @ coef
    residual = float(np.sum((y - predicted) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    return BlackBoxFit(
        t0_s=float(coef[0]),
        t_tok_s=float(coef[1]),
        t_kv_s=float(coef[2]),
        t_attn_s=float(coef[3]),
        overhead_s=float(coef[4]),
        path_s_per_token=float(coef[5]),
        ttft=tuple(ttft),
        itl=tuple(itl),
        relative_errors=tuple(float(e) for e in (predicted - y) / y),
        r2=1.0 - residual / total if total > 0 else 1.0,
        chunk_tokens=chunk_tokens,
    )


def profile_of(
    fit: BlackBoxFit,
    *,
    name: str,
    model: str,
    hardware: str = "unknown (black box)",
    tensor_parallel: int = 1,
    kv_capacity_tokens: int,
    kv_bytes_per_token: int,
    startup_s: float,
    max_context_tokens: int | None = None,
    url: str,
) -> IterationProfile:
    """The fit as a profile document: the coefficients, and the memory facts the caller
    knows (a black box does not say how large its KV cache is)."""
    return IterationProfile(
        name=name,
        model=model,
        hardware=hardware,
        tensor_parallel=tensor_parallel,
        t0_s=fit.t0_s,
        t_tok_s=fit.t_tok_s,
        t_kv_s=fit.t_kv_s,
        t_attn_s=fit.t_attn_s,
        kv_capacity_tokens=kv_capacity_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        startup_s=startup_s,
        source=(
            f"sara profile --openai-url {url}: {len(fit.ttft)} TTFT and {len(fit.itl)} ITL "
            f"samples, R² {fit.r2:.4f}, largest error {fit.max_relative_error:.1%}, HTTP "
            f"overhead {fit.overhead_s * 1000:.2f} ms and {fit.path_s_per_token * 1e6:.2f} us "
            "per prompt token of the path subtracted"
        ),
        max_context_tokens=max_context_tokens,
    )


# -- measuring over HTTP -------------------------------------------------------------------


@dataclass
class _Stream:
    """Arrival times of one streamed completion's tokens (perf_counter seconds)."""

    sent_s: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    error: BaseException | None = None


class BlackBoxProfiler:
    """Measures ``grid`` on the server behind ``client`` (an ``openai.OpenAI``)."""

    def __init__(
        self,
        client: object,
        *,
        model: str,
        grid: BlackBoxGrid,
        seed: int = 0,
        token_low: int = 100,
        token_high: int = 400,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        idle_s: float = 0.2,
        ignore_eos: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if not 0 <= token_low < token_high:
            raise ValueError(
                f"token_low/token_high: need 0 <= low < high, got {token_low}, {token_high}"
            )
        self._client = client
        self._model = model
        self._grid = grid
        self._rng = np.random.default_rng(seed)
        self._low, self._high = token_low, token_high
        self._clock = clock
        self._sleep = sleep
        self._idle_s = idle_s
        self._ignore_eos = ignore_eos
        self._progress = progress or (lambda _: None)

    def _prompt(self, tokens: int) -> list[int]:
        return [int(t) for t in self._rng.integers(self._low, self._high, size=tokens)]

    def _stream(self, prompt: list[int], max_tokens: int, out: _Stream) -> None:
        try:
            out.sent_s = self._clock()
            stream = self._client.completions.create(  # type: ignore[attr-defined]
                model=self._model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                # vLLM's extension, which SGLang and sara serve accept too: every stream
                # generates max_tokens, so the decode batch stays B while it is measured.
                extra_body={"ignore_eos": True} if self._ignore_eos else None,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text is not None:
                    out.arrivals.append(self._clock())
        except Exception as exc:  # reported by the caller, which names the shape
            out.error = exc

    def http_round_trip_s(self, repeats: int = 5) -> float:
        """Median time of ``GET /v1/models``: the HTTP floor, for the report."""
        times = []
        for _ in range(repeats):
            start = self._clock()
            self._client.models.list()  # type: ignore[attr-defined]
            times.append(self._clock() - start)
        return statistics.median(times)

    def measure_ttft(self) -> list[TtftSample]:
        samples = []
        for length in self._grid.prompt_tokens:
            times = []
            for _ in range(self._grid.repeats):
                out = _Stream()
                self._stream(self._prompt(length), 1, out)
                if out.error is not None or not out.arrivals:
                    raise BlackBoxError(
                        f"TTFT of a {length}-token prompt: {out.error or 'no token'}"
                    )
                times.append(out.arrivals[0] - out.sent_s)
                # Let the server go idle before the next probe (twice the time this one
                # took): a probe sent while the last step still runs, or right after
                # it, would be timed against that step rather than alone.
                self._sleep(max(self._idle_s, 2 * times[-1]))
            samples.append(TtftSample(prompt_tokens=length, ttft_s=min(times)))
            self._progress(f"TTFT  L={length:5d}: {samples[-1].ttft_s * 1000:8.2f} ms")
        return samples

    def _streams_needed(self, batch: int, context: int, ttft: Sequence[TtftSample]) -> int:
        """Output tokens per stream so that the last of ``batch`` prompts is prefilled
        before the first stream ends, plus ``output_tokens`` gaps together: a P/D
        stack prefills the prompts one budget at a time while the first ones decode."""
        lengths = np.array([s.prompt_tokens for s in ttft], dtype=float)
        times = np.array([s.ttft_s for s in ttft], dtype=float)
        prefill_s = float(np.interp(context, lengths, times))
        one = _Stream()
        self._stream(self._prompt(context), 6, one)
        gaps = np.diff(one.arrivals) if len(one.arrivals) > 2 else np.array([prefill_s])
        itl_s = max(float(np.median(gaps)), 1e-4)
        # Twice the estimate: the prefills slow down while the first streams decode
        # beside them on a shared machine, and a stream that ends early is wasted.
        return self._grid.output_tokens + 2 * math.ceil(batch * prefill_s / itl_s)

    def measure_itl(self, ttft: Sequence[TtftSample]) -> list[ItlSample]:
        samples = []
        for context in self._grid.context_tokens:
            for batch in self._grid.concurrency:
                n = self._streams_needed(batch, context, ttft)
                gaps: list[float] = []
                positions: list[float] = []
                for _ in range(self._grid.repeats):
                    outs = [_Stream() for _ in range(batch)]
                    threads = [
                        threading.Thread(target=self._stream, args=(self._prompt(context), n, o))
                        for o in outs
                    ]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()
                    for o in outs:
                        if o.error is not None or len(o.arrivals) < 3:
                            raise BlackBoxError(
                                f"ITL at concurrency {batch}, context {context}: "
                                f"{o.error or 'fewer than 3 tokens'}"
                            )
                    # Only while every stream decodes: after every stream's second
                    # token (its first from a decode step: in a P/D stack the first comes
                    # from the prefill instance) and before the first stream ends, so the
                    # batch is B throughout. Per stream, the mean gap over that window:
                    # a server or proxy that flushes two tokens at once makes single gaps
                    # short and long, their mean stays the step time.
                    start = max(o.arrivals[1] for o in outs)
                    end = min(o.arrivals[-1] for o in outs)
                    for o in outs:
                        inside = [i for i, t in enumerate(o.arrivals) if start <= t <= end]
                        # Enough gaps that a burst (tokens flushed together) cannot
                        # pass for the cadence.
                        if len(inside) > max(2, self._grid.output_tokens // 2):
                            first, last = inside[0], inside[-1]
                            gap = (o.arrivals[last] - o.arrivals[first]) / (last - first)
                            gaps.append(gap)
                            positions.append((first + last) / 2)
                if not gaps:
                    raise BlackBoxError(
                        f"ITL at concurrency {batch}, context {context}: the streams never "
                        "decoded together (raise output_tokens)"
                    )
                samples.append(
                    ItlSample(
                        concurrency=batch,
                        context_tokens=context,
                        kv_tokens_per_sequence=context + float(np.mean(positions)),
                        itl_s=statistics.median(gaps),
                    )
                )
                self._progress(
                    f"ITL   B={batch:3d} C={context:5d}: {samples[-1].itl_s * 1000:8.2f} ms"
                )
        return samples

    def run(self) -> BlackBoxFit:
        # A few untimed requests first: connections, caches and lazy initialisation.
        for _ in range(2):
            self._stream(self._prompt(min(self._grid.prompt_tokens)), 2, _Stream())
        ttft = self.measure_ttft()
        itl = self.measure_itl(ttft)
        return fit_blackbox(ttft, itl, chunk_tokens=self._grid.chunk_tokens)


def format_blackbox_report(fit: BlackBoxFit, *, http_round_trip_s: float | None = None) -> str:
    lines = [
        f"t0_s      {fit.t0_s * 1000:10.4f} ms",
        f"t_tok_s   {fit.t_tok_s * 1e6:10.4f} us",
        f"t_kv_s    {fit.t_kv_s * 1e9:10.4f} ns",
        f"t_attn_s  {fit.t_attn_s * 1e9:10.4f} ns",
        f"HTTP overhead subtracted from TTFT: {fit.overhead_s * 1000:.2f} ms"
        + (
            f" (a GET /v1/models round trip: {http_round_trip_s * 1000:.2f} ms)"
            if http_round_trip_s is not None
            else ""
        ),
        f"the path's cost per prompt token beyond the prefill (KV hand-off, serialising): "
        f"{fit.path_s_per_token * 1e6:.2f} us",
        f"fit: R² {fit.r2:.4f}, largest relative error {fit.max_relative_error:.1%} over "
        f"{len(fit.relative_errors)} samples",
        "sample                     measured ms   fitted ms   error",
    ]
    errors = iter(fit.relative_errors)
    for s in fit.ttft:
        e = next(errors)
        lines.append(
            f"TTFT L={s.prompt_tokens:<6d}            {s.ttft_s * 1000:10.3f} "
            f"{s.ttft_s * (1 + e) * 1000:10.3f}  {e:+6.1%}"
        )
    for d in fit.itl:
        e = next(errors)
        lines.append(
            f"ITL  B={d.concurrency:<3d} C={d.context_tokens:<6d}     {d.itl_s * 1000:10.3f} "
            f"{d.itl_s * (1 + e) * 1000:10.3f}  {e:+6.1%}"
        )
    return "\n".join(lines)
