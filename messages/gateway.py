"""Messages of the gateway: admission, streamed generation events, engine turns.

Prompts travel as token ids (rendering and tokenizing happen before
admission), so a gateway trace replays without a tokenizer or a model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ._base import Body, Request
from .prompt_cache import CACHE_SALT_MAX_CHARS, TakeResult, cache_namespace

__all__ = [
    "AdmissionReply",
    "Arriving",
    "AwaitDrained",
    "BackgroundTurnReport",
    "BeginShutdown",
    "CancelGeneration",
    "DoneEvent",
    "Drained",
    "EndRequest",
    "EngineWake",
    "ErrorEvent",
    "FinishReason",
    "GatewayCheckpointsLoaded",
    "GatewayStats",
    "GatewayStatsRequest",
    "Generate",
    "GenerationEvent",
    "GenerationParams",
    "LaneUnblocked",
    "PromptLogprobs",
    "RequestTurnReport",
    "RunTurn",
    "RunWhenIdle",
    "RunnerRetry",
    "RunnerStats",
    "RunnerStatsRequest",
    "ShutdownStarted",
    "StatValue",
    "StopBurst",
    "StopTurns",
    "Timings",
    "TokenEvent",
    "TurnDone",
    "Usage",
]

FinishReason = Literal["stop", "length", "cancelled"]
"""``stop``: EOS or a stop string; ``length``: ``max_tokens``; ``cancelled``: the client left."""


class _Data(BaseModel):
    """A value object nested inside message bodies (frozen, no unknown fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class GenerationParams(_Data):
    """Sampling and stopping parameters of one request (OpenAI / mlx-lm names).

    The one definition: ``kernels.SamplingParams`` is this class, so the
    gateway hands it to the generation kernel unchanged. ``temperature == 0``
    means greedy (argmax); ``top_k == 0``, ``top_p == 1``, ``min_p == 0``,
    ``xtc_probability == 0`` disable those filters; penalties are off when
    ``None`` and each looks at the last ``*_context_size`` tokens of the full
    history (the whole prompt, a reused prefix included, plus the output).
    ``stop`` strings are matched on the detokenized text and never emitted;
    ``stop_token_ids`` end the generation like EOS; ``ignore_eos`` (vLLM's
    field) generates until ``max_tokens``, past the model's EOS tokens
    (``stop`` strings and ``stop_token_ids`` still end it; not with a
    ``grammar``, whose end is an EOS); ``logprobs`` fills
    ``TokenEvent.logprob``; ``top_logprobs`` (0..20) fills
    ``TokenEvent.top_logprobs`` with that many most likely tokens;
    ``prompt_logprobs`` (vLLM's field; ``None``: off) scores the prompt: the
    first ``TokenEvent`` carries every prompt token's logprob and that many
    alternatives (``PromptLogprobs``). ``grammar``
    constrains decoding to a language (an llguidance grammar, made by
    ``kernels.engine.json_schema_grammar`` or ``tool_call_grammar``; ``None``:
    unconstrained).

    ``cache_salt`` (vLLM's field) and ``cache_scope`` choose the prompt-cache
    namespace (``messages.prompt_cache.cache_namespace``): a request reuses
    cached KV only when the prompt prefix and both values match (``None``:
    the shared namespace). The salt is the client's; the scope is set by the
    server (a digest of the API key with ``--cache-namespace api-key``) or by
    an embedder separating its users. Neither changes the output.
    """

    max_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens_to_keep: int = Field(default=1, ge=1)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=0.5)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    repetition_context_size: int = Field(default=20, ge=1)
    presence_penalty: float | None = None
    presence_context_size: int = Field(default=20, ge=1)
    frequency_penalty: float | None = None
    frequency_context_size: int = Field(default=20, ge=1)
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    grammar: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=CACHE_SALT_MAX_CHARS)
    cache_scope: str | None = Field(default=None, min_length=1, max_length=CACHE_SALT_MAX_CHARS)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        return stop

    @model_validator(mode="after")
    def _token_ids_are_ids(self) -> GenerationParams:
        if self.logit_bias is not None and any(k < 0 for k in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids (>= 0)")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        if self.ignore_eos and self.grammar is not None:
            # NOTE: a complete grammar allows only EOS next; past it nothing is allowed.
            raise ValueError("ignore_eos cannot be combined with a grammar (its end is an EOS)")
        return self

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def cache_namespace(self) -> str:
        """The prompt-cache namespace these parameters select (``""``: shared by every client)."""
        return cache_namespace(self.cache_salt, self.cache_scope)


class Usage(_Data):
    """Token accounting of one request; ``cached_tokens`` came from the prompt cache."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens (OpenAI's ``total_tokens``)."""
        return self.prompt_tokens + self.completion_tokens


class Timings(_Data):
    """Where one request's wall time went, in seconds, from the injected clock.

    ``queued_s``: admission to first engine turn (the serial lane) or to the
    step the row joined (the batch lane); ``ttft_s``: admission to the first
    token; ``prefill_s``/``decode_s``: time spent in those engine turns.
    ``admitted_at``: the clock reading at admission (the injected clock, so
    the HTTP edge can place these marks on its own timeline);
    ``lookup_start_s``/``lookup_done_s``: admission to the prompt-cache
    ``Take`` sent and answered (``None``: no lookup was made).
    """

    queued_s: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    admitted_at: float = 0.0
    lookup_start_s: float | None = None
    lookup_done_s: float | None = None


# --- requester -> gateway -------------------------------------------------


class Generate(Request):
    """Admit one request into the serial lane; the reply is an ``AdmissionReply``.

    After an accepted admission the gateway streams ``TokenEvent`` ... then
    exactly one ``DoneEvent`` or ``ErrorEvent`` to ``stream_to`` (a bounded
    inbox id).
    """

    kind: Literal["gateway.generate"] = "gateway.generate"
    request_id: str
    prompt_tokens: tuple[int, ...]
    params: GenerationParams = GenerationParams()
    stream_to: str = ""
    chat: bool = False
    shared_prompt: bool = False
    """Other requests over this prompt follow at once (a request's several choices): like a
    chat prompt, it takes the prompt-boundary snapshot, and rows sharing it wait for that
    snapshot instead of prefilling it again."""
    namespace: str = ""
    """The prompt-cache namespace the request's KV is looked up and stored in."""

    @property
    def snapshots_prompt(self) -> bool:
        """Whether the request takes a prompt-boundary snapshot: chat prompts, and prompts siblings share."""
        return self.chat or self.shared_prompt

    @model_validator(mode="after")
    def _namespace_isolates(self) -> Generate:
        # NOTE: the gateway keys every Take and Put on ``namespace``; a salted
        # request admitted under the shared namespace would leak its prefix.
        if self.params.cache_namespace and not self.namespace.endswith(
            self.params.cache_namespace
        ):
            raise ValueError("namespace must carry params.cache_namespace (cache_salt/cache_scope)")
        return self


class AdmissionReply(Body):
    """Answer to ``Generate``: accepted (with queue position) or the refusal's error code."""

    kind: Literal["gateway.admission"] = "gateway.admission"
    request_id: str
    accepted: bool
    position: int = 0
    error_code: str = ""
    detail: str = ""


class Arriving(Body):
    """A request is being prepared (rendered, tokenized, checked); its ``Generate`` follows.

    A hint, nothing owed: an idle batch lane lets a row that is ready wait a
    moment for it, so requests sent together start in one step instead of
    one step each; one that never comes (refused, or served by the serial
    lane) stops being waited for after the lane's gather window.
    """

    kind: Literal["gateway.arriving"] = "gateway.arriving"
    request_id: str


class CancelGeneration(Body):
    """The requester left: drop the request if queued, stop it after the current step if running."""

    kind: Literal["gateway.cancel"] = "gateway.cancel"
    request_id: str


class BeginShutdown(Request):
    """Stop admission; in-flight and queued requests finish. Reply: ``ShutdownStarted``."""

    kind: Literal["gateway.begin_shutdown"] = "gateway.begin_shutdown"


class ShutdownStarted(Body):
    """Reply to ``BeginShutdown``: how many requests are still to finish."""

    kind: Literal["gateway.shutdown_started"] = "gateway.shutdown_started"
    in_flight: int
    queued: int


# --- gateway -> requester (the stream) -------------------------------------


class PromptLogprobs(_Data):
    """Log-probabilities of the prompt's tokens under the model (``GenerationParams.prompt_logprobs``).

    ``token_ids``: the whole prompt. ``logprobs[i]`` belongs to
    ``token_ids[i + 1]`` (the first token has no context, so none), from the
    model's raw log-softmax at the position before it (no penalties, bias or
    grammar). ``top_ids``/``top_logprobs``: ``top`` alternatives per scored
    token, flattened row after row, most likely first (ties by id). Flat
    tuples keep a long prompt's scores compact and cheap to validate.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: int = Field(default=0, ge=0, le=20)
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    @model_validator(mode="after")
    def _shapes(self) -> PromptLogprobs:
        scored = max(len(self.token_ids) - 1, 0)
        if len(self.logprobs) != scored:
            raise ValueError(f"{scored} prompt tokens are scored, got {len(self.logprobs)} logprobs")
        if len(self.top_ids) != scored * self.top or len(self.top_logprobs) != scored * self.top:
            raise ValueError(f"top_ids and top_logprobs need {scored} x {self.top} entries")
        return self


class TokenEvent(Body):
    """One generated token and the text it completed (``text`` may be empty mid-codepoint)."""

    kind: Literal["gateway.token"] = "gateway.token"
    request_id: str
    index: int = Field(ge=0)
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """``(token_id, logprob)`` of the most likely tokens at this step, most likely first
    (``GenerationParams.top_logprobs`` of them; empty when none were asked)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's scores, on the first token's event when ``GenerationParams.prompt_logprobs`` is set."""


class DoneEvent(Body):
    """The request ended normally; always the last event of an accepted request's stream."""

    kind: Literal["gateway.done"] = "gateway.done"
    request_id: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings = Timings()


class ErrorEvent(Body):
    """The request failed on the engine thread after admission; ends the stream."""

    kind: Literal["gateway.error"] = "gateway.error"
    request_id: str
    error_code: str
    detail: str


GenerationEvent = TokenEvent | DoneEvent
"""What a caller of the public engine API iterates over (errors are raised)."""


# --- background actors <-> gateway (the engine-turn token) ------------------


class RunWhenIdle(Request):
    """Ask for ONE background engine turn, granted only while no request can run.

    ``step_id`` names a step callable the asker registered with the turn
    runner's step registry (``actors.gateway.BackgroundSteps``; tensors and
    callables never travel inside messages). Reply: ``TurnDone``.
    ``deadline`` (clock seconds, the system's injected clock) is when the
    asker stops waiting: a step still waiting then is dropped, never granted
    (``None``: no deadline; a step whose reply slot is gone is dropped too).
    """

    kind: Literal["gateway.run_when_idle"] = "gateway.run_when_idle"
    step_id: str
    label: str = ""
    deadline: float | None = None
    idle_only: bool = False
    """Never granted ahead of request or batch work (out of the background
    share): for steps whose work every request and batch turn already does
    as it ends (the prompt cache's drain), needed only on an idle engine.
    Under load the first request or batch turn granted after the ask answers
    it ``TurnDone(ok=True)`` as it ends, without running the step."""


class TurnDone(Body):
    """Reply to ``RunWhenIdle``: the step ran (``ok``) or why it did not."""

    kind: Literal["gateway.turn_done"] = "gateway.turn_done"
    step_id: str
    ok: bool
    error_code: str = ""
    detail: str = ""


class StopTurns(Body):
    """Grant no more background turns; waiting and later ``RunWhenIdle`` asks are refused."""

    kind: Literal["gateway.stop_turns"] = "gateway.stop_turns"


class AwaitDrained(Request):
    """Ask to be answered (``Drained``) once no request runs or waits, after ``BeginShutdown``."""

    kind: Literal["gateway.await_drained"] = "gateway.await_drained"


class Drained(Body):
    """Reply to ``AwaitDrained``: every admitted request has finished."""

    kind: Literal["gateway.drained"] = "gateway.drained"


class GatewayStatsRequest(Request):
    """Ask the gateway for :class:`GatewayStats` (``Engine.stats()``, ``/stats``)."""

    kind: Literal["gateway.stats_request"] = "gateway.stats_request"


StatValue = str | int | float | bool | None | dict[str, int | float]
"""One entry of a statistics snapshot: a scalar or one level of named numbers."""


class GatewayStats(Body):
    """The lane and the engine-turn token (``token``: holder, waiters, grants, time held,
    request counters) and how many admitted requests have not ended."""

    kind: Literal["gateway.stats"] = "gateway.stats"
    token: dict[str, StatValue]
    admitted_requests: int = Field(ge=0)


class RunnerStatsRequest(Request):
    """Ask the turn runner for :class:`RunnerStats` (answered between turns)."""

    kind: Literal["gateway.runner_stats_request"] = "gateway.runner_stats_request"


class RunnerStats(Body):
    """Requests whose generation state the runner holds; decode steps run so far."""

    kind: Literal["gateway.runner_stats"] = "gateway.runner_stats"
    live_requests: int = Field(ge=0)
    decode_steps_run: int = Field(ge=0)


# --- gateway <-> turn runner (the one actor that submits engine jobs) ---------


TurnOwner = Literal["request", "background"]
TurnPhase = Literal["prefill", "decode"]
TurnOutcome = Literal["continue", "finished", "failed", "cancelled", "blocked"]
"""``blocked``: the request's stream was full; its tokens are held and it takes no turn until
they went out (``LaneUnblocked``)."""


class RunTurn(Request):
    """Gateway -> runner: run ONE engine turn for ``ident`` (a request id or a step id).

    ``start`` carries the request on its first turn (the runner keeps the
    generation state from then on). The runner answers with a
    ``RequestTurnReport`` / ``BackgroundTurnReport`` told to the gateway;
    ``reply_to`` (the gateway) is there so that, should the runner's handler
    raise instead, the runtime's ``Failure`` reply reaches the gateway, which
    then fails the turn instead of waiting for a report that never comes.

    ``max_steps`` > 1 (requests only) grants a burst: the runner may run up
    to that many decode steps back to back, streaming each token as it is
    produced, and reports once; it stops early when the gateway sends
    ``StopBurst`` (the requester cancelled).

    ``lookup`` (first turn only) is the prompt-cache ``Take`` the gateway
    made while the request waited for its turn: the turn only materializes
    it (and releases its lease); ``None`` means no lookup (a cold prefill).
    ``lookup_started_at``/``lookup_done_at``: when that ``Take`` was sent and
    answered (the gateway's clock; ``None``: none was made), for ``Timings``.

    ``checkpoint_key`` (first turn only): the request's generation-checkpoint
    key (``None``: not checkpointed). ``checkpoint``: the handle of the
    checkpoint the gateway loaded beside the ``Take`` (held by the checkpoint
    port until the runner claims it; ``None``: none found), so the turn never
    waits for a file lookup.
    """

    kind: Literal["gateway.run_turn"] = "gateway.run_turn"
    owner: TurnOwner
    ident: str
    start: Generate | None = None
    admitted_at: float = 0.0
    max_steps: int = Field(default=1, ge=1)
    lookup: TakeResult | None = None
    lookup_started_at: float | None = None
    lookup_done_at: float | None = None
    checkpoint_key: str | None = None
    checkpoint: str | None = None


class GatewayCheckpointsLoaded(Body):
    """Gateway -> itself: generation-checkpoint lookups (worker threads) finished; the
    shell holds their results and feeds them to the core."""

    kind: Literal["gateway.checkpoints_loaded"] = "gateway.checkpoints_loaded"


class LaneUnblocked(Body):
    """Runner -> gateway: the lane holder whose turn ended ``blocked`` (its stream was full) is
    past that: its held tokens went out (``continue``: it takes turns again; ``finished``: its
    last token was among them), or its reader left or took nothing for the stream-write
    deadline (``cancelled``: the runner ended its stream and kept its cache)."""

    kind: Literal["gateway.lane_unblocked"] = "gateway.lane_unblocked"
    request_id: str
    outcome: Literal["continue", "finished", "cancelled"]


class RunnerRetry(Body):
    """The runner's retry alarm went off (sent to itself): try the held streams again."""

    kind: Literal["gateway.runner_retry"] = "gateway.runner_retry"


class StopBurst(Body):
    """Gateway -> runner: end ``request_id``'s burst after the step in flight (its requester cancelled).

    The runner sets the stop flag its engine-thread chain checks before
    every step, so the lane is free again within one step.
    """

    kind: Literal["gateway.stop_burst"] = "gateway.stop_burst"
    request_id: str


class EngineWake(Request):
    """Runner -> itself: engine job ``job`` produced results or ended (posted from the loop).

    Internal to the turn runner: an engine job's completion reaches the
    runner as a message in its mailbox's reserved room, so the runner keeps
    reading its mailbox (``StopBurst``, ``EndRequest``) while the engine
    works. ``reply_to`` is the gateway: should the runner's handler raise
    while handling it, the runtime's ``Failure`` reaches the gateway, which
    fails the turn instead of waiting for a report.
    """

    kind: Literal["gateway.engine_wake"] = "gateway.engine_wake"
    job: int = Field(ge=0)


class RequestTurnReport(Body):
    """Runner -> gateway: a request turn ended; ``outcome`` says whether more turns are needed.

    ``cancelled`` means the requester's stream was gone when the runner
    delivered (the runner already cleaned up). ``steps``: how many steps of
    ``phase`` the turn ran (more than one only in a granted burst).
    """

    kind: Literal["gateway.request_turn_report"] = "gateway.request_turn_report"
    request_id: str
    phase: TurnPhase
    outcome: TurnOutcome
    steps: int = Field(default=1, ge=1)


class BackgroundTurnReport(Body):
    """Runner -> gateway: a background step ran (``ok``) or failed."""

    kind: Literal["gateway.background_turn_report"] = "gateway.background_turn_report"
    step_id: str
    ok: bool
    error_code: str = ""
    detail: str = ""


class EndRequest(Body):
    """Gateway -> runner: drop a request's state.

    ``cancelled``: keep its cache for the prompt cache and close its stream
    with ``DoneEvent(finish_reason="cancelled")``. ``failed``: its turn failed
    without a report; discard its state (the gateway already ended the stream).
    """

    kind: Literal["gateway.end_request"] = "gateway.end_request"
    request_id: str
    reason: Literal["cancelled", "failed"] = "cancelled"
