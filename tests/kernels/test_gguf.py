"""Unit tests of kvtier's GGUF → mlx-lm converter on tiny synthetic GGUF files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from tokenizers import Tokenizer

from kernels import ModelConversionError, convert_gguf, is_converted_dir
from kernels.model._gguf import (
    COMPLETE_MARKER,
    gguf_to_hf_name,
    llama_config_from_metadata,
    read_gguf,
    tokenizer_files_from_metadata,
    unpermute_rope_rows,
)
from tests.model_fixtures import (
    llama_cpp_permute,
    mlx_lm_load,
    tiny_gguf_metadata,
    tiny_llama_gguf,
)


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, Any]:
    """A tiny llama GGUF in llama.cpp layout, and the mlx-lm model it was written from."""
    path = tmp_path / "tiny.gguf"
    return path, tiny_llama_gguf(path)


def test_metadata_to_llama_config() -> None:
    """GGUF llama metadata becomes the mlx-lm config, with float32 values restored to their decimals."""
    meta = tiny_gguf_metadata(vocab_size=262, layers=3)
    meta["llama.rope.freq_base"] = mx.array(100000.0, dtype=mx.float32)
    cfg = llama_config_from_metadata(meta, tie_word_embeddings=True)
    assert cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 3, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rms_norm_eps"] == 1e-5  # float32 9.99999974e-06 restored
    assert cfg["rope_theta"] == 100000.0
    assert cfg["vocab_size"] == 262
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "quantization" not in cfg
    q = llama_config_from_metadata(
        meta, tie_word_embeddings=False, quantization={"group_size": 32, "bits": 4}
    )
    assert q["quantization"] == {"group_size": 32, "bits": 4}
    assert q["tie_word_embeddings"] is False


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("general.architecture", "qwen2", "architecture"),
        ("llama.rope.dimension_count", mx.array(8, dtype=mx.uint32), "partial rotary"),
        ("llama.attention.head_count_kv", mx.array(3, dtype=mx.uint32), "head geometry"),
    ],
)
def test_unsupported_metadata_is_a_typed_error(key: str, value: Any, reason: str) -> None:
    """Architectures and geometries the converter cannot express raise ModelConversionError."""
    meta = tiny_gguf_metadata(vocab_size=262, layers=2)
    meta[key] = value
    with pytest.raises(ModelConversionError, match=reason):
        llama_config_from_metadata(meta, tie_word_embeddings=True)


def test_missing_metadata_is_a_typed_error() -> None:
    """A GGUF without a required llama key raises ModelConversionError naming it."""
    meta = tiny_gguf_metadata(vocab_size=262, layers=2)
    del meta["llama.block_count"]
    with pytest.raises(ModelConversionError, match="block_count"):
        llama_config_from_metadata(meta, tie_word_embeddings=True)


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
        ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("blk.3.attn_k.biases", "model.layers.3.self_attn.k_proj.biases"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.29.ffn_gate.weight", "model.layers.29.mlp.gate_proj.weight"),
        ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
    ],
)
def test_tensor_name_mapping(gguf: str, hf: str) -> None:
    """GGUF tensor names map to mlx-lm's llama parameter names."""
    assert gguf_to_hf_name(gguf) == hf


@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.0.attn_qkv.weight", "blk.x.attn_q.weight"])
def test_unknown_tensor_name_is_a_typed_error(name: str) -> None:
    """Tensors the llama mapping does not know raise ModelConversionError."""
    with pytest.raises(ModelConversionError):
        gguf_to_hf_name(name)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    """Un-permuting llama.cpp's q/k row order gives back the HF rows exactly."""
    w = mx.arange(3 * 8 * 5, dtype=mx.float32).reshape(3 * 8, 5)  # 3 heads, head_dim 8
    permuted = llama_cpp_permute(w, 3)
    assert not mx.array_equal(permuted, w)
    assert mx.array_equal(unpermute_rope_rows(permuted, 3), w)
    # Within a head, GGUF row 2*i + a holds HF row a*hd/2 + i (interleaved pairs).
    assert permuted[:8, 0].tolist() == [0, 20, 5, 25, 10, 30, 15, 35]


