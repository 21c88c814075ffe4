"""``ignore_eos``: both lanes generate ``max_tokens`` tokens past the model's EOS, as vLLM's field does."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kernels import Generation, SamplingParams, run_generation
from kernels.engine import BatchGeneration
from tests.kernels.test_batch import Plan, _prompts, drive
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

MAX = 12


@pytest.fixture(scope="module")
def model() -> Any:
    """A tiny fp32 Llama with varied greedy output."""
    return lively_llama(len(tiny_tokenizer()), seed=1)


@pytest.fixture(scope="module")
def case(model: Any) -> tuple[list[int], list[int], Any]:
    """A prompt, its free greedy answer, and a tokenizer whose EOS is the answer's 5th token."""
    free_tok = tiny_tokenizer()
    free_tok.eos_token_ids = []
    prompt = _prompts(len(free_tok), 1, seed=9, lo=20, hi=30)[0]
    free = run_generation(Generation(model, free_tok, prompt, SamplingParams(max_tokens=MAX)))
    ids = [o.token_id for o in free]
    eos_tok = tiny_tokenizer()
    eos_tok.eos_token_ids = [ids[4]]
    return prompt, ids, eos_tok


def test_serial_lane_runs_past_eos_to_max_tokens(model: Any, case: tuple[list[int], list[int], Any]) -> None:
    """Serial lane: EOS ends the answer without ignore_eos; with it, all max_tokens come out, finish 'length'."""
    prompt, ids, eos_tok = case
    stopped = run_generation(Generation(model, eos_tok, prompt, SamplingParams(max_tokens=MAX)))
    assert [o.token_id for o in stopped] == ids[: ids.index(ids[4]) + 1]
    steps = run_generation(Generation(model, eos_tok, prompt,
                                      SamplingParams(max_tokens=MAX, ignore_eos=True)))
    assert [o.token_id for o in steps] == ids
    assert [o.finish_reason for o in steps] == [None] * (MAX - 1) + ["length"]


def test_batch_lane_runs_past_eos_to_max_tokens(model: Any, case: tuple[list[int], list[int], Any]) -> None:
    """Batch lane: an ignore_eos row runs to max_tokens beside a row EOS stops, each as the serial lane."""
    prompt, ids, eos_tok = case
    run = drive(BatchGeneration(model, eos_tok), [
        Plan("ignore", prompt, SamplingParams(max_tokens=MAX, ignore_eos=True)),
        Plan("stop", prompt, SamplingParams(max_tokens=MAX)),
    ])
    assert run.ids("ignore") == ids
    assert run.exits["ignore"].reason == "length"
    assert run.exits["ignore"].completion_tokens == MAX
    assert run.ids("stop") == ids[: ids.index(ids[4]) + 1]
    assert run.exits["stop"].reason == "stop"


def test_stop_token_ids_still_end_an_ignore_eos_answer(model: Any,
                                                      case: tuple[list[int], list[int], Any]) -> None:
    """ignore_eos passes only EOS: a request's stop_token_ids end it on both lanes."""
    prompt, ids, eos_tok = case
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, stop_token_ids=(ids[7],))
    serial = [o.token_id for o in run_generation(Generation(model, eos_tok, prompt, params))]
    run = drive(BatchGeneration(model, eos_tok), [Plan("r", prompt, params)])
    assert serial == run.ids("r") == ids[: ids.index(ids[7]) + 1]
    assert run.exits["r"].reason == "stop"


def test_ignore_eos_with_a_grammar_is_refused() -> None:
    """A grammar ends with EOS, so ignore_eos with one is a validation error, not a stuck answer."""
    with pytest.raises(ValidationError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, grammar='start: "x"')
