"""The published OpenAPI document: FastAPI's, completed so that it describes what the server answers.

FastAPI describes the routes' handlers; the edge (middleware, the error
handlers) answers more than they do. :func:`openapi_document` adds:

- the hand-parsed generation bodies as components (pydantic's ``$defs``
  become components, so every reference resolves);
- every error status an operation can answer, each with OpenAI's error
  body (``ErrorResponse``): 400 (bad request, a ``Host`` not allowed) on
  all; 401 where the API key applies (all but ``/health``); 408/413/415 on
  every POST (body deadline, body cap, a body that is not JSON: the CSRF
  defence, a bodiless admin POST included); 403 on the admin routes; 404,
  429, 500 and 503 on the generation routes; FastAPI's 422, which the
  server never answers (validation failures are 400s), is replaced;
- the media types the routes really send: a streamed answer is
  ``text/event-stream``, ``/metrics`` is Prometheus text, a HEAD answer
  has no body; ``/health`` answers 503 ``{"status": "draining"}`` once
  shutdown began.

``/docs`` (Swagger UI) is not served: it loads its script from a CDN,
which a server that may run offline and keeps its pages free of foreign
scripts does not send; read ``/openapi.json`` with any OpenAPI viewer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

__all__ = ["json_body", "openapi_document"]

_COMPONENTS = "#/components/schemas/{model}"
_ERROR = "ErrorResponse"

_ERROR_SCHEMA: dict[str, Any] = {
    "title": _ERROR,
    "description": "OpenAI's error body; every error the server answers has this shape.",
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "additionalProperties": False,
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    }},
}

_WHY: dict[int, str] = {
    400: "Bad request (invalid body or parameter, or a Host header the server does not answer for).",
    401: "Missing or wrong API key.",
    403: "Admin routes are off for this client (no key configured, no loopback pass).",
    404: "Unknown model.",
    408: "The request body did not arrive in time.",
    409: "Nothing to do that way (no SSD tier to drain into).",
    413: "The request body is larger than the server's cap.",
    415: "A POST whose Content-Type is not application/json.",
    429: "The admission queue or the grammar compilers are full; retry later.",
    500: "The engine failed while generating (the body names the request id).",
    501: "This engine has no admin operations.",
    503: "The server is shutting down, or memory is short.",
}

_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions"})
_NO_KEY = frozenset({"/health"})
_ADMIN = "/admin/"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI description of a body that is parsed by hand (its schema is a component)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _COMPONENTS.format(model=model.__name__)}}}}}


def _error(status: int) -> dict[str, Any]:
    return {"description": _WHY[status], "content": {
        "application/json": {"schema": {"$ref": _COMPONENTS.format(model=_ERROR)}}}}


def _statuses(path: str, method: str) -> list[int]:
    """The error statuses the edge and the handler can answer on one operation."""
    out = [400]
    if path not in _NO_KEY:
        out.append(401)
    if method == "post":
        out += [408, 413, 415]
    if path.startswith(_ADMIN):
        out += [403, 409, 501, 503]
    if path in _GENERATION:
        out += [404, 429, 500, 503]
    if path == "/v1/models/{model_id}":
        out.append(404)
    return out


def _complete(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    schemas[_ERROR] = _ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            responses: dict[str, Any] = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in _statuses(path, method):
                responses.setdefault(str(status), _error(status))
            if method == "head":
                for answer in responses.values():
                    answer.pop("content", None)
    for path, ops in doc["paths"].items():
        if path.startswith(_ADMIN) and "post" in ops:
            # NOTE: the body is ignored, but a POST must be JSON (the CSRF defence).
            ops["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"description": "Ignored; send {}."}}}}
    health = doc["paths"].setdefault("/health", {})
    for method, op_id in (("get", "health"), ("head", "health_head")):
        health[method] = {
            "summary": "Health", "operationId": op_id,
            "description": "Liveness (no key needed): 200 {\"status\": \"ok\"}.",
            "responses": {"200": {"description": "Serving.", "content": {"application/json": {
                "schema": {"type": "object", "required": ["status"],
                           "properties": {"status": {"const": "ok"}}}}}},
                          "400": _error(400)}}
        if method == "head":
            for answer in health[method]["responses"].values():
                answer.pop("content", None)
    draining = {"description": "Shutdown began: the server is draining.", "content": {
        "application/json": {"schema": {"type": "object", "required": ["status"],
                                        "properties": {"status": {"const": "draining"}}}}}}
    for method, op in health.items():
        op["responses"]["503"] = ({"description": draining["description"]}
                                  if method == "head" else draining)
    metrics = doc["paths"].get("/metrics", {}).get("get")
    if metrics is not None:
        metrics["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    for path in _GENERATION:
        op = doc["paths"].get(path, {}).get("post")
        if op is not None:
            op["responses"]["200"]["content"]["text/event-stream"] = {
                "schema": {"type": "string", "description": "Server-sent events (stream: true)."}}


def openapi_document(app: FastAPI, hand_parsed: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """FastAPI's document plus the hand-parsed bodies and the edge's answers (module docstring).

    NOTE: pydantic nests a model's sub-schemas under a local ``$defs`` whose
    references (``#/$defs/...``) do not resolve inside an OpenAPI document;
    generated with the components' reference template, every sub-schema
    becomes a component and every reference resolves.
    """
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in hand_parsed:
            schema = model.model_json_schema(ref_template=_COMPONENTS)
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
        _complete(doc)
        app.openapi_schema = doc
    return app.openapi_schema
