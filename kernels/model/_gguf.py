"""kvtier's own GGUF → mlx-lm converter (llama architecture, GPT-2 byte-level BPE).

Reads a GGUF file through `mx.load(path, return_metadata=True)` (which gives
Q4_0/Q4_1/Q8_0 tensors as affine group-32 triples ``weight/scales/biases``)
and writes an mlx-lm model directory: ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.

The conversion is a pure function of the GGUF bytes and the `dequantize`
flag; `convert_gguf` writes into a temporary sibling directory and renames it
into place only when every file is written and synced, so an interrupted
conversion never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels._errors import KernelError

__all__ = [
    "COMPLETE_MARKER",
    "CONVERTER_VERSION",
    "GGUFFile",
    "ModelConversionError",
    "convert_gguf",
    "gguf_to_hf_name",
    "is_converted_dir",
    "llama_config_from_metadata",
    "permute_rope_rows",
    "read_gguf",
    "tokenizer_files_from_metadata",
    "unpermute_rope_rows",
]

CONVERTER_VERSION = 1
"""Bumped whenever the converter's output changes; part of the completion marker."""

COMPLETE_MARKER = ".kvtier-converted.json"
"""Written last (after fsync) into a converted directory."""

_GGUF_MAGIC = b"GGUF"

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LAYER_PARTS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_PARTS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SUFFIXES = ("weight", "scales", "biases", "bias")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.([a-z]+)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.([a-z]+)$")

# GGUF stores Q4_0/Q4_1/Q8_0 with 32-element blocks along the input dim;
# mx.load hands them over as affine groups of the same size.
_GGUF_GROUP_SIZE = 32


class ModelConversionError(KernelError):
    """The GGUF input is unreadable, truncated, or uses something the converter does not support."""


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """Tensors and metadata of one GGUF file, as `mx.load` returns them."""

    tensors: dict[str, Any]
    metadata: dict[str, Any]


def read_gguf(path: Path) -> GGUFFile:
    """Read a GGUF file; any malformed or truncated input raises `ModelConversionError`."""
    import mlx.core as mx

    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelConversionError(f"cannot read {path}: {exc}") from exc
    if magic != _GGUF_MAGIC:
        raise ModelConversionError(f"{path} is not a GGUF file (magic {magic!r})")
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ModelConversionError(f"cannot parse GGUF {path}: {exc}") from exc
    if not isinstance(loaded, tuple) or len(loaded) != 2:
        raise ModelConversionError(f"unexpected mx.load result for {path}")
    tensors: Any = loaded[0]
    metadata: Any = loaded[1]
    return GGUFFile(tensors=dict(tensors), metadata=dict(metadata))


# ---------------------------------------------------------------- metadata


def _plain(value: Any) -> Any:
    """Metadata value as plain Python (mx scalars/arrays → int/float/bool/list)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _required(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelConversionError(f"GGUF metadata lacks {key!r}")
    return _plain(meta[key])


def _int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    if key not in meta:
        if default is None:
            raise ModelConversionError(f"GGUF metadata lacks {key!r}")
        return default
    value = _plain(meta[key])
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConversionError(f"GGUF metadata {key!r} is not an integer: {value!r}")
    return value


def _float(meta: Mapping[str, Any], key: str, default: float) -> float:
    if key not in meta:
        return default
    value = _plain(meta[key])
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ModelConversionError(f"GGUF metadata {key!r} is not a number: {value!r}")
    # NOTE: GGUF stores float32; 7 significant digits give back the decimal the
    # source config had (9.999999747e-06 → 1e-05), so equal models fingerprint equal.
    return float(f"{float(value):.7g}")


def llama_config_from_metadata(
    metadata: Mapping[str, Any],
    *,
    tie_word_embeddings: bool,
    quantization: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """An mlx-lm/HF ``config.json`` dict for a llama-architecture GGUF."""
    arch = _required(metadata, "general.architecture")
    if arch != "llama":
        raise ModelConversionError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    p = "llama."
    hidden = _int(metadata, p + "embedding_length")
    heads = _int(metadata, p + "attention.head_count")
    kv_heads = _int(metadata, p + "attention.head_count_kv", heads)
    if heads <= 0 or hidden % heads or kv_heads <= 0 or heads % kv_heads:
        raise ModelConversionError(f"bad head geometry: hidden={hidden} heads={heads} kv={kv_heads}")
    head_dim = _int(metadata, p + "attention.key_length", hidden // heads)
    rope_dim = _int(metadata, p + "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelConversionError(f"partial rotary embeddings unsupported ({rope_dim} != {head_dim})")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = _int(metadata, p + "vocab_size", len(tokens) if isinstance(tokens, list) else None)
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _int(metadata, p + "block_count"),
        "intermediate_size": _int(metadata, p + "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float(metadata, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(metadata, p + "rope.freq_base", 10000.0),
        "rope_traditional": False,
        "max_position_embeddings": _int(metadata, p + "context_length", 2048),
        "vocab_size": vocab,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }
    scaling = _plain(metadata.get(p + "rope.scaling.type", "none"))
    if scaling == "linear":
        factor = _float(metadata, p + "rope.scaling.factor", 1.0)
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling not in ("none", None):
        raise ModelConversionError(f"unsupported rope scaling {scaling!r}")
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        meta_key = f"tokenizer.ggml.{name}_token_id"
        if meta_key in metadata:
            config[key] = _int(metadata, meta_key)
    if quantization is not None:
        config["quantization"] = dict(quantization)
        config["quantization_config"] = dict(quantization)
    return config


# ---------------------------------------------------------------- tensors


def gguf_to_hf_name(name: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to mlx-lm's (``model.layers.3.self_attn.q_proj.weight``)."""
    if m := _LAYER_RE.match(name):
        layer, part, suffix = m.groups()
        if part in _LAYER_PARTS and suffix in _SUFFIXES:
            return f"model.layers.{int(layer)}.{_LAYER_PARTS[part]}.{suffix}"
    elif m := _GLOBAL_RE.match(name):
        part, suffix = m.groups()
        if part in _GLOBAL_PARTS and suffix in _SUFFIXES:
            return f"{_GLOBAL_PARTS[part]}.{suffix}"
    raise ModelConversionError(f"unsupported GGUF tensor {name!r}")


