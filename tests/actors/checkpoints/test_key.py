"""The checkpoint request key: golden digests, every output-changing input changes it."""

from __future__ import annotations

import pytest

from actors.checkpoints import checkpoint_refusal, request_key
from messages.gateway import GenerationParams

PROMPT = (1, 9038, 2683, 28, 2)
FP = "kvt0123456789abcdef0123"


def _key(prompt: tuple[int, ...] = PROMPT, params: GenerationParams | None = None, *,
         namespace: str = "", fingerprint: str = FP) -> str:
    return request_key(prompt, params or GenerationParams(), namespace=namespace,
                       fingerprint=fingerprint)


def test_golden_digests() -> None:
    """The key of fixed requests is a fixed digest (an encoding change fails here)."""
    assert _key() == GOLDEN_DEFAULT
    seeded = GenerationParams(temperature=0.8, seed=7, max_tokens=400, stop=("\n\n",))
    assert _key(params=seeded) == GOLDEN_SEEDED
    assert _key(namespace="ns1") == GOLDEN_NS


GOLDEN_DEFAULT = "dcc1f9a4b926b6076b1f87a857862a7d"
GOLDEN_SEEDED = "db334c76e84af835144b3ad6909239a0"
GOLDEN_NS = "21d7ce1ed2947bc638b6e1a5ca67785e"


def test_defaults_pinned() -> None:
    """GenerationParams' defaults are what the key assumes: a changed default must raise KEY_VERSION."""
    d = GenerationParams().model_dump(mode="json")
    pinned: dict[str, object] = {
        "max_tokens": 512, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "min_tokens_to_keep": 1, "xtc_probability": 0.0, "xtc_threshold": 0.1, "seed": None,
        "repetition_penalty": None, "repetition_context_size": 20, "presence_penalty": None,
        "presence_context_size": 20, "frequency_penalty": None, "frequency_context_size": 20,
        "logit_bias": None, "stop": [], "stop_token_ids": [],
    }
    assert {k: d[k] for k in pinned} == pinned


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 511}, {"temperature": 0.8}, {"top_p": 0.9}, {"top_k": 5},
        {"min_p": 0.1}, {"min_tokens_to_keep": 2}, {"xtc_probability": 0.5},
        {"xtc_threshold": 0.2}, {"seed": 0}, {"repetition_penalty": 1.1},
        {"repetition_context_size": 21}, {"presence_penalty": 0.5},
        {"presence_context_size": 3}, {"frequency_penalty": 0.5},
        {"frequency_context_size": 3}, {"logit_bias": {5: 1.0}}, {"stop": ("x",)},
        {"stop_token_ids": (3,)}, {"cache_salt": "s"}, {"cache_scope": "k"},
    ],
)
def test_every_field_changes_the_key(change: dict[str, object]) -> None:
    """Each GenerationParams field, set off its default, gives another key."""
    assert _key(params=GenerationParams.model_validate(change)) != _key()


def test_other_inputs_change_the_key() -> None:
    """Prompt ids (value, order, length), namespace and fingerprint each change the key."""
    base = _key()
    assert _key(prompt=(1, 9038, 2683, 28, 3)) != base
    assert _key(prompt=(9038, 1, 2683, 28, 2)) != base
    assert _key(prompt=(*PROMPT, 0)) != base
    assert _key(namespace="a") != base
    assert _key(fingerprint="kvt-other") != base


def test_equal_requests_equal_keys() -> None:
    """Equal values give equal keys, whatever the dict order of logit_bias or a field set to its default."""
    a = GenerationParams(logit_bias={10: 1.0, 9: -1.0})
    b = GenerationParams(logit_bias={9: -1.0, 10: 1.0})
    assert _key(params=a) == _key(params=b)
    assert _key(params=GenerationParams(max_tokens=512)) == _key()


def test_bad_ids_refused() -> None:
    """A token id outside uint32 (above or below) is refused, never wrapped."""
    with pytest.raises(ValueError):
        _key(prompt=(1 << 32,))
    with pytest.raises(ValueError):
        _key(prompt=(5, -1))


def test_refusals() -> None:
    """Grammar and logprob requests are not checkpointed in v1; plain and sampled ones are."""
    assert checkpoint_refusal(GenerationParams(grammar="start: x")) == "grammar"
    assert checkpoint_refusal(GenerationParams(logprobs=True)) == "logprobs"
    assert checkpoint_refusal(GenerationParams(top_logprobs=2)) == "logprobs"
    assert checkpoint_refusal(GenerationParams(prompt_logprobs=0)) == "logprobs"
    assert checkpoint_refusal(GenerationParams(temperature=0.8, seed=1)) is None
