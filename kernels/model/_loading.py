"""Model loading and model identity.

`load_model` wraps `mlx_lm.load` and adds a `ModelIdentity`: the values the
cache tiers key their entries on, so a KV prefix computed by one model (or
one tokenizer) is never served to another.

NOTE: this is a plain synchronous function. In the server it must run on the
engine thread (MLX streams are per thread); nothing here starts threads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernels._errors import KernelError
from kernels._memory import on_cuda
from kernels._paths import kvtier_home

from ._compiled_decode import install_compiled_decode
from ._cuda_few_row import apply_qkv, cuda_few_row_enabled, few_row_product, qkv_enabled
from ._cuda_few_row import requested_variant as requested_cuda_few_row_variant
from ._cuda_few_row import self_check as cuda_few_row_check
from ._cuda_few_row import self_check_qkv as cuda_few_row_qkv_check
from ._cuda_few_row import use_variant as use_cuda_few_row_variant
from ._few_row import apply_few_row
from ._fused import FusionReport, fuse_gate_up, fuse_projections, fused_projections_enabled
from ._masked_attention import install as install_masked_attention
from ._rope import share_rope_tables
from ._weights import MEMO_NAME, WeightFiles, WeightsMemo, hash_weights

__all__ = [
    "LoadedModel",
    "ModelIdentity",
    "ModelLoadError",
    "apply_few_row_products",
    "config_fingerprint",
    "load_model",
    "resolve_model_path",
    "tokenizer_hash",
    "transform_forward",
    "weights_digest",
]

# Files whose bytes define how text maps to token ids (and back). Hashing the
# files (not the loaded object) makes the hash cheap and independent of the
# tokenizers library version.
_TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

# Config keys that do not change what the weights compute; leaving them out
# keeps the fingerprint stable across cosmetic config edits.
_CONFIG_IGNORED_KEYS: frozenset[str] = frozenset(
    {"_name_or_path", "transformers_version", "torch_dtype", "architectures", "use_cache"}
)

_DIGEST_BYTES = 16


class ModelLoadError(KernelError):
    """The model path or id could not be resolved or loaded."""


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What a KV cache entry was computed with.

    Two models with equal `fingerprint` produce interchangeable KV caches for
    equal token sequences; anything else must not share cache entries.
    """

    model_id: str
    """The path or Hugging Face id the model was loaded from (informational)."""
    name: str
    """A short human-readable name (directory name or the last id segment)."""
    config_fingerprint: str
    """Hex digest of the canonical config JSON (includes quantization)."""
    tokenizer_hash: str
    """Hex digest of the tokenizer files (or of the vocabulary when none exist)."""
    weights_digest: str
    """Hex digest of every byte of the safetensors files, names and sizes (see `weights_digest`)."""
    dtype: str
    """Dtype of the floating-point weights, e.g. ``"float32"`` or ``"bfloat16"``."""
    quantization: str | None
    """``"affine:<bits>:<group>"`` for quantized weights, None for dense ones."""

    @property
    def fingerprint(self) -> str:
        """One short digest over config, tokenizer, weights, dtype and quantization.

        Suitable as a directory name for the SSD tier.
        """
        parts = "\0".join(
            (
                self.config_fingerprint,
                self.tokenizer_hash,
                self.weights_digest,
                self.dtype,
                self.quantization or "",
            )
        )
        return hashlib.blake2b(parts.encode(), digest_size=8).hexdigest()

    def to_dict(self) -> dict[str, str | None]:
        """JSON-ready form (for file headers, /v1/models, /stats)."""
        return {
            "model_id": self.model_id,
            "name": self.name,
            "config_fingerprint": self.config_fingerprint,
            "tokenizer_hash": self.tokenizer_hash,
            "weights_digest": self.weights_digest,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for generation: the mlx-lm module, tokenizer and identity."""

    model: Any
    """The `mlx.nn.Module` built by mlx-lm."""
    tokenizer: Any
    """mlx-lm's `TokenizerWrapper` (``apply_chat_template``, ``eos_token_ids``, detokenizer)."""
    config: dict[str, Any]
    """The model config as mlx-lm read it (``config.json`` plus its fixes)."""
    path: Path
    """Local directory the model was read from."""
    identity: ModelIdentity
    fusion: FusionReport | None = None
    """What :func:`fuse_projections` did at load (``None``: not applied, e.g. off the CPU)."""

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template, or None when the model has none."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).hexdigest()


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def config_fingerprint(config: dict[str, Any]) -> str:
    """Stable hex digest of a model config (key order and cosmetic keys ignored)."""
    kept = {k: v for k, v in config.items() if k not in _CONFIG_IGNORED_KEYS}
    return _digest(_canonical_json(kept))


def tokenizer_hash(model_dir: Path, tokenizer: Any = None) -> str:
    """Hex digest of the tokenizer files in `model_dir`.

    Falls back to hashing `tokenizer.get_vocab()` when the directory holds no
    known tokenizer file (and a tokenizer is given).
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    found = False
    for name in _TOKENIZER_FILES:
        f = model_dir / name
        if f.is_file():
            found = True
            data = f.read_bytes()
            # NOTE: name and length framing keeps (a="xy", b="") and (a="x", b="y") apart.
            h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
            h.update(data)
    if found:
        return h.hexdigest()
    if tokenizer is None:
        raise ModelLoadError(f"no tokenizer files in {model_dir}")
    vocab = tokenizer.get_vocab()
    return _digest(_canonical_json(sorted(vocab.items(), key=lambda kv: kv[1])))


def weights_digest(
    model_dir: Path, *, memo: WeightsMemo | None = None, files: WeightFiles | None = None
) -> str:
    """Hex digest of every byte of the ``model*.safetensors`` files (with their names and sizes).

    NOTE: every byte: a sample (the header and a few windows) would let
    two fine-tunes that differ elsewhere share one SSD directory and be
    served each other's KV. Each file's digest is
    remembered by (device, inode, size, mtime, ctime) in
    ``$KVTIER_HOME/weights-digests.json`` (``memo``; default that file), so
    a restart of an unchanged model reads nothing (``kernels.model._weights``).
    Blocking file work: the engine thread or a worker thread.
    """
    paths = sorted(Path(model_dir).glob("model*.safetensors"))
    if not paths:
        raise ModelLoadError(f"no model*.safetensors in {model_dir}")
    if memo is None:
        memo = WeightsMemo(kvtier_home() / MEMO_NAME)
    try:
        return hash_weights(paths, memo=memo, files=files)
    except OSError as exc:
        raise ModelLoadError(f"cannot read the weights in {model_dir}: {exc}") from exc


def _weights_dtype_and_quant(model: Any, config: dict[str, Any]) -> tuple[str, str | None]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    quant = config.get("quantization")
    quant_str: str | None = None
    if isinstance(quant, dict) and "bits" in quant:
        mode = quant.get("mode", "affine")
        quant_str = f"{mode}:{quant['bits']}:{quant.get('group_size', 64)}"
    counts: dict[str, int] = {}
    flat: Any = tree_flatten(model.parameters())
    for _, arr in flat:
        if mx.issubdtype(arr.dtype, mx.floating):
            key = str(arr.dtype).removeprefix("mlx.core.")
            counts[key] = counts.get(key, 0) + int(arr.size)
    dtype = max(counts, key=lambda k: counts[k]) if counts else "unknown"
    return dtype, quant_str


def _identity_of(
    path_or_hf_id: str | Path, path: Path, model: Any, tokenizer: Any, config: dict[str, Any]
) -> ModelIdentity:
    """The identity of a model loaded from ``path`` (asked for as ``path_or_hf_id``).

    Shared by the one-process load and the tensor-parallel shard load, so
    both name and fingerprint a model the same way.
    """
    dtype, quant = _weights_dtype_and_quant(model, config)
    model_id = str(path_or_hf_id)
    name = path.name if Path(path_or_hf_id).expanduser().exists() else model_id.rsplit("/", 1)[-1]
    return ModelIdentity(
        model_id=model_id,
        name=name,
        config_fingerprint=config_fingerprint(config),
        tokenizer_hash=tokenizer_hash(path, tokenizer),
        weights_digest=weights_digest(path),
        dtype=dtype,
        quantization=quant,
    )


def resolve_model_path(path_or_hf_id: str | Path) -> Path:
    """A local directory for `path_or_hf_id`, downloading from the Hub when needed.

    Raises `ModelLoadError` when it is neither a local model dir nor a
    downloadable id.
    """
    p = Path(path_or_hf_id).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} is not an mlx-lm model directory (no config.json)")
        return p.resolve()
    if _is_local_path(path_or_hf_id):
        # NOTE: a path is never a Hub id; the Hub's "repo id must be ..." message
        # would hide the real problem (a typo, a missing mount).
        raise ModelLoadError(f"model directory not found: {p}")
    from mlx_lm.utils import _download

    try:
        local = Path(_download(str(path_or_hf_id)))
    except Exception as exc:
        raise ModelLoadError(f"cannot resolve model {path_or_hf_id!r}: {exc}") from exc
    if not (local / "config.json").is_file():
        raise ModelLoadError(f"{path_or_hf_id!r} resolved to {local}, which has no config.json")
    return local


def _is_local_path(path_or_hf_id: str | Path) -> bool:
    """Whether the name can only be a filesystem path (a Hub id is ``name`` or ``owner/name``)."""
    if isinstance(path_or_hf_id, Path):
        return True
    s = path_or_hf_id
    if s.startswith(("/", "./", "../", "~", ".\\")) or s in (".", "..") or s.endswith("/"):
        return True
    if s.count("/") > 1 or "\\" in s:
        return True
    head, sep, _ = s.partition("/")
    # NOTE: "models/smol" with a local ./models directory is a path with a typo.
    return bool(sep) and Path(head).expanduser().is_dir()


def transform_forward(model: Any) -> FusionReport:
    """The CPU forward transform, in place: fused projections, then shared RoPE tables (every output bit kept)."""
    report = fuse_projections(model)
    layers = getattr(model, "layers", None) or []
    attn = getattr(layers[0], "self_attn", None) if layers else None
    head_dim = getattr(attn, "head_dim", None)
    heads = getattr(attn, "n_heads", None)
    if report.groups == 0 or not isinstance(head_dim, int) or not isinstance(heads, int):
        return report
    dtype = layers[0].self_attn.o_proj.weight.dtype
    shared = share_rope_tables(model, dtype=dtype, head_dim=head_dim, heads=heads)
    return replace(report, rope_layers=shared)


def transform_for_device(
    model: Any, *, fuse: bool | None = None, few_row: bool | None = None
) -> FusionReport | None:
    """kvtier's load-time changes to the forward for the default device, in place (engine thread).

    CPU: fused projections and shared RoPE tables (bitwise), then one-token
    products through the few-row product. CUDA: gate|up as one product, and
    one-position queries under an array mask as folded products
    (:mod:`._masked_attention`); with ``KVTIER_CUDA_FEW_ROW=1`` one-token bf16
    products of 2-8 rows through the tensor-core few-row product
    (:mod:`._cuda_few_row`).
    Metal: none. ``fuse`` / ``few_row`` as :func:`load_model`'s. Returns
    what was done (``None``: nothing applied).
    """
    import mlx.core as mx

    on_cpu = mx.default_device() == mx.cpu
    if fuse is None:
        fuse = fused_projections_enabled()
    fusion: FusionReport | None = None
    if fuse and on_cpu:
        fusion = transform_forward(model)
    elif fuse and not mx.metal.is_available():
        # NOTE: CUDA: gate|up as one product (docs/benchmarks/gpu.md, "gate|up
        # as one product"); Metal was not measured and keeps mlx-lm's layers.
        fusion = fuse_gate_up(model)
    if few_row is None:
        # NOTE: measured on the CPU only (docs/batching.md, "Few-row products").
        few_row = on_cpu
    if few_row:
        fusion = apply_few_row_products(model, fusion or FusionReport())
    elif cuda_few_row_enabled() and on_cuda():
        # NOTE: one-token bf16 products through the tensor-core few-row
        # product (_cuda_few_row); other dtypes and longer inputs keep MLX's.
        use_cuda_few_row_variant(requested_cuda_few_row_variant())
        refused = cuda_few_row_check()
        routed = 0 if refused else apply_few_row(model, few_row_product, dtype=mx.bfloat16)
        status = refused or "CUDA few-row product"
        if routed and qkv_enabled():
            # NOTE: each layer's q, k, v one-position products as one launch.
            qkv_refused = cuda_few_row_qkv_check()
            status += (
                f"; q|k|v: {qkv_refused}"
                if qkv_refused
                else f"; q|k|v joined in {apply_qkv(model)} layers"
            )
        fusion = replace(fusion or FusionReport(), few_row=routed, few_row_status=status)
    # NOTE: CUDA only (a no-op elsewhere): the batch lane's masked decode
    # attention as folded products (_masked_attention).
    install_masked_attention(model)
    # NOTE: last: the traces capture the forward as transformed above.
    install_compiled_decode(model)
    return fusion


def apply_few_row_products(model: Any, report: FusionReport) -> FusionReport:
    """Route the model's one-token fp32 products through the few-row product where it runs here (in place)."""
    from kernels.native import few_row_op, few_row_status

    product = few_row_op()
    routed = apply_few_row(model, product) if product is not None else 0
    return replace(report, few_row=routed, few_row_status=few_row_status())


def load_model(
    path_or_hf_id: str | Path,
    *,
    lazy: bool = False,
    fuse: bool | None = None,
    few_row: bool | None = None,
) -> LoadedModel:
    """Load an mlx-lm model directory or Hugging Face id and compute its identity.

    ``fuse``: on the CPU, fuse the q|k|v and gate|up projections
    (:func:`fuse_projections`: bitwise the same outputs, fewer matrix
    products); on CUDA, gate|up as one product (:func:`fuse_gate_up`: not
    bitwise mlx-lm's); Metal keeps mlx-lm's layers. Default: on unless
    ``KVTIER_FUSED_PROJECTIONS=0``. ``few_row``: one-token
    steps' fp32 products through kvtier's few-row product
    (``kernels.model._few_row``; not bitwise mlx-lm's); default: on the CPU
    device where the extension builds, unless ``KVTIER_FEW_ROW=0``. Runs
    MLX: call it on the engine thread in server code.
    """
    from mlx_lm import load as mlx_load

    path = resolve_model_path(path_or_hf_id)
    try:
        loaded: Any = mlx_load(str(path), lazy=lazy, return_config=True)
        model, tokenizer, config = loaded
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    identity = _identity_of(path_or_hf_id, path, model, tokenizer, config)
    fusion = transform_for_device(model, fuse=fuse, few_row=few_row)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        path=path,
        identity=identity,
        fusion=fusion,
    )
