"""Live core traces: the codec round-trips what cores exchange, the recorder is bounded,
replay reproduces a recorded run of a real core and rejects an edited one."""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import pytest

from actors.durability.core import FlushRun
from actors.kv_events import core as kv
from actors.runtime import (
    CodecError,
    CoreTraceRecorder,
    Decoder,
    Encoder,
    Opaque,
    current_core_trace,
    is_live_trace,
    record_core_trace,
    replay_core_trace,
    traced,
)
from actors.runtime._core_codec import MAX_DEPTH, dumps
from messages import Envelope
from messages.kv_events import BlockIndexRequest, KvEventsStatsRequest, TierChange, TierChanged


def _round_trip(value: Any) -> Any:
    text = dumps(Encoder().encode(value))
    return Decoder().decode(json.loads(text))


def _change(op: str, tokens: tuple[int, ...], ts: float) -> kv.Received:
    body = TierChanged(medium="CPU", changes=(TierChange(op=op, namespace="", tokens=tokens),))  # type: ignore[arg-type]
    return kv.Received(body, ts=ts)


def test_codec_round_trips_containers_bytes_and_floats_exactly() -> None:
    """Tuples, dicts with tuple keys, OrderedDicts, deques (maxlen), sets, bytes, inf and
    an odd float come back equal and of the same types."""
    value = {
        (1, "a"): [1.1 + 2.2, math.inf, -0.0, None, True],
        "od": OrderedDict([("x", b"\x00\xff"), ("y", frozenset({3, 1}))]),
        "q": deque([1, 2], maxlen=5),
        "s": {"b", "a"},
    }
    back = _round_trip(value)
    assert back == value
    assert type(back["od"]) is OrderedDict
    assert list(back["od"]) == ["x", "y"]
    assert back["q"].maxlen == 5
    assert isinstance(back["s"], set)
    assert isinstance(back["od"]["y"], frozenset)
    assert isinstance(next(iter(back)), tuple)


def test_codec_round_trips_dataclasses_pydantic_bodies_and_envelopes() -> None:
    """A core's event (a frozen slotted dataclass holding a pydantic body), an envelope,
    and a dataclass whose __post_init__ set a non-field attribute, all survive."""
    event = _change("stored", tuple(range(20)), 5.25)
    assert _round_trip(event) == event
    envelope = Envelope("m1", "c1", None, "a", "b", 1.5, KvEventsStatsRequest(reply_to="x"))
    assert _round_trip(envelope) == envelope
    run = FlushRun(id=1, waiters=[], started_at=0.0, scope=(("ns", (1, 2)),))  # type: ignore[arg-type]
    back = _round_trip(run)
    assert back.in_scope(("ns", (1, 2)))
    assert not back.in_scope(("ns", (3,)))


def test_plain_objects_methods_and_partials_round_trip() -> None:
    """A plain class's object (the SSD index's restore estimator) keeps its learned
    attributes, and a partial of a dataclass's method (the memory guard's
    bytes-per-token) computes what the original does."""
    from actors.ssd_writer.core import Estimator

    estimator = Estimator(prior_prefill_tps=123.0)
    estimator.prefill_tps = 456.0
    back = _round_trip(estimator)
    assert type(back) is Estimator
    assert back.prefill_tps == 456.0
    assert back.prior_prefill_tps == 123.0
    assert back.read.predict(1 << 20) == estimator.read.predict(1 << 20)

    private = functools.partial(Opaque("x", 1).__eq__)  # not public: a placeholder
    assert "$o" in Encoder().encode(private)
    method = functools.partial(FlushRun(1, [], 0.0, (("ns", (1,)),)).in_scope)  # type: ignore[arg-type]
    again = _round_trip(method)
    assert isinstance(again, functools.partial)
    assert again(("ns", (1,))) is True
    assert again(("ns", (2,))) is False


def test_sets_are_written_in_one_order_whatever_their_iteration_order() -> None:
    """Two equal sets built in different orders encode to the same text (hash order free)."""
    # NOTE: 1, 9, 17, 25 share a slot in a small set's table, so the order
    # they were added in is the order they iterate in.
    one: set[int] = set()
    other: set[int] = set()
    for item in (1, 9, 17, 25):
        one.add(item)
    for item in (25, 17, 9, 1):
        other.add(item)
    assert list(one) != list(other)
    assert dumps(Encoder().encode(one)) == dumps(Encoder().encode(other))
    assert dumps(Encoder().encode(frozenset(one))) == dumps(Encoder().encode(frozenset(other)))


