"""The controller's configuration: one frozen document, validated whole.

The same JSON document is what ``GET /v1/config`` returns, what ``--config FILE``
reads, and (in Kubernetes mode) the ``SLOAutoscaler`` spec's knobs. Defaults follow
the SARA notes (30 s windows, EMA 0.7·old + 0.3·new, 10 % dead-band, at most 50 %
change per tick, one-window cooldown, 10–20 % headroom) and the Kubernetes HPA
(300 s scale-down stabilisation).

This module is the one schema of that document. Every field is declared with
``knob(...)``, which puts its meaning, its unit, its plain bounds and its name in the
``SLOAutoscaler`` spec into the field's metadata; from that, ``controller.api`` builds
the REST models (and so the OpenAPI of ``/v1/config``), ``controller.crd.spec`` the
spec codec and the CRD's schema of the knobs, and ``controller.schema`` the committed
CRD YAML and the docs' tables. The plain bounds are checked here from the same
metadata; rules that span fields (min <= max, stale_after_s >= window_s, ...) are
code in each block's ``validate``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


class ConfigError(ValueError):
    """A configuration is invalid; the message starts with the dotted field name."""


class Mode(enum.Enum):
    ACTIVE = "active"  # decide and scale
    ADVISORY = "advisory"  # decide and publish, never scale


# --------------------------------------------------------------------------------------
# Field metadata
# --------------------------------------------------------------------------------------

_KNOB = "sara.knob"  # the key of a field's Knob in its dataclasses metadata


@dataclass(frozen=True, kw_only=True)
class Knob:
    """What a config field means and allows, beyond its Python type and default.

    ``doc`` is the one sentence that the OpenAPI, the CRD and the docs' tables show.
    ``gt``/``ge`` and ``lt``/``le`` are the plain bounds (at most one of each pair);
    ``min_length`` applies to strings. ``spec_name`` is the field's name in the
    ``SLOAutoscaler`` spec when it is not the derived one (``KnobField.spec_name``).
    ``why`` is added to a lower bound's error message when the bound is not
    self-explanatory.
    """

    doc: str
    spec_name: str | None = None
    unit: str | None = None
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    min_length: int | None = None
    why: str | None = None

    def __post_init__(self) -> None:
        if not self.doc:
            raise ValueError("doc: every knob says what it means")
        if self.gt is not None and self.ge is not None:
            raise ValueError(f"{self.doc}: give gt or ge, not both")
        if self.lt is not None and self.le is not None:
            raise ValueError(f"{self.doc}: give lt or le, not both")

    @property
    def lower(self) -> float | None:
        return self.gt if self.gt is not None else self.ge

    @property
    def upper(self) -> float | None:
        return self.lt if self.lt is not None else self.le


def _camel(name: str) -> str:
    # Kubernetes spells units out: ``interval_s`` is ``intervalSeconds``.
    parts = name.split("_")
    if parts[-1] == "s":
        parts[-1] = "seconds"
    return parts[0] + "".join(part[:1].upper() + part[1:] for part in parts[1:])


def knob(
    *,
    doc: str,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    spec_name: str | None = None,
    unit: str | None = None,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    min_length: int | None = None,
    why: str | None = None,
) -> Any:
    """A dataclass field that carries its ``Knob`` in its metadata.

    Without ``spec_name`` the spec's name is the field's in camelCase, a trailing
    ``_s`` spelt ``Seconds`` (``interval_s`` is ``intervalSeconds``).
    """
    meta = Knob(
        doc=doc,
        spec_name=spec_name,
        unit=unit,
        gt=gt,
        ge=ge,
        lt=lt,
        le=le,
        min_length=min_length,
        why=why,
    )
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={_KNOB: meta})
    return field(default=default, metadata={_KNOB: meta})


@dataclass(frozen=True, kw_only=True)
class KnobField:
    """One field of a config block: its name, Python type, default and ``Knob``."""

    name: str
    type: Any  # the resolved annotation: bool, int, float, str, Mode, int | None, a block
    default: Any
    knob: Knob

    @property
    def spec_name(self) -> str:
        """The field's name in the ``SLOAutoscaler`` spec (camelCase)."""
        return self.knob.spec_name or _camel(self.name)

    @property
    def block(self) -> type | None:
        """The nested config block this field holds, if it is one."""
        return self.type if dataclasses.is_dataclass(self.type) else None


