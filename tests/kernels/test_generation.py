"""The steppable generation kernel on tiny random-weight models (fast, fp32)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from kernels import (
    Generation,
    GenerationFinished,
    InvalidPrompt,
    PrefillIncomplete,
    SamplingParams,
    StepOutput,
    TextStream,
    encode_prompt,
    render_chat,
    run_generation,
)
from tests.tiny_models import tiny_gemma3, tiny_llama, tiny_mamba

_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n")]
_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
PROMPT = "the cat in the hat sat on the mat and then it ran far away"


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte → printable-symbol table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiny_tokenizer(*, all_bytes: bool = False) -> TokenizerWrapper:
    """A real byte-level BPE tokenizer (HF fast tokenizer + mlx-lm wrapper), tiny vocab.

    ASCII-only by default (printable ASCII + newline, a few merges, ``<s>``/``</s>``)
    so a random model's output is readable text; ``all_bytes`` covers every
    byte for multi-byte UTF-8.
    """
    symbols = _byte_symbols()
    byte_values = range(256) if all_bytes else [*range(0x20, 0x7F), 0x0A]
    vocab: dict[str, int] = {}
    for b in byte_values:
        vocab[symbols[b]] = len(vocab)
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    for special in ("<s>", "</s>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = _TEMPLATE
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer)


def lively_llama(vocab_size: int, *, seed: int = 0) -> Any:
    """tiny_llama (fp32) with weights scaled ×2 so greedy output is varied, not one repeated token."""
    model = tiny_llama(seed=seed, vocab_size=vocab_size, dtype=mx.float32)
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tok() -> TokenizerWrapper:
    """The ASCII tiny tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: TokenizerWrapper) -> Any:
    """A tiny fp32 Llama over the tiny tokenizer's vocabulary."""
    return lively_llama(len(tok))


@pytest.fixture(scope="module")
def prompt(tok: TokenizerWrapper) -> list[int]:
    """A 50-odd token prompt."""
    return encode_prompt(tok, PROMPT)


def _ids(steps: Sequence[StepOutput]) -> list[int]:
    return [s.token_id for s in steps]


def _text(steps: Sequence[StepOutput]) -> str:
    return "".join(s.text for s in steps)


def _gen(model: Any, tok: Any, prompt: Sequence[int], **kw: Any) -> Generation:
    step = kw.pop("prefill_step_size", 2048)
    cache = kw.pop("cache", None)
    cached = kw.pop("cached_tokens", 0)
    return Generation(
        model, tok, prompt, SamplingParams(**kw), prefill_step_size=step, cache=cache, cached_tokens=cached
    )


def test_chunked_prefill_matches_one_shot_and_mlx_lm(model: Any, tok: Any, prompt: list[int]) -> None:
    """Greedy tokens are identical for prefill chunk sizes 1, 5, 16, 2048 and equal mlx-lm's."""
    runs = {n: _ids(run_generation(_gen(model, tok, prompt, max_tokens=12, prefill_step_size=n))) for n in (1, 5, 16, 2048)}
    reference = [r.token for r in stream_generate(model, tok, prompt, max_tokens=12, prefill_step_size=5)]
    assert len(set(runs[2048])) > 3, "the test model should not repeat one token"
    for n, ids in runs.items():
        assert ids == reference, f"prefill_step_size={n}"


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_mamba], ids=["gemma3-rotating", "mamba-recurrent"])
def test_other_cache_kinds_match_mlx_lm(build: Any, tok: Any, prompt: list[int]) -> None:
    """Sliding-window (RotatingKVCache) and recurrent (ArraysCache) models step like mlx-lm, chunked."""
    model = build(vocab_size=len(tok), dtype=mx.float32)
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    ours = _ids(run_generation(_gen(model, tok, prompt, max_tokens=10, prefill_step_size=5)))
    reference = [r.token for r in stream_generate(model, tok, prompt, max_tokens=10, prefill_step_size=5)]
    assert ours == reference