def test_rope_orders_agree_on_attention_scores() -> None:
    """HF rows with half-split rope score like GGUF rows with interleaved rope (why the permutation exists)."""
    mx.random.seed(1)
    heads, hd, dim, seq = 2, 8, 12, 5
    wq = mx.random.normal((heads * hd, dim))
    wk = mx.random.normal((heads * hd, dim))
    x = mx.random.normal((1, seq, dim))

    def scores(wq_: mx.array, wk_: mx.array, traditional: bool) -> mx.array:
        q = (x @ wq_.T).reshape(1, seq, heads, hd).transpose(0, 2, 1, 3)
        k = (x @ wk_.T).reshape(1, seq, heads, hd).transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, hd, traditional=traditional, base=10000.0, scale=1.0, offset=0)
        k = mx.fast.rope(k, hd, traditional=traditional, base=10000.0, scale=1.0, offset=0)
        return q @ k.transpose(0, 1, 3, 2)

    hf = scores(wq, wk, traditional=False)
    gguf = scores(llama_cpp_permute(wq, heads), llama_cpp_permute(wk, heads), traditional=True)
    assert mx.allclose(hf, gguf, atol=1e-4).item()
    unpermuted = scores(
        unpermute_rope_rows(llama_cpp_permute(wq, heads), heads),
        unpermute_rope_rows(llama_cpp_permute(wk, heads), heads),
        traditional=False,
    )
    assert mx.allclose(hf, unpermuted, atol=1e-5).item()


def test_unpermute_commutes_with_quantization() -> None:
    """Permuting the rows of a quantized triple equals permuting the dequantized rows (groups run along inputs)."""
    mx.random.seed(2)
    w = mx.random.normal((3 * 16, 64))
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    pq, ps, pb = (unpermute_rope_rows(t, 3) for t in (q, s, b))
    dq_then_perm = unpermute_rope_rows(mx.dequantize(q, s, b, group_size=32, bits=4), 3)
    perm_then_dq = mx.dequantize(pq, ps, pb, group_size=32, bits=4)
    assert mx.array_equal(dq_then_perm, perm_then_dq)


def test_tokenizer_json_from_metadata_round_trips() -> None:
    """The byte-level BPE built from GGUF vocab+merges applies merges, keeps specials whole and round-trips text."""
    files = tokenizer_files_from_metadata(tiny_gguf_metadata(vocab_size=262, layers=2))
    tok = Tokenizer.from_str(json.dumps(files["tokenizer.json"]))
    enc = tok.encode("the then 42<|im_end|>", add_special_tokens=False)
    # merges "h e", "Ġ t", "Ġt he" apply; there is no "t he", so "the" stays split.
    assert enc.tokens[:4] == ["t", "he", "Ġthe", "n"]
    assert enc.tokens[-1] == "<|im_end|>"
    assert enc.ids[-1] == 2
    assert enc.tokens[-3:-1] == ["4", "2"]  # smollm pre-tokenizer: single digits
    assert tok.decode(enc.ids, skip_special_tokens=False) == "the then 42<|im_end|>"
    text = "Grüße, 世界! tab\tnew\nline"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    cfg = files["tokenizer_config.json"]
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert "im_start" in cfg["chat_template"]


def test_unsupported_tokenizer_model_is_a_typed_error() -> None:
    """A SentencePiece ('llama') GGUF vocabulary raises ModelConversionError."""
    meta = tiny_gguf_metadata(vocab_size=262, layers=2)
    meta["tokenizer.ggml.model"] = "llama"
    with pytest.raises(ModelConversionError, match="tokenizer model"):
        tokenizer_files_from_metadata(meta)


