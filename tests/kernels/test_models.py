"""Model loading and `ModelIdentity` on a tiny converted model directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kernels import (
    LoadedModel,
    ModelIdentity,
    ModelLoadError,
    config_fingerprint,
    convert_gguf,
    load_model,
    resolve_model_path,
    tokenizer_hash,
)
from tests.model_fixtures import tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two converted tiny models: seed 0 and seed 1 (same config and tokenizer, other weights)."""
    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {}
    for seed in (0, 1):
        gguf = root / f"tiny{seed}.gguf"
        tiny_llama_gguf(gguf, seed=seed)
        dirs[f"seed{seed}"] = convert_gguf(gguf, root / f"tiny{seed}", dequantize=True)
    return dirs


def test_load_model_returns_model_tokenizer_config_identity(tiny_dirs: dict[str, Path]) -> None:
    """load_model gives a runnable model, a tokenizer with its chat template, the config and an identity."""
    loaded = load_model(tiny_dirs["seed0"])
    assert isinstance(loaded, LoadedModel)
    assert loaded.path == tiny_dirs["seed0"].resolve()
    logits = loaded.model(mx.array([loaded.tokenizer.encode("the hat")]))
    assert logits.shape[-1] == loaded.config["vocab_size"] == 262
    assert loaded.chat_template is not None
    assert "<|im_start|>" in loaded.chat_template
    ident = loaded.identity
    assert ident.name == "tiny0"
    assert ident.model_id == str(tiny_dirs["seed0"])
    assert ident.dtype == "float32"
    assert ident.quantization is None
    assert ident.to_dict()["fingerprint"] == ident.fingerprint


def test_identity_is_stable_across_loads(tiny_dirs: dict[str, Path]) -> None:
    """Loading the same directory twice gives equal identities (the cache key must be reproducible)."""
    assert load_model(tiny_dirs["seed0"]).identity == load_model(tiny_dirs["seed0"]).identity


def test_identity_changes_with_config_and_tokenizer(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Changing the config or a tokenizer file changes the fingerprint; copying the dir does not."""
    base = load_model(tiny_dirs["seed0"]).identity
    copy = Path(shutil.copytree(tiny_dirs["seed0"], tmp_path / "copy"))
    assert load_model(copy).identity.fingerprint == base.fingerprint

    cfg_path = copy / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = 20000.0
    cfg_path.write_text(json.dumps(cfg))
    changed_cfg = load_model(copy).identity
    assert changed_cfg.config_fingerprint != base.config_fingerprint
    assert changed_cfg.tokenizer_hash == base.tokenizer_hash
    assert changed_cfg.fingerprint != base.fingerprint

    tcfg_path = copy / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["chat_template"] = "{{ messages[0]['content'] }}"
    tcfg_path.write_text(json.dumps(tcfg))
    assert load_model(copy).identity.tokenizer_hash != base.tokenizer_hash


def test_config_fingerprint_ignores_key_order_and_cosmetic_keys() -> None:
    """The config fingerprint is canonical: key order and bookkeeping keys do not matter, values do."""
    a: dict[str, Any] = {"hidden_size": 64, "rope_theta": 10000.0, "quantization": {"bits": 4, "group_size": 32}}
    b = {"quantization": {"group_size": 32, "bits": 4}, "rope_theta": 10000.0, "hidden_size": 64}
    b["transformers_version"] = "4.99"
    assert config_fingerprint(a) == config_fingerprint(b)
    assert config_fingerprint(a) != config_fingerprint({**a, "quantization": {"bits": 8, "group_size": 32}})


def test_tokenizer_hash_falls_back_to_vocab(tmp_path: Path) -> None:
    """Without tokenizer files the hash comes from the vocabulary, and differs when the vocabulary does."""

    class ScriptedTokenizer:
        def __init__(self, vocab: dict[str, int]) -> None:
            self._vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self._vocab

    h1 = tokenizer_hash(tmp_path, ScriptedTokenizer({"a": 0, "b": 1}))
    assert h1 == tokenizer_hash(tmp_path, ScriptedTokenizer({"b": 1, "a": 0}))
    assert h1 != tokenizer_hash(tmp_path, ScriptedTokenizer({"a": 1, "b": 0}))
    with pytest.raises(ModelLoadError):
        tokenizer_hash(tmp_path)


def test_weights_enter_the_fingerprint(tiny_dirs: dict[str, Path]) -> None:
    """Equal config and tokenizer but other weights (a fine-tune) give another fingerprint."""
    a = load_model(tiny_dirs["seed0"]).identity
    b = load_model(tiny_dirs["seed1"]).identity
    assert (a.config_fingerprint, a.tokenizer_hash) == (b.config_fingerprint, b.tokenizer_hash)
    assert a.weights_digest != b.weights_digest
    assert a.fingerprint != b.fingerprint


def test_identity_is_frozen() -> None:
    """ModelIdentity is immutable, so a cache key cannot change under an entry."""
    ident = ModelIdentity("m", "m", "c", "t", "w", "float32", None)
    with pytest.raises(AttributeError):
        ident.dtype = "float16"  # type: ignore[misc]


def test_directory_without_config_is_a_typed_error(tmp_path: Path) -> None:
    """A local directory that is not an mlx-lm model raises ModelLoadError before MLX runs."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model_path(tmp_path)


def test_directory_without_weights_is_a_typed_error(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A model directory missing its safetensors raises ModelLoadError."""
    copy = Path(shutil.copytree(tiny_dirs["seed0"], tmp_path / "noweights"))
    (copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError):
        load_model(copy)