_FIELDS: dict[type, tuple[KnobField, ...]] = {}  # every validation walks these


def knob_fields(cls: type) -> tuple[KnobField, ...]:
    """The fields of config block ``cls`` in declaration order, with their metadata."""
    if cls not in _FIELDS:
        _FIELDS[cls] = _knob_fields(cls)
    return _FIELDS[cls]


def _knob_fields(cls: type) -> tuple[KnobField, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for item in fields(cls):
        meta = item.metadata.get(_KNOB)
        if not isinstance(meta, Knob):
            raise TypeError(f"{cls.__name__}.{item.name}: declare it with knob(...)")
        if item.default_factory is not dataclasses.MISSING:
            default = item.default_factory()
        else:
            default = item.default
        out.append(KnobField(name=item.name, type=hints[item.name], default=default, knob=meta))
    return tuple(out)


def leaf_knobs(cls: type | None = None, prefix: str = "") -> Iterator[tuple[str, KnobField]]:
    """Every leaf field below ``cls`` (the whole config by default) with its dotted
    name (``slo.ttft_p99_s``), depth first in declaration order."""
    for item in knob_fields(ControllerConfig if cls is None else cls):
        if item.block is not None:
            yield from leaf_knobs(item.block, f"{prefix}{item.name}.")
        else:
            yield f"{prefix}{item.name}", item


def _check(path: str, item: KnobField, value: Any) -> None:
    """The plain checks of one leaf value: its type and the knob's bounds."""
    kind, meta = item.type, item.knob
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if not isinstance(value, kind):
            raise ConfigError(f"{path}: must be one of {[m.value for m in kind]}, got {value!r}")
        return
    if kind is str:
        if not isinstance(value, str) or len(value) < (meta.min_length or 0):
            what = "a non-empty string" if meta.min_length else "a string"
            raise ConfigError(f"{path}: must be {what}, got {value!r}")
        return
    members = typing.get_args(kind)
    if type(None) in members:  # optional: None means "not set", never out of range
        if value is None:
            return
        (kind,) = [member for member in members if member is not type(None)]
        if kind is str:
            if not isinstance(value, str) or len(value) < (meta.min_length or 0):
                raise ConfigError(f"{path}: must be a non-empty string or null, got {value!r}")
            return
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value!r}")
    lower, upper = meta.lower, meta.upper
    if lower is not None and (value < lower or (meta.gt is not None and value == lower)):
        relation = ">" if meta.gt is not None else ">="
        why = f" ({meta.why})" if meta.why else ""
        raise ConfigError(f"{path}: must be {relation} {lower:g}, got {value!r}{why}")
    if upper is not None and (value > upper or (meta.lt is not None and value == upper)):
        if meta.ge == 0 and upper == 1:  # a fraction: say the whole interval
            bracket = ")" if meta.lt is not None else "]"
            raise ConfigError(f"{path}: must be in [0, 1{bracket}, got {value!r}")
        relation = "<" if meta.lt is not None else "<="
        raise ConfigError(f"{path}: must be {relation} {upper:g}, got {value!r}")


def _check_block(block: object, path: str) -> None:
    """The plain checks of every field of ``block``; nested blocks validate themselves."""
    prefix = f"{path}." if path else ""
    for item in knob_fields(type(block)):
        value = getattr(block, item.name)
        if item.block is not None:
            if not isinstance(value, item.block):
                raise ConfigError(
                    f"{prefix}{item.name}: must be a {item.block.__name__}, got {value!r}"
                )
            value.validate(f"{prefix}{item.name}")
        else:
            _check(f"{prefix}{item.name}", item, value)