def test_converted_tiny_model_matches_source_logits(tiny_gguf: tuple[Path, Any], tmp_path: Path) -> None:
    """A GGUF written in llama.cpp layout converts to an mlx-lm dir whose logits equal the source model's."""
    gguf_path, source = tiny_gguf
    out = convert_gguf(gguf_path, tmp_path / "tiny-mlx", dequantize=True)
    assert is_converted_dir(out)
    model, tokenizer = mlx_lm_load(out)
    ids = mx.array([tokenizer.encode("the cat then the hat")])
    assert mx.allclose(model(ids), source(ids), atol=1e-4).item()
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_skipping_unpermutation_changes_logits(tiny_gguf: tuple[Path, Any], tmp_path: Path) -> None:
    """Control for the logits test: weights left in GGUF row order give different logits."""
    gguf_path, source = tiny_gguf
    out = convert_gguf(gguf_path, tmp_path / "tiny-mlx", dequantize=True)
    model, _ = mlx_lm_load(out)
    layer = model.model.layers[0].self_attn
    layer.q_proj.weight = llama_cpp_permute(layer.q_proj.weight, 4)
    layer.k_proj.weight = llama_cpp_permute(layer.k_proj.weight, 2)
    ids = mx.array([[5, 60, 70, 80, 90, 100, 110]])
    assert not mx.allclose(model(ids), source(ids), atol=1e-3).item()


def _truncate(src: Path, dst: Path, keep: int) -> Path:
    dst.write_bytes(src.read_bytes()[:keep])
    return dst


@pytest.mark.parametrize("keep", [0, 3, 64, -200])
def test_bad_or_truncated_gguf_is_a_typed_error(tiny_gguf: tuple[Path, Any], tmp_path: Path, keep: int) -> None:
    """Empty, header-only, cut-off metadata and cut-off tensor data all raise ModelConversionError."""
    gguf_path, _ = tiny_gguf
    size = gguf_path.stat().st_size
    bad = _truncate(gguf_path, tmp_path / "bad.gguf", keep if keep >= 0 else size + keep)
    with pytest.raises(ModelConversionError):
        read_gguf(bad)


def test_not_a_gguf_is_a_typed_error(tmp_path: Path) -> None:
    """A file without the GGUF magic raises ModelConversionError, and so does a missing one."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelConversionError, match="not a GGUF"):
        read_gguf(junk)
    with pytest.raises(ModelConversionError):
        read_gguf(tmp_path / "missing.gguf")


def test_failed_conversion_leaves_no_directory(tiny_gguf: tuple[Path, Any], tmp_path: Path) -> None:
    """A conversion that fails while writing leaves neither the target nor a temp dir behind."""
    gguf_path, _ = tiny_gguf
    meta_bad = tmp_path / "models"
    meta_bad.mkdir()
    out = meta_bad / "tiny"

    class Interrupted(Exception):
        pass

    def interrupted_save(*args: Any, **kwargs: Any) -> None:
        raise Interrupted

    mp = pytest.MonkeyPatch()
    mp.setattr(mx, "save_safetensors", interrupted_save)
    try:
        with pytest.raises(Interrupted):
            convert_gguf(gguf_path, out, dequantize=True)
    finally:
        mp.undo()
    assert list(meta_bad.iterdir()) == []
    assert not is_converted_dir(out)


def test_reconversion_replaces_a_complete_dir_atomically(tiny_gguf: tuple[Path, Any], tmp_path: Path) -> None:
    """Converting over an existing complete dir replaces it and leaves no temp or old dirs."""
    gguf_path, _ = tiny_gguf
    out = tmp_path / "m" / "tiny"
    convert_gguf(gguf_path, out, dequantize=True)
    (out / "stale.txt").write_text("old")
    convert_gguf(gguf_path, out, dequantize=True, source={"run": 2})
    assert not (out / "stale.txt").exists()
    assert json.loads((out / COMPLETE_MARKER).read_text())["source"] == {"run": 2}
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]


def test_marker_from_other_converter_version_is_incomplete(tmp_path: Path) -> None:
    """A dir whose marker is missing, unparsable, or from another converter version is not complete."""
    d = tmp_path / "m"
    d.mkdir()
    assert not is_converted_dir(d)
    (d / COMPLETE_MARKER).write_text("{not json")
    assert not is_converted_dir(d)
    (d / COMPLETE_MARKER).write_text(json.dumps({"converter_version": -1}))
    assert not is_converted_dir(d)