def test_prefill_steps_follow_chunking_and_guard_decode(model: Any, tok: Any, prompt: list[int]) -> None:
    """prefill_step forwards ≤ step tokens per call, stops one short of the prompt, and gates decode_step."""
    gen = _gen(model, tok, prompt, max_tokens=2, prefill_step_size=16)
    with pytest.raises(PrefillIncomplete):
        gen.decode_step()
    calls = 0
    remaining = [gen.prefill_remaining]
    while not gen.prefill_step():
        calls += 1
        remaining.append(gen.prefill_remaining)
    calls += 1
    remaining.append(gen.prefill_remaining)
    assert calls == -(-(len(prompt) - 1) // 16)
    assert remaining[0] == len(prompt)
    assert remaining[-1] == 1
    assert all(a - b <= 16 for a, b in itertools.pairwise(remaining))
    assert gen.cache[0].offset == len(prompt) - 1
    assert gen.prefill_step() is True
    first = gen.decode_step()
    assert first.finish_reason is None
    assert gen.decode_step().finish_reason == "length"
    with pytest.raises(GenerationFinished):
        gen.decode_step()


def test_max_tokens_ends_with_length(model: Any, tok: Any, prompt: list[int]) -> None:
    """Exactly max_tokens tokens come out; only the last carries finish_reason 'length'."""
    steps = run_generation(_gen(model, tok, prompt, max_tokens=7))
    assert len(steps) == 7
    assert [s.finish_reason for s in steps] == [None] * 6 + ["length"]


def test_eos_ends_with_stop_and_emits_no_eos_text(model: Any, prompt: list[int]) -> None:
    """The first EOS token ends the generation with 'stop'; its text is not emitted."""
    free_tok = tiny_tokenizer()
    free_tok.eos_token_ids = []
    free = run_generation(_gen(model, free_tok, prompt, max_tokens=12))
    ids = _ids(free)
    eos = ids[4]
    cut = ids.index(eos)
    eos_tok = tiny_tokenizer()
    eos_tok.eos_token_ids = [eos]
    steps = run_generation(_gen(model, eos_tok, prompt, max_tokens=12))
    assert _ids(steps) == ids[: cut + 1]
    assert steps[-1].finish_reason == "stop"
    assert _text(steps) == free_tok.decode(ids[:cut])


def test_stop_token_ids_end_like_eos(model: Any, tok: Any, prompt: list[int]) -> None:
    """A request's stop_token_ids end the generation with 'stop' at the first such token."""
    ids = _ids(run_generation(_gen(model, tok, prompt, max_tokens=12)))
    target = ids[6]
    steps = run_generation(_gen(model, tok, prompt, max_tokens=12, stop_token_ids=(target,)))
    assert _ids(steps) == ids[: ids.index(target) + 1]
    assert steps[-1].finish_reason == "stop"


def _free_text_steps(model: Any, tok: Any, prompt: list[int]) -> list[StepOutput]:
    return run_generation(_gen(model, tok, prompt, max_tokens=24, temperature=1.0, seed=5))


def test_stop_string_across_tokens_is_cut_and_never_emitted(model: Any, tok: Any, prompt: list[int]) -> None:
    """A stop string spanning token boundaries ends with 'stop'; text is cut before it, never leaked."""
    free = _free_text_steps(model, tok, prompt)
    full = _text(free)
    # A 3-character stop string starting inside the 6th token's text.
    start = len(_text(free[:5])) + 1
    stop = full[start : start + 3]
    assert len(stop) == 3
    cut = full.find(stop)
    steps = run_generation(_gen(model, tok, prompt, max_tokens=24, temperature=1.0, seed=5, stop=(stop,)))
    assert _text(steps) == full[:cut]
    assert steps[-1].finish_reason == "stop"
    emitted = ""
    for s in steps:
        emitted += s.text
        assert full[:cut].startswith(emitted)
    assert len(steps) < len(free)


def test_partial_stop_match_is_held_then_released(model: Any, tok: Any, prompt: list[int]) -> None:
    """Text that begins a stop string is withheld until it can no longer match, then released."""
    free = _free_text_steps(model, tok, prompt)
    full = _text(free)
    k = next(i for i in range(4, len(free)) if free[i].text)
    piece = free[k].text
    never = piece + "\x00"  # can start matching at token k but never complete
    steps = run_generation(_gen(model, tok, prompt, max_tokens=24, temperature=1.0, seed=5, stop=(never,)))
    assert _text(steps) == full
    assert steps[-1].finish_reason == "length"
    emitted_through_k = _text(steps[: k + 1])
    released_at_k = _text(free[: k + 1])
    assert len(emitted_through_k) < len(released_at_k), "the possible stop start must be held back"
    assert released_at_k.startswith(emitted_through_k)


def test_text_stream_multibyte_utf8_and_unicode_stop() -> None:
    """Byte-per-token multi-byte UTF-8 streams without replacement chars; a stop with € cuts there."""
    tok = tiny_tokenizer(all_bytes=True)
    text = "héllo wörld € ok 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text), "multi-byte characters must span several tokens"
    stream = TextStream(tok.detokenizer)
    deltas = [stream.add(t) for t in ids] + [stream.finish()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    stream = TextStream(tok.detokenizer, ["€ ok"])
    out = ""
    for t in ids:
        out += stream.add(t)
        if stream.finished:
            break
    assert out == "héllo wörld "
    assert stream.stopped_by == "€ ok"


def test_seeded_sampling_is_deterministic_and_isolated(model: Any, tok: Any, prompt: list[int]) -> None:
    """Same seed → same tokens, even interleaved with another request; it also equals mlx-lm seeded."""
    a1 = _ids(run_generation(_gen(model, tok, prompt, max_tokens=12, temperature=1.0, seed=11)))
    b1 = _ids(run_generation(_gen(model, tok, prompt, max_tokens=12, temperature=1.0, seed=12)))
    assert a1 != b1
    ga = _gen(model, tok, prompt, max_tokens=12, temperature=1.0, seed=11)
    gb = _gen(model, tok, prompt, max_tokens=12, temperature=1.0, seed=12)
    while not ga.prefill_step():
        pass
    while not gb.prefill_step():
        pass
    a2: list[int] = []
    b2: list[int] = []
    while ga.finish_reason is None or gb.finish_reason is None:
        if ga.finish_reason is None:
            a2.append(ga.decode_step().token_id)
        mx.eval(mx.random.uniform(shape=(3,)))  # unrelated use of the global key in between
        if gb.finish_reason is None:
            b2.append(gb.decode_step().token_id)
    assert (a2, b2) == (a1, b1)
    mx.random.seed(11)
    ref = [r.token for r in stream_generate(model, tok, prompt, max_tokens=12, sampler=make_sampler(temp=1.0))]
    assert ref == a1


def test_filtered_seeded_sampling_matches_mlx_lm(model: Any, tok: Any, prompt: list[int]) -> None:
    """top-p, min-p, top-k and XTC with a seed give mlx-lm's tokens after mx.random.seed."""
    kw: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "min_p": 0.02, "top_k": 20, "xtc_probability": 0.5, "xtc_threshold": 0.05}
    ours = _ids(run_generation(_gen(model, tok, prompt, max_tokens=10, seed=3, **kw)))
    mx.random.seed(3)
    sampler = make_sampler(
        temp=0.8, top_p=0.9, min_p=0.02, top_k=20, xtc_probability=0.5, xtc_threshold=0.05,
        xtc_special_tokens=sorted(tok.eos_token_ids),
    )
    ref = [r.token for r in stream_generate(model, tok, prompt, max_tokens=10, sampler=sampler)]
    assert ours == ref


def _prefix_cache(model: Any, prompt: list[int], k: int) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:k])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("k", [1, 20])
def test_reused_prefix_cache_matches_cold_prefill(model: Any, tok: Any, prompt: list[int], k: int) -> None:
    """A cache holding the first k prompt tokens gives the cold prefill's greedy output (fp32)."""
    cold = _ids(run_generation(_gen(model, tok, prompt, max_tokens=10)))
    gen = _gen(model, tok, prompt, max_tokens=10, cache=_prefix_cache(model, prompt, k), cached_tokens=k, prefill_step_size=8)
    warm = run_generation(gen)
    assert _ids(warm) == cold
    assert gen.cached_tokens == k
    assert gen.cache_tokens == (*prompt, *cold[:-1])
    assert gen.cache[0].offset == len(gen.cache_tokens)