# --------------------------------------------------------------------------------------
# The blocks
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PoolLimits:
    """Replica bounds of one pool; min_replicas <= max_replicas."""

    min_replicas: int = knob(
        default=1,
        unit="workers",
        ge=0,
        le=100_000,
        doc="Fewest workers the controller keeps (0 lets the pool scale to zero).",
    )
    max_replicas: int = knob(
        default=64,
        unit="workers",
        ge=1,
        le=100_000,
        doc="Most workers the controller asks for; at least min_replicas.",
    )

    def validate(self, path: str) -> None:
        _check_block(self, path)
        if self.min_replicas > self.max_replicas:
            raise ConfigError(
                f"{path}.min_replicas: {self.min_replicas} > max_replicas {self.max_replicas}"
            )


@dataclass(frozen=True, kw_only=True)
class SloConfig:
    """The service-level objectives the pools are sized for."""

    ttft_p99_s: float = knob(
        default=2.0,
        unit="s",
        gt=0,
        le=3_600,
        doc="Target P99 time to first token, seconds (sizes the prefill pool).",
    )
    tpot_p99_s: float = knob(
        default=0.1,
        unit="s",
        gt=0,
        le=60,
        doc="Target P99 time per output token, seconds (sizes the decode pool).",
    )

    def validate(self, path: str) -> None:
        _check_block(self, path)


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """Online correction of the model by the observed / predicted P99 of each pool."""

    enabled: bool = knob(default=True, doc="Correct the model online.")
    ema_weight: float = knob(
        default=0.2,
        ge=0,
        le=1,
        doc="Weight of the newest observed/predicted ratio in its moving average.",
    )
    min_factor: float = knob(
        default=0.5,
        gt=0,
        le=1,
        doc="Smallest correction factor applied to a prediction.",
    )
    max_factor: float = knob(
        default=2.0,
        ge=1,
        le=100,
        doc="Largest correction factor applied to a prediction.",
    )

    def validate(self, path: str) -> None:
        _check_block(self, path)


@dataclass(frozen=True, kw_only=True)
class ForecastConfig:
    """Planning for the arrival rate one worker start-up ahead: a trend over the last
    minutes and the daily cycle; trend_window_s holds at least 3 bins of bin_s."""

    enabled: bool = knob(
        default=False,
        doc="Size the pools for the forecast rate (when higher than the smoothed one).",
    )
    horizon_s: float = knob(
        default=130.0,
        unit="s",
        gt=0,
        le=86_400,
        doc="How far ahead the rate matters, seconds: a worker's start-up time plus one "
        "tick (with lead_time enabled, the pools' measured lead time replaces it).",
    )
    trend_window_s: float = knob(
        default=300.0,
        unit="s",
        gt=0,
        le=604_800,
        doc="The recent past the trend is fitted over, seconds; at least 3 bins of bin_s.",
    )
    bin_s: float = knob(
        default=30.0,
        unit="s",
        gt=0,
        le=86_400,
        doc="Width of the rate bins the trend is fitted to, seconds.",
    )
    min_t_stat: float = knob(
        default=2.0,
        ge=0,
        le=1_000,
        doc="A trend counts only when its slope's t statistic reaches this.",
    )
    min_rise: float = knob(
        default=0.05,
        ge=0,
        le=100,
        doc="A trend counts only when it adds at least this fraction of the rate over the horizon.",
    )
    period_s: float = knob(
        default=86400.0,
        unit="s",
        gt=0,
        le=604_800,
        doc="Period of the daily cycle, seconds.",
    )
    seasonal_smoothing_s: float = knob(
        default=300.0,
        unit="s",
        gt=0,
        le=86_400,
        doc="Width of the window a past period's rate is read over, seconds.",
    )
    max_level_ratio: float = knob(
        default=2.0,
        ge=1,
        le=1_000,
        doc="Bound on today's level over the last period's (and its inverse) when "
        "scaling the cycle.",
    )

    def validate(self, path: str) -> None:
        _check_block(self, path)
        bins = self.trend_window_s / self.bin_s
        if bins < 3:
            # Not "must ...": a rule between two fields, not a bound of one.
            raise ConfigError(
                f"{path}.trend_window_s: {self.trend_window_s:g} holds {bins:g} bins of "
                f"bin_s {self.bin_s:g}; a trend needs at least 3"
            )


