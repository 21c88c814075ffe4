"""A batch turn's step chain: the engine job in flight, shared by the scheduler (loop) and the engine thread.

A granted batch turn runs as ONE engine job (:func:`run_chain`): the next
batch step starts as soon as one ends, without a trip through the event
loop, the gateway and back, and each step's :class:`~.core.StepOut` is
handed to the loop as it exists (so tokens still stream per step). Rows
ready to join and joined rows to remove (a cancel, a slow reader) are
offered to the running chain (``Chain.offer``) and taken by its next step.
A background step the gateway lends to the chain (``Chain.lend``) runs on
the engine thread right after the step in flight, before the next one:
the chain goes on instead of ending for it.
The scheduler's core decides when the chain must end (the gateway asking
for the turn back, stopping, a row the chain cannot take) and the shell
sets ``stop``; the engine thread reads it before every step after the
first. The record and its cross-thread rules are the
serial lane's too: :class:`actors.runtime.EngineJob`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.engine_thread import AHEAD, EngineJob

from .core import JoinRow, StepOut

__all__ = ["AHEAD", "HEAP_CHECK_EVERY", "Chain", "LentRun", "LoopWaker", "run_chain"]

HEAP_CHECK_EVERY = 8
"""Plain decode steps of a chain between two runs of its ``after_step`` hook.

