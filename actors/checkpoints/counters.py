"""The generation checkpoints' figures for ``/stats`` (one object shared by the writer and the runner).

A loop-only port: every field is written on the event loop only (the turn
runner's and the batch lane's shells, the SSD index and its store worker),
each update a synchronous ``+=`` with no ``await`` inside, so updates of two
actors never interleave and no lock is needed; ``/stats`` reads a copy.
NOTE: the thread that builds the counters owns them; a write from any other
thread raises instead of racing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointCounters"]


@dataclass(slots=True)
class CheckpointCounters:
    """Checkpoints taken, written, failed, removed, resumed; requests refused by reason.

    ``taken``: owned snapshots handed to the spill queue; ``unsent``: those
    the queue could not take (its mailbox full or gone; the snapshot was
    released). ``written``/``bytes``: files committed (fsync + rename);
    ``write_failed``: writes that did not commit (the previous file stays).
    ``deltas``: files composed from the previous file of their answer plus
    the tokens since (``kernels.cache._kv_delta``); ``delta_reused_bytes``:
    the tensor bytes they took from it instead of reading the live caches.
    ``removed``: files removed when their answer completed. ``resumed``:
    requests that restored a checkpoint; ``tokens_saved``: emitted tokens
    they replayed instead of computing (plus the prompt they did not
    prefill, counted in ``prompt_tokens_saved``). ``resume_failed``: found
    checkpoints that could not be used (the request then ran fresh).
    ``refused``: requests not checkpointed, by reason (``grammar``,
    ``logprobs``), and checkpoints the SSD cap had no room for
    (``over_cap``).

    Shared by several actors as a loop-only port (module docstring): written
    and read only on the thread that built it (the event loop's).
    """

    taken: int = 0
    unsent: int = 0
    written: int = 0
    bytes: int = 0
    deltas: int = 0
    delta_reused_bytes: int = 0
    write_failed: int = 0
    removed: int = 0
    resumed: int = 0
    tokens_saved: int = 0
    prompt_tokens_saved: int = 0
    resume_failed: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    _owner: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_owner", threading.get_ident())

    def __setattr__(self, name: str, value: object) -> None:
        self._check_thread()
        object.__setattr__(self, name, value)

    def _check_thread(self) -> None:
        owner = getattr(self, "_owner", None)  # NOTE: unset while __init__ runs.
        if owner is not None and owner != threading.get_ident():
            raise RuntimeError("CheckpointCounters are loop-only: written from another thread")

    def refuse(self, reason: str) -> None:
        """Count one request not checkpointed for ``reason``."""
        self._check_thread()
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """The figures as the ``/stats`` ``generation_checkpoints`` section."""
        return {
            "taken": self.taken,
            "unsent": self.unsent,
            "written": self.written,
            "bytes": self.bytes,
            "deltas": self.deltas,
            "delta_reused_bytes": self.delta_reused_bytes,
            "write_failed": self.write_failed,
            "removed": self.removed,
            "resumed": self.resumed,
            "tokens_saved": self.tokens_saved,
            "prompt_tokens_saved": self.prompt_tokens_saved,
            "resume_failed": self.resume_failed,
            "refused": dict(sorted(self.refused.items())),
        }