@dataclass(frozen=True, kw_only=True)
class LeadTimeConfig:
    """Sizing each pool for an upper quantile of the rate over its lead time (its
    measured worker start-up plus one tick), the quantile's level the SLO's
    percentile; the length mix and the inter-arrival SCV pooled over pool_s."""

    enabled: bool = knob(
        default=True,
        doc="Plan for the upper quantile of the rate over the lead time (off: the smoothed rate).",
    )
    startup_prior_s: float = knob(
        default=120.0,
        unit="s",
        ge=0,
        le=86_400,
        doc="A worker's start-up assumed until the pool's first scale-up is measured, seconds.",
    )
    startup_ema_weight: float = knob(
        default=0.2,
        gt=0,
        le=1,
        doc="Weight of the newest measured start-up once the first 1/weight are averaged.",
    )
    history_s: float = knob(
        default=3600.0,
        unit="s",
        gt=0,
        le=604_800,
        doc="How far back the rate's moves over a lead time are read, seconds.",
    )
    pool_s: float = knob(
        default=300.0,
        unit="s",
        gt=0,
        le=86_400,
        doc="The length mix and the inter-arrival SCV are pooled over this many seconds "
        "of windows.",
    )

    def validate(self, path: str) -> None:
        _check_block(self, path)


class MetricsFlavor(enum.Enum):
    """Whose metric names the Prometheus queries read (controller.sources.flavors)."""

    SARA = "sara"  # SARA's own router and workers
    VLLM = "vllm"  # vLLM's engine metrics (vllm:...), one pool per set of instances
    SGLANG = "sglang"  # SGLang's metrics (sglang:...)
    CUSTOM = "custom"  # every query from this block's *_query templates


