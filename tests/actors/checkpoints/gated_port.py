"""A checkpoint port whose lookups wait for the test: what a slow checkpoint lookup looks like to a lane."""

from __future__ import annotations

import threading

from actors.checkpoints import CheckpointCounters, CheckpointPort, ResumeFrom


class GatedPort(CheckpointPort):
    """A checkpoint port whose ``load`` blocks until the test opens the gate, then finds ``found``."""

    def __init__(self, found: ResumeFrom | None) -> None:
        super().__init__(every=8, directory="unused", fingerprint="f", port=None,  # type: ignore[arg-type]
                         spill_queue="spill", dispose=lambda _h: None, counters=CheckpointCounters())
        self.gate = threading.Event()
        self.found = found
        self.loads: list[tuple[str, str, tuple[int, ...], int]] = []

    def load(self, key: str, namespace: str, prompt: tuple[int, ...]) -> ResumeFrom | None:
        """Record the call (with its thread), wait for the gate, answer ``found``."""
        self.loads.append((key, namespace, prompt, threading.get_ident()))
        assert self.gate.wait(10)
        return self.found
