"""Continuous batching on the engine thread: many requests' rows, one forward per turn.

Built on mlx-lm's batch generation (``mlx_lm.generate.PromptProcessingBatch``
and ``GenerationBatch``) and its batch caches (``BatchKVCache``,
``BatchRotatingKVCache``, ``ArraysCache`` / ``CacheList`` merge, extend,
filter and extract). kvtier adds what its engine turn and prompt cache need:

- **Rows join with a cached prefix.** A row brings the per-layer caches the
  prompt cache lent it (or none) and only the uncached suffix is forwarded.
- **Prefill one row at a time, decode together.** A joining row's suffix is
  forwarded alone (batch of one, the serial lane's chunks), then its last
  prompt token enters the decode batch's next inputs. No row is ever padded during a
  prefill, so recurrent state (which has no mask) never sees a pad token and
  a row's prefill arithmetic is a lone row's (under the serial lane's
  causal mask: ``_lone_row``). Each turn forwards at most
  ``prefill_budget`` (by default ``prefill_step_size``) prompt tokens while
  any row decodes, its first chunk always, so active rows never wait for
  more than one chunk; with no row decoding nobody waits, and
  a turn may forward up to :data:`IDLE_PREFILL_ROWS` chunks (rows arriving
  together prefill in one padded forward, as mlx-lm's ``BatchGenerator``
  prefills ``prefill_batch_size`` prompts at once).
- **One step is one engine turn**: pending rows prefill within the turn's
  budget, then every decoding row advances by exactly one token
  (``GenerationBatch.next``); a row whose prefill completed enters with its
  last prompt token queued, forwarded by that same decode step (no forward
  of its own), and its first token comes out of the next turn.
- **First token first**: the turn that hands out rows' first tokens
  prefills nothing, so those tokens leave after one decode step, not after
  the next joiner's prefill chunk as well (which waits one decode step);
  ``KVTIER_BATCH_FIRST_TOKEN_FIRST=0`` prefills in every turn.
- **Per-row sampling and stops**: each row has its own sampler and logits
  processors (:func:`make_request_sampler` / :func:`make_request_processors`,
  so seeded rows draw from their own key), EOS / stop token ids and
  ``max_tokens`` end a row inside mlx-lm, stop strings are matched on each
  row's own :class:`TextStream`.
- **Rows leave through per-row extraction**, then their slot waits for the
  next joining row (``GreedyGenerationBatch``: no whole-batch copy; the
  batch is filtered for layer kinds that cannot hold a vacant slot):
  a finished or cancelled row hands back a per-layer cache list of the
  serial lane's kinds (``KVCache`` / ``RotatingKVCache`` / ``ArraysCache``,
  ``QuantizedKVCache`` for a converted transitioning row), together with the
  exact token ids it holds, ready for the prompt cache's ``Put`` like the
  serial lane's. A row can also hand back a prompt-boundary snapshot (its
  cache at a prompt offset it names, where its prefill chunks end, as on the
  serial lane).
- **Generation checkpoints per row**: a row joined with ``checkpoint_every``
  N hands back, after every N-th emitted token that did not end it, a
  :class:`RowCheckpoint`: an owned copy of its cache (per-row extraction,
  as a leaving row's) covering prompt + emitted tokens, the pending token
  (sampled, its forward queued, not emitted) and its PRNG key. A row joined
  with :meth:`BatchGeneration.join_resumed` brings such a state back: it
  replays the saved tokens (no forward, at most :data:`REPLAY_PER_STEP` a
  step, each with the text its :class:`TextStream` releases), then enters
  the decode batch without a forward, its pending token the next input.

:func:`batch_gate` says whether a model's cache kinds and KV scheme can be
batched, and why not (design 2.3). Under a quantizing KV scheme the
full-attention layers the scheme converts are *transitioning* rows
(:class:`TransitioningBatchKVCache`): each row starts plain and converts on
its own where the serial lane would. Everything that touches arrays here
runs on the engine thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from kernels._device import generation_stream, read_first_setting
from kernels._env import env_switch, env_text
from kernels._errors import InvalidPrompt, KernelError
from kernels._memory import on_cuda
from kernels.cache import KvScheme, LayerQuant, cache_arrays, snapshot_cuttable, trim_caches

from ._blas_threads import StepTuning
from ._checkpoint import CheckpointPoint, key_words, sampler_key_array, set_sampler_key
from ._detokenize import TextStream
from ._generation import KernelFinishReason, StepOutput, _check_cache_offset
from ._greedy import (
    argmax_with_logprobs,
    enter_generation,
    waiting_generation,
)
from ._logprobs import top_logprobs
from ._lone_row import lone_row_masks, plain_masks
from ._prefill_batch import PREFILL_CLEAR_ENV, PrefillBatch
from ._reserve import merge_with_room, reserve
from ._sampling import SamplingParams, make_request_processors, make_request_sampler
from ._structured import GrammarProcessor
from ._transitioning import TransitioningBatchKVCache

__all__ = [
    "ALIGN_SUFFIXES_ENV",
    "BATCH_SSM_ENV",
    "CLEAR_EVERY_ENV",
    "CUDA_PREFILL_BUCKET",
    "DEFAULT_CLEAR_EVERY",
    "FIRST_TOKEN_FIRST_ENV",
    "IDLE_PREFILL_ROWS",
    "PREFILL_BUCKET_ENV",
    "PREFILL_CLEAR_ENV",
    "REPLAY_PER_STEP",
    "RESERVE_ENV",
    "SLOT_REUSE_ENV",
    "BatchFull",
    "BatchGate",
    "BatchGeneration",
    "BatchRefusal",
    "BatchStep",
    "LayerKind",
    "RowCheckpoint",
    "RowExit",
    "RowExitReason",
    "RowSnapshot",
    "RowToken",
    "UnknownRow",
    "batch_gate",
    "batch_params_refusal",
    "batch_ssm_enabled",
    "clear_every_setting",
    "model_batch_gate",
    "prefill_bucket_setting",
]

BATCH_SSM_ENV = "KVTIER_BATCH_SSM"
"""Environment switch: ``0`` keeps models with recurrent state on the serial lane."""

SLOT_REUSE_ENV = "KVTIER_BATCH_SLOT_REUSE"
"""Environment switch: ``0`` filters leaving rows out and appends joining ones (no holes)."""

FIRST_TOKEN_FIRST_ENV = "KVTIER_BATCH_FIRST_TOKEN_FIRST"
"""Environment switch: ``0`` prefills in the turn that hands out rows' first tokens too."""

PREFILL_BUCKET_ENV = "KVTIER_BATCH_PREFILL_BUCKET"
"""Environment setting: a warm row's prefill forward rounded up to a multiple of this many tokens (0: off)."""

CUDA_PREFILL_BUCKET = 32
"""The bucket when ``KVTIER_BATCH_PREFILL_BUCKET`` is unset on CUDA (elsewhere 0).

NOTE: with the suffix fold (``kernels.model``'s ``KVTIER_CUDA_SUFFIX_FOLD``,
on by default on CUDA) an agent turn's join then meets one query length and
one key span turn after turn; together they cut the served agent line's
turns 2+ TTFT p50 to 0.72 x (232 vs 323 ms, 7 runs each on one H100, 8B
shape: docs/benchmarks.md, 2026-12-07 21:10). On the CPU the padding is
real compute and no graph is built per shape, so it stays off there."""

CLEAR_EVERY_ENV = "KVTIER_BATCH_CLEAR_EVERY"
"""Environment setting: MLX's buffer cache emptied after every N-th batch step (0: never)."""

DEFAULT_CLEAR_EVERY = 256
"""mlx-lm's cadence when the batch lane was built (its ``BatchGenerator`` now empties it every 512)."""

