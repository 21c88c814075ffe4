"""Cold-tier (SSD) hits restored into batch rows: ``Engine(max_batch=N, ssd_cache=...)`` on a tiny fp32 Llama.

A row whose lookup finds only a file restores it at its join (like the serial
lane's first turn), forwards only its suffix and answers like a cold run; a
file that fails verification is a miss with the right answer; no restored
bytes stay in host staging.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import DoneEvent, Engine, GenerationParams

from .cold_support import engine, ids, run

pytestmark = pytest.mark.anyio

GREEDY = GenerationParams(max_tokens=10)


async def _together(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], DoneEvent]]:
    out: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        out[i] = await run(engine, prompts[i], GREEDY)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


def _shared(entry: list[int], prompt: list[int]) -> int:
    n = 0
    while n < min(len(entry), len(prompt) - 1) and entry[n] == prompt[n]:
        n += 1
    return n


async def _write_tier(model: Any, tok: Any, root: Path, first: list[int]) -> list[int]:
    """Serve ``first`` on a serial engine with the tier at ``root``, flush, close; its output."""
    async with engine(model, tok, root, max_batch=1) as writer:
        done = await writer.complete_prompt(first, GREEDY)
        flushed = await writer.flush()
        assert flushed is not None
        assert flushed.durable
    return list(done.token_ids)


def _flip_a_tensor_bit(root: Path) -> Path:
    """Flip one bit in the middle of a tensor of the one stored file (its header stays valid)."""
    from kernels.cache import read_header
    from kernels.cache._file_port import OsFilePort

    (stored,) = sorted(root.rglob("*.kvt"))
    header = read_header(OsFilePort(), str(stored))
    tensor = header.tensors[len(header.tensors) // 2]
    raw = bytearray(stored.read_bytes())
    raw[tensor.offset + tensor.nbytes // 2] ^= 0x10
    stored.write_bytes(bytes(raw))
    return stored


async def test_a_batch_row_after_a_restart_restores_its_prefix_from_disk(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """After a restart, a batch row whose prompt extends a stored conversation reports
    cached_tokens from the SSD tier (/stats: an ssd hit, no RAM hit), forwards only its suffix,
    and gives the greedy tokens of a serial cold run; the other row of the batch is unaffected
    and no restored bytes are left in host staging."""
    first = ids(tok, "A batch row restores its prefix from the disk tier. " * 3)
    answer = await _write_tier(model, tok, tmp_path, first)
    second = [*first, *answer, *ids(tok, " Next question?")]
    # NOTE: without the BOS token, so no prefix at all is shared with the stored file.
    other = ids(tok, "Quite unrelated: another prompt in the same batch.")[1:]
    async with engine(model, tok, None, prompt_cache_bytes=0, max_batch=1) as serial:
        want_second, _ = await run(serial, second, GREEDY)
        want_other, _ = await run(serial, other, GREEDY)

    async with engine(model, tok, tmp_path, max_batch=4) as restarted:
        running = restarted._running
        assert running is not None
        assert running.cold is not None
        cold = running.cold
        (got_second, done_second), (got_other, done_other) = await _together(
            restarted, [second, other]
        )
        stats = await restarted.stats()
        staged = len(cold.staging)
    # NOTE: the serial lane's completion entry holds every token whose forward
    # ran: the prompt and the answer but its last token.
    shared = _shared([*first, *answer[:-1]], second)
    assert done_second.usage.cached_tokens == shared == len(first) + len(answer) - 1
    assert got_second == want_second
    assert (got_other, done_other.usage.cached_tokens) == (want_other, 0)
    assert (stats["ssd_cache"]["hits"], stats["ssd_cache"]["restores"]) == (1, 1)
    assert stats["prompt_cache"]["hits"] == 0
    batch = stats["batch"]["batch"]
    assert batch["joined"] == 2
    assert batch["ssd"] == {"restored": 1, "restored_tokens": shared, "restore_failed": 0}
    assert batch["cached_tokens"] == shared
    # NOTE: a row's last prompt token is forwarded by its first decode, not counted as prefill.
    assert batch["steps"]["prefill_tokens"] == (len(second) - shared - 1) + (len(other) - 1)
    assert staged == 0


async def test_a_corrupt_file_under_the_batch_lane_is_a_miss_with_the_right_answer(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """A stored file with one flipped tensor bit is removed and counted when a batch row's
    lookup finds it; the row joins cold, forwards its whole prompt, and gives the cold tokens."""
    first = ids(tok, "A flipped bit never reaches a batch row. " * 3)
    answer = await _write_tier(model, tok, tmp_path, first)
    second = [*first, *answer, *ids(tok, " And then?")]
    stored = _flip_a_tensor_bit(tmp_path)
    async with engine(model, tok, None, prompt_cache_bytes=0, max_batch=1) as serial:
        want, _ = await run(serial, second, GREEDY)

    async with engine(model, tok, tmp_path, max_batch=4) as restarted:
        assert (await restarted.stats())["ssd_cache"]["entries"] == 1
        got, done = await run(restarted, second, GREEDY)
        # NOTE: the reader's pass reports the bad file after its answer.
        for _ in range(500):
            stats = await restarted.stats()
            if stats["ssd_cache"]["corrupt_removed"]:
                break
            await anyio.sleep(0.01)
    assert (got, done.usage.cached_tokens) == (want, 0)
    cold = stats["ssd_cache"]
    assert (cold["restore_failures"], cold["corrupt_removed"]) == (1, 1)
    batch = stats["batch"]["batch"]
    assert batch["steps"]["prefill_tokens"] == len(second) - 1
    assert batch["ssd"]["restored"] == 0
    assert not stored.exists()


async def test_batch_steps_that_only_prefill_teach_the_restore_or_recompute_estimator(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """With every request on the batch lane, the cold tier still learns the prefill speed (its
    estimator's other half): a lone request's first step, which only prefilled its prompt,
    is reported, so /stats shows a prefill_tok_s."""
    prompt = ids(tok, "Only the batch lane serves this engine, and it prefills. " * 2)
    async with engine(model, tok, tmp_path, max_batch=4) as eng:
        assert (await eng.stats())["ssd_cache"]["prefill_tok_s"] is None
        await run(eng, prompt, GREEDY)
        # NOTE: the report is a tell to the index; poll until it was handled.
        with anyio.fail_after(10):
            while True:
                if (await eng.stats())["ssd_cache"]["prefill_tok_s"] is not None:
                    break
                await anyio.sleep(0.01)
