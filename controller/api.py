"""The controller's REST API (DESIGN §4): config, status, decisions, probes, metrics.

This is the only place Pydantic appears. The models below are generated from the
``ControllerConfig`` fields' metadata (``controller.config.knob``): types, ranges,
defaults and descriptions, hence the OpenAPI schema; every accepted request is then
converted to the frozen dataclass, whose validation is the single source of the
cross-field rules (min <= max, a GPU budget that covers
the minimums, ...). Whatever is rejected is a 4xx and leaves the stored config as
it was; no input can cause a 5xx.

Auth is a gate in front of the routes, not a dependency, because FastAPI parses
and validates the body before dependencies run: a client without the token gets
401/403 whatever it sent, never a validation report. PUT and PATCH always need
``Authorization: Bearer <token>``; reads need it only with ``open_reads=False``;
the probes and the OpenAPI document are always open.
"""

from __future__ import annotations

import enum
import functools
import hmac
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Body, FastAPI, Header, HTTPException, Query, Request, Security
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.routing import Route

from controller.config import ConfigError, ControllerConfig, knob_fields
from controller.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from controller.profiles import ProfileSources
from controller.store import ConfigStore, VersionConflictError, VersionedConfig
from queueing.profile import ProfileError

TOKEN_ENV_VAR = "SARA_API_TOKEN"
DEFAULT_DECISIONS_LIMIT = 50
MAX_DECISIONS_LIMIT = 1000
MERGE_PATCH_MEDIA_TYPE = "application/merge-patch+json"
_PATCH_ATTEMPTS = 5  # merges retried when another writer lands between load and replace
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_ALWAYS_OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_IF_MATCH_DOC = (
    "Write only if this is still the current version (the ETag of a GET), else 409. "
    "Without it the last writer wins."
)

# --------------------------------------------------------------------------------------
# The document's schema (REST edge only)
# --------------------------------------------------------------------------------------

# strict: no "2" for 2, no 1 for true, no 2.0 for an integer; the document's own
# validation would reject most of these too, but a coercion here would hide them.
_DOCUMENT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Document(BaseModel):
    """The base of the generated config models."""

    model_config = _DOCUMENT


class _ConfigDocumentBase(_Document):
    def to_config(self) -> ControllerConfig:
        """The frozen config; raises ``ConfigError`` (field named) on a cross-field rule."""
        return ControllerConfig.from_dict(self.model_dump(mode="json"))


@functools.cache  # one model per block: prefill and decode share PoolLimitsModel
def _model_of(cls: type, name: str, base: type[BaseModel] = _Document) -> type[BaseModel]:
    """The Pydantic model of config block ``cls``, field by field from its ``knob``
    metadata: type, default, bounds and description (the OpenAPI of /v1/config)."""
    definitions: dict[str, Any] = {}
    for item in knob_fields(cls):
        meta = item.knob
        if item.block is not None:
            nested = _model_of(item.block, f"{item.block.__name__.removesuffix('Config')}Model")
            definitions[item.name] = (
                nested,
                Field(default_factory=nested, description=meta.doc),
            )
            continue
        default = item.default
        is_enum = isinstance(item.type, type) and issubclass(item.type, enum.Enum)
        definitions[item.name] = (
            item.type,
            Field(
                default=default,
                description=meta.doc,
                gt=meta.gt,
                ge=meta.ge,
                lt=meta.lt,
                le=meta.le,
                min_length=meta.min_length,
                # JSON has no enums: the value arrives as its string.
                strict=False if is_enum else None,
            ),
        )
    doc = (cls.__doc__ or "").strip()
    return create_model(name, __base__=base, __doc__=doc, **definitions)


if TYPE_CHECKING:
    ConfigDocument = _ConfigDocumentBase  # its fields are generated
else:
    ConfigDocument = _model_of(ControllerConfig, "ConfigDocument", _ConfigDocumentBase)


