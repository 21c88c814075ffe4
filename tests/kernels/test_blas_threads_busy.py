"""The BLAS thread chooser skips its trials of fewer threads while the threads it runs have their cores."""

from __future__ import annotations

from kernels.engine import BUSY_FRACTION, BlasTuning, ThreadChooser
from tests.kernels.test_blas_threads import FakePort


def _feed(chooser: ThreadChooser, n: int, seconds: dict[int, float], use: float) -> None:
    """``n`` clean steps of 4 rows; the process's CPU time is ``use`` x threads x the step's wall time."""
    last = chooser.threads
    for _ in range(n):
        if chooser.threads != last:
            chooser.changed()
            last = chooser.threads
        wall = seconds[chooser.threads]
        chooser.observe(4, wall, use * chooser.threads * wall)


def test_no_trial_while_both_threads_get_their_cores() -> None:
    """On a free machine (CPU time ~ 2 x wall with 2 threads) the due trials of 1 thread are skipped and counted."""
    chooser = ThreadChooser(2, 1, window=3, explore_every=4)
    _feed(chooser, 40, {2: 0.06, 1: 0.09}, use=0.95)
    assert chooser.trials == 0
    assert chooser.skipped >= 5
    assert chooser.current == 2


def test_trials_run_and_switch_when_the_threads_wait_for_cores() -> None:
    """On a contended machine (CPU time ~ wall with 2 threads) the trial runs and one faster thread is chosen."""
    chooser = ThreadChooser(2, 1, window=3, explore_every=4)
    _feed(chooser, 40, {2: 0.25, 1: 0.19}, use=0.5)
    assert chooser.trials >= 1
    assert chooser.switches == 1
    assert chooser.current == 1


def test_with_one_thread_chosen_the_larger_count_is_still_tried() -> None:
    """Once one thread was chosen, trials of the default go on whatever the use, so a freed machine gets its threads back."""
    chooser = ThreadChooser(2, 1, window=3, explore_every=4)
    _feed(chooser, 40, {2: 0.25, 1: 0.19}, use=0.5)
    assert chooser.current == 1
    trials = chooser.trials
    _feed(chooser, 40, {2: 0.06, 1: 0.09}, use=1.0)
    assert chooser.trials > trials
    assert chooser.current == 2


def test_without_cpu_times_the_cadence_is_unchanged() -> None:
    """Steps observed without the process's CPU time never skip a trial (the gate needs evidence)."""
    chooser = ThreadChooser(2, 1, window=3, explore_every=4)
    for _ in range(40):
        if chooser.threads == 1:
            chooser.changed()
        chooser.observe(4, 0.06)
    assert chooser.skipped == 0
    assert chooser.trials >= 1


def test_shell_hands_the_process_cpu_time_of_each_step_to_the_chooser() -> None:
    """BlasTuning reads its CPU clock around each step, so a free machine's steps skip the trial."""
    port = FakePort()
    wall = iter([float(i) * 0.1 for i in range(200)])
    cpu = iter([float(i) * 0.1 * 2 * BUSY_FRACTION * 1.1 for i in range(200)])
    tuning = BlasTuning(
        port,
        2,
        port.sync,
        chooser=ThreadChooser(2, 1, window=2, explore_every=2),
        clock=lambda: next(wall),
        cpu_clock=lambda: next(cpu),
    )
    for _ in range(20):
        tuning.before_step()
        tuning.after_step(4, clean=True)
    assert port.sets == [], "no trial: the two threads had their cores"
    assert tuning.chooser.skipped >= 5
