"""What ``Engine.stats()`` (``/stats``) assembles: the actors' answers, asked at once through
the wiring, and the sections no actor owns (the model, the engine thread, the cache
registry, the mailboxes), read thread-safely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from actors.runtime import ActorSystem

from .startup import ModelParts, Running

if TYPE_CHECKING:
    from kernels import CacheRegistry, EngineThread

__all__ = ["engine_stats", "thread_stats"]


async def engine_stats(
    *,
    model_id: str,
    state: str,
    loaded: ModelParts | None,
    running: Running | None,
    system: ActorSystem | None,
    thread: EngineThread | None,
    timeout: float | None,
) -> dict[str, Any]:
    """The JSON-ready snapshot ``Engine.stats`` documents."""
    out: dict[str, Any] = {"model": model_id, "state": state}
    fusion = None if loaded is None else loaded.fusion
    if fusion is not None and fusion.few_row_status:
        # NOTE: whether one-token CPU steps use the few-row product, and why not.
        out["few_row"] = {"products": fusion.few_row, "status": fusion.few_row_status}
    from kernels.model import compiled_decode_of

    compiled = None if loaded is None else compiled_decode_of(loaded.model)
    if compiled is not None:
        # NOTE: a plain int the engine thread counts up; reading it is atomic.
        out["compiled_decode"] = {"traces": compiled.traces}
    if running is not None:
        out.update(await running.wired.stats(timeout))
    out.update(thread_stats(thread, None if running is None else running.registry))
    if system is not None:
        out["mailboxes"] = system.statistics().as_dict()
    return out


def thread_stats(thread: EngineThread | None, registry: CacheRegistry | None) -> dict[str, Any]:
    """``/stats``' ``engine_thread`` and ``cache_registry`` sections (thread-safe reads)."""
    out: dict[str, Any] = {}
    if thread is not None:
        es = thread.statistics()
        out["engine_thread"] = {
            "jobs_run": es.jobs_run,
            "jobs_failed": es.jobs_failed,
            "busy_s": es.busy_s,
            "queue_depth": es.queue_depth,
            "alive": es.alive,
        }
    if registry is not None:
        rs = registry.statistics()
        out["cache_registry"] = {
            "entries": rs.entries,
            "nbytes": rs.nbytes,
            # NOTE: disposed entries whose arrays are still alive (outside the cap).
            "pending_dispose": rs.pending_dispose,
            "pending_bytes": rs.pending_bytes,
        }
    return out