def test_opaque_objects_get_stable_placeholders() -> None:
    """An object the codec cannot write is numbered by first appearance, the same object
    keeps its number, and its decoded placeholder encodes back to the same tag."""
    encoder = Encoder()
    lock, other = threading.Lock(), threading.Lock()
    first = encoder.encode((lock, other, lock))
    assert first == {"$t": [{"$o": "lock", "n": 1}, {"$o": "lock", "n": 2}, {"$o": "lock", "n": 1}]}
    placeholder = Decoder().decode({"$o": "lock", "n": 2})
    assert placeholder == Opaque("lock", 2)
    assert Encoder().encode(placeholder) == {"$o": "lock", "n": 2}


@pytest.mark.parametrize(
    ("tree", "needle"),
    [
        ({"$c": "os:PathLike", "f": {}}, "outside"),
        ({"$c": "builtins:dict", "f": {}}, "outside"),
        ({"$c": "actors.runtime._errors:MailboxClosed", "f": {}}, "not a class of data"),
        ({"$m": {"$c": "actors.ssd_writer.core:Estimator", "f": {}}, "name": "__init__"}, "public"),
        ({"$m": {"$t": []}, "name": "count"}, "public method"),
        ({"$p": {"$t": []}, "args": [], "kw": {"$d": []}}, "method of a decoded object"),
        ({"$c": "actors.runtime._core_codec:Opaque", "f": {"bogus": 1}}, "no fields"),
        ({"$zz": 1}, "unknown tag"),
        ({"$d": [[1]]}, "pair"),
        ({"plain": "object"}, "unknown tag"),
    ],
)
def test_decoder_refuses_what_it_must_not_build(tree: Any, needle: str) -> None:
    """Classes outside actors/messages/kernels, non-data classes, unknown fields and tags,
    and malformed shapes are a CodecError naming the problem."""
    with pytest.raises(CodecError, match=needle):
        Decoder().decode(tree)


def test_decoder_bounds_nesting() -> None:
    """A value nested deeper than MAX_DEPTH is refused, not recursed into."""
    tree: Any = 0
    for _ in range(MAX_DEPTH + 5):
        tree = [tree]
    with pytest.raises(CodecError, match="nesting"):
        Decoder().decode(tree)


def _record_kv_run(path: Path, *, max_bytes: int = 1 << 20, events: int = 6) -> list[str]:
    """Drive the KV-event publisher's real core through ``traced`` while recording."""
    with record_core_trace(path, max_bytes=max_bytes) as recorder:
        assert current_core_trace() is recorder
        state = kv.CoreState(model="m", kv_scheme="kv:plain")
        state, _ = traced("kv_events", kv.handle, state, kv.Started(ts=1.0))
        for i in range(events):
            tokens = tuple(range(16 * (i + 1)))
            state, _ = traced("kv_events", kv.handle, state, _change("stored", tokens, 2.0 + i))
            state, _ = traced("kv_events", kv.handle, state, kv.Received(BlockIndexRequest(reply_to="r"), 9.0))
    assert current_core_trace() is None
    return path.read_text().splitlines()


def test_replay_reproduces_a_recorded_core_run(tmp_path: Path) -> None:
    """A recorded run of the real kv_events core replays with every effect equal and is
    recognised as a live trace; the file is private to its owner."""
    lines = _record_kv_run(tmp_path / "t.jsonl")
    assert is_live_trace(lines[0])
    assert not is_live_trace('{"kvtier_trace":1,"scenario":"x"}')
    assert json.loads(lines[-1]) == {"end": {"lines": len(lines) - 2, "truncated": False}}
    assert (tmp_path / "t.jsonl").stat().st_mode & 0o777 == 0o600
    report = replay_core_trace(lines)
    assert report.ok, report
    assert report.note is None


def test_replay_rejects_a_removed_a_moved_and_a_changed_call(tmp_path: Path) -> None:
    """Dropping a call, swapping two (with their numbers swapped back), or changing one
    recorded effect each fails at the line where the difference shows."""
    lines = _record_kv_run(tmp_path / "t.jsonl")
    removed = lines[:4] + lines[5:]
    report = replay_core_trace(removed)
    assert not report.ok
    assert report.line == 5
    assert "missing or out of order" in str(report.actual)

    swapped = list(lines)
    swapped[3], swapped[4] = swapped[4], swapped[3]
    for index, n in ((3, 3), (4, 4)):
        record = json.loads(swapped[index])
        record["n"] = n
        swapped[index] = json.dumps(record, separators=(",", ":"))
    report = replay_core_trace(swapped)
    assert not report.ok
    assert report.line == 4, report

    changed = list(lines)
    record = json.loads(changed[4])
    record["fx"] = record["fx"][:-1]
    changed[4] = json.dumps(record, separators=(",", ":"))
    report = replay_core_trace(changed)
    assert not report.ok
    assert report.line == 5, report


