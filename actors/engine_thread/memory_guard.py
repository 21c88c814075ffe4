"""The memory-pressure guard: does a request fit the memory budget? (design 5.4)

The RAM tier's byte cap bounds the cache, not the process: a long prompt's
KV, the copy a growing KV buffer makes, and a prefill chunk's activations
come on top of it. So before a request's prefill, and every
:data:`DECODE_CHECK_EVERY` decode tokens, the guard compares

    memory in use + the request's projected footprint  <=  budget

where the memory in use is the process's resident memory (RSS; at least
MLX's active and cached memory and, under CUDA, the device's memory in use
by every process on it, ``actors/engine/memory.py``), and the
footprint is the KV still to come (``KvGeometry.bytes_at`` of the prompt
plus ``max_tokens``, in the KV buffers' 256-token steps), the copy overlap
of the KV it already holds (a growing buffer is concatenated, so the old one
lives until the new one exists) and, before prefill, the prefill workspace;
a request that reports logprobs adds what their entries hold on the host
(:func:`token_logprob_bytes`, :func:`prompt_scoring_bytes`). The budget is
the smaller of usable RAM and the device's memory (Metal's working set, CUDA's total) unless
``EngineConfig.memory_budget_bytes`` names one.

What the process's RSS can reach is the budget plus :func:`stated_margin`:
the footprint counts arrays, and MLX keeps freed buffers in its cache (up to
its limit) on top of them; the rest is host memory a request allocates
outside MLX (HTTP bodies, tokenizer, the detokenizer, Python objects) and
the error of the footprint's estimate, :data:`HOST_SLACK_BYTES`. Little else
grows between two checks of the serial lane: background engine steps run in
idle turns or, under load, in the gateway's bounded share of engine time
(``actors.gateway.core``); such a step clones an entry (zero-copy views) or
reads one tensor back for an SSD write (a view; a copy only of a
non-contiguous tensor), and the next check reads RSS again. docs/operations.md ("Memory-pressure guard") states the
terms that come on top with the batch lane and queued SSD restores.

:func:`decide` is the whole decision, sans-IO: numbers in, a verdict out.
The numbers are read elsewhere: the memory in use ON the engine thread
(:class:`MemoryGauge` holds the latest reading, taken after every engine
job), the geometry once at start. Two places act on the verdict:

- before admission (``Engine``, on the loop): an idle turn first drops
  freed memory (MLX's cache, the C heap's free pages) and reads again; then
  ``Relieve`` persists LRU RAM entries to the SSD tier and drops them
  (``prompt_cache.Demote``, then the spill queue's drain and an idle turn
  that frees the arrays), and decides again; ``Refuse`` raises
  :class:`~actors.errors.MemoryPressure`.
- inside the request's turns (:class:`MemoryGuard`, engine thread, called by
  ``EngineWork``): nothing can be reclaimed inside a turn (writing an entry
  needs engine turns of its own), so an over-budget request fails there with
  ``MemoryPressure`` (after ``settle`` dropped freed memory and a second
  reading agreed); the server goes on serving. A request refused before its
  prefill (``MemoryShortAtStart``: admitted on a reading without the rows
  that started since) has run nothing: the engine API takes it back to
  admission once, where relief can run (``actors/engine/_memory_asks.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from actors.errors import MemoryPressure, MemoryShortAtStart
from kernels.engine import SCORE_ELEMENTS, prompt_logprob_entries
from messages.gateway import Generate

__all__ = [
    "DECODE_CHECK_EVERY",
    "HOST_SLACK_BYTES",
    "KV_STEP",
    "LOGPROB_ALTERNATIVE_BYTES",
    "LOGPROB_TOKEN_BYTES",
    "PROMPT_SCORE_BYTES",
    "Fits",
    "Footprint",
    "MemoryGauge",
    "MemoryGuard",
    "Refuse",
    "Relieve",
    "Verdict",
    "decide",
    "prompt_scoring_bytes",
    "stated_margin",
    "token_logprob_bytes",
]

DECODE_CHECK_EVERY = 256
"""Decode tokens between two checks of a running request."""

KV_STEP = 256
"""mlx-lm's KV buffers grow in steps of this many tokens."""

HOST_SLACK_BYTES = 32 * 1024**2
"""The stated margin's fixed part: host memory a request allocates outside MLX,
and the footprint estimate's error (measured: docs/operations.md)."""

_GIB = 1024**3

