"""Checkpoint lookups on their way back to the actor that started them (gateway, batch scheduler).

An actor shell starts a lookup with :meth:`CheckpointLoads.start` (the file
is read on a worker thread, :meth:`CheckpointPort.load_soon`); the result
waits here, and one note posted to the actor's own mailbox (its reserved
room, ``ActorRef.post``) tells the actor to :meth:`CheckpointLoads.take`
every waiting result and feed it to its core. The shell only sends: the
result comes back as a message to the actor itself.

Invariant (no lost wake-up): while results wait, a note is in the mailbox
or is posted before the actor handles its next message
(:meth:`CheckpointLoads.rewake`). A post finds no room only when the
mailbox is full, so a next message always comes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from actors.runtime import ActorRef, ActorStopped, MailboxClosed, UnknownAddress
from messages import Body

from .serving import CheckpointPort, ResumeFrom

__all__ = ["CheckpointLoads"]


class CheckpointLoads:
    """One actor's finished checkpoint lookups and its note to itself (event loop only; one per shell).

    ``note`` builds the message the actor receives when results wait
    (``GatewayCheckpointsLoaded``, ``BatchCheckpointsLoaded``).
    """

    __slots__ = ("_note", "_noted", "_results")

    def __init__(self, note: Callable[[], Body]) -> None:
        self._note = note
        self._results: deque[tuple[str, ResumeFrom | None]] = deque()
        self._noted = False  # NOTE: a note is in the mailbox and not yet read.

    def start(
        self,
        port: CheckpointPort,
        ref: ActorRef,
        request_id: str,
        key: str,
        namespace: str,
        prompt: tuple[int, ...],
    ) -> None:
        """Look ``key`` up on a worker thread; its result waits here and a note goes to ``ref``."""

        def arrived(found: ResumeFrom | None) -> None:
            self._results.append((request_id, found))
            self.rewake(ref)

        port.load_soon(key, namespace, prompt, arrived, request_id=request_id)

    def rewake(self, ref: ActorRef) -> None:
        """Post the note to ``ref`` if results wait and none is posted (the shell calls it before each message).

        A note that finds even the reserved room full is posted again on the
        next call. Once the actor stops, the results go: nobody is left to
        resume.
        """
        if self._noted or not self._results:
            return
        try:
            self._noted = ref.post(self._note())
        except (ActorStopped, MailboxClosed, UnknownAddress):
            self._results.clear()

    def take(self) -> list[tuple[str, ResumeFrom | None]]:
        """The note was read: every waiting ``(request_id, found)``, in the order the lookups ended."""
        self._noted = False
        results = list(self._results)
        self._results.clear()
        return results

    def __len__(self) -> int:
        return len(self._results)
