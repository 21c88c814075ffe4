"""Restore-or-recompute with a restore cost of fixed overhead + bytes / speed, read and landing.

Scripted devices: each read and landing takes exactly ``fixed + bytes / speed`` seconds, and
prefill a fixed number of tokens per second. The estimator is fed what the tier would measure
(``RestoreReport`` for reads, the staging's landing observations, ``ObservePrefill``) and must
pick the truly faster option.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest

from actors.ssd_writer import CostLine, Estimator, core
from messages import Envelope, Find, FindResult, ObservePrefill, RestoreReport
from messages.ssd_writer import LandingReport

_ids = itertools.count()
MB = 1_000_000


@dataclass(frozen=True)
class Device:
    """True costs: a read and a landing of ``n`` bytes, a prefill of ``t`` tokens."""

    read_fixed_s: float
    read_bps: float
    land_fixed_s: float
    land_bps: float
    prefill_tps: float

    def read_s(self, n: int) -> float:
        return self.read_fixed_s + n / self.read_bps

    def land_s(self, n: int) -> float:
        return self.land_fixed_s + n / self.land_bps

    def restore_s(self, n: int) -> float:
        return self.read_s(n) + self.land_s(n)

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tps


# NOTE: a CPU box like this VM (slow prefill, memory-bound landing) and a GPU host (fast
# prefill, fast landing); both with a real per-read overhead of a few tens of milliseconds.
CPU = Device(0.030, 2.5e9, 0.004, 1.3e9, 150.0)
GPU = Device(0.020, 3.0e9, 0.002, 20e9, 25_000.0)

# NOTE: a conversation tier holds files of many sizes; these are the restores it timed.
SIZES = (2 * MB, 40 * MB, 8 * MB, 300 * MB, 20 * MB, 120 * MB, 4 * MB, 60 * MB)


def _learn(est: Estimator, dev: Device, sizes: tuple[int, ...] = SIZES) -> None:
    for n in sizes:
        est.observe_read(n, dev.read_s(n))
        est.observe_landing(n, dev.land_s(n))
    est.observe_prefill(1000, dev.prefill_s(1000))


def test_a_cost_line_recovers_fixed_cost_and_speed_from_reads_of_different_sizes() -> None:
    """From exact samples of mixed sizes the fitted line is the device's line."""
    line = CostLine(prior_fixed_s=0.0, prior_bps=1e9)
    for n in SIZES:
        line.observe(n, CPU.read_s(n))
    assert line.fixed_s == pytest.approx(CPU.read_fixed_s, rel=1e-6)
    assert line.bps == pytest.approx(CPU.read_bps, rel=1e-6)
    assert line.predict(1_000 * MB) == pytest.approx(CPU.read_s(1_000 * MB), rel=1e-6)


def test_a_cost_line_of_one_size_keeps_its_fixed_prior_and_explains_the_rest_by_speed() -> None:
    """Samples of one size cannot split the two parts: the fixed prior stays (capped at the mean
    time) and the speed makes the samples' time exact."""
    line = CostLine(prior_fixed_s=0.01, prior_bps=1e9)
    for _ in range(4):
        line.observe(10 * MB, 0.05)
    assert line.fixed_s == pytest.approx(0.01)
    assert line.predict(10 * MB) == pytest.approx(0.05)
    tiny = CostLine(prior_fixed_s=1.0, prior_bps=1e9)
    tiny.observe(MB, 0.2)
    assert (tiny.fixed_s, tiny.bps) == (0.2, float("inf"))


def test_a_cost_line_follows_a_device_that_slows_down() -> None:
    """Newer samples weigh more: after the disk halves its speed the line follows."""
    line = CostLine(prior_fixed_s=0.0, prior_bps=1e9)
    slow = Device(0.03, 1.25e9, 0.0, 1.0, 1.0)
    for n in SIZES:
        line.observe(n, CPU.read_s(n))
    for n in SIZES * 4:
        line.observe(n, slow.read_s(n))
    assert line.bps == pytest.approx(slow.read_bps, rel=0.05)


def _speed_only_choice(dev: Device, file_bytes: int, saved: int) -> str:
    """What a bytes-over-average-speed estimator (the old one) advises after the same reads."""
    disk: float | None = None
    for n in SIZES:
        sample = n / dev.read_s(n)
        disk = sample if disk is None else disk + 0.3 * (sample - disk)
    assert disk is not None
    return "restore" if file_bytes / disk < saved / dev.prefill_tps else "recompute"


@pytest.mark.parametrize("dev", [CPU, GPU], ids=["cpu", "gpu"])
def test_the_choice_is_the_faster_option_for_every_file_size_and_saving(dev: Device) -> None:
    """Over files of 1 MB to 4 GB and savings of 64 to 32k tokens, the advice is the truly faster
    option wherever the two differ by more than 5 %."""
    est = Estimator()
    _learn(est, dev)
    checked = 0
    for file_bytes in (1 * MB, 5 * MB, 50 * MB, 500 * MB, 4000 * MB):
        for saved in (64, 256, 1024, 4096, 32768):
            restore, prefill = dev.restore_s(file_bytes), dev.prefill_s(saved)
            if abs(restore - prefill) < 0.05 * min(restore, prefill):
                continue
            want = "restore" if restore < prefill else "recompute"
            choice, predicted_restore, predicted_prefill = est.choose(file_bytes, saved)
            assert choice == want, (file_bytes, saved, restore, prefill)
            assert predicted_restore == pytest.approx(restore, rel=1e-6)
            assert predicted_prefill == pytest.approx(prefill, rel=1e-6)
            checked += 1
    assert checked >= 20


