"""An open-loop load generator: replay a trace's arrivals against the router, streaming.

``build_plan`` (pure) turns a ``Trace`` into the requests to send: arrival times
scaled (``time_scale``, ``rate_scale``), cut to ``duration_s`` and ``max_requests``,
lengths scaled and clipped (and fitted into the model's context when asked),
prompts as random token ids from the given generator. ``run_load`` sends each
request at its time whether or not earlier ones have answered (open loop), reads
the server-sent events and measures, on the client side:

- TTFT: from the request's *scheduled* send time to the first token (so a
  generator that falls behind, or a full connection pool, counts against the
  system rather than hiding it; ``max_send_lag_s`` shows how late sends were);
- TPOT: (last token time - first token time) / (tokens - 1);
- end-to-end latency, errors by kind, timeouts.

``summarize`` gives P50/P90/P99 over the successful requests and the SLO
attainment over all requests (a failed request misses its SLO), as vLLM's serving
benchmark reports its goodput.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np

from sim.trace import Trace

DEFAULT_MAX_REQUESTS = 10_000
DEFAULT_REQUEST_TIMEOUT_S = 120.0
DEFAULT_MAX_INFLIGHT = 1024


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How a trace becomes requests.

    ``time_scale``: every arrival time is multiplied by it (0.1 replays ten times
    faster). ``rate_scale``: the rate is multiplied by it on the same time axis
    (``sim.workload.scale_rate``: thinning or copying). ``duration_s``: only
    arrivals before it (after scaling). ``length_scale``: prompt and output lengths
    multiplied by it (at least 1 token). ``max_prompt_tokens`` / ``max_output_tokens``
    clip them; ``context_tokens`` then shortens the prompt (then the output) so that
    prompt + output fits. Prompt token ids are uniform in ``[0, vocab_size)``.
    """

    time_scale: float = 1.0
    rate_scale: float = 1.0
    duration_s: float | None = None
    max_requests: int = DEFAULT_MAX_REQUESTS
    length_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    context_tokens: int | None = None
    vocab_size: int = 256

    def __post_init__(self) -> None:
        for name in ("time_scale", "rate_scale", "length_scale", "duration_s"):
            value = getattr(self, name)
            if name == "duration_s" and value is None:
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")
        for name, low, optional in (
            ("max_requests", 1, False),
            ("vocab_size", 1, False),
            ("max_prompt_tokens", 1, True),
            ("max_output_tokens", 1, True),
            ("context_tokens", 2, True),
        ):
            value = getattr(self, name)
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PlannedRequest:
    index: int
    send_at_s: float  # seconds after the run starts
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _lengths(trace: Trace, o: PlanOptions) -> tuple[np.ndarray, np.ndarray]:
    def scaled(values: np.ndarray, cap: int | None) -> np.ndarray:
        out = np.maximum(1, np.rint(values.astype(np.float64) * o.length_scale)).astype(np.int64)
        return out if cap is None else np.minimum(out, cap)

    prompt = scaled(trace.prompt_tokens, o.max_prompt_tokens)
    output = scaled(trace.output_tokens, o.max_output_tokens)
    if o.context_tokens is not None:
        output = np.minimum(output, o.context_tokens - 1)  # leave a prompt token
        prompt = np.minimum(prompt, o.context_tokens - output)
    return prompt, output


def build_plan(
    trace: Trace, options: PlanOptions, rng: np.random.Generator
) -> list[PlannedRequest]:
    """The requests to send, in order of their send times (see ``PlanOptions``)."""
    from sim import workload

    scaled = Trace(
        arrival_s=trace.arrival_s * options.time_scale,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        source=trace.source,
    )
    if options.rate_scale != 1.0:
        scaled = workload.scale_rate(scaled, options.rate_scale, rng)
    keep = len(scaled)
    if options.duration_s is not None:
        keep = int(np.searchsorted(scaled.arrival_s, options.duration_s, side="left"))
    keep = min(keep, options.max_requests)
    prompt, output = _lengths(scaled, options)
    return [
        PlannedRequest(
            index=i,
            send_at_s=float(scaled.arrival_s[i]),
            prompt_token_ids=tuple(rng.integers(0, options.vocab_size, int(prompt[i])).tolist()),
            max_tokens=int(output[i]),
        )
        for i in range(keep)
    ]


# --------------------------------------------------------------------------- one request


class ResultStatus(enum.Enum):
    OK = "ok"
    HTTP_ERROR = "http_error"  # a non-200 answer (its status code in ``http_status``)
    STREAM_ERROR = "stream_error"  # an error event, or a stream cut short
    TIMEOUT = "timeout"  # the client's timeout, or the router's (error code request_timeout)
    CONNECTION_ERROR = "connection_error"  # could not connect / the connection broke


