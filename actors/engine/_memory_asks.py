"""The Engine's two asks of the memory actor (``actors/memory``): the check before admission,
and relief on demand (``Engine.demote_cache``).

The protocol is the actor's; these only ask and turn its answers into the
engine API's typed errors.
"""

from __future__ import annotations

from actors.errors import GenerationFailed, MemoryBusy, MemoryPressure, ServerShuttingDown
from actors.runtime import AskTimeout, MailboxClosed, use_correlation
from messages.gateway import GenerationParams
from messages.memory import AdmitMemory, MemoryAdmitted, Relieve, Relieved
from messages.memory import Refuse as MemoryRefused

from . import wiring
from .startup import Running

__all__ = ["admit", "relieve"]


async def admit(running: Running | None, request_id: str, prompt_tokens: int,
                params: GenerationParams, *, timeout: float, refused_in_turn: bool = False) -> None:
    """The memory guard before admission: the memory actor admits, relieves first, or refuses.

    ``refused_in_turn``: the in-turn guard refused this request before its
    prefill after a first admission; no fast path then (its reading is the
    one that was contradicted): the actor settles, measures and relieves.

    Raises ``MemoryPressure`` when the request cannot fit and nothing more
    can be moved out of memory (``MemoryBusy`` when it would fit once
    running requests end), or when the actor does not answer within
    ``timeout`` seconds; ``ServerShuttingDown`` when it has stopped. Without
    a memory guard (or no engine running) there is nothing to check.
    """
    if running is None or running.guard is None or wiring.MEMORY not in running.wired.refs:
        return
    wired = running.wired
    ask = AdmitMemory(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        max_tokens=params.max_tokens,
        prompt_logprobs=params.prompt_logprobs,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        refused_in_turn=refused_in_turn,
    )
    if not refused_in_turn and wired.admission is not None and wired.admission.fits(ask):
        return  # NOTE: fits the latest reading: no relief, no round trip.
    try:
        with use_correlation(request_id):
            reply = await wired.ref(wiring.MEMORY).ask(ask, timeout=timeout)
    except AskTimeout as exc:
        raise MemoryPressure(
            f"the memory check did not answer within {timeout:g} s; retry later"
        ) from exc
    except MailboxClosed as exc:
        raise ServerShuttingDown(f"the memory actor is not accepting requests ({exc})") from exc
    if isinstance(reply, MemoryRefused):
        if reply.may_fit_later:
            raise MemoryBusy(reply.detail)
        raise MemoryPressure(reply.detail)
    if not isinstance(reply, MemoryAdmitted):
        raise GenerationFailed(f"the memory check answered {reply.kind}")


async def relieve(wired: wiring.Wired, *, idle_s: float, max_bytes: int | None,
                  dispose_without_tier: bool, wait: bool, timeout: float) -> Relieved:
    """Ask the memory actor to demote idle RAM entries now (``Relieve``); its answer."""
    ask = Relieve(idle_s=idle_s, max_bytes=max_bytes,
                  dispose_without_tier=dispose_without_tier, wait=wait, timeout_s=timeout)
    with use_correlation("engine-demote"):
        # NOTE: up to three asks of the memory actor's, each within timeout.
        return await wired.ref(wiring.MEMORY).ask(ask, timeout=3 * timeout + 1.0,
                                                  expect=Relieved)
