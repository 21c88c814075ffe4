"""The batch lane's BLAS thread count: the chooser's decisions, the shell's synchronised changes, the kernel's calls."""

from __future__ import annotations

from typing import Any

import pytest

from kernels.engine import BatchGeneration, BlasTuning, SamplingParams, ThreadChooser, find_openblas
from tests.kernels.test_batch import Plan, _prompts, _serial, drive


class Feeder:
    """Plays the shell for a chooser: calls ``changed`` whenever the count it asks for changes."""

    def __init__(self, chooser: ThreadChooser) -> None:
        self.chooser = chooser
        self.last = chooser.threads

    def __call__(self, rows: int, seconds_by_threads: dict[int, float], n: int) -> None:
        """``n`` clean steps, each taking what its thread count costs."""
        for _ in range(n):
            if self.chooser.threads != self.last:
                self.chooser.changed()
                self.last = self.chooser.threads
            self.chooser.observe(rows, seconds_by_threads[self.chooser.threads])


def test_switches_to_the_other_count_when_its_trial_is_faster() -> None:
    """Once a window of samples exists, a trial of the other count runs, and a faster trial becomes the current count."""
    chooser = ThreadChooser(2, 1, window=4, explore_every=8)
    feed = Feeder(chooser)
    feed(4, {2: 0.25, 1: 0.19}, 4)
    assert chooser.threads == 1, "a trial starts after the first full window"
    feed(4, {2: 0.25, 1: 0.19}, 5)
    assert (chooser.current, chooser.trials, chooser.switches) == (1, 1, 1)
    assert chooser.threads == 1


def test_keeps_the_current_count_when_the_trial_is_not_faster_by_the_margin() -> None:
    """A trial within the margin (or slower) leaves the count, and the next trial comes later (backoff)."""
    chooser = ThreadChooser(2, 1, window=4, explore_every=8, margin=0.05)
    feed = Feeder(chooser)
    feed(4, {2: 0.100, 1: 0.097}, 9)
    assert (chooser.current, chooser.trials, chooser.switches) == (2, 1, 0)
    assert chooser.threads == 2
    feed(4, {2: 0.100, 1: 0.097}, 16)
    assert chooser.trials == 1, (
        "the interval doubled after a lost trial: no second trial within 16 steps"
    )
    feed(4, {2: 0.100, 1: 0.097}, 2)
    assert chooser.trials == 2


def test_the_sample_after_a_change_is_dropped() -> None:
    """The step right after a change only built the graph; its short time must not decide the trial."""
    chooser = ThreadChooser(2, 1, window=2, explore_every=1)
    chooser.observe(4, 0.2)
    chooser.observe(4, 0.2)
    assert chooser.threads == 1
    chooser.changed()
    chooser.observe(4, 0.001)  # NOTE: dropped; would win the trial if counted.
    chooser.observe(4, 0.3)
    chooser.observe(4, 0.3)
    assert (chooser.current, chooser.switches) == (2, 0)


def test_a_change_of_rows_abandons_the_trial_and_compares_like_with_like() -> None:
    """Samples of different batch shapes are never compared: a new row count ends a trial unjudged."""
    chooser = ThreadChooser(2, 1, window=2, explore_every=1)
    chooser.observe(4, 0.2)
    chooser.observe(4, 0.2)
    assert chooser.threads == 1
    chooser.changed()
    chooser.observe(4, 0.0)  # dropped
    chooser.observe(
        8, 0.01
    )  # a new shape: the trial is over, this sample is not the current count's
    assert (chooser.threads, chooser.switches) == (2, 0)
    chooser.observe(8, 0.3)
    chooser.observe(8, 0.3)
    assert chooser.threads == 1, "a fresh window of the new shape, then a trial again"


class FakePort:
    """Records thread counts set, and how many synchronisations came before each."""

    def __init__(self) -> None:
        self.syncs = 0
        self.sets: list[tuple[int, int]] = []

    def sync(self) -> None:
        self.syncs += 1

    def set_threads(self, n: int) -> None:
        self.sets.append((n, self.syncs))


