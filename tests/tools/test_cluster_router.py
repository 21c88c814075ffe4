"""The cluster launcher's sglang-router keeps routing after replicas answer client errors."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tools.cluster.launch import Router, free_port

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.timeout(120)


def _worker_app() -> Starlette:
    """A scripted replica: the probe endpoints, and chat that rejects a ``logit_bias`` key that is no token id, as kvtier does."""

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def model_info(_: Request) -> JSONResponse:
        return JSONResponse({"model_path": "m", "tokenizer_path": None, "is_generation": True})

    async def server_info(_: Request) -> JSONResponse:
        return JSONResponse({"model_path": "m"})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        if any(not key.isdigit() for key in body.get("logit_bias") or {}):
            return JSONResponse({"error": {"message": "logit_bias keys must be token ids",
                                           "type": "invalid_request_error", "param": "logit_bias",
                                           "code": "invalid_value"}}, status_code=400)
        return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "ok"}}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                       "total_tokens": 2}})

    return Starlette(routes=[Route("/health", health), Route("/get_model_info", model_info),
                             Route("/get_server_info", server_info), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


@contextlib.contextmanager
def _worker() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_worker_app(), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class _Stub:
    """What Router.start reads of a replica: its URL."""

    def __init__(self, url: str) -> None:
        self.url = url


def test_client_errors_do_not_take_the_replicas_out_of_the_router(tmp_path: Path) -> None:
    """Twenty requests the replica rejects (400, passed through) leave a valid request answered
    200 by the replica (sglang-router's circuit breaker, which counted 4xx answers as replica
    failures, is off)."""
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    bad = {**good, "logit_bias": {"x": 1}}
    with _worker() as url:
        router = Router.start("round_robin", cast("Any", [_Stub(url)]), tmp_path)
        try:
            codes = [httpx.post(f"{router.url}/v1/chat/completions", json=bad, timeout=10)
                     .status_code for _ in range(20)]
            assert codes == [400] * 20
            ok = httpx.post(f"{router.url}/v1/chat/completions", json=good, timeout=10)
            assert ok.status_code == 200, ok.text[:300]
            assert ok.json()["choices"][0]["message"]["content"] == "ok"
        finally:
            router.stop()
