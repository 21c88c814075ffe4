"""Background steps: the one place where a callable crosses from an asker to the engine thread.

A background step (an SSD writer's tensor read-back, a snapshot clone) is a
callable that must run ON the engine thread during a granted background
turn. Callables never travel inside messages (traces stay serializable), so
they cross through ONE owner: the turn runner's :class:`BackgroundSteps`.

- The asker registers its callable (``add``) and gets a typed
  :class:`StepHandle`, then asks the gateway for a turn with ``RunWhenIdle(step_id=handle.step_id)``.
- The runner takes the callable when the turn is granted, runs it on the
  engine thread and settles the handle (on the event loop) before it
  reports the turn; so once ``TurnDone`` arrives the handle holds the
  outcome. A step the gateway lends to a running batch chain is taken,
  run and settled the same way by the batch scheduler instead (its chain
  runs it between two steps); the gateway grants each step to one of them.
- The asker reads the outcome from its handle (``result()``), or
  ``withdraw()``s a step it no longer waits for; a withdrawn step is never
  run (the runner reports it ``unknown_step``).

Everything here runs on the event loop thread; nothing is shared with the
engine thread except the callable itself, which only the runner's job calls
(wrapped so that it times itself: the time is written on the engine thread
before the job ends and read on the loop in :meth:`BackgroundSteps.settle`,
after it ended).

A background turn holds the engine: a request that arrives during it waits
for it (docs/engine-turn.md, rule 5). So every step must be small, and a
step that ran :data:`SLOW_STEP_S` or longer is logged when it settles
(``engine.background_step_slow``, with its callable's name and time): the
line names the step behind a long ``join`` phase in the request timeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import structlog

__all__ = ["SLOW_STEP_S", "BackgroundSteps", "StepHandle", "StepNotRun"]

T = TypeVar("T")

_log = structlog.get_logger("kvtier.engine")

SLOW_STEP_S = 0.010
"""A background step this long (seconds, on the engine thread) or longer is logged when it settles.

NOTE: about one decode step of an 8B model on a GPU: a request arriving
during a longer one waits longer than a step for its first turn.
"""


class _Timed:
    """A step's callable that records how long its run took (engine thread writes, loop reads after)."""

    __slots__ = ("elapsed_s", "fn")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.elapsed_s: float | None = None

    def __call__(self) -> Any:
        start = time.perf_counter()
        try:
            return self.fn()
        finally:
            self.elapsed_s = time.perf_counter() - start


def _name(fn: Callable[[], Any]) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__qualname__))


class StepNotRun(RuntimeError):
    """A background step has no outcome: it was not granted, or was withdrawn."""


class StepHandle(Generic[T]):
    """The asker's side of one registered background step: its id and, once run, its outcome."""

    __slots__ = ("_error", "_registry", "_result", "_settled", "step_id")

    def __init__(self, registry: BackgroundSteps, step_id: str) -> None:
        self._registry = registry
        self.step_id = step_id
        self._settled = False
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def ran(self) -> bool:
        """Whether the step ran (successfully or not)."""
        return self._settled

    def result(self) -> T:
        """The step's return value; re-raises its exception; ``StepNotRun`` if it did not run."""
        if not self._settled:
            raise StepNotRun(f"background step {self.step_id!r} did not run")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]

    def withdraw(self) -> None:
        """Give up on the step: if it has not run yet, it never will."""
        self._registry._withdraw(self.step_id)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        self._settled, self._result, self._error = True, result, error


class BackgroundSteps:
    """The registry of background step callables, keyed by ``RunWhenIdle.step_id``: a loop-only port.

    Askers call :meth:`add` only (and keep the handle); :meth:`take`,
    :meth:`put_back` and :meth:`settle` are the turn runner's, or the batch
    scheduler's for a step the gateway lent to its chain (the gateway grants
    each step to one of them, so they never take the same step). A one-shot
    step is registered until it is taken or withdrawn; a *standing* step
    (e.g. the prompt cache's disposal drain, asked for again and again)
    stays registered until withdrawn, and its handle holds the outcome of
    its latest run. NOTE: loop-only: every method runs on the event loop
    and none awaits, so the actors holding it (the runner, the batch
    scheduler) may share it; the engine thread only calls a taken callable.
    """

    def __init__(self) -> None:
        self._steps: dict[str, tuple[Callable[[], Any], StepHandle[Any], bool]] = {}
        self._running: dict[str, tuple[StepHandle[Any], _Timed]] = {}
        self.slow = 0
        """Steps that ran :data:`SLOW_STEP_S` or longer."""
        self.longest_s = 0.0
        """The longest run of any step so far (seconds on the engine thread)."""

    def add(self, step_id: str, fn: Callable[[], T], *, standing: bool = False) -> StepHandle[T]:
        """Register ``fn`` under ``step_id`` (unique among registered and running steps)."""
        if step_id in self._steps or step_id in self._running:
            raise ValueError(f"step {step_id!r} is already registered")
        handle: StepHandle[T] = StepHandle(self, step_id)
        self._steps[step_id] = (fn, handle, standing)
        return handle

    def take(self, step_id: str) -> Callable[[], Any] | None:
        """Runner: the callable of a registered step, now running (``None``: unknown or withdrawn)."""
        entry = self._steps.get(step_id)
        if entry is None or step_id in self._running:
            return None
        fn, handle, standing = entry
        if not standing:
            del self._steps[step_id]
        timed = _Timed(fn)
        self._running[step_id] = (handle, timed)
        return timed

    def put_back(self, step_id: str) -> None:
        """A taker that did not run a taken step: it is registered again, as before :meth:`take`."""
        running = self._running.pop(step_id, None)
        if running is None:
            return
        handle, timed = running
        if step_id not in self._steps:
            self._steps[step_id] = (timed.fn, handle, False)

    def settle(self, step_id: str, result: Any, error: BaseException | None) -> None:
        """Runner: hand a taken step's outcome to its handle (after the step's job ended)."""
        running = self._running.pop(step_id, None)
        if running is None:
            return
        handle, timed = running
        elapsed = timed.elapsed_s
        if elapsed is not None:
            self.longest_s = max(self.longest_s, elapsed)
            if elapsed >= SLOW_STEP_S:
                self.slow += 1
                _log.info("engine.background_step_slow", step_id=step_id, fn=_name(timed.fn),
                          ms=round(elapsed * 1e3, 3))
        handle._settle(result, error)

    def _withdraw(self, step_id: str) -> None:
        self._steps.pop(step_id, None)

    def __len__(self) -> int:
        return len(self._steps) + sum(1 for s in self._running if s not in self._steps)