def test_repetition_penalty_sees_whole_prompt_on_cache_hit(model: Any, tok: Any, prompt: list[int]) -> None:
    """A penalty counts tokens of the reused prefix too: a cache hit equals the cold run and mlx-lm's."""
    first = _ids(run_generation(_gen(model, tok, prompt, max_tokens=1)))[0]
    # The token the model wants first now sits only in the (cached) prompt head.
    p = [first, *prompt]
    assert first not in p[20:]
    kw: dict[str, Any] = {"max_tokens": 6, "repetition_penalty": 2.0, "repetition_context_size": len(p) + 8}
    plain = _ids(run_generation(_gen(model, tok, p, max_tokens=6)))
    cold = _ids(run_generation(_gen(model, tok, p, **kw)))
    warm = _ids(run_generation(_gen(model, tok, p, cache=_prefix_cache(model, p, 20), cached_tokens=20, **kw)))
    procs = make_logits_processors(repetition_penalty=2.0, repetition_context_size=len(p) + 8)
    ref = [r.token for r in stream_generate(model, tok, p, max_tokens=6, logits_processors=procs)]
    assert plain[0] == first, "precondition: unpenalized, the model repeats the head token"
    assert cold == warm == ref
    assert warm[0] != first


def test_logprob_is_the_chosen_tokens_log_softmax(model: Any, tok: Any, prompt: list[int]) -> None:
    """The first step's logprob equals log-softmax of a direct forward at the chosen token."""
    first = run_generation(_gen(model, tok, prompt, max_tokens=1, logprobs=True))[0]
    logits = model(mx.array(prompt)[None])[0, -1]
    expected = (logits - mx.logsumexp(logits))[first.token_id].item()
    assert first.logprob == pytest.approx(expected, abs=1e-4)
    assert mx.argmax(logits).item() == first.token_id


