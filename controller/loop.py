"""The control loop: ``controller.tick.run_tick`` once per interval.

The loop owns everything with side effects around the pure tick: it reads the
current config from the store (so a REST edit takes effect on the next tick),
hands the tick its actuator, source, profile loader, capacity-model cache and the
history of measured rates (for the forecaster, when configured), publishes
metrics, keeps a bounded history, logs each decision with its reason chain as one
JSON line, and persists the policy state so
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

from controller.actuator import Actuator
from controller.config import ControllerConfig
from controller.metrics import ControllerMetrics
from controller.observation import ObservationSource
from controller.policy import CapacityModels, ControllerState
from controller.policy.forecast import RecordedArrivals
from controller.profiles import load_profile
from controller.sources.base import MeasurementUnavailable
from controller.store import ConfigStore
from controller.tick import TickRecord, run_tick
from queueing.profile import IterationProfile

log = logging.getLogger("sara.controller")
STATE_FILE = "state.json"
ARRIVALS_FILE = "arrivals.json"


def _keep_s(config: ControllerConfig) -> float:
    """How much rate history the forecaster reads: a period and its smoothing window."""
    forecast = config.forecast
    return forecast.period_s + forecast.seasonal_smoothing_s + config.window_s


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
        self.models = CapacityModels()  # this loop's, kept while the inputs hold
        # The rates this loop measured, for the forecaster: warm-started from the
        # source's own history when it keeps one (Prometheus), else from the record
        # the loop persisted, so a restart does not wait a trend window, or a day.
        self.arrivals = RecordedArrivals(keep_s=_keep_s(store.load().config))
        self.arrivals_source = self._warm_start_arrivals()
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

    def _arrivals_path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / ARRIVALS_FILE

    def _warm_start_arrivals(self) -> str:
        """Fill the arrival record before the first tick; returns where it came from
        ("metrics", "state" or "none")."""
        if self._seed_from_source():
            return "metrics"
        path = self._arrivals_path()
        if path is not None and path.exists():
            try:
                self.arrivals.restore(json.loads(path.read_text(encoding="utf-8")))
                return "state"
            except (OSError, ValueError, TypeError) as exc:
                log.warning("arrivals: cannot read %s (%s); starting empty", path, exc)
        return "none"

    def _seed_from_source(self) -> bool:
        """Seed the record from the source's own history (a ``query_range`` of the
        arrival rate over the record's span at the measurement window's step), when
        the source keeps one; whether anything was seeded."""
        config = self.store.load().config
        history = getattr(self.source, "arrival_history", None)
        if not callable(history):
            return False
        now_s = self.clock()
        try:
            points = history(
                start_s=now_s - self.arrivals.keep_s, end_s=now_s, step_s=config.window_s
            )
        except (MeasurementUnavailable, ValueError) as exc:
            log.warning("arrivals: no history from the metrics (%s)", exc)
            return False
        return self.arrivals.seed(points, window_s=config.window_s) > 0

    def replace_source(self, source: ObservationSource, *, same_series: bool) -> None:
        """Observe through ``source`` from the next tick. Unless it measures the same
        series (``same_series``: only the scale targets changed), its arrivals are
        another record: the old one is dropped and the new source's history read, as
        at start-up, so the forecaster neither plans on the old series nor waits a
        trend window (or a day) for the new one."""
        self.source = source
        if same_series:
            return
        self.arrivals = RecordedArrivals(keep_s=_keep_s(self.store.load().config))
        self.arrivals_source = "metrics" if self._seed_from_source() else "none"

    def _save_arrivals(self) -> None:
        path = self._arrivals_path()
        if path is None:
            return
        tmp = path.with_name(f".{ARRIVALS_FILE}.tmp")
        tmp.write_text(json.dumps(self.arrivals.to_list()), encoding="utf-8")
        os.replace(tmp, path)

    # -- one tick ----------------------------------------------------------------------

    def _profile(self, spec: str) -> IterationProfile:
        """The profile ``spec`` names, read once while the config keeps naming it."""
        profile = self._profiles.get(spec)
        if profile is None:
            profile = self.profile_loader(spec)
            self._profiles = {spec: profile}
        return profile

    def tick(self) -> TickRecord:
        now_s = self.clock()
        versioned = self.store.load()
        config = versioned.config
        self.arrivals.keep_s = _keep_s(config)
        done = run_tick(
            now_s=now_s,
            config=config,
            config_version=versioned.version,
            state=self.state,
            source=self.source,
            actuator=self.actuator,
            load_profile=self._profile,
            models=self.models,
            history=self.arrivals,
            timer=time.perf_counter,
        )
        if done.record.decision is not None:
            self.state = done.state
            self._save_state()
            self._save_arrivals()
            self.metrics.record_decision(done.record.decision, solve_s=done.decide_s)
        return self._record(done.record)

    def _record(self, record: TickRecord) -> TickRecord:
        with self._lock:
            self._history.append(record)
        self.metrics.record_outcome(failed=record.error is not None)
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
            "calibration": self.state.pools.map(lambda p: p.calibration).as_dict(),
        }
        if last is not None and last.decision is not None:
            d = last.decision.pools
            out.update(
                current=d.map(lambda p: p.current).as_dict(),
                desired=d.map(lambda p: p.target).as_dict(),
                raw_rate_rps=last.decision.raw_rate_rps,
                predicted_p99_s=d.map(lambda p: p.predicted_p99_s).as_dict(),
                observed_p99_s=d.map(lambda p: p.observed_p99_s).as_dict(),
                model_error=d.map(lambda p: p.model_error).as_dict(),
                reasons=[r.as_dict() for r in last.decision.reasons],
            )
        return out

    def readiness(self) -> tuple[bool, str]:
        """Ready while the latest tick succeeded; else not, with that tick's error.

        A controller whose ticks fail scales nothing: a killed worker is not
        replaced. Saying so on ``/readyz`` (and ``sara_controller_tick_failing``)
        turns a silent stop into one that probes and alerts see within a tick.
        """
        with self._lock:
            last = self._history[-1] if self._history else None
        if last is None:
            return False, "no control tick has completed yet"
        if last.error is not None:
            return False, f"the latest tick failed: {last.error}"
        return True, "ready"

    def ready(self) -> bool:
        return self.readiness()[0]

    # -- the loop ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Tick every ``interval_s`` (read from the config each time) until ``stop``."""
        while not stop.is_set():
            started = self.clock()
            try:
                self.tick()
            except Exception as exc:  # the loop must survive one bad tick
                log.exception("tick failed")
                try:
                    version = self.store.load().version
                except Exception:  # the store may be what failed
                    version = "unknown"
                self._record(
                    TickRecord(
                        time_s=started,
                        config_version=version,
                        decision=None,
                        applied=False,
                        error=f"tick: {type(exc).__name__}: {exc}",
                    )
                )
            interval = self.store.load().config.interval_s
            stop.wait(max(0.0, interval - (self.clock() - started)))