PROMPT_SCORE_BYTES = 160
"""Host bytes per reported prompt score (``prompt_logprobs``): the float and id in the
event, their spelling and JSON in the answer (an upper estimate)."""


def prompt_scoring_bytes(prompt_tokens: int, top: int | None) -> int:
    """What scoring a prompt adds (``None``: not scored): one scoring forward's
    logits, their float32 copy and log-softmax (at most ``SCORE_ELEMENTS`` each,
    ``kernels.engine.score_rows``), and the reported scores on the host."""
    if top is None:
        return 0
    return 3 * 4 * SCORE_ELEMENTS + prompt_logprob_entries(prompt_tokens, top) * PROMPT_SCORE_BYTES


LOGPROB_TOKEN_BYTES = 3_000
"""Host bytes per generated token whose logprob is reported (``logprobs``), alternatives aside.

NOTE: the HTTP edge keeps every reported token's entry until the answer ends
(``actors.http.ChatAnswer``, streamed or not) and a non-streamed answer then
dumps them to a dict and to JSON as well. Measured peak of a chat answer
(the default model's tokenizer, 400 tokens): 2,325 bytes per token with no
alternative, 12,300 with 5, 31,151 with 20 (a text completion's legacy
columns: 527 / 2,594 / 8,186); this constant and
:data:`LOGPROB_ALTERNATIVE_BYTES` are an upper estimate of all three."""

LOGPROB_ALTERNATIVE_BYTES = 2_000
"""Host bytes per reported alternative (``top_logprobs``) per generated token (see :data:`LOGPROB_TOKEN_BYTES`)."""


def token_logprob_bytes(tokens: int, logprobs: bool, top: int) -> int:
    """What reporting ``tokens`` generated tokens' logprobs (``top`` alternatives each) holds on the host.

    ``0`` when neither ``logprobs`` nor alternatives are asked for.
    """
    if not logprobs and top <= 0:
        return 0
    return max(tokens, 0) * (LOGPROB_TOKEN_BYTES + max(top, 0) * LOGPROB_ALTERNATIVE_BYTES)


def stated_margin(mlx_cache_limit_bytes: int) -> int:
    """How far the process's RSS may pass the budget: MLX's buffer-cache limit plus :data:`HOST_SLACK_BYTES`."""
    if mlx_cache_limit_bytes < 0:
        raise ValueError("the MLX cache limit must be >= 0")
    return mlx_cache_limit_bytes + HOST_SLACK_BYTES


@dataclass(frozen=True, slots=True)
class Fits:
    """The request fits; ``headroom`` bytes would be left."""

    headroom: int


@dataclass(frozen=True, slots=True)
class Relieve:
    """Over the budget by ``need`` bytes, and RAM entries could give some back: reclaim, then decide again."""

    need: int


@dataclass(frozen=True, slots=True)
class Refuse:
    """Over the budget by ``need`` bytes and nothing can be reclaimed: fail the request."""

    need: int
    active: int
    demand: int
    budget: int

    def message(self) -> str:
        """The client-facing explanation."""
        return (
            f"not enough memory for this request: it needs about {_gb(self.demand)} GiB more "
            f"(KV cache, prefill workspace and reported logprobs) while {_gb(self.active)} "
            "GiB are in use, over "
            f"the memory budget of {_gb(self.budget)} GiB by {_gb(self.need)} GiB, and no "
            "cached entry can be moved out of memory; retry with a shorter prompt or fewer "
            "max_tokens, or later"
        )


Verdict = Fits | Relieve | Refuse


def _gb(n: int) -> str:
    return f"{n / _GIB:.3f}"


def decide(*, active: int, demand: int, budget: int, reclaimable: int) -> Verdict:
    """The guard's decision: fit, reclaim first, or refuse.

    ``active``: the memory in use now (the guard's reading); ``demand``: the request's projected
    footprint on top of it (:meth:`Footprint.at_prefill` / :meth:`Footprint.in_decode`);
    ``reclaimable``: bytes of RAM entries that could be persisted and
    dropped (0 inside a turn).
    """
    if min(active, demand, budget, reclaimable) < 0:
        raise ValueError("memory figures must be >= 0")
    over = active + demand - budget
    if over <= 0:
        return Fits(headroom=-over)
    if reclaimable > 0:
        return Relieve(need=over)
    return Refuse(need=over, active=active, demand=demand, budget=budget)