def _patch_model(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with every field optional and absent unless sent (an RFC 7386 patch).

    ``null`` is accepted everywhere: in a merge patch it removes the key, which puts
    the field back to its default. Ranges and descriptions are the model's own.
    """
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation: Any = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            annotation = _patch_model(annotation)
        elif info.metadata:
            annotation = Annotated[(annotation, *info.metadata)]
        description = f"{info.description} null: back to the default."
        fields[name] = (annotation | None, Field(default=None, description=description))
    name = model.__name__.removesuffix("Model").removesuffix("Document")
    return create_model(
        f"{name}Patch", __config__=_DOCUMENT, __doc__=f"A merge patch of {name}.", **fields
    )


if TYPE_CHECKING:
    ConfigPatch = BaseModel  # its fields are generated, so the checker sees the base
else:
    ConfigPatch = _patch_model(ConfigDocument)


class Problem(BaseModel):
    """An error other than a validation failure."""

    detail: str


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------


def create_app(
    *,
    store: ConfigStore,
    status: Callable[[], Mapping[str, Any]],
    decisions: Callable[[int], Sequence[Mapping[str, Any]]],
    ready: Callable[[], tuple[bool, str]],
    metrics: Callable[[], bytes],
    api_token: str | None,
    open_reads: bool = True,
    profiles: ProfileSources = ProfileSources(),  # noqa: B008 (frozen, immutable)
) -> FastAPI:
    """The controller's FastAPI app over ``store`` and the loop's read-outs.

    ``ready`` says whether the loop serves, and why not. ``profiles`` is where a
    written config may take its ``profile`` from (built-ins only by default): a new
    profile is loaded before the config is stored, so a name that is not a profile,
    or a file outside those directories, is a 422 and the config stays as it was.

    With ``api_token=None`` the config cannot be changed through the API (PUT and
    PATCH answer 403). ``open_reads=False`` puts the reads (config, status,
    decisions, metrics) behind the token too, which needs a token.
    """
    if api_token is not None:
        _check_token(api_token, where="api_token")
    elif not open_reads:
        raise ConfigError("api_token: open_reads=False needs a token, or nothing could read")

    app = FastAPI(
        title="SARA controller",
        version="v1",
        description="SLO-driven autoscaler for disaggregated LLM inference. "
        "See docs/api.md for examples.",
    )
    # Documents the bearer scheme in OpenAPI; the gate below is what enforces it.
    bearer = Security(
        HTTPBearer(auto_error=False, description=f"The API token (${TOKEN_ENV_VAR} or a file).")
    )
    unauthorised = _problems(401, 403)
    read_guard = [] if open_reads else [bearer]
    read_problems = {} if open_reads else unauthorised
    etag_header = {
        "ETag": {"description": "The config's version, quoted.", "schema": {"type": "string"}}
    }

    allowed_methods: dict[str, str] = {}  # path -> Allow header, filled once routes exist

    @app.middleware("http")
    async def gate(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        refusal = _refusal(request, api_token=api_token, open_reads=open_reads)
        if refusal is None:
            refusal = _unsupported_media_type(request)
        if refusal is not None:
            return refusal
        response = await call_next(request)
        if response.status_code == 405 and request.url.path in allowed_methods:
            # Starlette answers from the first route on the path, which names only its
            # own method; RFC 9110 wants every method the resource supports.
            response.headers["Allow"] = allowed_methods[request.url.path]
        return response

    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(ConfigError, _config_error)

    def document(current: VersionedConfig) -> JSONResponse:
        return JSONResponse(current.config.to_dict(), headers={"ETag": f'"{current.version}"'})

    @app.get(
        "/v1/config",
        response_model=ConfigDocument,
        responses={200: {"headers": etag_header}, **read_problems},
        dependencies=read_guard,
        tags=["config"],
    )
    def get_config() -> JSONResponse:
        """The config document; its ETag is the version for If-Match."""
        return document(store.load())

    @app.put(
        "/v1/config",
        response_model=ConfigDocument,
        responses={200: {"headers": etag_header}, **_problems(400, 401, 403, 409, 415)},
        dependencies=[bearer],
        tags=["config"],
    )
    def put_config(
        body: ConfigDocument,
        if_match: Annotated[str | None, Header(description=_IF_MATCH_DOC)] = None,
    ) -> JSONResponse:
        """Replace the whole document (fields left out take their defaults)."""
        config = body.to_config()
        current = store.load()
        _check_profile(profiles, config, current.config)
        try:
            return document(
                store.replace(config, expected_version=_expected_version(if_match, current))
            )
        except VersionConflictError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc

    @app.patch(
        "/v1/config",
        response_model=ConfigDocument,
        responses={200: {"headers": etag_header}, **_problems(400, 401, 403, 409, 415)},
        dependencies=[bearer],
        tags=["config"],
    )
    def patch_config(
        body: Annotated[ConfigPatch, Body(media_type=MERGE_PATCH_MEDIA_TYPE)],
        if_match: Annotated[str | None, Header(description=_IF_MATCH_DOC)] = None,
    ) -> JSONResponse:
        """Apply a JSON merge patch (RFC 7386); null puts a field back to its default."""
        patch = body.model_dump(mode="json", exclude_unset=True)
        for _ in range(_PATCH_ATTEMPTS):
            current = store.load()
            expected = _expected_version(if_match, current)
            config = current.config.merged(patch)
            _check_profile(profiles, config, current.config)
            try:
                # Always conditional on the version merged onto, so a concurrent write
                # is never lost: without If-Match the patch is merged again onto it.
                return document(store.replace(config, expected_version=current.version))
            except VersionConflictError as exc:
                if expected is not None:
                    raise HTTPException(status_code=409, detail=str(exc)) from exc
        raise HTTPException(
            status_code=409, detail="config: changed concurrently while patching; retry"
        )

    @app.get(
        "/v1/status",
        response_model=dict[str, Any],
        responses=read_problems,
        dependencies=read_guard,
        tags=["loop"],
    )
    def get_status() -> JSONResponse:
        """The control loop's latest state (replicas, predictions, last reasons)."""
        return JSONResponse(_json_safe(status()))

    @app.get(
        "/v1/decisions",
        response_model=list[dict[str, Any]],
        responses=read_problems,
        dependencies=read_guard,
        tags=["loop"],
    )
    def get_decisions(
        limit: Annotated[
            int,
            Query(ge=1, le=MAX_DECISIONS_LIMIT, description="How many, newest first."),
        ] = DEFAULT_DECISIONS_LIMIT,
    ) -> JSONResponse:
        """The most recent decisions with their reason chains."""
        return JSONResponse(_json_safe(list(decisions(limit))))

    @app.get("/healthz", tags=["probes"])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        responses={503: {"model": Problem, "description": "Not ready yet."}},
        tags=["probes"],
    )
    def readyz() -> JSONResponse:
        """Readiness: 200 while the loop's latest tick succeeded; 503 with the reason
        before the first tick and after a failed one."""
        ok, reason = ready()
        if ok:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"detail": f"not ready: {reason}"}, status_code=503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text exposition.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **read_problems,
        },
        dependencies=read_guard,
        tags=["probes"],
    )
    def get_metrics() -> Response:
        """The controller's metrics in the Prometheus text format."""
        return Response(content=metrics(), media_type=METRICS_CONTENT_TYPE)

    by_path: dict[str, set[str]] = {}
    for route in app.routes:
        if isinstance(route, Route) and route.methods:
            by_path.setdefault(route.path, set()).update(route.methods)
    allowed_methods.update({path: ", ".join(sorted(ms)) for path, ms in by_path.items()})
    return app