def permute_rope_rows(w: Any, n_heads: int) -> Any:
    """llama.cpp's q/k row permutation (HF half-split rope → interleaved rope).

    Within each head, output row ``a*hd/2 + i`` moves to ``2*i + a``.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelConversionError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: Any, n_heads: int) -> Any:
    """Inverse of `permute_rope_rows`: GGUF interleaved q/k rows → HF half-split order.

    NOTE: valid for quantized triples too: it moves whole output rows, and
    quantization groups run along the input dim, within one row.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelConversionError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quant_bits(weight: Any, scales: Any, name: str) -> int:
    # NOTE: weight packs 32 // bits values per uint32 word; scales hold one value per group.
    cols_values = scales.shape[-1] * _GGUF_GROUP_SIZE
    bits: int = weight.shape[-1] * 32 // cols_values
    if bits not in (2, 3, 4, 5, 6, 8) or weight.shape[-1] * 32 != bits * cols_values:
        raise ModelConversionError(f"tensor {name!r}: cannot infer bits from {weight.shape}/{scales.shape}")
    return bits


def _convert_tensors(
    gguf: GGUFFile, *, dequantize: bool, heads: int, kv_heads: int
) -> tuple[dict[str, Any], dict[str, int]]:
    """Renamed (and un-permuted, optionally dequantized) tensors, plus bits per quantized module."""
    import mlx.core as mx

    src = gguf.tensors
    out: dict[str, Any] = {}
    bits_of: dict[str, int] = {}
    for name in sorted(src):
        if name.endswith((".scales", ".biases")):
            continue
        hf = gguf_to_hf_name(name)
        module = hf.rsplit(".", 1)[0]
        stem = name.rsplit(".", 1)[0]
        arrays = {"weight": src[name]}
        if f"{stem}.scales" in src:
            if f"{stem}.biases" not in src:
                raise ModelConversionError(f"tensor {stem!r} has scales but no biases")
            arrays["scales"], arrays["biases"] = src[f"{stem}.scales"], src[f"{stem}.biases"]
        if module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            n = heads if module.endswith("q_proj") else kv_heads
            arrays = {k: unpermute_rope_rows(v, n) for k, v in arrays.items()}
        if "scales" in arrays:
            bits = _quant_bits(arrays["weight"], arrays["scales"], name)
            if dequantize:
                # NOTE: fp32 scales/biases so the dequantized values carry no fp16 rounding.
                dense = mx.dequantize(
                    arrays["weight"],
                    arrays["scales"].astype(mx.float32),
                    arrays["biases"].astype(mx.float32),
                    group_size=_GGUF_GROUP_SIZE,
                    bits=bits,
                )
                out[f"{module}.weight"] = dense.astype(mx.float32)
            else:
                bits_of[module] = bits
                out[f"{module}.weight"] = arrays["weight"]
                # NOTE: activations run in fp32 (norm weights are fp32), and
                # quantized_matmul wants scales in the activation dtype.
                out[f"{module}.scales"] = arrays["scales"].astype(mx.float32)
                out[f"{module}.biases"] = arrays["biases"].astype(mx.float32)
        else:
            out[hf] = arrays["weight"].astype(mx.float32)
    return out, bits_of


# ---------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre == "smollm":
        # llama.cpp's "smollm" = single digits, then the GPT-2 regex.
        return {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        }
    if pre in ("gpt-2", "gpt2", "default"):
        return byte_level
    raise ModelConversionError(f"unsupported GGUF pre-tokenizer {pre!r}")