def _steps(tokens: int) -> int:
    """``tokens`` rounded up to the KV buffers' step."""
    return -(-max(tokens, 0) // KV_STEP) * KV_STEP


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a request adds to memory, from the model's shape (pure arithmetic).

    ``kv_bytes_at(n)``: the KV bytes of ``n`` tokens (``KvGeometry.bytes_at``
    under the engine's KV scheme). The prefill workspace of one chunk of
    ``chunk`` tokens is estimated from the shape: the hidden states of a
    layer (``8 * hidden``: residual, norm, queries, attention output and
    temporaries), the MLP (``3 * intermediate``: gate, up and their
    product) in the model's ``dtype_bytes``, and the attention scores
    (``heads * context`` float32 per token; mlx does not always fuse them
    on the CPU).
    """

    kv_bytes_at: Callable[[int], int]
    chunk: int
    hidden: int = 0
    intermediate: int = 0
    heads: int = 0
    dtype_bytes: int = 2

    def workspace(self, tokens: int, context: int) -> int:
        """Activation bytes of a prefill chunk of ``tokens`` tokens attending to ``context`` tokens."""
        per_token = (8 * self.hidden + 3 * self.intermediate) * self.dtype_bytes
        per_token += self.heads * max(context, 1) * 4
        return max(min(tokens, self.chunk), 1) * per_token

    def at_prefill(self, prompt_tokens: int, max_tokens: int) -> int:
        """Before prefill: the whole KV it will hold, the prompt's KV again (copy overlap), one chunk's workspace."""
        final = self.kv_bytes_at(_steps(prompt_tokens + max_tokens))
        overlap = self.kv_bytes_at(_steps(prompt_tokens))
        return final + overlap + self.workspace(prompt_tokens, prompt_tokens)

    def growth(self, tokens_now: int, final_tokens: int) -> int:
        """The KV still to come of a cache holding ``tokens_now`` tokens that may reach ``final_tokens``."""
        now = self.kv_bytes_at(_steps(tokens_now))
        return max(self.kv_bytes_at(_steps(final_tokens)) - now, 0)

    def in_decode(self, tokens_now: int, final_tokens: int) -> int:
        """During decode: the KV still to come, plus a copy of what it holds (the next growth)."""
        return self.growth(tokens_now, final_tokens) + self.kv_bytes_at(_steps(tokens_now))


class MemoryGauge:
    """The latest reading of the memory in use, written ON the engine thread after each job.

    ``read`` is the reading (``actors/engine/memory.py``: RSS, at least
    MLX's active and cached memory). NOTE: one int, replaced whole (atomic
    under the GIL); the loop reads it like the engine thread's other
    statistics. Memory grows only inside engine jobs; memory freed between
    jobs makes the reading high, never low. A job still running has grown
    memory the reading does not show yet: a decision made off the engine
    thread on it alone may be low (``actors.memory.ports.GuardGauges`` reads
    RSS now beside it).
    """

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self._value = 0
        self._lock = threading.Lock()
        self.samples = 0

    def sample(self) -> int:
        """Read now (engine thread only) and keep the reading."""
        value = int(self._read())
        with self._lock:
            self._value = value
            self.samples += 1
        return value

    @property
    def active_bytes(self) -> int:
        """The latest reading (any thread)."""
        with self._lock:
            return self._value


class GrowthLedger:
    """What each lane's running requests may still add to memory, as the lane last published it.

    Thread-safe: the serial and batch lanes' engine halves publish their
    figure after every step (engine thread); a check before a prefill reads
    the sum. Plain numbers, so neither lane holds anything of the other.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_lane: dict[str, int] = {}

    def publish(self, lane: str, growth_bytes: int) -> None:
        """``lane``'s running requests may still add ``growth_bytes`` (replaces its last figure)."""
        with self._lock:
            self._by_lane[lane] = max(int(growth_bytes), 0)

    def total(self) -> int:
        """Every lane's last figure, summed."""
        with self._lock:
            return sum(self._by_lane.values())

    def snapshot(self) -> dict[str, int]:
        """Each lane's last figure."""
        with self._lock:
            return dict(self._by_lane)


@dataclass
class MemoryGuard:
    """The in-turn checks (engine thread): ``EngineWork`` calls them; over budget raises ``MemoryPressure``.

    ``gauge`` reads the memory in use ON the engine thread. ``settle``
    (optional, engine thread) drops freed memory the reading still counts
    (MLX's buffer cache, the C heap's free pages): a check that would refuse
    settles, reads again and decides on that (``settled`` counts those).
    ``refused`` counts the refusals here; ``refused_before_prefill`` those of
    them before a prefill (the request did not fail: a batch row waits, the
    engine API takes the request back to admission). ``margin``: how far RSS may
    pass the budget (:func:`stated_margin`; 0 when not stated).
    ``ahead``: per lane (``"serial"``, ``"batch"``), what its running
    requests may still add (:meth:`growth` summed, published by the lane
    after each step); every check before a prefill counts them all, so a
    request opened on one lane cannot leave a running one on either lane
    short of memory later.
    """

    budget: int
    footprint: Footprint
    gauge: MemoryGauge
    ahead: GrowthLedger = field(default_factory=GrowthLedger)
    refused: int = 0
    checks: int = 0
    settle: Callable[[], object] | None = None
    settled: int = 0
    margin: int = 0
    refused_before_prefill: int = 0

    def before_prefill(self, request: Generate, cached_tokens: int, pending: int = 0,
                       settle: bool = True) -> int:
        """Before the request's first turn opens its generation; the demand it counted.

        ``pending``: the demand of rows admitted in the same step before this
        one, whose prefill has not run yet (so the reading does not show
        them): the batch lane's joins of one step are checked one after the
        other, and each must fit beside the ones before it. The running
        requests' growth still to come (``ahead``) is counted too.
        Over budget
        raises :class:`~actors.errors.MemoryShortAtStart`: nothing of the
        request has run, so it can go back to admission. ``settle`` False:
        decide on the first reading (memory was settled in this step already).

        NOTE: ``cached_tokens`` does not lower the demand: a reused prefix is
        a view of the entry, copied into a new buffer when the cache first grows.
        """
        del cached_tokens
        prompt = len(request.prompt_tokens)
        demand = self.footprint.at_prefill(prompt, request.params.max_tokens)
        demand += prompt_scoring_bytes(prompt, request.params.prompt_logprobs)
        params = request.params
        demand += token_logprob_bytes(params.max_tokens, params.logprobs, params.top_logprobs)
        self._check(demand + max(pending, 0) + self.running_growth(), at_start=True,
                    settle=settle)
        return demand

    def running_growth(self) -> int:
        """What the running requests of every lane may still add to memory (``ahead``)."""
        return self.ahead.total()

    def during_decode(self, request: Generate, tokens_now: int) -> None:
        """Every :data:`DECODE_CHECK_EVERY` decode tokens.

        NOTE: the logprobs of the tokens already produced are in the reading
        (the HTTP edge holds them in this process); those still to come are not.
        """
        params = request.params
        final = len(request.prompt_tokens) + params.max_tokens
        demand = self.footprint.in_decode(tokens_now, final)
        demand += token_logprob_bytes(final - tokens_now, params.logprobs, params.top_logprobs)
        self._check(demand, at_start=False)

    def growth(self, request: Generate, tokens_now: int) -> int:
        """What a running request may still add to memory, holding ``tokens_now`` tokens of KV.

        Its KV still to come (to ``max_tokens``) and the logprobs of the tokens
        still to come: what the reading does not show yet. The batch lane
        checks a join beside the growth of the rows already running, so a row
        admitted now cannot leave a running one short of memory later.
        """
        params = request.params
        final = len(request.prompt_tokens) + params.max_tokens
        return (self.footprint.growth(tokens_now, final)
                + token_logprob_bytes(max(final - tokens_now, 0), params.logprobs,
                                      params.top_logprobs))

    def publish_growth(self, lane: str, running: Iterable[tuple[Generate, int]]) -> None:
        """Publish into ``ahead`` what ``lane``'s running requests (each with the tokens of KV it
        holds) may still add: :meth:`growth` summed."""
        self.ahead.publish(lane, sum(self.growth(request, held) for request, held in running))

    def _check(self, demand: int, *, at_start: bool, settle: bool = True) -> None:
        self.checks += 1
        verdict = decide(active=self.gauge.sample(), demand=demand, budget=self.budget,
                         reclaimable=0)
        if isinstance(verdict, Refuse) and settle and self.settle is not None:
            self.settle()
            self.settled += 1
            verdict = decide(active=self.gauge.sample(), demand=demand, budget=self.budget,
                             reclaimable=0)
        if isinstance(verdict, Refuse):
            self.refused += 1
            if at_start:
                self.refused_before_prefill += 1
                raise MemoryShortAtStart(verdict.message())
            raise MemoryPressure(verdict.message())
