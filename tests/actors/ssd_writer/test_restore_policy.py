"""The cold tier never restores a prefix too short to pay off.

``Find`` offers no file that adds fewer than ``MIN_RESTORE_TOKENS`` to what
RAM serves, and a speed not measured yet is a prior (``PRIOR_DISK_BPS``,
``PRIOR_PREFILL_TPS``), so the first advice compares the file's bytes with
the tokens it saves. Core rules by plain calls;
then through ``Engine`` on a tiny fp32 Llama after a restart: a prompt
sharing only its BOS token (or a few dozen tokens) with a stored
conversation reads no file.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine import Engine, GenerationParams
from actors.ssd_writer import FileIdentity, SsdWriterConfig, core
from kernels import ModelIdentity
from messages import Envelope, Find, FindResult, ObservePrefill, RestoreReport
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

_ids = itertools.count()
FILE = tuple(range(1000, 1500))
"""A stored entry of 500 tokens (a 10 MB file unless a test says otherwise)."""


def _state(
    *, min_restore_tokens: int = core.MIN_RESTORE_TOKENS, file_bytes: int = 10_000_000
) -> core.IndexState:
    state = core.IndexState(root="/cache", fingerprint="fp0", max_bytes=10**9,
                            min_restore_tokens=min_restore_tokens)
    directory = state.directory_of("")
    entry = core.IndexEntry(f"{directory}/a.kvt", "", FILE, file_bytes, 1, True, 0)
    scan = core.ScanResult(files=(core.ScannedFile(entry.path, directory, None, entry=entry),))
    core.handle(state, core.ScanLoaded(scan, locked=True, now=0.0))
    return state


def _send(state: core.IndexState, body: Any) -> list[core.Effect]:
    envelope = Envelope(f"m-{next(_ids)}", "c", None, "x", "ssd_writer", 0.0, body)
    return core.handle(state, core.Received(envelope, 0.0))[1]


def _find(state: core.IndexState, shared: int, better: int = 0) -> FindResult:
    """Find for a prompt sharing ``shared`` tokens with the stored file, then diverging."""
    prompt = (*FILE[:shared], 7, 8, 9)
    (effect,) = _send(state, Find(tokens=prompt, better_than=better))
    assert isinstance(effect, core.Answer)
    assert isinstance(effect.body, FindResult)
    return effect.body


def test_find_offers_no_file_adding_fewer_than_min_restore_tokens() -> None:
    """A file sharing 1 or MIN-1 tokens with the prompt, or adding MIN-1 over RAM's prefix, is a
    miss (no path, no choice counted); sharing MIN tokens more than RAM is offered."""
    state = _state()
    least = core.MIN_RESTORE_TOKENS
    assert least >= 32
    for shared, better in ((1, 0), (least - 1, 0), (least + 99, 100)):
        assert _find(state, shared, better) == FindResult(), (shared, better)
    # NOTE: past the floor, the estimator advises (here its priors: 10 ms to read, 64 ms).
    offered = _find(state, 300, 300 - least)
    assert (offered.path, offered.cached_tokens) == (f"{state.directory_of('')}/a.kvt", 300)
    assert offered.choice == "restore"
    stats = core.stats(state)
    assert (stats.choices_restore + stats.choices_recompute, stats.finds) == (1, 4)


@settings(max_examples=200, deadline=None)
@given(shared=st.integers(0, 520), tail=st.integers(0, 80), better=st.integers(0, 600))
def test_find_misses_whenever_the_prompts_rest_is_below_the_floor(shared: int, tail: int,
                                                                 better: int) -> None:
    """The prompt cache's skip rule (actors/prompt_cache/core.py, ``cold_min_gain``) never hides a file.

    For any prompt (a prefix of the stored file, or sharing part of it and
    then diverging) and any RAM prefix ``better``: when fewer than
    ``MIN_RESTORE_TOKENS`` tokens of the prompt lie past ``better`` (the last
    one left to compute), ``Find`` answers a miss.
    """
    prompt = (*FILE[:shared], *range(7, 7 + tail))
    better = min(better, max(len(prompt) - 1, 0))
    if len(prompt) - 1 - better >= core.MIN_RESTORE_TOKENS:
        return
    (effect,) = _send(_state(), Find(tokens=prompt, better_than=better))
    assert isinstance(effect, core.Answer)
    assert effect.body == FindResult()


def test_unmeasured_speeds_are_their_priors_until_measured() -> None:
    """With no speeds measured, a restore is advised while the file holds at most about 1 MB per
    token it saves (the priors 1 GB/s and 1,000 tokens/s); each measurement replaces its prior."""
    assert (core.PRIOR_DISK_BPS, core.PRIOR_PREFILL_TPS) == (1e9, 1000.0)
    state = _state(file_bytes=200_000_000)  # 400 KB per token of the file
    assert _find(state, 150).choice == "recompute"  # 0.2 s to read, 0.15 s to prefill
    assert _find(state, 250).choice == "restore"  # 0.2 s to read, 0.25 s to prefill
    assert _find(state, 500, 400).choice == "recompute"  # 100 tokens saved: 0.1 s
    _send(state, RestoreReport(path="elsewhere", ok=True, bytes=10**10, seconds=1.0))  # 10 GB/s
    assert _find(state, 150).choice == "restore"  # 0.02 s to read, the prior's 0.15 s to prefill
    _send(state, ObservePrefill(tokens=100_000, seconds=1.0))  # 100,000 tok/s
    got = _find(state, 250)  # 0.02 s to read, 0.0025 s to prefill
    assert (got.choice, got.predicted_restore_s, got.predicted_prefill_s) == (
        "recompute", 0.02, 0.0025,
    )


def test_the_tiers_config_sets_the_floor() -> None:
    """SsdWriterConfig defaults to MIN_RESTORE_TOKENS; an index refuses a floor below 1."""
    identity = FileIdentity(model_id="m", fingerprint="fp0", tokenizer_hash="t")
    config = SsdWriterConfig(root="/cache", identity=identity, max_bytes=1)
    assert config.min_restore_tokens == core.MIN_RESTORE_TOKENS
    with pytest.raises(ValueError, match="min_restore_tokens"):
        _state(min_restore_tokens=0)


# --- through the Engine ------------------------------------------------------------------

IDENTITY = ModelIdentity(
    model_id="tiny-llama",
    name="tiny-llama",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    weights_digest="w0",
    dtype="float32",
    quantization=None,
)
GREEDY = GenerationParams(max_tokens=6)


def _engine(
    model: Any, tok: Any, root: Path, *, restore: Literal["auto", "always"] = "auto"
) -> Engine:
    return Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY,
                              prompt_cache_bytes=1 << 26, ssd_cache=root, ssd_restore=restore)


def _tokens(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok.encode(text)]


def _shared(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


async def _store(model: Any, tok: Any, root: Path, prompts: list[list[int]]) -> None:
    async with _engine(model, tok, root) as writer:
        for prompt in prompts:
            await writer.complete_prompt(prompt, GREEDY)
        flushed = await writer.flush()
        assert flushed is not None
        assert flushed.durable


@pytest.mark.anyio
async def test_a_prompt_sharing_only_its_bos_token_with_a_stored_file_reads_no_file(
    tmp_path: Path
) -> None:
    """Right after a restart (no prefill estimate yet), a prompt sharing only its BOS token with
    a stored conversation is served without reading that file (no restore, no ssd hit)."""
    tok = tiny_tokenizer()
    model = lively_llama(len(tok))
    stored = _tokens(tok, "Rivers and their deltas, in great detail please. " * 4)
    asked = _tokens(tok, "Mountains in spring, briefly?")
    assert _shared(stored, asked) == 1
    await _store(model, tok, tmp_path, [stored])
    async with _engine(model, tok, tmp_path) as restarted:
        assert (await restarted.stats())["ssd_cache"]["entries"] == 1
        done = await restarted.complete_prompt(asked, GREEDY)
        cold = (await restarted.stats())["ssd_cache"]
    assert done.usage.cached_tokens == 0
    assert (cold["restores"], cold["hits"]) == (0, 0)


@pytest.mark.anyio
async def test_a_short_shared_prefix_reads_no_file_even_when_the_estimate_favours_it(
    tmp_path: Path
) -> None:
    """With every usable file restored whatever the estimate (``--ssd-restore always``), a
    prompt sharing fewer than MIN_RESTORE_TOKENS with a stored file still does not read it (no
    restore, no hit, no choice counted); one sharing the whole file does."""
    tok = tiny_tokenizer()
    model = lively_llama(len(tok))
    preamble = "You are a careful assistant. "
    target = _tokens(tok, preamble + "Tell me about the history of printing, at length. " * 3)
    asked = _tokens(tok, preamble + "What is the boiling point of water at altitude?")
    shared = _shared(target, asked)
    assert 8 <= shared < core.MIN_RESTORE_TOKENS
    await _store(model, tok, tmp_path, [target])
    # NOTE: "always" instead of a measured estimate (speeds vary with the
    # machine's load): only the MIN_RESTORE_TOKENS floor can refuse the file.
    async with _engine(model, tok, tmp_path, restore="always") as restarted:
        done = await restarted.complete_prompt(asked, GREEDY)
        short = (await restarted.stats())["ssd_cache"]
        whole = await restarted.complete_prompt([*target, *_tokens(tok, " More?")], GREEDY)
        final = (await restarted.stats())["ssd_cache"]
    assert done.usage.cached_tokens <= 1
    assert (short["restores"], short["hits"]) == (0, 0)
    assert (short["choices_restore"], short["choices_recompute"]) == (0, 0)
    assert whole.usage.cached_tokens >= len(target)
    assert (final["restores"], final["hits"], final["choices_restore"]) == (1, 1, 1)


def test_always_restore_reads_a_file_the_estimator_would_recompute() -> None:
    """--ssd-restore always: a restore predicted slower than the prefill is still chosen; auto recomputes it."""
    from actors.ssd_writer.core import Estimator

    auto, always = Estimator(), Estimator(always_restore=True)
    for est in (auto, always):
        est.observe_read(1_000_000, 1.0)  # 1 MB/s disk
        est.observe_prefill(10_000, 1.0)  # 10k tok/s prefill
    # NOTE: 10 MB to save 100 tokens: 10 s of reading against 10 ms of prefill.
    assert auto.choose(10_000_000, 100)[0] == "recompute"
    choice, restore_s, prefill_s = always.choose(10_000_000, 100)
    assert choice == "restore"
    assert restore_s is not None
    assert prefill_s is not None
    assert restore_s > prefill_s


@pytest.mark.anyio
async def test_a_next_turn_served_by_ram_skips_the_index(tmp_path: Path) -> None:
    """Through the Engine with the SSD tier: a prompt extending a RAM entry by fewer than MIN_RESTORE_TOKENS does not ask the index (counted in /stats); a new prompt does."""
    tok = tiny_tokenizer()
    model = lively_llama(len(tok))
    first = _tokens(tok, "Rivers and their deltas, in great detail please. " * 4)
    async with _engine(model, tok, tmp_path) as engine:
        await engine.complete_prompt(first, GREEDY)
        before = (await engine.stats())["ssd_cache"]
        nxt = [*first, *_tokens(tok, " And lakes?")]
        assert len(nxt) - len(first) < core.MIN_RESTORE_TOKENS
        done = await engine.complete_prompt(nxt, GREEDY)
        after = (await engine.stats())["ssd_cache"]
    assert done.usage.cached_tokens >= len(first) - 1
    assert (before["lookups"], before["lookups_skipped"]) == (1, 0)
    assert (after["lookups"], after["lookups_skipped"]) == (1, 1)
