"""`sara controller`: the control loop with its REST API, on this machine or Kubernetes.

    sara controller --actuator advisory --metrics-source prometheus http://127.0.0.1:9090
    sara controller --actuator local --metrics-source scrape http://127.0.0.1:8000/metrics \\
        --prefill-command "sara worker prefill --metrics-listen 127.0.0.1:{port}" \\
        --decode-command "sara worker decode --metrics-listen 127.0.0.1:{port}" \\
        --prefill-port 9400 --decode-port 9500
    sara controller --actuator kubernetes --namespace llm --prefill-deployment prefill \\
        --decode-deployment decode --metrics-source prometheus http://prometheus:9090
    sara controller --metrics-flavor vllm --metrics-source prometheus http://prometheus:9090

The config lives in ``STATE_DIR/config.json`` (the document ``GET /v1/config``
returns); ``--config FILE`` seeds it when the state directory has none yet, so REST
edits survive restarts. The policy state lives in ``STATE_DIR/state.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from cli import common
from cli.common import UsageError
from cli.runtime import run_with_api
from controller.actuator import Actuator
from controller.closing import close_if_closable
from controller.config import ConfigError, ControllerConfig, MetricsFlavor
from controller.loop import ControlLoop
from controller.metrics import ControllerMetrics
from controller.observation import ObservationSource
from controller.store import FileConfigStore
from queueing.pools import Pool

CONFIG_FILE = "config.json"


def _store(args: argparse.Namespace) -> FileConfigStore:
    state_dir = Path(args.state_dir)
    path = state_dir / CONFIG_FILE
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        if args.config and not path.exists():
            seed = ControllerConfig.from_dict(json.loads(Path(args.config).read_text()))
            store = FileConfigStore(path)
            store.replace(seed, expected_version=None)
            return store
        if args.config:
            logging.getLogger("sara.controller").warning(
                "--config %s ignored: %s already holds the config (edit it through the API)",
                args.config,
                path,
            )
        return FileConfigStore(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--config: {exc}") from exc
    except ConfigError as exc:
        raise UsageError(f"--config: {exc}") from exc


def _with_flavor(store: FileConfigStore, flavor: str | None) -> ControllerConfig:
    """The stored config, its metrics flavour set to ``--metrics-flavor`` when given
    (written to the store, so that ``GET /v1/config`` shows what is queried)."""
    current = store.load()
    config = current.config
    if flavor is None or config.metrics.flavor.value == flavor:
        return config
    try:
        changed = config.merged({"metrics": {"flavor": flavor}})
    except ConfigError as exc:
        raise UsageError(f"--metrics-flavor: {exc}") from exc
    return store.replace(changed, expected_version=current.version).config


def _source(args: argparse.Namespace, config: ControllerConfig) -> ObservationSource:
    kind, *targets = args.metrics_source
    if kind == "prometheus" and len(targets) == 1:
        from controller.sources.prometheus import PrometheusSource

        return PrometheusSource(
            targets[0],
            window_s=config.window_s,
            burst_window_s=config.burst_window_s,
            scv_span_s=config.lead_time.pool_s,
            metrics=config.metrics,
        )
    if kind == "scrape" and config.metrics.flavor is not MetricsFlavor.SARA:
        raise UsageError(
            f"--metrics-flavor: the scrape source reads SARA's own metrics only, got "
            f"{config.metrics.flavor.value!r} (use --metrics-source prometheus URL)"
        )
    if kind == "scrape" and targets:
        from controller.sources.scrape import ScrapeSource

        urls = [u for t in targets for u in t.split(",") if u]
        return ScrapeSource(
            urls,
            window_s=config.window_s,
            burst_window_s=config.burst_window_s,
            scv_span_s=config.lead_time.pool_s,
            clock=time.time,
        )
    raise UsageError(
        "--metrics-source: expected 'prometheus URL' or 'scrape URL[,URL...]', "
        f"got {' '.join(args.metrics_source)!r}"
    )


def _actuator(args: argparse.Namespace) -> Actuator:
    if args.actuator == "advisory":
        from controller.actuators.advisory import AdvisoryActuator

        return AdvisoryActuator(
            {Pool.PREFILL: args.initial_prefill, Pool.DECODE: args.initial_decode}
        )
    if args.actuator == "local":
        from controller.actuators.local import LocalProcessActuator

        if not args.prefill_command or not args.decode_command:
            raise UsageError(
                "--prefill-command: the local actuator needs --prefill-command and --decode-command"
            )
        from controller.actuators.local import http_readiness

        ports = {
            pool: port
            for pool, port in ((Pool.PREFILL, args.prefill_port), (Pool.DECODE, args.decode_port))
            if port is not None
        }
        try:
            return LocalProcessActuator(
                {
                    Pool.PREFILL: shlex.split(args.prefill_command),
                    Pool.DECODE: shlex.split(args.decode_command),
                },
                log_dir=Path(args.state_dir) / "logs",
                ports=ports,
                # A worker counts as ready once its /readyz says so (needs both ports).
                readiness=(
                    http_readiness("http://127.0.0.1:{port}/readyz") if len(ports) == 2 else None
                ),
            )
        except ValueError as exc:
            raise UsageError(f"--prefill-command: {exc}") from exc
    if args.actuator == "kubernetes":
        from controller.actuators.kubernetes import KubernetesActuator

        if not (args.namespace and args.prefill_deployment and args.decode_deployment):
            raise UsageError(
                "--namespace: the kubernetes actuator needs --namespace, "
                "--prefill-deployment and --decode-deployment"
            )
        return KubernetesActuator.from_environment(
            namespace=args.namespace,
            deployments={
                Pool.PREFILL: args.prefill_deployment,
                Pool.DECODE: args.decode_deployment,
            },
            kubeconfig=args.kubeconfig,
        )
    raise UsageError(f"--actuator: unknown actuator {args.actuator!r}")


def cmd_controller(args: argparse.Namespace) -> int:
    from controller.api import load_api_token

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    host, port = common.parse_listen("--listen", args.listen)
    store = _store(args)
    config = _with_flavor(store, args.metrics_flavor)
    source = _source(args, config)
    actuator = _actuator(args)
    try:
        token = load_api_token(file=args.api_token_file)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--api-token-file: {exc}") from exc
    metrics = ControllerMetrics()
    loop = ControlLoop(
        store=store,
        source=source,
        actuator=actuator,
        metrics=metrics,
        state_dir=Path(args.state_dir),
    )
    if args.once:
        record = loop.tick()
        print(json.dumps(record.as_dict(), indent=2, default=str))
        close_if_closable(actuator)
        return 0 if record.error is None else 1
    try:
        run_with_api(loop, token=token, host=host, port=port)
    finally:
        close_if_closable(actuator)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("controller", help="run the control loop with its REST API")
    p.add_argument("--config", metavar="FILE", help="config JSON that seeds the state dir")
    p.add_argument(
        "--state-dir",
        default=".sara",
        metavar="DIR",
        help="where config.json, state.json and worker logs live (default .sara)",
    )
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    p.add_argument("--actuator", choices=("local", "kubernetes", "advisory"), default="advisory")
    p.add_argument(
        "--metrics-source",
        nargs="+",
        default=["prometheus", "http://127.0.0.1:9090"],
        metavar="KIND",
        help="'prometheus URL' or 'scrape URL[,URL...]'",
    )
    p.add_argument(
        "--metrics-flavor",
        choices=[flavor.value for flavor in MetricsFlavor if flavor is not MetricsFlavor.CUSTOM],
        help="whose metric names Prometheus holds: sara (default), vllm or sglang; sets "
        "metrics.flavor in the stored config (custom: set the templates through --config)",
    )
    p.add_argument(
        "--prefill-command",
        help="local: command template of a prefill worker "
        "({index}, {pool}, {port} are substituted)",
    )
    p.add_argument("--decode-command", help="local: command template of a decode worker")
    p.add_argument("--prefill-port", type=int, help="local: {port} of prefill worker i is this + i")
    p.add_argument("--decode-port", type=int, help="local: {port} of decode worker i is this + i")
    p.add_argument("--namespace", help="kubernetes: namespace of the Deployments")
    p.add_argument("--prefill-deployment", help="kubernetes: the prefill Deployment")
    p.add_argument("--decode-deployment", help="kubernetes: the decode Deployment")
    p.add_argument(
        "--kubeconfig",
        help="kubernetes: kubeconfig (default: in-cluster, then $KUBECONFIG / ~/.kube/config)",
    )
    p.add_argument("--initial-prefill", type=int, default=1, help="advisory: current prefill")
    p.add_argument("--initial-decode", type=int, default=1, help="advisory: current decode")
    p.add_argument("--api-token-file", help="bearer token for mutations (else $SARA_API_TOKEN)")
    p.add_argument("--once", action="store_true", help="run one tick, print it, exit")
    p.set_defaults(func=cmd_controller)
