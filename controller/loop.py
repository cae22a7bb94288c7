"""The control loop: observe -> decide -> actuate, once per interval.

The loop owns everything with side effects around the pure ``decide``: it reads the
current config from the store (so a REST edit takes effect on the next tick), asks
the actuator for the replicas, the source for the measurements, applies the
decision (unless advisory), publishes metrics, keeps a bounded history, logs each
decision with its reason chain as one JSON line, and persists the policy state so
that a restarted controller resumes where it stopped — same cooldowns, same
stabilisation windows, no burst of changes.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controller.actuator import Actuator, ActuatorError, ActuatorRetryableError
from controller.config import ControllerConfig
from controller.metrics import ControllerMetrics
from controller.observation import PoolObservation
from controller.policy import POOLS, ControllerState, Decision, decide
from controller.profiles import load_profile
from controller.sources.base import ObservationSource
from controller.store import ConfigStore
from controller.tick import TickRecord
from queueing.pools import Pool
from queueing.profile import IterationProfile, ProfileError

log = logging.getLogger("sara.controller")
STATE_FILE = "state.json"


class ControlLoop:
    def __init__(
        self,
        *,
        store: ConfigStore,
        source: ObservationSource,
        actuator: Actuator,
        metrics: ControllerMetrics,
        clock: Callable[[], float] = time.time,
        state_dir: Path | None = None,
        history: int = 500,
        profile_loader: Callable[[str], IterationProfile] = load_profile,
    ) -> None:
        self.store = store
        self.source = source
        self.actuator = actuator
        self.metrics = metrics
        self.clock = clock
        self.state_dir = state_dir
        self.profile_loader = profile_loader
        self._history: deque[TickRecord] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._profiles: dict[str, IterationProfile] = {}
        self.state = self._load_state()

    # -- state persistence ---------------------------------------------------------------

    def _state_path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / STATE_FILE

    def _load_state(self) -> ControllerState:
        path = self._state_path()
        if path is None or not path.exists():
            return ControllerState()
        try:
            return ControllerState.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            # A damaged state file costs the smoothing history, not the controller:
            # start fresh (cooldowns restart too, which errs on the side of holding).
            log.warning("state: cannot read %s (%s); starting from a fresh state", path, exc)
            return ControllerState()

    def _save_state(self) -> None:
        path = self._state_path()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".state-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self.state.to_dict(), handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -- one tick ----------------------------------------------------------------------

    def _profile(self, config: ControllerConfig) -> IterationProfile:
        profile = self._profiles.get(config.profile)
        if profile is None:
            profile = self.profile_loader(config.profile)
            self._profiles = {config.profile: profile}
        return profile

    def tick(self) -> TickRecord:
        now_s = self.clock()
        versioned = self.store.load()
        config = versioned.config
        try:
            replicas = {pool: self.actuator.observe(pool) for pool in Pool}
        except ActuatorError as exc:
            return self._record(
                TickRecord(
                    time_s=now_s,
                    config_version=versioned.version,
                    decision=None,
                    applied=False,
                    error=f"actuator: {exc}",
                )
            )
        try:
            profile = self._profile(config)
        except (OSError, ProfileError) as exc:
            return self._record(
                TickRecord(
                    time_s=now_s,
                    config_version=versioned.version,
                    decision=None,
                    applied=False,
                    error=f"profile: {exc}",
                )
            )
        observation = self.source.observe(now_s=now_s, replicas=replicas)
        started = time.perf_counter()
        decision = decide(observation, self.state, config, now_s=now_s, profile=profile)
        solve_s = time.perf_counter() - started
        error = None
        applied = False
        if decision.actuate:
            try:
                for pool, replicas_now in replicas.items():
                    target = decision.target(pool.value)
                    if target != replicas_now.current_replicas:
                        self.actuator.scale(pool, target)
                applied = True
            except ActuatorRetryableError as exc:
                error = f"actuator (will retry): {exc}"
            except ActuatorError as exc:
                error = f"actuator: {exc}"
        # Keep the decided state even if actuation failed: the next tick observes the
        # real replicas and decides again, and cooldowns stay honest.
        self.state = decision.state
        self._save_state()
        self._publish(decision, replicas, solve_s)
        return self._record(
            TickRecord(
                time_s=now_s,
                config_version=versioned.version,
                decision=decision,
                applied=applied,
                error=error,
            )
        )

    def _publish(
        self, decision: Decision, replicas: dict[Pool, PoolObservation], solve_s: float
    ) -> None:
        self.metrics.record_tick(
            desired={"prefill": decision.prefill_target, "decode": decision.decode_target},
            current={p.value: r.current_replicas for p, r in replicas.items()},
            predicted_p99_s={
                "prefill": decision.predicted_ttft_p99_s,
                "decode": decision.predicted_tpot_p99_s,
            },
            observed_p99_s={
                "prefill": decision.observed_ttft_p99_s,
                "decode": decision.observed_tpot_p99_s,
            },
            raw_rate_rps=decision.raw_rate_rps,
            smoothed_rate_rps=decision.smoothed_rate_rps,
            reasons={pool: decision.reason_for(pool).value for pool in POOLS},
            solve_s=solve_s,
            # The decision's error is relative (observed / predicted - 1); the metric is
            # the ratio itself, so 1 reads as a perfect model on the dashboard.
            model_error={
                pool: None if error is None else 1.0 + error
                for pool, error in decision.model_error.items()
            },
        )

    def _record(self, record: TickRecord) -> TickRecord:
        with self._lock:
            self._history.append(record)
        line = {"event": "tick", **record.as_dict()}
        if record.error:
            log.warning(json.dumps(line, default=str))
        else:
            log.info(json.dumps(line, default=str))
        return record

    # -- what the REST API reads ---------------------------------------------------------

    def decisions(self, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            records = list(self._history)[-limit:]
        return [r.as_dict() for r in reversed(records)]

    def status(self) -> dict[str, Any]:
        with self._lock:
            last = self._history[-1] if self._history else None
        versioned = self.store.load()
        out: dict[str, Any] = {
            "mode": versioned.config.mode.value,
            "config_version": versioned.version,
            "ticks": len(self._history),
            "last_tick_s": None if last is None else last.time_s,
            "last_error": None if last is None else last.error,
            "smoothed_rate_rps": self.state.smoothed_rate_rps,
            "calibration": {p: self.state.pool(p).calibration for p in POOLS},
        }
        if last is not None and last.decision is not None:
            d = last.decision
            out.update(
                current={"prefill": d.prefill_current, "decode": d.decode_current},
                desired={"prefill": d.prefill_target, "decode": d.decode_target},
                raw_rate_rps=d.raw_rate_rps,
                predicted_p99_s={
                    "prefill": d.predicted_ttft_p99_s,
                    "decode": d.predicted_tpot_p99_s,
                },
                observed_p99_s={"prefill": d.observed_ttft_p99_s, "decode": d.observed_tpot_p99_s},
                model_error=d.model_error,
                reasons=[r.as_dict() for r in d.reasons],
            )
        return out

    def ready(self) -> bool:
        """Ready once a tick has completed without an actuator or profile error."""
        with self._lock:
            return any(r.decision is not None for r in self._history)

    # -- the loop ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Tick every ``interval_s`` (read from the config each time) until ``stop``."""
        while not stop.is_set():
            started = self.clock()
            try:
                self.tick()
            except Exception:  # the loop must survive one bad tick; the error is logged
                log.exception("tick failed")
            interval = self.store.load().config.interval_s
            stop.wait(max(0.0, interval - (self.clock() - started)))
