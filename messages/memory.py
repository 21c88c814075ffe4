"""Messages of the memory actor (``actors.memory``): admission relief and demotion.

The memory actor owns what happens when a request does not fit the memory
budget before admission (docs/operations.md, "Memory-pressure guard"): it
drops freed memory in an idle engine turn, moves least recently used RAM
entries out (to the SSD tier, or dropped without one), frees their arrays
in another idle turn, and decides again; or it refuses. One relief runs at
a time; requests that fit are answered at once.

Public protocol:

- ``AdmitMemory`` (ask) -> ``MemoryAdmitted`` | ``Refuse``.
- ``Relieve`` (ask) -> ``Relieved``: move RAM entries out now
  (``Engine.demote_cache``).
- ``MemoryStatsRequest`` (ask) -> ``MemoryStats``.

Internal: ``MemoryWake`` (the actor's alarm, sent to itself).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Body, Request
from .prompt_cache import DemoteResult

__all__ = [
    "AdmitMemory",
    "MemoryAdmitted",
    "MemoryStats",
    "MemoryStatsRequest",
    "MemoryWake",
    "Refuse",
    "Relieve",
    "Relieved",
]


class AdmitMemory(Request):
    """Does this request fit the memory budget? Relieve memory first if entries can give some back.

    The request's shape decides its projected footprint: the KV of
    ``prompt_tokens + max_tokens``, the prefill workspace, and the host
    memory of reported log-probabilities (``prompt_logprobs``: the prompt's
    scores, ``None`` when not asked; ``logprobs``/``top_logprobs``: the
    generated tokens'). Answered with :class:`MemoryAdmitted` or :class:`Refuse`.

    ``refused_in_turn``: this request was admitted once and then refused by
    the in-turn guard before its prefill (the reading it was admitted on did
    not show the rows that started since): it is never admitted at once on
    the reading; the actor settles, measures and relieves first.
    """

    kind: Literal["memory.admit"] = "memory.admit"
    request_id: str
    prompt_tokens: int = Field(ge=0)
    max_tokens: int = Field(ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0)
    refused_in_turn: bool = False


class MemoryAdmitted(Body):
    """The request fits (``relieved_bytes``: what a relief moved out for it first; 0: none ran)."""

    kind: Literal["memory.admitted"] = "memory.admitted"
    request_id: str
    relieved_bytes: int = Field(default=0, ge=0)


class Refuse(Body):
    """The request does not fit and nothing more can be moved out: ``detail`` is the client's explanation.

    ``may_fit_later``: it would fit beside the least memory the process has
    held (no request running, nothing cached): memory running requests hold
    now may come back when they end.
    """

    kind: Literal["memory.refuse"] = "memory.refuse"
    request_id: str
    detail: str
    may_fit_later: bool = False


class Relieve(Request):
    """Move unleased RAM entries idle for ``idle_s`` seconds out of memory now, LRU first (ask).

    ``max_bytes`` stops after that many bytes (``None``: no limit). With a
    cold tier they go to the SSD tier; without one only with
    ``dispose_without_tier`` (they are dropped). With ``wait`` the answer
    comes once the spill queue is empty. Each ask the actor sends on the way
    waits at most ``timeout_s``. Answered with :class:`Relieved`.
    """

    kind: Literal["memory.relieve"] = "memory.relieve"
    idle_s: float = Field(default=0.0, ge=0)
    max_bytes: int | None = Field(default=None, ge=0)
    dispose_without_tier: bool = False
    wait: bool = True
    timeout_s: float = Field(default=30.0, gt=0)


class Relieved(Body):
    """What a :class:`Relieve` did.

    ``result``: the RAM tier's answer (``None``: it did not answer; ``error``
    says why). ``stored``/``dropped``/``failed``: spill-queue items settled
    that way between the demotion and the queue's drain (other producers'
    items included); ``None`` when the call did not wait or there is no cold tier.
    """

    kind: Literal["memory.relieved"] = "memory.relieved"
    result: DemoteResult | None = None
    stored: int | None = None
    dropped: int | None = None
    failed: int | None = None
    error: str = ""


class MemoryStatsRequest(Request):
    """Ask for :class:`MemoryStats`."""

    kind: Literal["memory.stats_request"] = "memory.stats_request"


class MemoryStats(Body):
    """The memory guard's figures (``/stats`` ``memory``); ``None``: not known here.

    ``budget_bytes``, ``margin_bytes``: the budget and how far RSS may pass
    it; ``active_bytes``: the latest reading, taken after every engine job
    (``samples`` of them); ``checks_in_turn``/``refused_in_turn``/
    ``settled_in_turn``: the in-turn guard's checks (engine thread), and
    ``refused_before_prefill`` of its refusals came before a prefill (the
    request waited or went back to admission: not a failure);
    ``refused_at_admission``, ``relieved_entries``, ``relieved_bytes``,
    ``reliefs``, ``readmissions`` (requests refused in turn before their
    prefill and asked again), ``busy_at_admission`` (refusals that may fit
    once running requests end: the asker waits; not in
    ``refused_at_admission``): this actor's; the reading's parts at the last engine job
    (``resident_bytes``, ``mlx_bytes``, ``resident_at_start_bytes``,
    ``mlx_active_bytes``, ``mlx_cache_bytes``, ``mlx_peak_bytes``; under
    CUDA ``device_used_bytes``, the device's memory in use by every process
    on it, which the reading counts too) and the C-heap trims (``heap_trims``, ``heap_trim_s``); ``growth_ahead_bytes``:
    what the requests running now may still add (their KV up to
    ``max_tokens``, their logprobs still to come), which admission and the
    check before a prefill count beside the reading, and
    ``growth_ahead_by_lane`` its parts by lane (``serial``, ``batch``).
    """

    kind: Literal["memory.stats"] = "memory.stats"
    budget_bytes: int | None = None
    active_bytes: int | None = None
    samples: int | None = None
    checks_in_turn: int | None = None
    refused_in_turn: int | None = None
    refused_before_prefill: int | None = None
    refused_at_admission: int = 0
    busy_at_admission: int = 0
    relieved_entries: int = 0
    relieved_bytes: int = 0
    reliefs: int = 0
    readmissions: int = 0
    settled_in_turn: int | None = None
    margin_bytes: int | None = None
    resident_bytes: int | None = None
    mlx_bytes: int | None = None
    resident_at_start_bytes: int | None = None
    heap_trims: int | None = None
    heap_trim_s: float | None = None
    mlx_active_bytes: int | None = None
    mlx_cache_bytes: int | None = None
    mlx_peak_bytes: int | None = None
    device_used_bytes: int | None = None
    growth_ahead_bytes: int | None = None
    growth_ahead_by_lane: dict[str, int] | None = None


class MemoryWake(Body):
    """The memory actor's alarm went off (sent to itself): a reply deadline may have passed."""

    kind: Literal["memory.wake"] = "memory.wake"
