"""The restore staging holds open, checked files: every descriptor is closed on every path, off
the calling thread, and a landing that finds the file changed is a miss the index learns of."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import mlx.core as mx
import pytest

from actors.backend.mlx import MlxBackend
from actors.ssd_writer import HostStaging, LandingObservation, StagedEntry, core
from kernels.cache import cache_arrays
from kernels.cache._file_port import FilePort, OsFilePort
from kernels.cache._kv_header import read_header
from kernels.cache._kv_reader import open_entry
from messages import Body, Envelope, Find, FindResult
from messages.gateway import Generate
from messages.ssd_writer import FilesRemoved, LandingReport
from tests.crash.ports import ForwardingPort
from tests.kernels.cache.test_kv_file import _filled_kv, raw, write_entry

TOKENS = tuple(range(9))


class CountingPort(ForwardingPort):
    """Counts the descriptors opened and not yet closed, and the threads that closed any."""

    def __init__(self) -> None:
        super().__init__(OsFilePort(writeback=None))
        self.open_fds: set[int] = set()
        self.closers: set[int] = set()
        self._lock = threading.Lock()

    def open_read(self, path: str) -> int:
        """Open and count."""
        fd = super().open_read(path)
        with self._lock:
            self.open_fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        """Close and uncount."""
        with self._lock:
            self.open_fds.discard(fd)
            self.closers.add(threading.get_ident())
        super().close(fd)


@pytest.fixture
def file(tmp_path: Path) -> Path:
    """A committed entry: one plain KV layer of 9 tokens."""
    return write_entry([_filled_kv(len(TOKENS), seed=4)], TOKENS, tmp_path)


def _staged(port: FilePort, path: Path) -> StagedEntry:
    header = read_header(OsFilePort(writeback=None), str(path))
    return StagedEntry(str(path), open_entry(port, str(path), header, verify=True))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_every_staging_path_closes_its_file_off_the_calling_thread(file: Path) -> None:
    """Pushed out, discarded, taken and released, landed, left at shutdown: each file is closed,
    and those closed before shutdown were closed on a landing thread."""
    port = CountingPort()
    staging = HostStaging(max_entries=2)
    staging.put("pushed", _staged(port, file))
    staging.put("discarded", _staged(port, file))
    staging.put("released", _staged(port, file))  # pushes "pushed" out
    assert staging.take("pushed") is None
    staging.discard("discarded")
    taken = staging.take("released")
    assert taken is not None
    staging.release(taken)
    staging.put("landed", _staged(port, file))
    landing = staging.take("landed")
    assert landing is not None
    staging.land(landing)
    staging.put("waiting", _staged(port, file))
    assert len(port.open_fds) >= 1  # the waiting one at least
    closers_before_shutdown = set(port.closers)
    staging.close()
    assert port.open_fds == set()
    assert staging.evicted == 1
    assert threading.get_ident() not in closers_before_shutdown
    late = _staged(port, file)
    assert staging.put("late", late) is False  # closed staging: refused and closed at once
    assert port.open_fds == set()


def test_a_landing_that_finds_a_flipped_bit_is_a_recorded_corrupt_miss(file: Path) -> None:
    """A byte changed after the worker's pass fails the landing; the file is closed and the
    observation says corrupt, so the index can drop it."""
    port = CountingPort()
    staging = HostStaging(max_entries=2)
    seen: list[LandingObservation] = []
    staging.bind_reports(seen.append)
    staged = _staged(port, file)
    rec = staged.header.tensors[1]
    _flip(file, rec.offset + 3)
    with pytest.raises(Exception, match="hash mismatch"):
        staging.land(staged)
    staging.close()
    assert port.open_fds == set()
    (obs,) = seen
    assert (obs.path, obs.ok, obs.corrupt) == (str(file), False, True)
    assert staging.land_failures == 1


def test_a_landing_records_its_size_and_time(file: Path) -> None:
    """A good landing records the bytes it landed and its engine-thread seconds (the clock's)."""
    ticks = iter([10.0, 10.25])
    staging = HostStaging(max_entries=2, clock=lambda: next(ticks))
    seen: list[LandingObservation] = []
    staging.bind_reports(seen.append)
    staged = _staged(OsFilePort(writeback=None), file)
    caches = staging.land(staged)
    staging.close()
    (obs,) = seen
    assert (obs.ok, obs.nbytes, obs.seconds) == (True, staged.header.nbytes, 0.25)
    assert caches[0].offset == len(TOKENS)


def _request(tokens: tuple[int, ...]) -> Generate:
    return Generate(request_id="r", prompt_tokens=tokens)


@pytest.mark.parametrize("outcome", ["landed", "mismatch", "untrimmable", "corrupt", "lost"])
def test_the_backend_restore_closes_the_file_on_every_outcome(file: Path, outcome: str) -> None:
    """MlxBackend's restore lands a matching entry and misses on every other outcome; the file is
    closed either way."""
    port = CountingPort()
    staging = HostStaging(max_entries=2)
    backend = MlxBackend(None, None, prefill_step_size=16, staging=staging)
    staged = _staged(port, file)
    prompt = (*TOKENS, 99)
    tokens = len(TOKENS)
    if outcome == "mismatch":
        prompt = (1000, *TOKENS[1:], 99)
    elif outcome == "untrimmable":
        # NOTE: 4 of the file's 9 tokens need a trim, and the header now says it cannot.
        tokens, prompt = 4, (*TOKENS[:4], 99)
        layer = dataclasses.replace(
            staged.header.layers[0], kind="rotating", max_size=4, keep=0, idx=1
        )
        object.__setattr__(staged.header, "layers", (layer,))
        assert not staged.header.trimmable
    elif outcome == "corrupt":
        _flip(file, staged.header.tensors[0].offset)
    if outcome != "lost":
        staging.put("s", staged)
    else:
        staged.close()
    caches = backend._restore(_request(prompt), "s", tokens)
    staging.close()
    assert port.open_fds == set()
    if outcome == "landed":
        assert caches is not None
        assert backend.restores == 1
        assert raw(cache_arrays(caches)[0][..., :tokens, :]) == raw(
            _filled_kv(len(TOKENS), seed=4).keys[..., :tokens, :]  # type: ignore[index]
        )
    else:
        assert caches is None
        assert backend.restore_failures == 1


def _index(path: str) -> core.IndexState:
    state = core.IndexState(root="/cache", fingerprint="fp0", max_bytes=10**9, min_restore_tokens=1)
    directory = state.directory_of("")
    entry = core.IndexEntry(path, "", TOKENS, 1000, 1, True, 0)
    scan = core.ScanResult(files=(core.ScannedFile(entry.path, directory, None, entry=entry),))
    core.handle(state, core.ScanLoaded(scan, locked=True, now=0.0))
    return state


def _send(state: core.IndexState, body: Body) -> list[core.Effect]:
    envelope = Envelope("m", "c", None, "x", "ssd_writer", 0.0, body)
    return core.handle(state, core.Received(envelope, 0.0))[1]


def _landed(state: core.IndexState, path: str, *, ok: bool, seconds: float) -> list[core.Effect]:
    report = LandingReport(path=path, nbytes=500, seconds=seconds, ok=ok, corrupt=not ok)
    return _send(state, report)


def _find(state: core.IndexState) -> FindResult:
    (effect,) = _send(state, Find(tokens=(*TOKENS, 5)))
    assert isinstance(effect, core.Answer)
    assert isinstance(effect.body, FindResult)
    return effect.body


def test_a_corrupt_landing_removes_the_file_and_counts_it() -> None:
    """The index drops a file whose landing failed its check (never offered again), counts it
    removed and has it unlinked, its bytes counted until that is done; a good landing only
    feeds the estimator."""
    state = _index("/cache/fp0/x/a.kvt")
    path = next(iter(state.entries))
    assert _find(state).path == path
    assert _landed(state, path, ok=True, seconds=0.5) == []
    assert state.estimator.land.samples == 1
    effects = _landed(state, path, ok=False, seconds=0.0)
    assert [type(e) for e in effects] == [core.Log, core.RemoveFiles]
    remove = effects[1]
    assert isinstance(remove, core.RemoveFiles)
    assert (remove.paths, remove.reason) == ((path,), "corrupt")
    assert path not in state.entries
    assert state.leftovers == {path: 1000}
    assert (state.restore_failures, state.corrupt_removed) == (1, 1)
    assert _find(state) == FindResult()
    assert _send(state, FilesRemoved(removed=(path,), failed=())) == []
    assert state.leftovers == {}


def test_a_read_only_tier_only_stops_offering_a_corrupt_landing() -> None:
    """A tier that does not own its directory removes nothing after a corrupt landing."""
    state = _index("/cache/fp0/x/a.kvt")
    state.read_only = True
    path = next(iter(state.entries))
    effects = _landed(state, path, ok=False, seconds=0.0)
    assert [type(e) for e in effects] == [core.Log]
    assert path not in state.entries
    assert (state.leftovers, state.corrupt_removed) == ({}, 0)
    assert _find(state) == FindResult()


def test_staged_bytes_are_reported_and_nothing_is_host_memory(file: Path) -> None:
    """The staging's bytes are what waiting landings will allocate: the files' tensor bytes."""
    staging = HostStaging(max_entries=2)
    staged = _staged(OsFilePort(writeback=None), file)
    staging.put("a", staged)
    assert staging.nbytes == staged.header.nbytes == 2 * len(TOKENS) * 2 * 32 * mx.float32.size
    staging.close()


@pytest.mark.anyio
async def test_a_landing_reaches_the_index_as_a_message_before_the_next_ask(
    tmp_path: Path, file: Path
) -> None:
    """A landing on another thread is posted to the index as a LandingReport: a stats ask sent
    after the landing returned counts it (no shared state is drained)."""
    from actors.engine.wiring import spawn_ssd_writer
    from actors.runtime import ActorSystem
    from tests.actors.ssd_writer.support import config, ssd_stats
    from tests.crash.checker import ScriptedSource

    staging = HostStaging(max_entries=2)
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(
            system, config=config(tmp_path / "tier"), source=ScriptedSource(), staging=staging
        )
        assert (await ssd_stats(system, tier)).landings == 0
        await anyio.to_thread.run_sync(staging.land, _staged(OsFilePort(writeback=None), file))
        stats = await ssd_stats(system, tier)
        assert (stats.landings, stats.land_failures) == (1, 0)
