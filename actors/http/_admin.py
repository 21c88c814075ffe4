"""Operator routes: ``POST /admin/cache/flush`` and ``POST /admin/cache/drain``.

- **flush** asks the durability coordinator to force every dirty RAM entry
  to the SSD tier and answers with the evidence (``FlushResult``): **200**
  when ``durable`` is true, **503** otherwise (also without an SSD tier, or
  when the flush did not finish in time). Both bodies carry ``durable``,
  ``pending``, ``dropped``, ``failed``, ``uncovered``, ``lost``,
  ``evicted_unwritten`` (reported once, never a reason for 503), the SSD
  index's entry count and the longest durable prefix.
- **drain** moves every unleased RAM entry to the SSD tier now (the RAM
  tier's idle demotion with an idle time of 0) and answers once the spill
  queue has written them: **200** with what moved, **409** without an SSD
  tier.

Protection (``AdminGuardMiddleware``, before these handlers run): the
admin key (``--admin-key``), else the API key, as ``Authorization: Bearer``;
with neither, **403** ``admin_forbidden``. ``--admin-loopback on`` lets
loopback clients in without a key (``X-Forwarded-For`` counts only from
``--trusted-proxies``). NOTE: ``/stats`` is readable by any client allowed to
reach the server; these routes change state, so they are closed by default.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from actors.errors import KvtierError
from actors.runtime import RuntimeFailure
from messages.durability import FlushResult

from ._errors import ApiError

__all__ = ["AdminPort", "flush_body", "install_admin"]


@runtime_checkable
class AdminPort(Protocol):
    """What the admin routes need from the engine (``actors.engine.Engine`` has it)."""

    async def flush(self, *, timeout: float | None = None) -> FlushResult | None:
        """Force every dirty RAM entry to the SSD tier; the evidence (``None``: no tier)."""
        ...

    async def demote_cache(
        self,
        *,
        idle_s: float = 0.0,
        max_bytes: int | None = None,
        dispose_without_tier: bool = False,
        wait: bool = True,
        timeout: float | None = None,
    ) -> Any:
        """Move unleased RAM entries to the SSD tier now (``Engine.demote_cache``)."""
        ...


def flush_body(result: FlushResult | None, *, reason: str | None = None,
               seconds: float | None = None) -> dict[str, Any]:
    """The JSON body of a flush answer (``result`` ``None``: no evidence, ``reason`` says why)."""
    if result is None:
        return {
            "durable": False, "reason": reason, "pending": None, "dropped": None,
            "failed": None, "uncovered": None, "lost": None, "evicted_unwritten": None,
            "entries": None,
            "longest_durable_prefix_tokens": None, "checkpoints_lost": None,
            "duration_s": seconds,
        }
    return {
        "durable": result.durable,
        "reason": None if result.durable else _why(result),
        "pending": result.pending,
        "dropped": result.dropped,
        "failed": result.failed,
        "uncovered": result.uncovered,
        "lost": result.lost,
        "evicted_unwritten": result.evicted_unwritten,
        "entries": result.entries,
        "longest_durable_prefix_tokens": result.longest_durable_prefix_tokens,
        "scope": result.scope,
        "written": result.written,
        "covered": result.covered,
        "dirty_after": result.dirty_after,
        # NOTE: generation checkpoint writes failed or dropped since the previous
        # flush; they do not make the flush not durable (restart points, not prefixes).
        "checkpoints_lost": result.checkpoints_lost,
        "duration_s": seconds,
    }


def _why(result: FlushResult) -> str:
    parts = [f"{n} {name}" for name, n in (
        ("pending", result.pending), ("dropped", result.dropped), ("failed", result.failed),
        ("uncovered", result.uncovered), ("lost", result.lost)) if n]
    return "not durable: " + (", ".join(parts) if parts else "the index did not answer")


def install_admin(app: FastAPI, engine: object) -> None:
    """Register the admin routes on ``app`` (``engine`` must be an :class:`AdminPort` to use them).

    Who may call them is decided before: ``AdminGuardMiddleware``.
    """

    def admin() -> AdminPort:
        if not isinstance(engine, AdminPort):
            raise ApiError(501, "This engine has no admin operations.", type="server_error",
                           code="not_implemented")
        return engine

    @app.post("/admin/cache/flush", response_model=None)
    async def flush() -> JSONResponse:
        """Force the SSD tier to a durable boundary: 200 when durable, 503 otherwise."""
        port = admin()
        started = time.perf_counter()
        try:
            result = await port.flush()
        except (RuntimeFailure, KvtierError) as exc:
            seconds = round(time.perf_counter() - started, 3)
            body = flush_body(None, reason=f"the flush did not finish: {type(exc).__name__}",
                              seconds=seconds)
            return JSONResponse(body, status_code=503)
        seconds = round(time.perf_counter() - started, 3)
        if result is None:
            body = flush_body(None, reason="no SSD tier is configured", seconds=seconds)
            return JSONResponse(body, status_code=503)
        return JSONResponse(flush_body(result, seconds=seconds),
                            status_code=200 if result.durable else 503)

    @app.post("/admin/cache/drain", response_model=None)
    async def drain() -> JSONResponse:
        """Move every unleased RAM entry to the SSD tier now; 200 once the queue wrote them."""
        port = admin()
        started = time.perf_counter()
        try:
            moved = await port.demote_cache(idle_s=0.0, wait=True)
        except (RuntimeFailure, KvtierError) as exc:
            raise ApiError(503, f"The drain did not finish: {type(exc).__name__}.",
                           type="server_error", code="drain_incomplete") from None
        if moved is None or getattr(moved, "stored", None) is None:
            raise ApiError(409, "This server has no SSD tier to drain the RAM tier into.",
                           code="no_ssd_tier")
        result = moved.result
        return JSONResponse({
            "demoted": result.spilled,
            "demoted_bytes": result.spilled_bytes,
            "leased": result.leased,
            "left": result.left,
            "left_bytes": result.left_bytes,
            "stored": moved.stored,
            "dropped": moved.dropped,
            "failed": moved.failed,
            "duration_s": round(time.perf_counter() - started, 3),
        })
