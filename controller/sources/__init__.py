"""Observation sources: where the controller's measurements come from (DESIGN §3.5, §4).

- ``PrometheusSource``: PromQL instant queries against Prometheus's HTTP API.
- ``ScrapeSource``: scrapes the router's and workers' ``/metrics`` itself, for a
  machine without Prometheus.

Both implement ``ObservationSource``: a measurement that cannot be made is ``None``
in the ``Observation``, never an exception. docs/observation.md lists the queries.
"""

from __future__ import annotations

from controller.observation import ObservationSource
from controller.sources.base import MeasurementUnavailable
from controller.sources.prometheus import PrometheusSource
from controller.sources.scrape import ScrapeSource

__all__ = ["MeasurementUnavailable", "ObservationSource", "PrometheusSource", "ScrapeSource"]