@dataclass(frozen=True, kw_only=True)
class RequestResult:
    """What one request saw. Times in seconds; ``None`` where it never got that far."""

    index: int
    scheduled_s: float
    send_lag_s: float
    prompt_tokens: int
    max_tokens: int
    status: ResultStatus
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    http_status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is ResultStatus.OK


class _Failed(Exception):
    def __init__(self, status: ResultStatus, message: str, http_status: int | None = None):
        super().__init__(message)
        self.status = status
        self.http_status = http_status


@dataclass
class _Seen:
    """What arrived so far: the time of each chunk that carried tokens, and the count."""

    times: list[float]
    tokens: int = 0
    usage_tokens: int | None = None


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    seen: _Seen,
    clock: Callable[[], float],
) -> None:
    """Read one streamed completion into ``seen``; ``_Failed`` unless it ends with [DONE]."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise _Failed(ResultStatus.HTTP_ERROR, _error_message(text), resp.status_code)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                kind = (
                    ResultStatus.TIMEOUT
                    if error.get("code") == "request_timeout"
                    else ResultStatus.STREAM_ERROR
                )
                raise _Failed(kind, str(error.get("message")))
            n = _chunk_tokens(chunk)
            if n:
                seen.times.append(clock())
                seen.tokens += n
            if chunk.get("usage"):
                seen.usage_tokens = int(chunk["usage"]["completion_tokens"])
    raise _Failed(ResultStatus.STREAM_ERROR, "the stream ended without [DONE]")


async def _send(
    client: httpx.AsyncClient,
    url: str,
    req: PlannedRequest,
    *,
    model: str | None,
    start: float,
    timeout_s: float,
    clock: Callable[[], float],
) -> RequestResult:
    scheduled = start + req.send_at_s
    sent = clock()
    body: dict[str, Any] = {
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if model is not None:
        body["model"] = model
    seen = _Seen(times=[])

    def result(
        status: ResultStatus, *, error: str | None = None, http_status: int | None = None
    ) -> RequestResult:
        n_out = seen.usage_tokens if seen.usage_tokens is not None else seen.tokens
        first = seen.times[0] - scheduled if seen.times else None
        done = status is ResultStatus.OK
        tpot = (seen.times[-1] - seen.times[0]) / (n_out - 1) if done and n_out >= 2 else None
        return RequestResult(
            index=req.index,
            scheduled_s=req.send_at_s,
            send_lag_s=sent - scheduled,
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.max_tokens,
            status=status,
            output_tokens=n_out,
            ttft_s=first,
            tpot_s=tpot,
            latency_s=seen.times[-1] - scheduled if done else None,
            http_status=http_status,
            error=error,
        )

    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, url, body, seen, clock)
    except _Failed as exc:
        return result(exc.status, error=str(exc), http_status=exc.http_status)
    except TimeoutError:
        return result(ResultStatus.TIMEOUT, error=f"no complete answer within {timeout_s:g} s")
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        return result(ResultStatus.CONNECTION_ERROR, error=f"{type(exc).__name__}: {exc}")
    if not seen.times:
        return result(ResultStatus.STREAM_ERROR, error="the stream carried no token")
    return result(ResultStatus.OK, http_status=200)


def _chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens in one chunk: SARA's ``token_ids`` when present, else one per text chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    ids = choices[0].get("token_ids")
    if ids is not None:
        return len(ids)
    return 1 if choices[0].get("text") or choices[0].get("finish_reason") is None else 0


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


# --------------------------------------------------------------------------- the run


def completions_url(base: str) -> str:
    """``http://host:port[/v1[/completions]]`` → the completions endpoint."""
    base = base.rstrip("/")
    for suffix in ("/v1/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return f"{base}/v1/completions"


async def run_load(
    url: str,
    plan: Sequence[PlannedRequest],
    *,
    model: str | None = None,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    clock: Callable[[], float] = time.perf_counter,
    on_result: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send ``plan`` open-loop against the router at ``url``; the results in plan order.

    Takes at most the last send time plus ``request_timeout_s`` (and a little).
    ``max_inflight`` bounds open connections; requests beyond it wait for one, and
    that wait counts in their TTFT.
    """
    if not (math.isfinite(request_timeout_s) and request_timeout_s > 0):
        raise ValueError(f"request_timeout_s: expected a number > 0, got {request_timeout_s!r}")
    if max_inflight < 1:
        raise ValueError(f"max_inflight: expected an integer >= 1, got {max_inflight!r}")
    endpoint = completions_url(url)
    limits = httpx.Limits(max_connections=max_inflight, max_keepalive_connections=max_inflight)
    timeout = httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = clock() + 0.05  # time to schedule everything before the first send

        async def one(req: PlannedRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + req.send_at_s - clock()))
            result = await _send(
                client,
                endpoint,
                req,
                model=model,
                start=start,
                timeout_s=request_timeout_s,
                clock=clock,
            )
            if on_result is not None:
                on_result(result)
            return result

        return list(await asyncio.gather(*(one(req) for req in plan)))


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True, kw_only=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles | None:
        if not values:
            return None
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(mean=float(a.mean()), p50=float(p50), p90=float(p90), p99=float(p99))


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """The run in numbers. Attainment fractions are over all requests sent."""

    requests: int
    completed: int
    failed: int
    failures: dict[str, int]
    duration_s: float
    offered_rate_rps: float
    completed_rate_rps: float
    output_tokens_per_s: float
    ttft_s: Percentiles | None
    tpot_s: Percentiles | None
    latency_s: Percentiles | None
    ttft_slo_s: float
    tpot_slo_s: float
    ttft_attainment: float
    tpot_attainment: float
    slo_attainment: float
    max_send_lag_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    results: Sequence[RequestResult], *, ttft_slo_s: float, tpot_slo_s: float
) -> LoadReport:
    ok = [r for r in results if r.ok]
    n = len(results)
    ends = [r.scheduled_s + (r.latency_s or 0.0) for r in ok]
    span = (max(ends, default=0.0) - min((r.scheduled_s for r in results), default=0.0)) or 0.0
    sends = [r.scheduled_s for r in results]
    send_span = (max(sends) - min(sends)) if n >= 2 else 0.0
    failures = Counter(
        r.status.value if r.http_status in (None, 200) else f"http_{r.http_status}"
        for r in results
        if not r.ok
    )
    ttft_ok = [r for r in ok if r.ttft_s is not None and r.ttft_s <= ttft_slo_s]
    tpot_ok = [r for r in ok if r.tpot_s is None or r.tpot_s <= tpot_slo_s]
    both = [r for r in ttft_ok if r.tpot_s is None or r.tpot_s <= tpot_slo_s]

    def share(part: Sequence[RequestResult]) -> float:
        return len(part) / n if n else math.nan

    return LoadReport(
        requests=n,
        completed=len(ok),
        failed=n - len(ok),
        failures=dict(sorted(failures.items())),
        duration_s=span,
        offered_rate_rps=(n - 1) / send_span if send_span > 0 else math.nan,
        completed_rate_rps=len(ok) / span if span > 0 else math.nan,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / span if span > 0 else math.nan,
        ttft_s=Percentiles.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=Percentiles.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        latency_s=Percentiles.of([r.latency_s for r in ok if r.latency_s is not None]),
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        ttft_attainment=share(ttft_ok),
        tpot_attainment=share(tpot_ok),
        slo_attainment=share(both),
        max_send_lag_s=max((r.send_lag_s for r in results), default=0.0),
    )


def format_report(report: LoadReport) -> str:
    """A table like vLLM's serving benchmark prints."""
    lines = [
        "=" * 20 + " sara load " + "=" * 20,
        f"{'requests sent':<34}{report.requests:>16}",
        f"{'completed':<34}{report.completed:>16}",
        f"{'failed':<34}{report.failed:>16}",
    ]
    lines += [f"  {kind:<32}{count:>16}" for kind, count in report.failures.items()]
    lines += [
        f"{'duration (s)':<34}{report.duration_s:>16.2f}",
        f"{'offered rate (req/s)':<34}{report.offered_rate_rps:>16.2f}",
        f"{'completed rate (req/s)':<34}{report.completed_rate_rps:>16.2f}",
        f"{'output tokens/s':<34}{report.output_tokens_per_s:>16.1f}",
        f"{'max send lag (ms)':<34}{report.max_send_lag_s * 1e3:>16.1f}",
    ]
    for name, p, slo in (
        ("TTFT", report.ttft_s, report.ttft_slo_s),
        ("TPOT", report.tpot_s, report.tpot_slo_s),
        ("E2E latency", report.latency_s, None),
    ):
        lines.append(f"{'-' * 18} {name} (ms) {'-' * (30 - len(name) - 5)}")
        if p is None:
            lines.append(f"{'(no data)':<34}")
            continue
        for label, value in (("mean", p.mean), ("P50", p.p50), ("P90", p.p90), ("P99", p.p99)):
            lines.append(f"{label:<34}{value * 1e3:>16.1f}")
        if slo is not None:
            lines.append(f"{'SLO':<34}{slo * 1e3:>16.1f}")
    lines += [
        "-" * 51,
        f"{'TTFT SLO attainment':<34}{report.ttft_attainment:>16.1%}",
        f"{'TPOT SLO attainment':<34}{report.tpot_attainment:>16.1%}",
        f"{'SLO attainment (both)':<34}{report.slo_attainment:>16.1%}",
        "=" * 51,
    ]
    return "\n".join(lines)
