"""`sara operator`: the kopf operator for ``SLOAutoscaler`` resources (docs/operator.md).

    sara operator --namespace llm --api-listen 0.0.0.0:8080 \\
        --api-token-file /var/run/secrets/sara/api-token/token --peering sara
    sara operator --standalone --all-namespaces

One control loop per resource in the served namespaces. In production several
replicas coordinate through kopf's peering (``--peering NAME``, the default, names
the KopfPeering object; only the highest-priority live peer acts); ``--standalone``
runs without peering, which is right for exactly one replica and for development.
With ``--api-listen`` the REST API (``/v1/config`` ...) serves one resource: the one
``--api-resource`` names, else the only one served.
"""

from __future__ import annotations

import argparse
import logging
import re
import threading
from typing import Any

from cli import common
from cli.common import UsageError
from controller.config import ConfigError

DEFAULT_PEERING = "sara"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

log = logging.getLogger("sara.operator")


def _resource(value: str) -> tuple[str, str]:
    namespace, sep, name = value.partition("/")
    if not sep or not _DNS_LABEL.fullmatch(namespace) or not _DNS_SUBDOMAIN.fullmatch(name):
        raise UsageError(
            f"--api-resource: expected NAMESPACE/NAME of an SLOAutoscaler, got {value!r}"
        )
    return namespace, name


def check_arguments(args: argparse.Namespace) -> None:
    """Every usage error, before anything connects or starts."""
    if not args.namespace and not args.all_namespaces:
        raise UsageError(
            "--namespace: name the namespaces to serve (--namespace NS, repeatable) "
            "or give --all-namespaces"
        )
    for namespace in args.namespace or ():
        if not _DNS_LABEL.fullmatch(namespace):
            raise UsageError(f"--namespace: not a namespace name: {namespace!r}")
    if args.standalone and args.peering is not None:
        raise UsageError("--peering: --standalone runs without peering; give one or the other")
    if args.api_listen is None:
        for flag, value in (
            ("--api-resource", args.api_resource),
            ("--api-token-file", args.api_token_file),
        ):
            if value is not None:
                raise UsageError(f"{flag}: needs --api-listen HOST:PORT (the REST API)")
    else:
        common.parse_listen("--api-listen", args.api_listen)
    if args.api_resource is not None:
        namespace, _ = _resource(args.api_resource)
        if args.namespace and namespace not in args.namespace:
            raise UsageError(
                f"--api-resource: namespace {namespace!r} is not served "
                f"(--namespace {' --namespace '.join(args.namespace)})"
            )
    if args.liveness is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", args.liveness):
        raise UsageError(
            f"--liveness: expected a URL such as http://0.0.0.0:8081/healthz, got {args.liveness!r}"
        )


def cmd_operator(args: argparse.Namespace) -> int:
    check_arguments(args)
    import kopf

    from controller.api import load_api_token
    from controller.operator import OperatorRuntime, create_operator_app, load_configuration

    kopf.configure(log_format=kopf.LogFormat.FULL)
    try:
        configuration = load_configuration(args.kubeconfig, args.context)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    token = None
    if args.api_listen is not None:
        try:
            token = load_api_token(file=args.api_token_file)
        except ConfigError as exc:
            raise UsageError(f"--api-token-file: {exc}") from exc
        if token is None:
            log.warning(
                "no API token (--api-token-file or $SARA_API_TOKEN): the REST API is read-only"
            )
    runtime = OperatorRuntime(configuration=configuration)
    if args.api_listen is not None:
        app = create_operator_app(
            runtime,
            resource=None if args.api_resource is None else _resource(args.api_resource),
            api_token=token,
        )
        host, port = common.parse_listen("--api-listen", args.api_listen)
        threading.Thread(
            target=_serve, args=(app, host, port), name="sara-operator-api", daemon=True
        ).start()
    try:
        kopf.run(
            registry=runtime.registry(),
            settings=runtime.settings(standalone=args.standalone),
            standalone=args.standalone,
            peering_name=None if args.standalone else (args.peering or DEFAULT_PEERING),
            namespaces=args.namespace or (),
            clusterwide=args.all_namespaces,
            liveness_endpoint=args.liveness,
        )
    finally:
        runtime.close()
    return 0


def _serve(app: Any, host: str, port: int) -> None:
    import uvicorn

    # Off the main thread uvicorn leaves the signals alone: SIGTERM reaches kopf, which
    # stops the operator, and this daemon thread ends with the process.
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "operator",
        help="the kopf operator: one control loop per SLOAutoscaler resource",
        description="Run one control loop per SLOAutoscaler resource (sara.io/v1alpha1) and "
        "scale their Deployments; see docs/operator.md.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        action="append",
        metavar="NS",
        help="serve the SLOAutoscalers of this namespace (repeatable)",
    )
    scope.add_argument(
        "--all-namespaces", action="store_true", help="serve every namespace (cluster-wide RBAC)"
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="run without kopf peering (exactly one replica; development)",
    )
    p.add_argument(
        "--peering",
        metavar="NAME",
        help=f"the KopfPeering object the replicas coordinate through (default {DEFAULT_PEERING})",
    )
    p.add_argument("--api-listen", metavar="HOST:PORT", help="serve the REST API here")
    p.add_argument(
        "--api-resource",
        metavar="NAMESPACE/NAME",
        help="the SLOAutoscaler the REST API edits (default: the only one served)",
    )
    p.add_argument(
        "--api-token-file", metavar="FILE", help="bearer token for mutations (else $SARA_API_TOKEN)"
    )
    p.add_argument(
        "--liveness",
        metavar="URL",
        help="kopf's own liveness endpoint, e.g. http://0.0.0.0:8081/healthz",
    )
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig (default: in-cluster, then $KUBECONFIG / ~/.kube/config)",
    )
    p.add_argument("--context", help="kubeconfig context (default: its current context)")
    p.set_defaults(func=cmd_operator)