def test_a_small_file_is_no_longer_advised_when_its_read_overhead_exceeds_the_prefill() -> None:
    """On a GPU, 64 tokens from a 2 MB file: the per-read overhead (22 ms) exceeds the prefill
    (2.6 ms), so recompute; a speed-only estimate saw 1 ms and advised the read."""
    est = Estimator()
    _learn(est, GPU)
    file_bytes, saved = 2 * MB, 64
    assert GPU.restore_s(file_bytes) > 5 * GPU.prefill_s(saved)
    assert _speed_only_choice(GPU, file_bytes, saved) == "restore"  # the old mis-advice
    assert est.choose(file_bytes, saved)[0] == "recompute"


def test_small_reads_no_longer_make_a_large_file_look_slow() -> None:
    """After reads of small files only (overhead-dominated), a 1 GB file on a GPU is restored to
    save 32k tokens (0.41 s against 1.31 s of prefill), where a speed-only estimate believed
    0.1 GB/s and advised recompute; to save 8k tokens (0.33 s of prefill) it is recomputed."""
    est = Estimator()
    small = (1 * MB, 2 * MB, 4 * MB, 3 * MB, 2 * MB, 1 * MB)
    _learn(est, GPU, small)
    file_bytes = 1_000 * MB
    disk: float | None = None
    for n in small:
        sample = n / GPU.read_s(n)
        disk = sample if disk is None else disk + 0.3 * (sample - disk)
    assert disk is not None
    assert disk < 0.3e9  # what the old estimate believed
    assert file_bytes / disk > GPU.prefill_s(32768)  # so it advised recompute
    assert GPU.restore_s(file_bytes) < GPU.prefill_s(32768)
    assert est.choose(file_bytes, 32768)[0] == "restore"
    assert GPU.restore_s(file_bytes) > GPU.prefill_s(8192)
    assert est.choose(file_bytes, 8192)[0] == "recompute"


def test_the_landing_cost_counts_in_the_restore_prediction_once_prefill_is_timed() -> None:
    """A device that reads fast but lands slowly (this CPU VM) is predicted read + landing, once
    a prefill was timed: before, the prefill side is a prior and a landing does not weigh in."""
    est = Estimator()
    for n in SIZES:
        est.observe_read(n, CPU.read_s(n))
    before = est.restore_s(1_000 * MB)
    for n in SIZES:
        est.observe_landing(n, CPU.land_s(n))
    assert est.restore_s(1_000 * MB) == before  # prefill not timed yet
    est.observe_prefill(1000, CPU.prefill_s(1000))
    assert est.restore_s(1_000 * MB) == pytest.approx(CPU.restore_s(1_000 * MB), rel=1e-6)
    assert est.restore_s(1_000 * MB) - before == pytest.approx(CPU.land_s(1_000 * MB), rel=1e-6)


def test_a_slow_first_landing_does_not_turn_an_untimed_prefill_into_recompute() -> None:
    """After a restart every turn may come from disk (no prefill timed): one landing slowed by a
    busy machine must not make the prior prefill look faster than a read that is not."""
    est = Estimator()
    n = 5 * MB
    est.observe_read(n, 0.01)
    est.observe_landing(n, 0.18)  # a scheduling spike: 2-20 ms is usual
    assert est.choose(n, 79)[0] == "restore"  # 10 ms of read against 79 ms of prior prefill


def _send(state: core.IndexState, body: Any) -> list[core.Effect]:
    envelope = Envelope(f"m-{next(_ids)}", "c", None, "x", "ssd_writer", 0.0, body)
    return core.handle(state, core.Received(envelope, 0.0))[1]


def test_the_index_learns_reads_landings_and_prefill_and_advises_by_them() -> None:
    """Through the index: RestoreReport, landing reports and ObservePrefill set the advice, and
    Find reports the predictions it decided by."""
    tokens = tuple(range(5000))
    state = core.IndexState(root="/c", fingerprint="fp0", max_bytes=10**12, min_restore_tokens=1)
    directory = state.directory_of("")
    entry = core.IndexEntry(f"{directory}/a.kvt", "", tokens, 640 * MB, 1, True, 0)
    scanned = core.ScannedFile(entry.path, directory, None, entry=entry)
    core.handle(state, core.ScanLoaded(core.ScanResult(files=(scanned,)), locked=True, now=0.0))
    for n in SIZES:
        _send(state, RestoreReport(path="elsewhere", ok=True, bytes=n, seconds=CPU.read_s(n)))
        _send(state, LandingReport(path="elsewhere", nbytes=n, seconds=CPU.land_s(n), ok=True))
    _send(state, ObservePrefill(tokens=1500, seconds=10.0))  # 150 tok/s
    (effect,) = _send(state, Find(tokens=(*tokens, 1)))
    assert isinstance(effect, core.Answer)
    got = effect.body
    assert isinstance(got, FindResult)
    assert got.choice == "restore"
    assert got.predicted_restore_s == pytest.approx(CPU.restore_s(640 * MB), rel=1e-6)
    assert got.predicted_prefill_s == pytest.approx(5000 / 150.0)