def test_replay_rejects_a_missing_last_call_through_the_end_count(tmp_path: Path) -> None:
    """The end line counts the calls, so removing the last one (before the end) is seen."""
    lines = _record_kv_run(tmp_path / "t.jsonl")
    report = replay_core_trace(lines[:-2] + lines[-1:])
    assert not report.ok
    assert report.line == len(lines) - 1, report


def test_recorder_stops_at_its_bound_and_replay_says_truncated(tmp_path: Path) -> None:
    """With a 2 KiB bound the file stays under it, ends with a truncated line, records no
    more, and its replay passes what it holds while saying it is truncated."""
    path = tmp_path / "t.jsonl"
    lines = _record_kv_run(path, max_bytes=2048, events=50)
    assert path.stat().st_size <= 2048
    last = json.loads(lines[-1])
    assert last["truncated"]["reason"] == "max_bytes reached"
    assert last["truncated"]["lines"] == len(lines) - 2
    report = replay_core_trace(lines)
    assert report.ok, report
    assert "truncated" in str(report.note)


def test_a_call_that_raises_is_recorded_and_replayed(tmp_path: Path) -> None:
    """A core that raises is recorded with its exception's type; replay expects the same
    raise and restarts the actor from the next state line."""
    path = tmp_path / "t.jsonl"
    with record_core_trace(path):
        state = kv.CoreState(model="m", kv_scheme="kv:plain")
        state, _ = traced("kv_events", kv.handle, state, kv.Started(ts=1.0))
        with pytest.raises(kv.UnknownKvEventsMessage):
            traced("kv_events", kv.handle, state, kv.Received(_foreign_body(), 2.0))
        state, _ = traced("kv_events", kv.handle, state, _change("stored", tuple(range(32)), 3.0))
    lines = path.read_text().splitlines()
    assert json.loads(lines[3])["err"] == "UnknownKvEventsMessage"
    assert "state" in json.loads(lines[4])  # a new segment after the raise
    assert replay_core_trace(lines).ok


def _foreign_body() -> Any:
    """A body the kv_events core has no rule for (a stats request of another actor)."""
    from messages.prompt_cache import PromptCacheStatsRequest

    return PromptCacheStatsRequest(reply_to="r")


def test_the_recorder_refuses_a_bound_too_small_to_hold_anything(tmp_path: Path) -> None:
    """A bound under 1 KiB is a ValueError before any file is made."""
    with pytest.raises(ValueError, match="at least 1024"):
        CoreTraceRecorder(tmp_path / "t.jsonl", max_bytes=100)
    assert not (tmp_path / "t.jsonl").exists()


def test_kvtier_replay_reads_a_live_trace_and_says_when_it_is_truncated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier replay` picks the live replay from the header: exit 0 with a note for a
    truncated trace, exit 1 naming the line for an edited one."""
    from actors.cli.main import build_parser
    from actors.cli.replay import run

    path = tmp_path / "t.jsonl"
    lines = _record_kv_run(path, max_bytes=2048, events=50)
    assert run(build_parser(["replay", str(path)]).parse_args(["replay", str(path)])) == 0
    out = capsys.readouterr().out
    assert "replay ok" in out
    assert "note: truncated (max_bytes reached)" in out
    path.write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    assert run(build_parser(["replay", str(path)]).parse_args(["replay", str(path)])) == 1
    assert "diverged at line 4" in capsys.readouterr().out


def test_a_value_the_codec_cannot_write_stops_recording_not_the_call(tmp_path: Path) -> None:
    """A state holding a cycle ends the trace as truncated ('cannot encode'); the core's
    call still returns its state and effects, and later calls run untraced."""
    path = tmp_path / "t.jsonl"
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with record_core_trace(path) as recorder:
        state = kv.CoreState(model="m", kv_scheme="kv:plain")
        state, _ = traced("kv_events", kv.handle, state, kv.Started(ts=1.0))
        state.roots["loop"] = cyclic  # type: ignore[assignment]
        state, effects = traced("other", kv.handle, state, _change("stored", tuple(range(32)), 2.0))
        assert len(effects) == 1
        assert recorder.truncated is not None
        assert recorder.truncated.startswith("cannot encode: RecursionError")
        state, effects = traced("kv_events", kv.handle, state, _change("stored", tuple(range(64)), 3.0))
        assert len(effects) == 1
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["truncated"]["lines"] == 2
    report = replay_core_trace(lines)
    assert report.ok
    assert "truncated" in str(report.note)


def test_a_lone_surrogate_is_written_escaped(tmp_path: Path) -> None:
    """Text with a lone surrogate (a broken detokenization) is written as ASCII and comes back."""
    text = "half \ud83d"
    tree = Encoder().encode(text)
    assert dumps(tree).isascii()
    assert Decoder().decode(json.loads(dumps(tree))) == text
