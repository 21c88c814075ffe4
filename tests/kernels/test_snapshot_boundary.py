"""The chat-template probe that finds the prompt-boundary snapshot point."""

from __future__ import annotations

from kernels import Generation, SamplingParams, render_chat
from kernels.engine import SnapshotBoundary, probe_snapshot_boundary
from tests.chat_templates import thinking_tokenizer
from tests.tiny_models import tiny_llama, tiny_tokenizer

TURN1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a color"}]


def _turn2(reply: str) -> list[dict[str, str]]:
    return [*TURN1, {"role": "assistant", "content": reply}, {"role": "user", "content": "another"}]


def test_a_template_that_repeats_its_generation_prompt_has_no_unstable_tail() -> None:
    """When the generation prompt reappears verbatim in history, the point is len(prompt) - 1."""
    tok = tiny_tokenizer()
    boundary = probe_snapshot_boundary(tok)
    assert boundary == SnapshotBoundary(())
    p1 = render_chat(tok, TURN1)
    assert boundary.stable_prefix(p1) == len(p1) - 1
    assert render_chat(tok, _turn2("red"))[: len(p1)] == p1


def test_a_thinking_template_moves_the_point_before_the_think_opener() -> None:
    """The probe finds that '<think>\\n' does not survive into the next turn: the point is
    before it, and the next turn's rendering really repeats exactly that prefix."""
    tok = thinking_tokenizer()
    boundary = probe_snapshot_boundary(tok)
    opener = tuple(int(t) for t in tok.encode("<think>\n", add_special_tokens=False))
    assert boundary.unstable == (opener,)
    p1 = render_chat(tok, TURN1)
    point = boundary.stable_prefix(p1)
    assert point == len(p1) - len(opener)
    for reply in ("<think>\nhmm</think>red", "red"):
        p2 = render_chat(tok, _turn2(reply))
        assert p2[:point] == p1[:point]
        assert p2[: point + 1] != p1[: point + 1]  # the old point (len - 1) is not a prefix


def test_a_prompt_rendered_otherwise_falls_back_to_the_last_token() -> None:
    """A prompt that does not end with the probed tail (other template options) keeps len - 1."""
    boundary = SnapshotBoundary(((7, 8),))
    assert boundary.stable_prefix([1, 2, 3, 7, 8]) == 3
    assert boundary.stable_prefix([1, 2, 3, 8, 7]) == 4
    assert boundary.stable_prefix([7, 8]) == 1  # never the whole prompt, never empty by a tail
    assert SnapshotBoundary().stable_prefix([]) == 0


def test_a_prefill_chunk_can_end_at_a_limit() -> None:
    """prefill_step(limit) forwards at most ``limit`` tokens, so a chunk ends on the point."""
    tok = tiny_tokenizer()
    prompt = [int(t) for t in tok.encode("twelve tokens!")]
    gen = Generation(tiny_llama(vocab_size=len(tok)), tok, prompt, SamplingParams(max_tokens=1))
    assert not gen.prefill_step(5)
    assert len(gen.cache_tokens) == 5
    assert gen.cache[0].offset == 5
    assert gen.prefill_step()  # no limit: the rest (all but the last token)
    assert len(gen.cache_tokens) == len(prompt) - 1
