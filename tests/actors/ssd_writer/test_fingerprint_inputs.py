"""The cold tier's fingerprint directory: each input selects its own directory (rules R3-7, R5.1-NC).

The unit tests vary one input of ``cold_fingerprint`` at a time; the wiring
tests start real Engines (tiny fp32 Llama) on one SSD root and check which
``<root>/<fingerprint>`` directory each one created and locked, for a KV
scheme change and for a runtime identity change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import actors.backend
from actors.engine import Engine
from actors.ssd_writer import cold_fingerprint
from kernels import ModelIdentity, resolve_kv_scheme
from kernels.cache import FORMAT_VERSION
from tests.tiny_models import kv_llama, tiny_tokenizer

BASE: dict[str, Any] = {
    "model": "model-digest",
    "kv_scheme": "bf16",
    "runtime": "mlx-0.0.0/cpu/x86_64",
    "format_version": 1,
}
CHANGED: dict[str, Any] = {
    "model": "other-model-digest",
    "kv_scheme": "kv8",
    "runtime": "mlx-0.0.1/cpu/x86_64",
    "format_version": 2,
}
IDENTITY = ModelIdentity(
    model_id="tiny-llama",
    name="tiny-llama",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    weights_digest="w0",
    dtype="float32",
    quantization=None,
)


def test_equal_inputs_give_the_same_directory_name() -> None:
    """The fingerprint is a pure function: equal inputs name the same directory (kvt + 20 hex digits)."""
    first = cold_fingerprint(**BASE)
    assert first == cold_fingerprint(**dict(BASE))
    assert first[:3] == "kvt"
    assert len(first) == 23
    assert set(first[3:]) <= set("0123456789abcdef")


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_input_alone_selects_another_directory(field: str) -> None:
    """Changing only the model, the KV scheme key, the runtime identity or the format version changes the name."""
    assert cold_fingerprint(**{**BASE, field: CHANGED[field]}) != cold_fingerprint(**BASE)


def test_text_moved_between_inputs_selects_another_directory() -> None:
    """The inputs are kept apart: text moved from one input to the next does not give the same name."""
    moved = {**BASE, "model": BASE["model"] + "b", "kv_scheme": BASE["kv_scheme"][1:]}
    assert cold_fingerprint(**moved) != cold_fingerprint(**BASE)


# --- wiring: the directory a running Engine uses ------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def quant_model(tok: Any) -> Any:
    """A tiny fp32 Llama with 64-wide heads (its K/V rows divide into the 64-element quantization groups)."""
    return kv_llama(vocab_size=len(tok), head_dim=64)


def _fingerprint_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("kvt")}


async def _run_engine(
    model: Any, tok: Any, root: Path, monkeypatch: pytest.MonkeyPatch, *, kv_quant: str, runtime: str
) -> tuple[set[str], int]:
    """Start an Engine on ``root`` with ``runtime`` as MLX's identity: its new directories, foreign dirs seen."""
    # NOTE: the Engine takes no port for the runtime identity; it imports
    # actors.backend.runtime_identity when it starts and runs it on the engine thread.
    monkeypatch.setattr(actors.backend, "runtime_identity", lambda: runtime)
    before = _fingerprint_dirs(root)
    engine = Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=1 << 26, ssd_cache=root, kv_quant=kv_quant)
    async with engine:
        ssd = (await engine.stats(timeout=5.0))["ssd_cache"]
        assert ssd["ready"]
        assert not ssd["read_only"]
        foreign = int(ssd["foreign_dirs"])
    return _fingerprint_dirs(root) - before, foreign


def _expected(kv_quant: str, runtime: str) -> str:
    return cold_fingerprint(model=IDENTITY.fingerprint, kv_scheme=resolve_kv_scheme(kv_quant).cache_key,
                            runtime=runtime, format_version=FORMAT_VERSION)


@pytest.mark.anyio
async def test_a_kv_scheme_change_selects_another_directory(
    quant_model: Any, tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Engine with kv_quant=8 on the same root and runtime keys its files under a new directory (the old one is foreign)."""
    plain, plain_foreign = await _run_engine(quant_model, tok, tmp_path, monkeypatch,
                                             kv_quant="off", runtime="mlx-test/cpu/a")
    quant, quant_foreign = await _run_engine(quant_model, tok, tmp_path, monkeypatch,
                                             kv_quant="8", runtime="mlx-test/cpu/a")
    assert plain == {_expected("off", "mlx-test/cpu/a")}
    assert quant == {_expected("8", "mlx-test/cpu/a")}
    assert plain != quant
    assert (plain_foreign, quant_foreign) == (0, 1)


@pytest.mark.anyio
async def test_a_runtime_change_selects_another_directory(
    quant_model: Any, tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Engine whose MLX runtime identity differs keys its files under a new directory; the same one reuses its own."""
    first, _ = await _run_engine(quant_model, tok, tmp_path, monkeypatch,
                                 kv_quant="off", runtime="mlx-test/cpu/a")
    again, again_foreign = await _run_engine(quant_model, tok, tmp_path, monkeypatch,
                                             kv_quant="off", runtime="mlx-test/cpu/a")
    other, other_foreign = await _run_engine(quant_model, tok, tmp_path, monkeypatch,
                                             kv_quant="off", runtime="mlx-test/gpu/b")
    assert first == {_expected("off", "mlx-test/cpu/a")}
    assert (again, again_foreign) == (set(), 0)
    assert other == {_expected("off", "mlx-test/gpu/b")}
    assert other_foreign == 1