def test_cache_hook_runs_after_every_forward(model: Any, tok: Any, prompt: list[int]) -> None:
    """The cache hook sees the live cache after each prefill chunk and each decode forward."""
    seen: list[int] = []
    gen = Generation(model, tok, prompt, SamplingParams(max_tokens=4), prefill_step_size=16,
                     cache_hook=lambda cache: seen.append(len(cache)))
    run_generation(gen)
    chunks = -(-(len(prompt) - 1) // 16)
    # last prompt token + 3 pipelined forwards (none after the max_tokens-th token)
    assert len(seen) == chunks + 4
    assert set(seen) == {len(gen.cache)}


def test_invalid_prompt_and_cache_combinations(model: Any, tok: Any, prompt: list[int]) -> None:
    """Empty prompts, fully-cached prompts and caches of the wrong length are rejected typed."""
    with pytest.raises(InvalidPrompt):
        _gen(model, tok, [], max_tokens=2)
    with pytest.raises(InvalidPrompt):
        _gen(model, tok, prompt, cache=_prefix_cache(model, prompt, len(prompt)), cached_tokens=len(prompt))
    with pytest.raises(InvalidPrompt):
        _gen(model, tok, prompt, cache=_prefix_cache(model, prompt, 5), cached_tokens=6)
    with pytest.raises(InvalidPrompt):
        _gen(model, tok, prompt, cached_tokens=3)


def test_sampling_params_validate() -> None:
    """Out-of-range sampling parameters and empty stop strings are rejected before any MLX work."""
    from pydantic import ValidationError

    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"min_p": 2}, {"stop": [""]}, {"stop_token_ids": [-1]}, {"seed": -1}, {"seed": 2**63}):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
    # NOTE: JSON input carries a list; validation stores the tuple.
    assert SamplingParams.model_validate({"stop": ["a", "b"]}).stop == ("a", "b")


def test_render_chat_and_encode_prompt(tok: Any) -> None:
    """render_chat applies the template with a generation prompt; encode_prompt adds BOS exactly once."""
    ids = render_chat(tok, [{"role": "user", "content": "hi there"}])
    assert tok.decode(ids) == "<s>user\nhi there</s>\n<s>assistant\n"
    bos = tok.bos_token_id
    plain = encode_prompt(tok, "hello")
    assert plain[0] == bos
    assert plain[1:] == tok.encode("hello", add_special_tokens=False)
    already = encode_prompt(tok, "<s>hello")
    assert already.count(bos) == 1
