"""The controller's configuration: one frozen document, validated whole.

The same JSON document is what ``GET /v1/config`` returns, what ``--config FILE``
reads, and (in Kubernetes mode) the ``SLOAutoscaler`` spec's knobs. Defaults follow
the SARA notes (30 s windows, EMA 0.7·old + 0.3·new, 10 % dead-band, at most 50 %
change per tick, one-window cooldown, 10–20 % headroom) and the Kubernetes HPA
(300 s scale-down stabilisation).
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


class ConfigError(ValueError):
    """A configuration is invalid; the message starts with the dotted field name."""


class Mode(enum.Enum):
    ACTIVE = "active"  # decide and scale
    ADVISORY = "advisory"  # decide and publish, never scale


def _number(path: str, value: Any, *, minimum: float, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise ConfigError(f"{path}: must be {relation} {minimum:g}, got {value!r}")


def _integer(path: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value!r}")


def _fraction(path: str, value: Any, *, upper_open: bool = True) -> None:
    _number(path, value, minimum=0.0)
    if value > 1.0 or (upper_open and value == 1.0):
        raise ConfigError(f"{path}: must be in [0, 1{')' if upper_open else ']'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PoolLimits:
    """Replica bounds of one pool."""

    min_replicas: int = 1
    max_replicas: int = 64

    def validate(self, path: str) -> None:
        _integer(f"{path}.min_replicas", self.min_replicas, minimum=0)
        _integer(f"{path}.max_replicas", self.max_replicas, minimum=1)
        if self.min_replicas > self.max_replicas:
            raise ConfigError(
                f"{path}.min_replicas: {self.min_replicas} > max_replicas {self.max_replicas}"
            )


@dataclass(frozen=True, kw_only=True)
class SloConfig:
    ttft_p99_s: float = 2.0
    tpot_p99_s: float = 0.1

    def validate(self, path: str) -> None:
        _number(f"{path}.ttft_p99_s", self.ttft_p99_s, minimum=0.0, strict=True)
        _number(f"{path}.tpot_p99_s", self.tpot_p99_s, minimum=0.0, strict=True)


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """Online correction of the model by observed/predicted P99 per pool."""

    enabled: bool = True
    ema_weight: float = 0.2  # weight of the newest observed/predicted ratio
    min_factor: float = 0.5
    max_factor: float = 2.0

    def validate(self, path: str) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{path}.enabled: must be true or false, got {self.enabled!r}")
        _fraction(f"{path}.ema_weight", self.ema_weight, upper_open=False)
        _number(f"{path}.min_factor", self.min_factor, minimum=0.0, strict=True)
        _number(f"{path}.max_factor", self.max_factor, minimum=1.0)
        if self.min_factor > 1.0:
            raise ConfigError(f"{path}.min_factor: must be <= 1, got {self.min_factor!r}")


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Every knob of the control loop, with its default."""

    mode: Mode = Mode.ACTIVE
    profile: str = "llama-3-8b@h100-sxm"  # built-in profile name or profile JSON path
    slo: SloConfig = field(default_factory=SloConfig)
    headroom: float = 0.15  # plan for SLO / (1 + headroom)
    interval_s: float = 30.0  # one tick per interval
    window_s: float = 30.0  # measurement window
    stale_after_s: float = 90.0  # observations older than this are stale
    ema_weight: float = 0.3  # smoothed = (1 - w) * old + w * measured  (0.7 / 0.3)
    burst_window_s: float = 5.0  # short window for burst detection
    burst_ratio: float = 1.5  # short-window rate above ratio * EMA bypasses smoothing
    dead_band: float = 0.10  # ignore |target - current| / current below this
    max_step_fraction: float = 0.5  # at most 50 % change per tick (and at least 1)
    scale_up_cooldown_s: float = 30.0  # after a change, one window before scaling up
    scale_down_cooldown_s: float = 120.0
    scale_down_stabilisation_s: float = 300.0  # a lower target must hold this long
    kv_link_gbps: float = 400.0
    prefill: PoolLimits = field(default_factory=PoolLimits)
    decode: PoolLimits = field(default_factory=PoolLimits)
    gpu_budget: int | None = None  # total GPUs both pools may use; None: unlimited
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.mode, Mode):
            raise ConfigError(f"mode: must be one of {[m.value for m in Mode]}, got {self.mode!r}")
        if not isinstance(self.profile, str) or not self.profile:
            raise ConfigError(f"profile: must be a non-empty string, got {self.profile!r}")
        self.slo.validate("slo")
        _number("headroom", self.headroom, minimum=0.0)
        if self.headroom >= 10:
            raise ConfigError(f"headroom: must be < 10, got {self.headroom!r}")
        for name in ("interval_s", "window_s", "stale_after_s", "burst_window_s", "kv_link_gbps"):
            _number(name, getattr(self, name), minimum=0.0, strict=True)
        _fraction("ema_weight", self.ema_weight, upper_open=False)
        if self.ema_weight == 0:
            raise ConfigError("ema_weight: must be > 0 (0 would never follow the load)")
        _number("burst_ratio", self.burst_ratio, minimum=1.0, strict=True)
        _fraction("dead_band", self.dead_band)
        _number("max_step_fraction", self.max_step_fraction, minimum=0.0, strict=True)
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_stabilisation_s"):
            _number(name, getattr(self, name), minimum=0.0)
        if self.stale_after_s < self.window_s:
            raise ConfigError(
                f"stale_after_s: {self.stale_after_s} must be >= window_s {self.window_s}"
            )
        self.prefill.validate("prefill")
        self.decode.validate("decode")
        if self.gpu_budget is not None:
            _integer("gpu_budget", self.gpu_budget, minimum=1)
            floor = self.prefill.min_replicas + self.decode.min_replicas
            if self.gpu_budget < floor:
                raise ConfigError(
                    f"gpu_budget: {self.gpu_budget} is below prefill.min_replicas + "
                    f"decode.min_replicas = {floor} (workers, before tensor parallelism)"
                )
        self.calibration.validate("calibration")

    # -- JSON document -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["mode"] = self.mode.value
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


_NESTED: dict[str, type] = {
    "slo": SloConfig,
    "prefill": PoolLimits,
    "decode": PoolLimits,
    "calibration": CalibrationConfig,
}


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown field")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if cls is ControllerConfig and key in _NESTED:
            kwargs[key] = _build(_NESTED[key], value, f"{prefix}{key}.")
        elif cls is ControllerConfig and key == "mode":
            try:
                kwargs[key] = Mode(value)
            except ValueError as exc:
                raise ConfigError(
                    f"mode: must be one of {[m.value for m in Mode]}, got {value!r}"
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