RESERVE_ENV = "KVTIER_BATCH_RESERVE"
"""Environment switch: ``0`` lets a prefill's batch cache grow chunk by chunk (mlx-lm's way; :mod:`._reserve`)."""

ALIGN_SUFFIXES_ENV = "KVTIER_BATCH_ALIGN_SUFFIXES"
"""Environment switch: ``0`` pads a group's shorter suffixes instead of aligning them (``_align_suffixes``)."""

LayerKind = Literal["full", "transitioning", "rotating", "recurrent", "list"]
"""How a layer's cache joins, filters and extracts in a batch.

``full``: ``KVCache`` (left-padded ``BatchKVCache``); ``transitioning``:
a full-attention layer the KV scheme quantizes, ``KVCache`` before a row
converts and ``QuantizedKVCache`` after (:class:`TransitioningBatchKVCache`);
``rotating``:
``RotatingKVCache`` (``BatchRotatingKVCache``, merged in temporal order);
``recurrent``: ``ArraysCache`` (rows stacked, no token axis); ``list``:
``CacheList`` whose members are all batchable.
"""

BatchRefusal = Literal[
    "unknown_cache_kind",
    "quantized_cache",
    "rotating_keep",
    "recurrent_disabled",
]
"""Why a model (or a row's cache) cannot join the batch.

``unknown_cache_kind``: a layer class kvtier declares no batch rule for;
``quantized_cache``: a layer holds quantized KV the KV scheme does not
produce there (no scheme, another bit width or group size, or a layer the
scheme leaves plain, such as a ``CacheList`` member); ``rotating_keep``: a
sliding-window ring that keeps leading tokens (mlx-lm's batched ring has no
``keep``); ``recurrent_disabled``: recurrent state with ``KVTIER_BATCH_SSM=0``.
"""

RowExitReason = Literal["stop", "length", "cancelled"]
"""Why a row left: EOS / stop token / stop string, ``max_tokens``, or a cancel."""

REPLAY_PER_STEP = 64
"""Saved tokens a resumed row hands back per step while it replays (its stream's backlog stays small)."""

IDLE_PREFILL_ROWS = 8
"""Prefill chunks one turn may forward while no row decodes (mlx-lm's default ``prefill_batch_size``)."""


class BatchFull(KernelError):
    """A row cannot join: the batch already holds ``max_rows`` rows."""


class UnknownRow(KernelError, KeyError):
    """No row with this id is in the batch (never joined, or already left)."""


# --- gates --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchGate:
    """Whether a cache layout (and KV scheme) can be batched; the layer kinds when it can."""

    kinds: tuple[LayerKind, ...] = ()
    refusal: BatchRefusal | None = None
    detail: str = ""

    @property
    def batchable(self) -> bool:
        """True when rows with this layout may join a batch."""
        return self.refusal is None

    @property
    def recurrent(self) -> bool:
        """True when some layer holds recurrent state."""
        return "recurrent" in self.kinds or "list" in self.kinds


def _count_setting(name: str, unit: str, default: int, env: Mapping[str, str] | None) -> int:
    """The whole number >= 0 in environment variable ``name`` (unset: ``default``); else ``ValueError`` naming it."""
    text = env_text(name, env)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of {unit}, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def prefill_bucket_setting(env: Mapping[str, str] | None = None, *, cuda: bool | None = None) -> int:
    """``KVTIER_BATCH_PREFILL_BUCKET`` in tokens; anything but a whole number >= 0 raises ``ValueError``.

    Unset: :data:`CUDA_PREFILL_BUCKET` where MLX computes on CUDA (``cuda``;
    ``None`` asks :func:`kernels.on_cuda`), else 0 (off).
    """
    if cuda is None:
        cuda = on_cuda()
    return _count_setting(PREFILL_BUCKET_ENV, "tokens", CUDA_PREFILL_BUCKET if cuda else 0, env)


def clear_every_setting(env: Mapping[str, str] | None = None) -> int:
    """``KVTIER_BATCH_CLEAR_EVERY`` in steps (unset: :data:`DEFAULT_CLEAR_EVERY`; 0: never); anything but a whole number >= 0 raises ``ValueError``."""
    return _count_setting(CLEAR_EVERY_ENV, "steps", DEFAULT_CLEAR_EVERY, env)


