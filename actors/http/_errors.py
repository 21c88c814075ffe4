"""The ONE edge where typed errors become HTTP responses with OpenAI error bodies.

Every error the server answers, whatever raised it, leaves through this
module as ``{"error": {"message", "type", "param", "code"}}``. Mapping:

========================================  ======  =========================
cause                                     status  ``type`` / ``code``
========================================  ======  =========================
malformed JSON body                       400     invalid_request_error / invalid_json
wrong field types, unknown fields         400     invalid_request_error / invalid_value
``InvalidRequest`` (and ``ContextTooLong``)  400   invalid_request_error / its code
missing / wrong API key                   401     invalid_request_error / invalid_api_key
unknown model                             404     invalid_request_error / model_not_found
unknown route                             404     invalid_request_error / not_found
wrong method                              405     invalid_request_error / method_not_allowed
body not received in time                408     invalid_request_error / request_timeout
body larger than ``--max-body-bytes``     413     invalid_request_error / request_too_large
``SchemaTooComplex`` (schema limits)      400     invalid_request_error / schema_too_complex
``QueueFull``                             429     rate_limit_exceeded / queue_full
``GrammarCompilerBusy``                   429     rate_limit_exceeded / grammar_compiler_busy
``ServerShuttingDown``, engine not ready  503     server_error / shutting_down ...
``MemoryPressure``, step out of memory    503     server_error / memory_pressure
POST body not ``application/json``       415     invalid_request_error / unsupported_media_type
``Host`` not in the allowlist             400     invalid_request_error / invalid_host
admin route, no key and no loopback pass  403     invalid_request_error / admin_forbidden
``GenerationFailed`` (engine failure)     500     server_error / generation_failed
anything else (a bug)                     500     server_error / internal_error
========================================  ======  =========================

A 500 never carries the failure's text (it may name files or internal
state): the message is generic and names the request id (also in the
``X-Request-Id`` header); the log line with that id has the detail.

NOTE: FastAPI answers validation failures with 422; OpenAI answers bad
parameters with 400, and clients (the ``openai`` package included) treat
400 as "your request is wrong", so validation failures become 400 here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.errors import (
    EngineClosed,
    EngineNotStarted,
    InvalidRequest,
    KvtierError,
    MemoryPressure,
    QueueFull,
    ServerShuttingDown,
)

from ._request_id import request_id_of

__all__ = [
    "ApiError",
    "error_body",
    "error_response",
    "install_error_handlers",
    "internal_error",
    "kvtier_error_to_api",
    "validation_to_api",
]

_log = structlog.get_logger("kvtier.http")


class ApiError(Exception):
    """An error already phrased for the HTTP client (status + OpenAI error fields)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers


def error_body(message: str, type_: str, code: str | None, param: str | None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    """Render an :class:`ApiError` as a JSON response."""
    return JSONResponse(
        error_body(err.message, err.type, err.code, err.param),
        status_code=err.status,
        headers=err.headers,
    )


def internal_error(request_id: str | None, *, code: str = "internal_error") -> ApiError:
    """The 500 a client sees for a failure inside the server: no detail, the request id to quote."""
    ref = f" (request id {request_id})" if request_id else ""
    return ApiError(500, f"The server had an error while processing your request{ref}; "
                         "its log has the details.", type="server_error", code=code)


def kvtier_error_to_api(exc: KvtierError, request_id: str | None = None) -> ApiError:
    """Map a typed kvtier error to its HTTP form (table in the module docstring).

    A failure inside the engine (``GenerationFailed`` and any other error
    without a mapping) becomes a generic 500 naming ``request_id``; its text
    (which may name files, the model path or internal state) goes to the log.
    """
    if isinstance(exc, QueueFull):
        # NOTE: Retry-After tells well-behaved clients (openai retries 429s) to back off.
        return ApiError(429, str(exc), type="rate_limit_exceeded", code=exc.code,
                        headers={"Retry-After": "1"})
    if isinstance(exc, ServerShuttingDown | EngineNotStarted | EngineClosed | MemoryPressure):
        return ApiError(503, str(exc), type="server_error", code=exc.code)
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), code=exc.code, param=getattr(exc, "param", None))
    _log.error("http.engine_error", error_type=type(exc).__name__, detail=str(exc),
               request_id=request_id)
    return internal_error(request_id, code=exc.code)


_UNION_MEMBER = re.compile(r"^(?:[A-Z]\w*|str|int|float|bool|none|[a-z-]+\[.*\]|function-\w+|constrained-\w+)$")
"""Location parts pydantic adds for the member of a union it tried (``str``,
``literal['none','auto']``, ``NamedToolChoice``): not field names."""


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    # NOTE: FastAPI prefixes the location with "body"; OpenAI names the field only.
    parts = [str(p) for p in loc
             if p != "body" and not (isinstance(p, str) and _UNION_MEMBER.match(p))]
    return ".".join(parts) if parts else None


def validation_to_api(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """Turn pydantic/FastAPI validation errors into the OpenAI-style 400."""
    if any(e.get("type") == "json_invalid" for e in errors):
        if any("recursion limit" in str(e.get("msg", "")) for e in errors):
            # NOTE: the JSON parser stops at about 200 levels of nesting (its
            # recursion limit): say which limit, as every other refusal does.
            return ApiError(400, "The JSON body nests too deeply to parse (the parser's "
                                 "nesting depth limit, about 200 levels).", code="invalid_json")
        return ApiError(400, "We could not parse the JSON body of your request.",
                        code="invalid_json")
    if not errors:
        return ApiError(400, "invalid request body", code="invalid_value")
    first = errors[0]
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    text = f"Invalid value for '{param}': {msg}" if param else f"Invalid request body: {msg}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error(s))"
    return ApiError(400, text, code="invalid_value", param=param)


_HTTP_CODES: dict[int, str] = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
}


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that make every error an OpenAI error body."""

    async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_kvtier_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, KvtierError)
        return error_response(kvtier_error_to_api(exc, request_id_of(request.scope)))

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_to_api(exc.errors()))

    async def on_http(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        err_type = "server_error" if status >= 500 else "invalid_request_error"
        return error_response(ApiError(status, str(exc.detail), type=err_type,
                                       code=_HTTP_CODES.get(status),
                                       headers=dict(exc.headers or {}) or None))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: only bugs reach this; bad input is mapped above, never a 500.
        rid = request_id_of(request.scope)
        _log.error("http.unhandled", path=request.url.path, error=repr(exc), request_id=rid,
                   exc_info=exc)
        return error_response(internal_error(rid))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(KvtierError, on_kvtier_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