def test_shell_synchronises_before_every_change_and_releases_to_the_default() -> None:
    """The thread count changes only after a synchronisation, never when unchanged, and goes back to the default on release."""
    port = FakePort()
    clock = iter([0.0, 0.3] * 20)
    tuning = BlasTuning(
        port,
        2,
        port.sync,
        chooser=ThreadChooser(2, 1, window=1, explore_every=1),
        clock=lambda: next(clock),
    )
    tuning.before_step()
    tuning.after_step(4, clean=True)
    assert port.sets == [], "the default needs no call"
    tuning.before_step()  # the chooser asks for a trial of 1 thread
    assert port.sets == [(1, 1)]
    assert tuning.threads == 1
    tuning.after_step(4, clean=False)
    tuning.release()
    assert port.sets == [(1, 1), (2, 2)]
    tuning.release()
    assert port.syncs == 2, "releasing at the default neither synchronises nor sets"


class RecordingTuning:
    """A StepTuning that records what the kernel tells it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool]] = []

    def before_step(self) -> None:
        self.calls.append(("before", 0, False))

    def after_step(self, rows: int, clean: bool) -> None:
        self.calls.append(("after", rows, clean))

    def release(self) -> None:
        self.calls.append(("release", 0, False))


def test_kernel_reports_only_pure_decode_steps_as_clean_and_releases_when_idle(
    model: Any, tok: Any
) -> None:
    """Steps that prefill, join or lose a row are not clean; a decode step starts with before_step, a prefill step with release (the default count); the batch going idle releases."""
    prompts = _prompts(len(tok), 2, seed=31, lo=6, hi=9)
    tuning = RecordingTuning()
    run = drive(
        BatchGeneration(model, tok, prefill_step_size=16, tuning=tuning),
        [
            Plan("a", prompts[0], SamplingParams(max_tokens=6)),
            Plan("b", prompts[1], SamplingParams(max_tokens=3)),
        ],
    )
    after = [(rows, clean) for kind, rows, clean in tuning.calls if kind == "after"]
    assert len(after) == len(run.steps)
    # NOTE: what opens each step: the call before each "after".
    opening = [tuning.calls[i - 1][0] for i, c in enumerate(tuning.calls) if c[0] == "after"]
    assert opening[0] == "release", "the prefill step runs at the default count"
    assert opening.count("release") + opening.count("before") == len(run.steps)
    assert after[0] == (0, False), "the prefill step"
    finishing = {run.left_step["a"], run.left_step["b"]}
    for i, (rows, clean) in enumerate(after):
        assert clean == (i > 0 and i not in finishing and rows > 0), (i, after)
    assert tuning.calls[-1][0] == "release"


@pytest.mark.skipif(find_openblas() is None, reason="needs OpenBLAS (LD_PRELOAD) to change threads")
def test_rows_stay_equal_to_serial_greedy_while_the_thread_count_flips_every_step(
    model: Any, tok: Any
) -> None:
    """With the real OpenBLAS switched between 1 and 2 threads at every step, each row's greedy tokens equal its serial run."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    blas = find_openblas()
    assert blas is not None
    default = blas.get_threads()
    if default < 2:
        pytest.skip("OpenBLAS runs one thread here: nothing to switch")
    chooser = ThreadChooser(default, 1, window=1, explore_every=1, margin=-10.0)
    # NOTE: margin -10: every trial "wins", so the count changes at every step.
    tuning = BlasTuning(blas, default, lambda: mx.synchronize(generation_stream), chooser=chooser)
    prompts = _prompts(len(tok), 3, seed=32, lo=5, hi=20)
    params = SamplingParams(max_tokens=12)
    try:
        run = drive(
            BatchGeneration(model, tok, prefill_step_size=8, tuning=tuning),
            [Plan(str(i), p, params) for i, p in enumerate(prompts)],
        )
    finally:
        tuning.release()
    assert blas.get_threads() == default
    assert chooser.switches >= 3, "the count really changed during the run"
    for i, p in enumerate(prompts):
        assert run.ids(str(i)) == [o.token_id for o in _serial(model, tok, p, params, step=8)]