def batch_ssm_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when ``KVTIER_BATCH_SSM`` is ``0``/``false``/``off``/``no`` (default: enabled)."""
    return env_switch(BATCH_SSM_ENV, env)


class _Refused(Exception):
    def __init__(self, refusal: BatchRefusal, detail: str) -> None:
        super().__init__(detail)
        self.refusal: BatchRefusal = refusal
        self.detail = detail


def _layer_kind(
    cache: object, index: str, batch_ssm: bool, quant: LayerQuant | None = None
) -> tuple[LayerKind, bool]:
    """The batch kind of one layer and whether it (or a member) is recurrent.

    ``quant``: how the KV scheme converts this layer (``None``: it stays plain).
    """
    # NOTE: exact classes, never isinstance: a subclass nobody declared a rule
    # for is refused, not routed ("unknown is a bug, not a route").
    kind = type(cache)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind is KVCache:
        return ("full" if quant is None else "transitioning"), False
    if kind is RotatingKVCache:
        keep = int(getattr(cache, "keep", 0))
        if keep != 0:
            raise _Refused(
                "rotating_keep", f"layer {index}: sliding-window ring keeps {keep} tokens"
            )
        return "rotating", False
    if kind is ArraysCache:
        if not batch_ssm:
            raise _Refused(
                "recurrent_disabled", f"layer {index}: recurrent state and {BATCH_SSM_ENV}=0"
            )
        return "recurrent", True
    if kind is CacheList:
        recurrent = False
        for j, member in enumerate(cache.caches):  # type: ignore[attr-defined]
            _, r = _layer_kind(member, f"{index}.{j}", batch_ssm)
            recurrent = recurrent or r
        return "list", recurrent
    if kind is QuantizedKVCache:
        held = (int(cache.bits), int(cache.group_size))  # type: ignore[attr-defined]
        if quant is not None and held == (quant.bits, quant.group_size):
            return "transitioning", False  # NOTE: a converted row (the serial lane's kind).
        wanted = "plain" if quant is None else f"{quant.bits}-bit group {quant.group_size}"
        raise _Refused(
            "quantized_cache",
            f"layer {index}: {name} holds {held[0]}-bit group {held[1]} quantized KV; "
            f"the KV scheme keeps this layer {wanted}",
        )
    raise _Refused("unknown_cache_kind", f"layer {index}: no batch rule for {name}")


def batch_gate(
    caches: Sequence[object],
    scheme: KvScheme | None = None,
    *,
    batch_ssm: bool | None = None,
) -> BatchGate:
    """Can rows whose per-layer caches look like ``caches`` be batched under ``scheme``?

    Checks every layer's exact class (:data:`LayerKind`) against the
    scheme: a full-attention layer the scheme converts is ``transitioning``
    (a ``KVCache`` row not converted yet, or a ``QuantizedKVCache`` row of
    the scheme's bits and group size), as ``kernels.cache.convert_caches``
    decides per layer on the serial lane; quantized KV anywhere else is
    ``quantized_cache``. ``batch_ssm`` defaults to :func:`batch_ssm_enabled`.
    Pure inspection of classes: safe anywhere.
    """
    ssm = batch_ssm_enabled() if batch_ssm is None else batch_ssm
    quantizing = scheme is not None and scheme.quantized
    kinds: list[LayerKind] = []
    try:
        for i, cache in enumerate(caches):
            quant = scheme.layer_quant(i) if quantizing and scheme is not None else None
            kinds.append(_layer_kind(cache, str(i), ssm, quant)[0])
    except _Refused as refused:
        return BatchGate(tuple(kinds), refused.refusal, refused.detail)
    return BatchGate(tuple(kinds))


def batch_params_refusal(params: SamplingParams) -> str | None:
    """The request option a batch row cannot serve (it runs on the serial lane), or ``None``.

    ``prompt_logprobs`` (scoring the prompt) is implemented by the serial
    kernel only; a batch row would silently drop it. ``top_logprobs`` a row
    reports from its own log-probabilities, the distribution its token was
    sampled from; a ``grammar`` masks a row's logits as the serial lane's
    (the row's own processor, its violation failing that row alone:
    :meth:`BatchGeneration.grammar_violations`).
    """
    if params.prompt_logprobs is not None:
        return "prompt_logprobs"
    return None


def model_batch_gate(
    model: Any, scheme: KvScheme | None = None, *, batch_ssm: bool | None = None
) -> BatchGate:
    """:func:`batch_gate` over the model's fresh cache list (engine thread: builds caches)."""
    return batch_gate(make_prompt_cache(model), scheme, batch_ssm=batch_ssm)


# --- step results -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowToken:
    """One token of one row; ``index`` counts the row's tokens from 0."""

    row_id: str
    index: int
    output: StepOutput


@dataclass(frozen=True, slots=True)
class RowExit:
    """A row that left the batch, with its extracted cache (owned by the caller now).

    ``cache`` is a per-layer list of the serial lane's kinds holding exactly
    ``cache_tokens`` (the prompt, then the output tokens forwarded before the
    row left), usable by the prompt cache like the serial lane's
    ``Generation.cache`` (a converted row's layers carry the minimum reusable
    offset the serial lane would declare). Under read first the row's last
    output token is usually not in it: its forward was built, not computed,
    when the row left, and the leave does not wait for it
    (:attr:`BatchGeneration.read_first`); a next turn prefills that token.
    """

    row_id: str
    reason: RowExitReason
    cache: list[Any]
    cache_tokens: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class RowSnapshot:
    """A row's prompt-boundary cache: an owned copy holding ``cache_tokens`` (the prompt but its last token)."""

    row_id: str
    cache: list[Any]
    cache_tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RowCheckpoint:
    """A decoding row at a checkpoint boundary (after an emitted token that did not end it).

    ``cache`` (an owned copy, the serial lane's kinds) holds ``cache_tokens``
    = the prompt (``prompt_len`` tokens) then every emitted token;
    ``pending_token`` is sampled (its forward queued) but not emitted;
    ``rng_key`` is the row's PRNG key after that draw (``None``: greedy).
    """

    row_id: str
    cache: list[Any]
    cache_tokens: tuple[int, ...]
    prompt_len: int
    pending_token: int
    rng_key: tuple[int, int] | None

    @property
    def sample_index(self) -> int:
        """Tokens emitted before the pending one."""
        return len(self.cache_tokens) - self.prompt_len


@dataclass(frozen=True, slots=True)
class BatchStep:
    """What one :meth:`BatchGeneration.step` did.

    ``tokens``: one per decoding row, in batch order; ``exits``: rows that
    finished in this step (their last token is in ``tokens``);
    ``snapshots``: prompt-boundary caches of rows that asked for one;
    ``decode_rows``: rows that decoded a token, not counting rows that
    entered the batch in this step (the decode forward also takes their last
    prompt token, and read first hands out their first token in this step:
    that part belongs to their prefill, as mlx-lm's separate first forward
    would); ``prefill_tokens``: prompt tokens forwarded for joining rows;
    ``joined``: rows that entered the decode batch (their first token comes
    with this step where read first, else with the next);
    ``checkpoints``: rows at a checkpoint boundary this step (``checkpoint_every``);
    ``since_clear``: steps run since MLX's buffer cache was last emptied by
    this generation, this one included; ``cleared``: this step emptied it at
    its end, ``cleared_bytes`` / ``clear_s`` what that freed and took.
    """

    tokens: tuple[RowToken, ...] = ()
    exits: tuple[RowExit, ...] = ()
    snapshots: tuple[RowSnapshot, ...] = ()
    decode_rows: int = 0
    prefill_tokens: int = 0
    joined: tuple[str, ...] = ()
    checkpoints: tuple[RowCheckpoint, ...] = ()
    since_clear: int = 0
    cleared: bool = False
    cleared_bytes: int = 0
    clear_s: float = 0.0


# --- rows ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Capture:
    """A row's checkpoint boundary taken by one step and completed by the next.

    NOTE: the next step emits the pending token, so it is read there, with
    that step's tokens, instead of waiting for its forward at the boundary
    (which would stop the host building the next step while the device
    runs this one). ``cache`` is the extracted copy, its evaluation queued;
    ``key`` the sampler's PRNG key array after the pending draw, unread.
    """

    cache: list[Any]
    cache_tokens: tuple[int, ...]
    prompt_len: int
    key: Any


@dataclass(eq=False)
class _Row:
    row_id: str
    uid: int
    prompt: list[int]
    params: SamplingParams
    cached_tokens: int
    cache: list[Any] | None
    sampler: Any
    processors: list[Any]
    stop_ids: frozenset[int]
    text: TextStream
    snapshot_at: int | None
    cursor: int
    prefill: Any = None
    """The row's batch-of-one ``PromptProcessingBatch`` while its suffix is forwarded."""
    generated: list[int] = field(default_factory=list)
    checkpoint_every: int = 0
    """Hand back a :class:`RowCheckpoint` after every this many emitted tokens (0: never)."""
    replay: deque[tuple[int, str]] | None = None
    """A resumed row's saved tokens (with their text) still to hand back."""
    pending_token: int = 0
    """A resumed row's pending token (its first input once it decodes)."""


class BatchGeneration:
    """The rows of one batch and their shared forward passes (engine thread only).

    ``max_rows`` bounds the rows held (pending and decoding);
    ``prefill_step_size`` is both a joining row's chunk size (the serial
    lane's) and, unless ``prefill_budget`` is given, the most prompt tokens
    one :meth:`step` forwards while rows decode (a row's first chunk of the
    step always goes, so a budget below the chunk size means one joining
    chunk per step).
    ``kv_scheme``: the server's KV scheme; when it quantizes, the
    full-attention layers it converts are transitioning rows
    (:class:`TransitioningBatchKVCache`) that convert where the serial lane's
    ``convert_caches`` would, rows may join with a prefix already in the
    scheme's ``QuantizedKVCache``, and converted rows leave as one.
    ``tuning``: called around every step (``kernels.engine._blas_threads``:
    the BLAS thread count of the decode steps, chosen by measuring them);
    told each step's decoding rows and whether it only decoded, and released
    when the batch goes idle. ``reuse_slots``: a leaving row's slot waits
    for the next joining row (``GreedyGenerationBatch``); ``None`` reads
    ``KVTIER_BATCH_SLOT_REUSE`` (on unless an off word).
    ``first_token_first``: the turn that hands out rows' first tokens
    prefills nothing; ``None`` reads ``KVTIER_BATCH_FIRST_TOKEN_FIRST`` (on
    unless an off word). ``prefill_bucket``: a warm row's (or warm group's)
    prefill forward is rounded up to a multiple of this many tokens by
    re-forwarding the last tokens of its lent prefix, so a served lane's
    prefill shapes repeat (0: off; ``None`` reads
    ``KVTIER_BATCH_PREFILL_BUCKET``: default 32 on CUDA, else 0). ``read_first``: each decode
    step computes its own tokens before it builds the next forward
    (``GreedyGenerationBatch.read_first``); ``None``: on where ``async_eval``
    blocks (the CPU) unless ``KVTIER_READ_FIRST`` says off
    (``kernels.read_first_setting``). Call :meth:`close` when done.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_rows: int = 8,
        prefill_step_size: int = 2048,
        prefill_budget: int | None = None,
        kv_scheme: KvScheme | None = None,
        tuning: StepTuning | None = None,
        reuse_slots: bool | None = None,
        align_suffixes: bool | None = None,
        first_token_first: bool | None = None,
        prefill_bucket: int | None = None,
        clear_every: int | None = None,
        reserve_room: bool | None = None,
        read_first: bool | None = None,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        if prefill_budget is not None and prefill_budget < 1:
            raise ValueError(f"prefill_budget must be >= 1, got {prefill_budget}")
        self._model = model
        self._tokenizer = tokenizer
        self._max_rows = max_rows
        self._step_size = prefill_step_size
        self._budget = prefill_step_size if prefill_budget is None else prefill_budget
        self._scheme = kv_scheme if kv_scheme is not None and kv_scheme.quantized else None
        self._tuning = tuning
        self._reuse_slots = env_switch(SLOT_REUSE_ENV) if reuse_slots is None else reuse_slots
        self._align = env_switch(ALIGN_SUFFIXES_ENV) if align_suffixes is None else align_suffixes
        self._first_token_first = (
            env_switch(FIRST_TOKEN_FIRST_ENV) if first_token_first is None else first_token_first
        )
        self._bucket = prefill_bucket_setting() if prefill_bucket is None else prefill_bucket
        if self._bucket < 0:
            raise ValueError(f"prefill_bucket must be >= 0, got {self._bucket}")
        self._clear_every = clear_every_setting() if clear_every is None else clear_every
        if self._clear_every < 0:
            raise ValueError(f"clear_every must be >= 0, got {self._clear_every}")
        self._reserve = env_switch(RESERVE_ENV) if reserve_room is None else reserve_room
        self._read_first = read_first_setting() if read_first is None else read_first
        self._owes_first = False
        """Whether rows entered the decode batch last turn (this turn's decode hands out their first tokens)."""
        self._eos = frozenset(int(t) for t in (getattr(tokenizer, "eos_token_ids", ()) or ()))
        self._rows: dict[str, _Row] = {}
        self._by_uid: dict[int, _Row] = {}
        self._pending: deque[_Row] = deque()
        self._replaying: list[_Row] = []
        """Resumed rows handing back their saved tokens (they decode once done)."""
        self._captures: dict[int, _Capture] = {}
        """Checkpoint boundaries of the last step, by row uid, completed by the next step."""
        self._batch: Any = None
        """mlx-lm's ``GenerationBatch`` of the decoding rows, ``None`` while none decode."""
        self._next_uid = 0
        self._left_violated: list[tuple[str, str]] = []
        """Rows that left in the current step with a failed grammar (grammar_violations)."""
        self._steps = 0
        self._recurrent: bool | None = None
        """Whether the model holds recurrent state (decided on the first prefill)."""
        self._cut: bool | None = None
        """Whether a snapshot is cut from a chunk that ran past its point (decided on first use)."""

    # -- state ---------------------------------------------------------------

    @property
    def read_first(self) -> bool:
        """Whether a decode step computes its own tokens before it builds the next forward.

        Where it does, a leaving row's cache is cut from the layers before
        that build while the built forward is held untouched: it holds the
        row's prompt and answer but the answer's last token, whose forward
        the leave does not wait for (``GreedyGenerationBatch._extract_before_build``).
        """
        return self._read_first

    @property
    def max_rows(self) -> int:
        """The most rows this batch holds."""
        return self._max_rows

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._rows

    @property
    def row_ids(self) -> tuple[str, ...]:
        """Every row held, pending first (in join order), then decoding rows."""
        return self.pending + self.decoding

    @property
    def pending(self) -> tuple[str, ...]:
        """Rows still forwarding their prompt (or replaying a checkpoint), in join order."""
        return tuple(r.row_id for r in self._pending) + tuple(r.row_id for r in self._replaying)

    @property
    def decoding(self) -> tuple[str, ...]:
        """Rows in the decode batch, in batch order."""
        if self._batch is None:
            return ()
        # NOTE: a vacant slot (a hole, uid < 0) is no row.
        return tuple(self._by_uid[uid].row_id for uid in self._batch.uids if uid >= 0)

    @property
    def idle(self) -> bool:
        """True when no row is held (nothing for :meth:`step` to do)."""
        return not self._rows

    def grammar_violations(self) -> list[tuple[str, str]]:
        """Rows whose grammar failed in the last step, with why: (row id, detail).

        NOTE: such a row's token of that step was sampled from unmasked logits:
        its owner drops the token and removes the row alone (:meth:`cancel`),
        as the serial lane fails the request at the same point.
        """
        return [*self._left_violated,
                *(v for row in self._rows.values() for v in _grammar_violations(row))]

    def reused(self, row_id: str) -> int:
        """Prompt tokens of the row whose lent KV it reuses (fewer than it joined with where a
        group aligned its suffixes: ``_align_suffixes``)."""
        return self._row(row_id).cached_tokens

    def _row(self, row_id: str) -> _Row:
        try:
            return self._rows[row_id]
        except KeyError:
            raise UnknownRow(row_id) from None

    # -- join / cancel -------------------------------------------------------

    def join(
        self,
        row_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        cache: list[Any] | None = None,
        cached_tokens: int = 0,
        snapshot_at: int | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        """Add a row; it starts forwarding its uncached suffix at the next :meth:`step`.

        ``cache`` holds the KV of ``prompt[:cached_tokens]`` (lent by the
        prompt cache; it is copied into the batch, never written). An empty
        list or ``None`` means a cold row. ``snapshot_at`` asks for a
        :class:`RowSnapshot` of the cache holding ``prompt[:snapshot_at]``
        (the prompt's stable boundary; at most ``len(prompt) - 1``): cut
        from the chunk that reaches it where every layer can be cut back
        (plain KV, no converting scheme), else the row's prefill chunks end
        exactly there (the serial lane's rule). Ignored unless it lies past
        ``cached_tokens`` (nothing new to keep otherwise). ``checkpoint_every``
        N > 0: a :class:`RowCheckpoint` after every N-th emitted token.
        """
        row = self._new_row(row_id, prompt, params, cache, cached_tokens, checkpoint_every)
        if snapshot_at is not None and not 0 < snapshot_at < len(prompt):
            raise InvalidPrompt(
                f"snapshot_at={snapshot_at} must lie inside the prompt, before its last token"
            )
        row.snapshot_at = (
            snapshot_at if snapshot_at is not None and snapshot_at > cached_tokens else None
        )
        self._add(row)
        self._pending.append(row)

    def join_resumed(
        self,
        row_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        cache: list[Any],
        point: CheckpointPoint,
        checkpoint_every: int = 0,
    ) -> None:
        """Add a row resumed from a checkpoint: no forward; it replays, then decodes from the pending token.

        ``cache`` (a restored checkpoint's, the serial lane's kinds) holds
        ``prompt + point.generated``. The row hands back the saved tokens
        (at most :data:`REPLAY_PER_STEP` a step, with the text its stream
        releases), then enters the decode batch with ``point.pending_token``
        as its next input and its sampler's PRNG key set to
        ``point.rng_key``: it continues exactly where the checkpoint was
        taken. Raises :class:`InvalidPrompt` when the pieces do not fit
        (nothing is added; a cold :meth:`join` is the caller's fallback).
        """
        if not cache:
            raise InvalidPrompt("a resumed row needs the checkpoint's cache")
        if point.prompt_len != len(prompt):
            raise InvalidPrompt("the checkpoint was taken for a prompt of another length")
        if not point.generated or len(point.generated) + 1 >= params.max_tokens:
            raise InvalidPrompt("the checkpoint's pending token would be past max_tokens")
        if params.logprobs:
            raise InvalidPrompt("requests with logprobs are not resumed")
        # NOTE: checked as a row whose cache holds prompt + generated and whose
        # one token left to forward is the pending one (what it is).
        covered = [*prompt, *point.generated]
        row = self._new_row(row_id, [*covered, int(point.pending_token)], params, cache,
                            len(covered), checkpoint_every)
        set_sampler_key(row.sampler, point.rng_key)
        replay: deque[tuple[int, str]] = deque()
        for token in point.generated:
            text = row.text.add(int(token))
            # NOTE: the saved tokens did not end the original answer (it went on
            # to sample the pending token), so none of them may end it here.
            if int(token) in row.stop_ids or row.text.finished:
                raise InvalidPrompt("a saved checkpoint token ends the answer: not a checkpoint")
            replay.append((int(token), text))
        row.prompt = [int(t) for t in prompt]
        row.cached_tokens = len(row.prompt)
        row.cursor = len(row.prompt)
        row.replay = replay
        row.pending_token = int(point.pending_token)
        self._add(row)
        self._replaying.append(row)

    def _new_row(
        self,
        row_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        cache: list[Any] | None,
        cached_tokens: int,
        checkpoint_every: int,
    ) -> _Row:
        """A row checked against the batch's limits and its cache (not added yet)."""
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if row_id in self._rows:
            raise InvalidPrompt(f"row {row_id!r} is already in the batch")
        if len(self._rows) >= self._max_rows:
            raise BatchFull(f"the batch holds {self._max_rows} rows")
        if len(prompt) == 0:
            raise InvalidPrompt("the prompt has no tokens")
        unsupported = batch_params_refusal(params)
        if unsupported is not None:
            raise InvalidPrompt(f"a batch row cannot serve {unsupported}: use the serial lane")
        if not cache:
            if cached_tokens != 0:
                raise InvalidPrompt("cached_tokens > 0 needs the cache that holds them")
            cache = None
        if not 0 <= cached_tokens < len(prompt):
            raise InvalidPrompt(
                f"cached_tokens={cached_tokens} must leave at least one of the "
                f"{len(prompt)} prompt tokens to forward"
            )
        if cache is not None:
            gate = batch_gate(cache, self._scheme, batch_ssm=True)
            if not gate.batchable:
                raise InvalidPrompt(f"the row's cache cannot join a batch: {gate.detail}")
            _check_cache_offset(cache, cached_tokens)
        special = self._eos | frozenset(params.stop_token_ids)
        # NOTE: ignore_eos only stops EOS from ending the row; XTC still spares it.
        stop_ids = (
            frozenset(params.stop_token_ids) if params.ignore_eos else special
        )
        row = _Row(
            row_id=row_id,
            uid=-1,
            prompt=[int(t) for t in prompt],
            params=params,
            cached_tokens=cached_tokens,
            cache=cache,
            sampler=_row_sampler(params, special),
            # NOTE: a grammar's violation is recorded, not raised: raised inside
            # the batch's step it would fail every row (grammar_violations).
            processors=make_request_processors(params, tokenizer=self._tokenizer,
                                               contain_grammar=True),
            stop_ids=stop_ids,
            text=TextStream(self._tokenizer.detokenizer, params.stop),
            snapshot_at=None,
            cursor=cached_tokens,
            checkpoint_every=checkpoint_every,
        )
        return row

    def _add(self, row: _Row) -> None:
        row.uid = self._next_uid
        self._next_uid += 1
        self._rows[row.row_id] = row
        self._by_uid[row.uid] = row

    def cancel(self, row_id: str) -> RowExit:
        """Remove a row now; its cache is extracted before its slot is vacated (or the batch filtered)."""
        row = self._row(row_id)
        with mx.stream(generation_stream()):
            if row in self._replaying:
                self._replaying.remove(row)
                cache = row.cache if row.cache is not None else []
                saved = [t for t, _ in row.replay or ()]
                tokens = [*row.prompt, *row.generated, *saved]
            elif row in self._pending:
                self._pending.remove(row)
                if row.prefill is not None:
                    cache = row.prefill.extract_cache(0)
                    tokens = list(row.prefill.tokens[0])
                else:
                    cache = row.cache if row.cache is not None else []
                    tokens = row.prompt[: row.cached_tokens]
                row.prefill = None
            else:
                cache, tokens = self._remove_decoding(row)
        return self._leave(row, "cancelled", cache, tokens)

    def close(self) -> None:
        """Drop every row and array reference (engine thread); the tuning gives its threads back."""
        if self._tuning is not None:
            self._tuning.release()
        self._rows.clear()
        self._by_uid.clear()
        self._pending.clear()
        self._replaying.clear()
        self._captures.clear()
        self._batch = None

    # -- the step ------------------------------------------------------------

    def step(self) -> BatchStep:
        """One engine turn: prefill within the budget, then one token for every decoding row."""
        self._left_violated.clear()
        tuning = self._tuning
        first_token_turn = self._owes_first and self._first_token_first and self._batch is not None
        prefill_turn = bool(self._pending) and not first_token_turn
        if tuning is not None:
            if prefill_turn:
                # NOTE: a turn that prefills runs at the process's default count,
                # the serial lane's: the tuned count is chosen on decode steps
                # (where the few-row product, not BLAS, takes the projections
                # on the CPU), and one thread made a prefill's many-row products
                # take one core of two (CPU 4 / 8 clients by wall clock 1.32 /
                # 1.16 x mlx_lm.server tuned, 1.53 / 1.27 untuned,
                # docs/benchmarks.md). It also gives a row's prefill the serial
                # lane's products, bit for bit (_blas_threads' NOTE).
                tuning.release()
            else:
                tuning.before_step()
        with mx.stream(generation_stream()):
            # NOTE: prefill first: rows it completes enter the decode batch with
            # their last prompt token queued, and this turn's decode forward
            # takes it with every other row (one forward, not two); their
            # first token is emitted by the next turn, as before.
            if first_token_turn:
                # NOTE: first token first: this turn's decode hands out the
                # first tokens of the rows that entered last turn; a prefill
                # here would hold them back by a whole chunk. Pending rows
                # wait one decode step instead (the next turn owes nothing).
                snapshots: list[RowSnapshot] = []
                joined: list[str] = []
                prefilled = 0
            else:
                snapshots, prefilled, joined = self._prefill()
            tokens, exits, decode_rows, checkpoints = self._decode()
            if joined:
                entered = set(joined)
                decode_rows -= sum(1 for t in tokens if t.index == 0 and t.row_id in entered)
            # NOTE: not every join owes: a read-first step hands out entering
            # rows' first tokens in the turn they enter (GreedyGenerationBatch.next).
            self._owes_first = self._batch is not None and self._batch.owes_first
            tokens.extend(self._replay())
        if tuning is not None:
            # NOTE: only steps that decoded the same rows and nothing else
            # compare thread counts (a prefill or a row leaving costs more).
            clean = not exits and not joined and prefilled == 0 and not prefill_turn
            tuning.after_step(decode_rows, clean)
            if not self._rows:
                tuning.release()
        self._steps += 1
        every, cleared_bytes, clear_s = self._clear_every, 0, 0.0
        # NOTE: the emptyings fall on the multiples of ``every``: the last one
        # before this step was at the multiple below it (0: the lane's start).
        since_clear = self._steps - ((self._steps - 1) // every * every if every else 0)
        cleared = bool(every) and self._steps % every == 0
        if cleared:
            # NOTE: timed and reported: on MLX's CUDA backend every cached
            # buffer is a managed allocation, freed one by one here, and the
            # steps after allocate (and first touch) their buffers afresh.
            cleared_bytes = int(mx.get_cache_memory())
            began = time.perf_counter()
            mx.clear_cache()
            clear_s = time.perf_counter() - began
        return BatchStep(
            tokens=tuple(tokens),
            exits=tuple(exits),
            snapshots=tuple(snapshots),
            decode_rows=decode_rows,
            prefill_tokens=prefilled,
            joined=tuple(joined),
            checkpoints=tuple(checkpoints),
            since_clear=since_clear,
            cleared=cleared,
            cleared_bytes=cleared_bytes,
            clear_s=clear_s,
        )

    def _decode(self) -> tuple[list[RowToken], list[RowExit], int, list[RowCheckpoint]]:
        if self._batch is None:
            self._captures.clear()  # NOTE: their rows left; nothing completes them.
            return [], [], 0, []
        # NOTE: mlx-lm extracts every row it finishes (EOS / stop id / length)
        # before it filters the batch; stop strings are ours and leave below.
        responses = self._batch.next()
        # NOTE: the rows that handed out a token (counted after the step: a
        # read-first step hands out the first tokens of rows entering in it).
        decode_rows = len(responses)
        tokens: list[RowToken] = []
        exits: list[RowExit] = []
        stopped_by_text: list[_Row] = []
        due: list[_Row] = []
        captures, self._captures = self._captures, {}
        checkpoints: list[RowCheckpoint] = []
        for response in responses:
            row = self._by_uid[response.uid]
            token = int(response.token)
            index = len(row.generated)
            row.generated.append(token)
            logprob = float(response.logprobs[token].item()) if row.params.logprobs else None
            k = row.params.top_logprobs
            top = top_logprobs(response.logprobs, k) if k else ()
            finish: KernelFinishReason | None = None
            if token in row.stop_ids:
                finish = "stop"
                text = row.text.finish()
            else:
                text = row.text.add(token)
                if row.text.finished:
                    finish = "stop"
                elif response.finish_reason is not None:
                    finish = "length"
                    text += row.text.finish()
            tokens.append(RowToken(row.row_id, index, StepOutput(token, text, finish, logprob, top)))
            capture = captures.pop(response.uid, None)
            if capture is not None and finish is None:
                # NOTE: this token is the boundary's pending one. A row this
                # token ends keeps no checkpoint: its completion removes them.
                checkpoints.append(_completed(row, capture, token))
            if response.finish_reason is not None:
                assert finish is not None, "mlx-lm finished a row kvtier did not"
                exits.append(self._leave(row, finish, response.prompt_cache, response.all_tokens))
            elif finish is not None:
                stopped_by_text.append(row)
            elif row.checkpoint_every and len(row.generated) % row.checkpoint_every == 0 \
                    and len(row.generated) + 1 < row.params.max_tokens:
                # NOTE: not when the pending token is the last one max_tokens
                # allows: such a checkpoint would replay all but nothing.
                due.append(row)
        for row in stopped_by_text:
            cache, cache_tokens = self._remove_decoding(row)
            exits.append(self._leave(row, "stop", cache, cache_tokens))
        if self._batch is not None and len(self._batch) == 0:
            self._batch = None
        # NOTE: after the removals, so each row's batch index is final; a
        # capture whose row left (stopped, cancelled) is dropped with ``captures``.
        for row in due:
            self._captures[row.uid] = self._capture(row)
        return tokens, exits, decode_rows, checkpoints

    def _capture(self, row: _Row) -> _Capture:
        """The row's state at this boundary: its cache covers prompt + emitted, its next token is queued.

        NOTE: the extraction copies the row out of the batch's buffers; its
        evaluation is queued here, behind the forward that writes the last
        emitted token's KV and ahead of the next step's writes, so the
        batch's next in-place write neither changes it nor has to copy its
        buffers away from it. Nothing here waits for the device: the
        pending token and the key are read by the next step (:class:`_Capture`).
        """
        batch = self._batch
        assert batch is not None
        index = batch.uids.index(row.uid)
        cache = batch.extract_cache(index)
        tokens = tuple(int(t) for t in batch.tokens[index])
        mx.async_eval(*cache_arrays(cache))  # type: ignore[no-untyped-call]
        return _Capture(cache, tokens, len(row.prompt), sampler_key_array(row.sampler))

    def _replay(self) -> list[RowToken]:
        """Resumed rows hand back saved tokens; a row done replaying enters the decode batch."""
        tokens: list[RowToken] = []
        done: list[_Row] = []
        for row in self._replaying:
            replay = row.replay
            assert replay is not None
            for _ in range(min(REPLAY_PER_STEP, len(replay))):
                token, text = replay.popleft()
                index = len(row.generated)
                row.generated.append(token)
                tokens.append(RowToken(row.row_id, index, StepOutput(token, text)))
            if not replay:
                done.append(row)
        for row in done:
            self._replaying.remove(row)
            self._enter_resumed(row)
        return tokens

    def _enter_resumed(self, row: _Row) -> None:
        """Move a resumed row into the decode batch without a forward: its pending token is its next input.

        NOTE: the state a joined row reaches after its priming step (its last
        prompt token forwarded, its first token sampled), built from the
        checkpoint instead: caches and token history cover prompt + emitted,
        the pending token is queued, ``max_tokens`` counts the emitted ones.
        """
        assert row.cache is not None
        history = [*row.prompt, *row.generated]
        stops = StopSequences([(t,) for t in sorted(row.stop_ids)] or None)
        ready = waiting_generation(
            self._model,
            [row.uid],
            [row.pending_token],
            self._merge([row.cache]),
            [history],
            [row.sampler],
            row.sampler,
            [row.processors],
            [stops],
            [row.params.max_tokens],
            num_tokens=[len(row.generated)],
            priming=False,
            reuse_slots=self._reuse_slots,
            read_first=self._read_first,
        )
        row.cache = None
        row.replay = None
        if self._batch is None:
            self._batch = ready
        else:
            self._batch.absorb(ready)

    def _prefill(self) -> tuple[list[RowSnapshot], int, list[str]]:
        snapshots: list[RowSnapshot] = []
        prefilled: list[_Row] = []
        used = 0
        # NOTE: the one-chunk budget protects decoding rows' inter-token time;
        # with none decoding, a wider turn costs nobody latency and saves the
        # partial decode steps a trickle of joins would run (H200, 8B shape,
        # 32 rows of 512 tokens: 8 turns of 4 rows became one forward).
        limit = self._budget if self._batch is not None else self._step_size * IDLE_PREFILL_ROWS
        while self._pending:
            group = self._group(limit - used)
            if len(group) > 1:
                used += self._prefill_group(group, snapshots)
                for row in group:
                    self._pending.popleft()
                    prefilled.append(row)
                continue
            row = self._pending[0]
            if row.prefill is None:
                if self._bucket > 1:
                    # NOTE: a lone warm row's forward rounded up like a group's
                    # (_align_suffixes with one row: only the bucket moves it).
                    _align_suffixes([row], cut=self._cuts(), bucket=self._bucket)
                row.prefill = self._start_prefill([row])
            # NOTE: every chunk is the serial lane's chunk (prefill_step_size from
            # the row's cached offset), so a row's prefill arithmetic does not
            # depend on who else joins; the turn's budget only decides when.
            while len(row.prompt) - row.cursor > 1:
                n = self._chunk(row)
                if used > 0 and used + n > limit:
                    break
                row.prefill.prompt([row.prompt[row.cursor : row.cursor + n]])
                row.cursor += n
                used += n
                if self._reserve:
                    # NOTE: a cold row's first chunk made its buffers; the rest grows them once.
                    reserve(row.prefill.prompt_cache, len(row.prompt) - row.cursor - 1)
                if _reached(row, n):
                    snapshots.append(self._snapshot(row, 0))
            if len(row.prompt) - row.cursor > 1:
                break  # NOTE: the turn's prefill budget is spent.
            self._pending.popleft()
            prefilled.append(row)
        if prefilled:
            self._enter_decode(prefilled)
        return snapshots, used, [row.row_id for row in prefilled]

    def _chunk(self, row: _Row) -> int:
        """The row's next prefill chunk: at most a step, never past its last token, nor past its
        snapshot point unless the snapshot is cut (:meth:`_cuts`)."""
        n = min(self._step_size, len(row.prompt) - row.cursor - 1)
        point = row.snapshot_at
        if point is not None and point > row.cursor and not self._cuts():
            n = min(n, point - row.cursor)
        return n

    def _cuts(self) -> bool:
        """Whether snapshots are cut from chunks that ran past their point (the serial lane's rule)."""
        if self._cut is None:
            self._cut = self._scheme is None and snapshot_cuttable(make_prompt_cache(self._model))
        return self._cut

    def _snapshot(self, row: _Row, index: int) -> RowSnapshot:
        cache = row.prefill.extract_cache(index)
        tokens = tuple(row.prefill.tokens[index])
        point = row.snapshot_at
        assert point is not None
        assert len(tokens) >= point
        if len(tokens) > point:
            # NOTE: the chunk ran past the point (_cuts): the extracted copy is
            # the row's own, so cutting it back touches nothing else.
            trim_caches(cache, len(tokens) - point)
            tokens = tokens[:point]
        return RowSnapshot(row.row_id, cache, tokens)

    def _group(self, budget: int) -> list[_Row]:
        """Pending rows not started yet whose whole prefill fits ``budget`` together (attention-only models)."""
        if self._recurrent is None:
            self._recurrent = batch_gate(make_prompt_cache(self._model), batch_ssm=True).recurrent
        if self._recurrent:
            # NOTE: recurrent state has no mask: a padded prefill would run pad
            # tokens through it, so such rows always prefill alone.
            return []
        group: list[_Row] = []
        total = 0
        for row in self._pending:
            need = len(row.prompt) - row.cursor - 1
            if row.prefill is not None or total + need > budget:
                break
            if self._scheme is not None and (
                need == 0 or (group and self._precision(row) != self._precision(group[0]))
            ):
                # NOTE: a plain row beside converted ones would make their forward
                # a mixed (dense) read instead of the serial lane's quantized one;
                # a row with nothing to prefill stays plain until it decodes.
                break
            group.append(row)
            total += need
        return group

    def _prefill_group(self, group: list[_Row], snapshots: list[RowSnapshot]) -> int:
        """Forward the whole uncached prefill of ``group`` in shared, right-padded forwards."""
        # NOTE: mlx-lm's padded prefill (right padding, masked, rolled to left
        # padding afterwards): one forward per chunk for all rows instead of one
        # per row. Chunks still end at each row's snapshot point; a row with
        # nothing left in a round gets an empty chunk (all padding). Rows whose
        # suffixes differ in length are aligned first where their caches allow
        # it (_align_suffixes), so no chunk is padded and nothing is rolled.
        if self._align:
            _align_suffixes(group, cut=self._cuts(), bucket=self._bucket)
        batch = self._start_prefill(group)
        for row in group:
            row.prefill = batch
        used = 0
        while any(len(row.prompt) - row.cursor > 1 for row in group):
            chunks: list[list[int]] = []
            for row in group:
                n = self._chunk(row) if len(row.prompt) - row.cursor > 1 else 0
                chunks.append(row.prompt[row.cursor : row.cursor + n])
                row.cursor += n
                used += n
            batch.prompt(chunks)
            if self._reserve:
                # NOTE: a cold group's first chunk made its buffers; the rest grows them once.
                reserve(batch.prompt_cache, max(len(row.prompt) - row.cursor - 1 for row in group))
            for index, row in enumerate(group):
                if chunks[index] and _reached(row, len(chunks[index])):
                    snapshots.append(self._snapshot(row, index))
        return used

    def _enter_decode(self, rows: list[_Row]) -> None:
        """Move rows whose prompt but its last token is cached into the decode batch, together.

        Under a quantizing scheme, rows whose prefill left every transitioning
        layer converted enter apart from the others, so neither reads a mixed view.
        """
        if self._scheme is None:
            self._enter_decode_together(rows)
            return
        # NOTE: these rows forward their last prompt token at once, apart from
        # the decode batch (mlx-lm's order): priming them inside it would make
        # that forward read converted and plain rows together.
        done = [row for row in rows if _all_converted(row.prefill.prompt_cache)]
        rest = [row for row in rows if not _all_converted(row.prefill.prompt_cache)]
        for part in (done, rest):
            if part:
                self._enter_decode_together(part, forward_now=True)

    def _enter_decode_together(self, rows: list[_Row], *, forward_now: bool = False) -> None:
        # NOTE: one forward of every such row's last prompt token (a batch of
        # len(rows)) instead of one forward each: on a memory-bound CPU every
        # forward reads all the weights once. Rows prefilled as a group share
        # one prefill batch; the others are joined to it.
        merged = rows[0].prefill
        seen = {id(merged)}
        for row in rows[1:]:
            if id(row.prefill) not in seen:
                seen.add(id(row.prefill))
                merged.extend(row.prefill)
        # NOTE: the last prompt tokens are queued, not forwarded: the next
        # decode step forwards them with every other row (enter_generation).
        # NOTE: from here on the cache is the decode batch's, which pads rows.
        plain_masks(merged.prompt_cache)
        order = {uid: i for i, uid in enumerate(merged.uids)}
        last: list[int] = [0] * len(order)
        for row in rows:
            last[order[row.uid]] = row.prompt[-1]
        # NOTE: kvtier's decode batch (whose all-greedy steps skip the
        # log-softmax nobody reads: _greedy.py).
        ready = enter_generation(
            merged,
            last,
            forward_now=forward_now,
            reuse_slots=self._reuse_slots,
            read_first=self._read_first,
        )
        for row in rows:
            row.prefill = None
            row.cache = None
            row.cursor = len(row.prompt)
        if self._batch is None:
            self._batch = ready
        else:
            # NOTE: read first, the running rows' next forward is built but not
            # started: taken back, so the entering rows share it and hand out
            # their first tokens in this turn (GreedyGenerationBatch.retract).
            if not forward_now:
                self._batch.retract()
            # NOTE: into the slots of rows that left where they fit (no
            # whole-batch copy), the rest appended (GreedyGenerationBatch).
            self._batch.absorb(ready)

    def _precision(self, row: _Row) -> tuple[int, ...]:
        """The layers in which the row's lent prefix is already quantized (``()``: none, or no prefix)."""
        if row.cache is None:
            return ()
        return tuple(i for i, c in enumerate(row.cache) if type(c) is QuantizedKVCache)

    def _merge(self, caches: list[list[Any]], room: int = 0) -> list[Any]:
        """One batch cache per layer from the rows' caches (mlx-lm's merge, or transitioning layers).

        ``room``: tokens the plain layers' buffers hold past the longest row
        (:func:`merge_with_room`), so the prefill after the merge does not
        copy them again to grow.
        """
        merged: list[Any] = []
        for i in range(len(caches[0])):
            layer = [c[i] for c in caches]
            quant = self._scheme.layer_quant(i) if self._scheme is not None else None
            if quant is not None and all(type(c) in (KVCache, QuantizedKVCache) for c in layer):
                start = self._scheme.start if self._scheme is not None else 0
                merged.append(TransitioningBatchKVCache.merge(layer, quant, start))
            else:
                # NOTE: the first layer's own merge (mlx-lm's) where there is
                # no room to make or a layer is not a plain KVCache.
                merged.append(merge_with_room(layer, room))
        return merged

    def _start_prefill(self, rows: list[_Row]) -> Any:
        caches = [
            row.cache if row.cache is not None else make_prompt_cache(self._model) for row in rows
        ]
        # NOTE: mlx-lm merges each layer with its first row's class's merge;
        # kvtier merges (the same classes, plus transitioning layers) itself.
        batch = PrefillBatch(
            self._model,
            [row.uid for row in rows],
            [],
            tokens=[row.prompt[: row.cached_tokens] for row in rows],
            prefill_step_size=self._step_size,
            samplers=[row.sampler for row in rows],
            fallback_sampler=rows[0].sampler,
            logits_processors=[row.processors for row in rows],
            stop_sequences=[
                StopSequences([(t,) for t in sorted(row.stop_ids)] or None) for row in rows
            ],
            max_tokens=[row.params.max_tokens for row in rows],
        )
        # NOTE: room for the whole prefill still to come (its last token is
        # forwarded on entering the decode batch, which copies anyway).
        room = max(len(row.prompt) - row.cursor - 1 for row in rows) if self._reserve else 0
        batch.prompt_cache = self._merge(caches, room)
        if len(rows) == 1:
            # NOTE: no padding in a batch of one: the serial lane's causal mask
            # (the fused attention kernel on CUDA; _lone_row).
            lone_row_masks(batch.prompt_cache)
        return batch

    def _remove_decoding(self, row: _Row) -> tuple[list[Any], list[int]]:
        assert self._batch is not None
        index = self._batch.uids.index(row.uid)
        # NOTE: extracted, then its slot left as a hole for the next joining
        # row (or the batch filtered, for layer kinds that cannot hold one).
        cache, tokens = self._batch.vacate(index)
        if len(self._batch) == 0:
            self._batch = None
        return cache, tokens

    def _leave(
        self, row: _Row, reason: RowExitReason, cache: list[Any], tokens: Iterable[int]
    ) -> RowExit:
        del self._rows[row.row_id]
        del self._by_uid[row.uid]
        row.cache = None
        row.prefill = None
        if reason != "cancelled":
            # NOTE: a row whose unmasked token ended it this step (EOS, a stop)
            # still failed its grammar (grammar_violations).
            self._left_violated.extend(_grammar_violations(row))
        return RowExit(
            row_id=row.row_id,
            reason=reason,
            cache=cache,
            cache_tokens=tuple(int(t) for t in tokens),
            prompt_tokens=len(row.prompt),
            completion_tokens=len(row.generated),
            cached_tokens=row.cached_tokens,
        )


def _grammar_violations(row: _Row) -> list[tuple[str, str]]:
    """(row id, why) for each of the row's grammar processors that recorded a violation."""
    return [(row.row_id, p.violation) for p in row.processors
            if isinstance(p, GrammarProcessor) and p.violation is not None]


def _reached(row: _Row, n: int) -> bool:
    """Whether the chunk of ``n`` tokens that just moved ``row.cursor`` reached its snapshot point."""
    point = row.snapshot_at
    return point is not None and row.cursor - n < point <= row.cursor


def _align_suffixes(group: list[_Row], *, cut: bool, bucket: int = 0) -> int:
    """Give back the last cached tokens of the group's shorter suffixes, so every row prefills as many.

    NOTE: rows joining together over one cached prefix (an agent's turns)
    have suffixes of different lengths. mlx-lm pads the shorter ones on the
    right and, after the forward, rolls every layer's whole batch cache so
    the padding ends up on the left (``BatchKVCache.finalize``: a gather
    over all of it, per layer, keys and values). Measured in process with 8
    rows of 24-56 tokens over a cached 5,100: the padded group's prefill
    took 282-359 ms on the H200 against 82-89 ms with equal suffixes, and on
    the CPU (4 rows over 1,130) 2.7-2.9 s against 1.7-1.8 s. Instead, a
    shorter row re-forwards the last few tokens of its lent prefix: the
    forward computes exactly what the padding would have (every row
    ``longest`` tokens), its caches merge left-padded as rows of different
    lengths always do, and nothing is rolled. Only rows whose lent caches
    are plain ``KVCache`` layers are shortened (new cache objects over the
    same arrays: the lent ones may be shared; the merge copies
    ``[:offset]``), and only where every row joined warm and no row has a
    snapshot point ahead, unless snapshots are ``cut`` (then no chunk stops
    at one); otherwise the group pads as before. A shortened row's ``cached_tokens``
    is what it really reuses.

    ``bucket`` > 1: the common length is rounded up to a multiple of it
    where every row has that many cached tokens to give back (else it stays
    the longest suffix). NOTE: on MLX's CUDA backend a step whose shapes are
    new cost ~90-110 ms more than a repeated one (H200, 8B shape,
    ``join_cost.py --new-shapes``); rounding makes a served lane's prefill
    shapes repeat. A group's budget was counted before the rounding, so a
    step may forward up to ``bucket - 1`` tokens a row past it. Returns the
    tokens given back (0: unchanged).
    """
    need = [len(row.prompt) - row.cursor - 1 for row in group]
    longest = max(need)
    targets = [longest]
    if bucket > 1 and longest % bucket:
        targets.insert(0, longest + bucket - longest % bucket)
    if not cut and any(row.snapshot_at is not None and row.snapshot_at > row.cursor for row in group):
        return 0
    if any(row.cache is None for row in group):
        return 0  # NOTE: a cold row's prefill dwarfs the roll; warm rows keep their whole reuse.
    for target in targets:
        short = [(row, target - n) for row, n in zip(group, need, strict=True) if n < target]
        if not short:
            return 0
        # NOTE: a row that has not started its prefill has cursor == cached_tokens.
        if all(
            back <= row.cached_tokens and all(type(c) is KVCache for c in row.cache or ())
            for row, back in short
        ):
            for row, back in short:
                row.cache = [_shortened(layer, back) for layer in row.cache or ()]
                row.cursor -= back
                row.cached_tokens -= back
            return sum(back for _, back in short)
    return 0


def _shortened(layer: Any, back: int) -> Any:
    """A new ``KVCache`` over ``layer``'s arrays holding ``back`` tokens fewer (``layer`` is untouched)."""
    out: Any = KVCache()  # type: ignore[no-untyped-call]
    out.keys, out.values, out.offset = layer.keys, layer.values, layer.offset - back
    return out


def _completed(row: _Row, capture: _Capture, pending: int) -> RowCheckpoint:
    """The checkpoint of ``capture``, now that the step after its boundary emitted ``pending``."""
    return RowCheckpoint(
        row_id=row.row_id,
        cache=capture.cache,
        cache_tokens=capture.cache_tokens,
        prompt_len=capture.prompt_len,
        pending_token=pending,
        rng_key=None if capture.key is None else key_words(capture.key),
    )


def _row_sampler(params: SamplingParams, stop_ids: frozenset[int]) -> Any:
    """The row's sampler; a greedy row that reads its logprobs gets a sampler of its own identity."""
    sampler = make_request_sampler(params, xtc_special_tokens=sorted(stop_ids))
    # NOTE: a decode step skips the log-softmax only when every sampler is the
    # plain greedy one (greedy_without_logprobs), so this row keeps it.
    if params.greedy and (params.logprobs or params.top_logprobs):
        return argmax_with_logprobs
    return sampler


def _all_converted(caches: Sequence[Any]) -> bool:
    """True when every row of every transitioning layer holds quantized KV (no such layer: True)."""
    return all(all(c.converted) for c in caches if type(c) is TransitioningBatchKVCache)