def tokenizer_files_from_metadata(metadata: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` contents.

    Only GPT-2 style byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported.
    """
    model = _required(metadata, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelConversionError(f"unsupported GGUF tokenizer model {model!r} (only 'gpt2')")
    tokens = _required(metadata, "tokenizer.ggml.tokens")
    merges = _required(metadata, "tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelConversionError("tokenizer.ggml.tokens is not a list of strings")
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise ModelConversionError("tokenizer.ggml.merges is not a list of 'a b' strings")
    types = _plain(metadata.get("tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens)))
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ModelConversionError("tokenizer.ggml.token_type does not match the vocabulary")
    if len(set(tokens)) != len(tokens):
        raise ModelConversionError("tokenizer.ggml.tokens has duplicate entries")
    pre = str(_plain(metadata.get("tokenizer.ggml.pre", "default")))

    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": typ != _TOKEN_CONTROL,
            "special": typ == _TOKEN_CONTROL,
        }
        for i, (tok, typ) in enumerate(zip(tokens, types, strict=True))
        if typ in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer_json: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(pre),
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }

    def token_for(kind: str) -> str | None:
        key = f"tokenizer.ggml.{kind}_token_id"
        if key not in metadata:
            return None
        idx = _int(metadata, key)
        if not 0 <= idx < len(tokens):
            raise ModelConversionError(f"{key}={idx} is outside the vocabulary")
        return str(tokens[idx])

    special_map: dict[str, Any] = {}
    for kind in ("bos", "eos", "unknown", "padding"):
        tok = token_for(kind)
        if tok is not None:
            field = {"unknown": "unk_token", "padding": "pad_token"}.get(kind, f"{kind}_token")
            special_map[field] = tok
    control = [a["content"] for a in added if a["special"]]
    special_map["additional_special_tokens"] = [
        t for t in control if t not in special_map.values()
    ]
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _int(metadata, "llama.context_length", 2048),
        "added_tokens_decoder": {
            str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added
        },
        **special_map,
    }
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = str(_plain(template))
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_map,
    }


# ---------------------------------------------------------------- output


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # NOTE: some platforms cannot open directories; rename is still atomic.
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, value: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def is_converted_dir(path: Path) -> bool:
    """True when `path` holds a complete conversion by this converter version."""
    marker = Path(path) / COMPLETE_MARKER
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("converter_version") == CONVERTER_VERSION


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dequantize: bool,
    source: Mapping[str, Any] | None = None,
) -> Path:
    """Convert a llama GGUF file into an mlx-lm model directory at `out_dir`.

    `dequantize=True` writes fp32 weights; otherwise Q4_1/Q8_0 tensors stay
    affine-quantized (group size 32) with a matching ``quantization`` config.
    `source` is recorded in the completion marker (e.g. the download's sha256).
    An existing complete `out_dir` is replaced atomically. Raises
    `ModelConversionError` for unreadable or unsupported input.
    """
    import mlx.core as mx

    out_dir = Path(out_dir)
    gguf = read_gguf(Path(gguf_path))
    meta = gguf.metadata
    tie = "output.weight" not in gguf.tensors
    probe = llama_config_from_metadata(meta, tie_word_embeddings=tie)
    tensors, bits_of = _convert_tensors(
        gguf,
        dequantize=dequantize,
        heads=probe["num_attention_heads"],
        kv_heads=probe["num_key_value_heads"],
    )
    quantization: dict[str, Any] | None = None
    if bits_of:
        # NOTE: the most common width is the default; the rest (e.g. a Q8_0
        # embedding in a Q4_1 file) are per-module overrides mlx-lm understands.
        widths = sorted(bits_of.values())
        main_bits = max(set(widths), key=widths.count)
        quantization = {"group_size": _GGUF_GROUP_SIZE, "bits": main_bits, "mode": "affine"}
        for module, bits in sorted(bits_of.items()):
            if bits != main_bits:
                quantization[module] = {"group_size": _GGUF_GROUP_SIZE, "bits": bits}
    config = llama_config_from_metadata(meta, tie_word_embeddings=tie, quantization=quantization)
    tokenizer_files = tokenizer_files_from_metadata(meta)
    expected = 2 + 9 * config["num_hidden_layers"] + (0 if tie else 1)
    modules = {k.rsplit(".", 1)[0] for k in tensors}
    if len(modules) != expected:
        raise ModelConversionError(f"expected {expected} weight tensors, found {len(modules)}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        weights = tmp / "model.safetensors"
        mx.save_safetensors(str(weights), tensors, metadata={"format": "mlx"})
        _fsync_file(weights)
        _write_json(tmp / "config.json", config)
        for name, content in tokenizer_files.items():
            _write_json(tmp / name, content)
        marker = {
            "converter_version": CONVERTER_VERSION,
            "dequantize": dequantize,
            "source": dict(source or {"gguf": str(gguf_path)}),
        }
        _write_json(tmp / COMPLETE_MARKER, marker)
        _fsync_dir(tmp)
        if out_dir.exists():
            # NOTE: move the old tree aside first: rename() cannot replace a non-empty dir.
            trash = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex}"
            os.replace(out_dir, trash)
            os.replace(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
        _fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