NOTE: the hook (the engine's heap trim) reads RSS, and reading
``/proc/PID/statm`` takes the process's memory-map lock, which the
threads evaluating the step hold while they fault pages in: measured 0.25
to 0.9 ms a reading on the CPU proxy (docs/batching.md, "Per-step cost of
the actor path"), on the engine thread between two steps. A plain decode
step (no row joined, left, prefilled, snapshotted or failed) frees little
besides the activations MLX keeps cached, so the hook runs after every
step that changed the batch and after every ``HEAP_CHECK_EVERY``-th plain
one; the job's end runs it anyway (``api._SamplingExecutor``).
"""


class LoopWaker:
    """A thread that wakes the event loop for the engine thread, so the engine thread keeps the GIL.

    Why: waking the loop is a write to its self-pipe, and any system call
    lets go of the GIL. Made by the engine thread right after a step, it
    hands the GIL to the loop, which wakes up for that step's tokens just
    then, and the engine thread waits for the loop's burst (the scheduler,
    every row's token, the consumers) before it can build the next step:
    measured 0.3-0.6 ms a step on the CPU proxy (docs/batching.md, "Per-step
    cost of the actor path"). :meth:`wake` only sets a flag (no system call,
    the GIL kept); this thread then needs the GIL to write to the pipe, and
    gets it when the engine thread next lets go of it, which is when the
    step waits for the device (or after the interpreter's switch interval).
    So the loop's burst runs while the device computes, not in between.
    """

    def __init__(self) -> None:
        self._calls: deque[tuple[asyncio.AbstractEventLoop, Callable[[], object]]] = deque()
        self._flag = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-loop-waker", daemon=True)
        self._thread.start()

    def wake(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
        """Any thread: have ``fn`` called on ``loop`` soon (dropped once ``loop`` is closed)."""
        self._calls.append((loop, fn))
        self._flag.set()

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Let the thread end once it has forwarded every call made before (any thread, never waits).

        NOTE: no join: the thread needs the GIL to finish, and the loop must
        not wait for the engine thread to let go of it.
        """
        self._closed = True
        self._flag.set()

    def _run(self) -> None:
        calls, flag = self._calls, self._flag
        while True:
            flag.wait()
            flag.clear()
            # NOTE: cleared before draining: a wake appended from now on sets it again.
            while calls:
                loop, fn = calls.popleft()
                try:
                    loop.call_soon_threadsafe(fn)
                except RuntimeError:
                    pass  # NOTE: the loop is closed; nobody waits any more.
            if self._closed:
                return


@dataclass(frozen=True, slots=True)
class LentRun:
    """A lent background step's run inside a chain: its outcome and its time on the engine thread."""

    step_id: str
    value: Any
    error: BaseException | None
    held_s: float


class Chain(EngineJob[StepOut]):
    """One batch turn's engine job and what it has produced so far (``ident`` is the turn).

    ``waker``: how the engine thread wakes the loop after a step
    (:class:`LoopWaker`; ``None``: ``call_soon_threadsafe`` from the engine
    thread itself).

    Rows join a running chain (:meth:`offer`, on the loop): the engine
    thread takes what was offered before each step after the first
    (:meth:`next_work`), so a row ready to join enters at the next step
    without ending the chain and paying a turn's round trip through the
    loop and the gateway. Once the engine thread has decided to end the
    chain it is *closed*: an offer is refused, and whatever was offered
    and not taken is in ``returned`` (read by the loop once the job
    ended). NOTE: the offer, the take and the close hold one lock, so an
    offered row is either run by this job or handed back, never lost.
    """

    __slots__ = ("_closed", "_lent", "_lent_runs", "_lock", "_offered", "returned",
                 "returned_lent", "waker")

    def __init__(
        self,
        turn: int,
        loop: asyncio.AbstractEventLoop,
        post: Callable[[], bool],
        *,
        budget: int = 1,
        waker: LoopWaker | None = None,
    ) -> None:
        super().__init__(turn, loop, post, budget=max(1, budget), wake_lost="batch.wake_lost")
        self.waker = waker
        self._lock = threading.Lock()
        self._offered: tuple[list[JoinRow], list[str]] = ([], [])
        self._closed = False
        self.returned: tuple[tuple[JoinRow, ...], tuple[str, ...]] = ((), ())
        """Offered joins and cancels no step took (set when the chain closed)."""
        self._lent: list[tuple[str, Callable[[], Any]]] = []
        self._lent_runs: list[LentRun] = []
        self.returned_lent: tuple[str, ...] = ()
        """Lent steps the chain did not run (set when it closed)."""

    @property
    def turn(self) -> int:
        """The batch turn this chain runs."""
        return self.ident

    def offer(self, joins: Sequence[JoinRow], cancels: Sequence[str]) -> bool:
        """Loop: have the next step join ``joins`` and cancel ``cancels``; False once the chain is closed."""
        with self._lock:
            if self._closed:
                return False
            self._offered[0].extend(joins)
            self._offered[1].extend(cancels)
            return True

    def lend(self, step_id: str, fn: Callable[[], Any]) -> bool:
        """Loop: run ``fn`` after the step in flight, before the next; False once the chain is closed."""
        with self._lock:
            if self._closed:
                return False
            self._lent.append((step_id, fn))
            return True

    def run_lent(self) -> None:
        """Engine thread, between two steps: run the steps lent so far; the loop reads :meth:`lent_runs`.

        NOTE: a step's exception is its asker's outcome (its handle re-raises
        it), not the chain's: the chain goes on.
        """
        with self._lock:
            todo, self._lent = self._lent, []
        if not todo:
            return
        for step_id, fn in todo:
            start = time.perf_counter()
            value: Any = None
            error: BaseException | None = None
            try:
                value = fn()
            except Exception as exc:  # noqa: BLE001 - the asker's outcome, handed to its handle
                error = exc
            run = LentRun(step_id, value, error, time.perf_counter() - start)
            with self._lock:
                self._lent_runs.append(run)
        self.notify()

    def lent_runs(self) -> list[LentRun]:
        """Loop: the lent steps run since the last call, in order."""
        with self._lock:
            runs, self._lent_runs = self._lent_runs, []
        return runs

    def next_work(self, idle: Callable[[], bool]) -> tuple[list[JoinRow], list[str]] | None:
        """Engine thread, after a step: the next step's joins and cancels, or ``None`` (the chain closed).

        The chain goes on while :meth:`may_go_on` and the batch holds a row or
        something was offered; otherwise it closes, handing back what was
        offered (``returned``).
        """
        with self._lock:
            joins, cancels = self._offered
            if self.may_go_on() and (joins or cancels or not idle()):
                self._offered = ([], [])
                return joins, cancels
            self._close_locked()
            return None

    def close(self) -> None:
        """Engine thread (the job ends, a step raised): refuse later offers, hand back what was offered."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        joins, cancels = self._offered
        self._offered = ([], [])
        self.returned = (tuple(joins), tuple(cancels))
        self.returned_lent = tuple(step_id for step_id, _ in self._lent)
        self._lent = []

    def notify(self) -> None:
        """Engine thread: ask the loop to wake the owner, unless a wake is already on its way."""
        waker = self.waker
        if waker is None:
            super().notify()
            return
        if self.wake_pending:
            return
        self.wake_pending = True
        waker.wake(self.loop, self._post)


def run_chain(
    chain: Chain,
    step: Callable[[Sequence[JoinRow], Sequence[str]], StepOut],
    idle: Callable[[], bool],
    joins: Sequence[JoinRow],
    cancels: Sequence[str],
    after_step: Callable[[], object] | None = None,
) -> None:
    """ON the engine thread: run batch steps back to back while the chain may go on.

    The first step cancels ``cancels`` and joins ``joins``, and always runs;
    each further one takes the rows offered meanwhile (``Chain.offer``).
    Before each further one the chain ends when its budget is used up, the
    scheduler set ``stop``, the batch holds no row any more (``idle``) and
    nothing was offered, or the chain is ``AHEAD`` steps ahead of what the
    loop has taken; what was offered and not taken is then ``returned``. A step
    that raises ends the job with its exception (the outputs before it stay
    in ``results``). Background steps lent to the chain (``Chain.lend``) run
    after each step's output is handed over. ``after_step`` runs once a step's output is handed
    over (the engine's C heap trim, ``actors/engine/memory.py``
    ``HeapTrim``: a chain of steps is one engine job, and the memory its
    steps free must not wait for the job's end): after every step that
    changed the batch, and after every ``HEAP_CHECK_EVERY``-th plain decode
    step.
    """
    plain = 0  # plain decode steps since after_step last ran
    work: tuple[Sequence[JoinRow], Sequence[str]] | None = (joins, cancels)
    try:
        while work is not None:
            out = step(*work)
            chain.hand_over(out)
            if after_step is not None:
                plain = plain + 1 if _plain(out) else HEAP_CHECK_EVERY
                if plain >= HEAP_CHECK_EVERY:
                    plain = 0
                    after_step()
            # NOTE: background steps lent meanwhile run here, between two steps.
            chain.run_lent()
            work = chain.next_work(idle)
    finally:
        # NOTE: a step that raised ends the job too: rows offered after it go back.
        chain.close()


def _plain(out: StepOut) -> bool:
    """Whether a step only decoded: no row joined, left, prefilled, snapshotted or failed."""
    return bool(
        out.decode_rows
        and not out.prefill_tokens
        and not out.exits
        and not out.joined
        and not out.prefilled
        and not out.snapshots
        and not out.failed
    )
