"""Injected ports for time, ids and randomness (real and simulated).

Actors take time, ids and random numbers only from these ports (through
their ``Context``), so the simulated runtime can make a run reproducible.
"""

from __future__ import annotations

import itertools
import random
import secrets
import time
from typing import Protocol, runtime_checkable

__all__ = [
    "Clock",
    "Ids",
    "ManualClock",
    "Rng",
    "SeededRng",
    "SequentialIds",
    "SystemClock",
    "SystemIds",
    "SystemRng",
]


@runtime_checkable
class Clock(Protocol):
    """A monotonic clock in seconds."""

    def now(self) -> float:
        """The current time in seconds (monotonic; the origin is arbitrary)."""
        ...


@runtime_checkable
class Ids(Protocol):
    """A source of unique string ids."""

    def new_id(self, prefix: str = "") -> str:
        """A new id, unique within this source, starting with ``prefix``."""
        ...


@runtime_checkable
class Rng(Protocol):
    """A source of random numbers."""

    def random(self) -> float:
        """A float in ``[0, 1)``."""
        ...

    def randrange(self, stop: int) -> int:
        """An int in ``[0, stop)``."""
        ...


class SystemClock:
    """The process's monotonic clock (``time.monotonic``)."""

    __slots__ = ()

    def now(self) -> float:
        """Seconds from ``time.monotonic``."""
        return time.monotonic()


class ManualClock:
    """A virtual clock that only moves when told to (simulation, tests)."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        """The virtual time."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the virtual time forward by ``seconds`` (never backwards)."""
        if seconds < 0:
            raise ValueError("a clock never runs backwards")
        # NOTE: rounding keeps repeated float steps byte-identical across runs and
        # readable in traces (0.003 rather than 0.0030000000000000005).
        self._now = round(self._now + seconds, 9)


class SystemIds:
    """Process-unique ids: a random per-instance stem plus a counter.

    NOTE: a counter is ~10x cheaper than ``uuid4`` on the hot path; the random
    stem keeps ids from two processes (or two systems) apart in merged logs.
    """

    __slots__ = ("_counter", "_stem")

    def __init__(self) -> None:
        self._stem = secrets.token_hex(4)
        self._counter = itertools.count(1)

    def new_id(self, prefix: str = "") -> str:
        """``<prefix><stem>-<n hex>``."""
        return f"{prefix}{self._stem}-{next(self._counter):x}"


class SequentialIds:
    """Deterministic ids ``<prefix><n>`` with one counter per prefix (simulation)."""

    __slots__ = ("_counters",)

    def __init__(self) -> None:
        self._counters: dict[str, int] = {}

    def new_id(self, prefix: str = "") -> str:
        """The next id for ``prefix``."""
        n = self._counters.get(prefix, 0) + 1
        self._counters[prefix] = n
        return f"{prefix}{n}"


class SystemRng:
    """OS-seeded randomness (``random.Random()``)."""

    __slots__ = ("_random",)

    def __init__(self) -> None:
        self._random = random.Random()

    def random(self) -> float:
        """A float in ``[0, 1)``."""
        return self._random.random()

    def randrange(self, stop: int) -> int:
        """An int in ``[0, stop)``."""
        return self._random.randrange(stop)


class SeededRng:
    """Reproducible randomness from a seed (simulation, tests)."""

    __slots__ = ("_random", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._random = random.Random(seed)

    def random(self) -> float:
        """A float in ``[0, 1)``."""
        return self._random.random()

    def randrange(self, stop: int) -> int:
        """An int in ``[0, stop)``."""
        return self._random.randrange(stop)