# --------------------------------------------------------------------------------------
# The gate: auth and media types, before any route reads the body
# --------------------------------------------------------------------------------------


def _refusal(request: Request, *, api_token: str | None, open_reads: bool) -> Response | None:
    write = request.method not in _SAFE_METHODS
    if not write and (open_reads or _always_open(request)):
        return None
    if api_token is None:
        return _problem(
            403,
            "Authorization: no API token is configured on this controller, so the config "
            f"cannot be changed through the API (set {TOKEN_ENV_VAR} or a token file)",
        )
    header = request.headers.get("authorization")
    if header is None:
        return _problem(
            401,
            "Authorization: a bearer token is required",
            headers={"WWW-Authenticate": 'Bearer realm="sara"'},
        )
    scheme, _, presented = header.strip().partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        return _problem(
            401,
            "Authorization: expected 'Bearer <token>'",
            headers={"WWW-Authenticate": 'Bearer realm="sara", error="invalid_request"'},
        )
    # Constant time, on bytes: the header arrives latin-1 decoded, the token is ASCII.
    if not hmac.compare_digest(presented.encode("latin-1"), api_token.encode("ascii")):
        return _problem(403, "Authorization: the bearer token is not valid")
    return None


def _always_open(request: Request) -> bool:
    app = request.app
    docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    return request.url.path in _ALWAYS_OPEN_PATHS or request.url.path in docs


def _unsupported_media_type(request: Request) -> Response | None:
    if request.method not in {"PUT", "PATCH"} or request.url.path != "/v1/config":
        return None
    accepted = ["application/json"]
    if request.method == "PATCH":
        accepted.append(MERGE_PATCH_MEDIA_TYPE)
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type in accepted:
        return None
    return _problem(
        415,
        f"Content-Type: expected {' or '.join(accepted)}, got {media_type or 'none'}",
    )