# The templates of the custom flavour, in the order docs/engines.md lists them.
CUSTOM_QUERY_FIELDS: tuple[str, ...] = (
    "arrival_rate_query",
    "arrival_samples_query",
    "ttft_p99_query",
    "tpot_p99_query",
    "prompt_buckets_query",
    "output_buckets_query",
    "prefill_queue_depth_query",
    "kv_usage_query",
)
_TEMPLATE_DOC = " (custom flavour only; $window, $selector, $prefill and $decode are filled in)."


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Which metrics the observation is read from: a flavour (an engine's own metric
    names) and the label matchers that tell the two pools' series apart. The custom
    flavour takes every *_query template; the others take none."""

    flavor: MetricsFlavor = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default=MetricsFlavor.SARA,
        doc="Whose metric names to query: sara, vllm, sglang, or custom (the *_query templates).",
    )
    prefill_selector: str = knob(
        default='pool="prefill"',
        doc="PromQL label matchers without braces that select the prefill pool's series.",
    )
    decode_selector: str = knob(
        default='pool="decode"',
        doc="PromQL label matchers without braces that select the decode pool's series.",
    )
    arrival_rate_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL of the arrival rate, requests/s, over $window" + _TEMPLATE_DOC,
    )
    arrival_samples_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL range vector of the request counters' raw samples over $window, for "
        "the arrivals' SCV" + _TEMPLATE_DOC,
    )
    ttft_p99_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL of the P99 time to first token, seconds" + _TEMPLATE_DOC,
    )
    tpot_p99_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL of the P99 time per output token, seconds" + _TEMPLATE_DOC,
    )
    prompt_buckets_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL of the prompt-length histogram, by le, over $window" + _TEMPLATE_DOC,
    )
    output_buckets_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL of the output-length histogram, by le, over $window" + _TEMPLATE_DOC,
    )
    prefill_queue_depth_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL of the requests waiting in the prefill pool" + _TEMPLATE_DOC,
    )
    kv_usage_query: str | None = knob(
        default=None,
        min_length=1,
        doc="PromQL of the decode pool's KV-cache usage, a fraction" + _TEMPLATE_DOC,
    )

    def validate(self, path: str) -> None:
        _check_block(self, path)
        for name in ("prefill_selector", "decode_selector"):
            if "{" in getattr(self, name) or "}" in getattr(self, name):
                raise ConfigError(
                    f"{path}.{name}: label matchers without braces, got {getattr(self, name)!r}"
                )
        templates = {name: getattr(self, name) for name in CUSTOM_QUERY_FIELDS}
        if self.flavor is MetricsFlavor.CUSTOM:
            missing = [name for name, value in templates.items() if value is None]
            if missing:
                raise ConfigError(
                    f"{path}.{missing[0]}: required with flavor custom "
                    f"(missing: {', '.join(missing)})"
                )
        else:
            given = [name for name, value in templates.items() if value is not None]
            if given:
                raise ConfigError(
                    f"{path}.{given[0]}: only with flavor custom, got flavor {self.flavor.value!r}"
                )


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Every knob of the control loop. Fields left out take their defaults.

    Cross-field rules checked on the whole document: stale_after_s >= window_s,
    min_replicas <= max_replicas per pool, gpu_budget >= the sum of the pools'
    min_replicas, forecast.trend_window_s >= 3 * forecast.bin_s.
    """

    mode: Mode = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default=Mode.ACTIVE,
        doc="active: decide and scale; advisory: decide and publish, never scale.",
    )
    profile: str = knob(
        default="llama-3-8b@h100-sxm",
        min_length=1,
        doc="Iteration-time profile of one worker (model, GPU, tensor parallelism): a "
        "built-in name (`sara profiles` lists them) or a profile JSON path (over the "
        "REST API: one under an allowed profile directory that parses); a cluster "
        "takes only built-in names.",
    )
    slo: SloConfig = knob(default_factory=SloConfig, doc="The SLOs.")  # noqa: RUF009
    headroom: float = knob(
        default=0.15,
        ge=0,
        lt=10,
        doc="Plan for SLO / (1 + headroom): 0.15 sizes for 87 % of each target.",
    )
    interval_s: float = knob(
        default=30.0,
        unit="s",
        gt=0,
        le=3_600,
        doc="Seconds between control ticks.",
    )
    window_s: float = knob(
        default=30.0,
        unit="s",
        gt=0,
        le=3_600,
        doc="Measurement window of the rates and quantiles, seconds.",
    )
    stale_after_s: float = knob(
        default=90.0,
        unit="s",
        gt=0,
        le=86_400,
        doc="Observations older than this (seconds) are stale: the tick holds the "
        "replicas (never scales down on missing data). At least window_s.",
    )
    ema_weight: float = knob(
        default=0.3,
        gt=0,
        le=1,
        why="0 would never follow the load",
        doc="Arrival-rate EMA weight: smoothed = (1 - w) * old + w * measured.",
    )
    burst_window_s: float = knob(
        default=5.0,
        unit="s",
        gt=0,
        le=3_600,
        doc="Short window for burst detection, seconds.",
    )
    burst_ratio: float = knob(
        default=1.5,
        gt=1,
        le=100,
        doc="A short-window rate above burst_ratio * EMA bypasses smoothing upward.",
    )
    dead_band: float = knob(
        default=0.10,
        ge=0,
        lt=1,
        doc="No change while |target - current| / current is below this fraction.",
    )
    max_step_fraction: float = knob(
        default=0.5,
        gt=0,
        le=100,
        doc="Largest change per tick as a fraction of current replicas (at least 1).",
    )
    scale_up_cooldown_s: float = knob(
        default=30.0,
        unit="s",
        ge=0,
        le=86_400,
        doc="After a change, seconds before the next scale-up.",
    )
    scale_down_cooldown_s: float = knob(
        default=120.0,
        unit="s",
        ge=0,
        le=86_400,
        doc="After a change, seconds before the next scale-down.",
    )
    scale_down_stabilisation_s: float = knob(
        default=300.0,
        unit="s",
        ge=0,
        le=86_400,
        doc="A lower target must hold this many seconds before scaling down; the pool "
        "then shrinks to the highest target seen in that window. With lead-time "
        "planning, a pool whose lead-time bounds held over the history waits its lead "
        "time instead, where that is shorter.",
    )
    kv_link_gbps: float = knob(
        default=400.0,
        unit="Gbit/s",
        gt=0,
        le=100_000,
        doc="KV-cache transfer bandwidth between the pools, Gbit/s.",
    )
    prefill: PoolLimits = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default_factory=PoolLimits,
        doc="The prefill pool (sets the time to first token).",
    )
    decode: PoolLimits = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default_factory=PoolLimits,
        doc="The decode pool (sets the time per output token).",
    )
    gpu_budget: int | None = knob(
        default=None,
        unit="GPUs",
        ge=1,
        le=1_000_000,
        doc="GPUs both pools may use together (a worker uses the profile's "
        "tensor-parallel degree of GPUs); unset (null): unlimited. At least "
        "prefill.min_replicas + decode.min_replicas.",
    )
    calibration: CalibrationConfig = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default_factory=CalibrationConfig, doc="Online model calibration."
    )
    forecast: ForecastConfig = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default_factory=ForecastConfig,
        doc="Forecasting the arrival rate one worker start-up ahead.",
    )
    lead_time: LeadTimeConfig = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default_factory=LeadTimeConfig,
        doc="Sizing for the rate over each pool's lead time, with its uncertainty.",
    )
    metrics: MetricsConfig = knob(  # noqa: RUF009 (knob returns a dataclasses.field)
        default_factory=MetricsConfig,
        doc="Which metrics the observation reads: the engine's flavour and the pools' "
        "label matchers.",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_block(self, "")
        if self.stale_after_s < self.window_s:
            raise ConfigError(
                f"stale_after_s: {self.stale_after_s} must be >= window_s {self.window_s}"
            )
        if self.gpu_budget is not None:
            floor = self.prefill.min_replicas + self.decode.min_replicas
            if self.gpu_budget < floor:
                raise ConfigError(
                    f"gpu_budget: {self.gpu_budget} is below prefill.min_replicas + "
                    f"decode.min_replicas = {floor} (workers, before tensor parallelism)"
                )

    # -- JSON document -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["mode"] = self.mode.value
        data["metrics"]["flavor"] = self.metrics.flavor.value
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ControllerConfig:
        """Parse a full document; unknown or mistyped fields are errors naming them."""
        config = _build(cls, data, "")
        assert isinstance(config, ControllerConfig)
        return config

    def merged(self, patch: Any) -> ControllerConfig:
        """This config with a JSON merge patch (RFC 7386) applied, validated whole."""
        if not isinstance(patch, dict):
            raise ConfigError(f"config: a patch must be a JSON object, got {type(patch).__name__}")
        return ControllerConfig.from_dict(_merge(self.to_dict(), patch))

    def with_mode(self, mode: Mode) -> ControllerConfig:
        return replace(self, mode=mode)


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    known = {item.name: item for item in knob_fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown field")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        item = known[key]
        if item.block is not None:
            kwargs[key] = _build(item.block, value, f"{prefix}{key}.")
        elif isinstance(item.type, type) and issubclass(item.type, enum.Enum):
            try:
                kwargs[key] = item.type(value)
            except ValueError as exc:
                raise ConfigError(
                    f"{prefix}{key}: must be one of {[m.value for m in item.type]}, got {value!r}"
                ) from exc
        else:
            kwargs[key] = value
    if cls is ControllerConfig:
        return cls(**kwargs)
    obj = cls(**kwargs)
    obj.validate(prefix.rstrip("."))
    return obj


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(target)
    for key, value in patch.items():
        if value is None:  # RFC 7386: null removes the key, i.e. back to its default
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