def _problem(status_code: int, detail: str, headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse({"detail": detail}, status_code=status_code, headers=headers)


_PROBLEM_DESCRIPTIONS = {
    400: "The body could not be parsed (e.g. an integer beyond the JSON parser's limit).",
    401: "No bearer token, or a malformed Authorization header.",
    403: "The token is wrong, or no token is configured (writes disabled).",
    409: "If-Match names a version that is no longer current; nothing changed.",
    415: "The Content-Type is not JSON (or merge-patch JSON for PATCH).",
}


def _problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": Problem, "description": _PROBLEM_DESCRIPTIONS[code]} for code in codes}


# --------------------------------------------------------------------------------------
# Errors and versions
# --------------------------------------------------------------------------------------


def _check_profile(
    profiles: ProfileSources, config: ControllerConfig, current: ControllerConfig
) -> None:
    """A new ``profile`` must load from ``profiles``; an unchanged one was admitted."""
    if config.profile == current.profile:
        return
    try:
        profiles.load(config.profile)
    except ProfileError as exc:
        raise ConfigError(str(exc)) from exc


def _expected_version(if_match: str | None, current: VersionedConfig) -> str | None:
    """The version a write must find, from If-Match; None when there is no precondition.

    Raises 409 when no listed tag is the current version. ``*`` matches any version
    (the config always exists); weak tags never match (If-Match compares strongly).
    """
    if if_match is None:
        return None
    tags = [tag.strip() for tag in if_match.split(",") if tag.strip()]
    if "*" in tags:
        return None
    strong = {tag.strip('"') for tag in tags if not tag.startswith("W/")}
    if current.version in strong:
        return current.version
    raise HTTPException(
        status_code=409,
        detail=f'If-Match: {if_match} is not the current version "{current.version}"; '
        "read the config again and retry",
    )


async def _request_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": [_named(error) for error in exc.errors()]}, status_code=422)


def _named(error: Mapping[str, Any]) -> dict[str, Any]:
    """A Pydantic/FastAPI error, its message prefixed with the dotted field name.

    The submitted input is not echoed back: it can be large, and it is the client's.
    """
    loc = list(error.get("loc", ()))
    kind = str(error.get("type", "value_error"))
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "cannot be parsed")
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return {"loc": loc, "msg": f"body: not valid JSON{at}: {reason}", "type": kind}
    field = ".".join(str(part) for part in loc[1:]) or (str(loc[0]) if loc else "body")
    message = "unknown field" if kind == "extra_forbidden" else str(error.get("msg", "invalid"))
    return {"loc": loc, "msg": f"{field}: {message}", "type": kind}


async def _config_error(request: Request, exc: Exception) -> Response:
    """A ``ConfigError`` from the document's own validation, in the 422 format."""
    message = str(exc)
    field = message.partition(": ")[0]
    if field == "config" or not field or " " in field:
        loc: list[str | int] = ["body"]
    else:
        loc = ["body", *field.split(".")]
    return JSONResponse(
        {"detail": [{"loc": loc, "msg": message, "type": "value_error"}]}, status_code=422
    )


def _json_safe(value: Any) -> Any:
    """JSON types only; NaN and infinities (which JSON cannot carry) become null."""
    return _finite(jsonable_encoder(value))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


# --------------------------------------------------------------------------------------
# The token
# --------------------------------------------------------------------------------------


def load_api_token(
    env: Mapping[str, str] = os.environ, file: str | os.PathLike[str] | None = None
) -> str | None:
    """The API token from ``file`` if given, else ``$SARA_API_TOKEN``; None when neither.

    An explicit file wins over the ambient environment. Surrounding whitespace (the
    trailing newline of a mounted Secret) is stripped; an empty token, or one with
    characters an HTTP header cannot carry, raises ``ConfigError`` naming its source.
    """
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: cannot read the API token file: {exc}") from exc
        return _check_token(text.strip(), where=os.fspath(file))
    if TOKEN_ENV_VAR in env:
        return _check_token(env[TOKEN_ENV_VAR].strip(), where=TOKEN_ENV_VAR)
    return None


def _check_token(token: str, *, where: str) -> str:
    if not token:
        raise ConfigError(f"{where}: the API token is empty")
    if not all("!" <= char <= "~" for char in token):
        raise ConfigError(
            f"{where}: the API token must be printable ASCII without spaces "
            "(it travels in an HTTP header)"
        )
    return token
