"""Typed server-level errors, named after the state that caused them.

The engine API and the gateway raise these; the HTTP layer converts them to
status codes at exactly one edge (suggested mapping in each docstring). No
other module maps errors to HTTP.
"""

from __future__ import annotations

__all__ = [
    "ContextTooLong",
    "EngineClosed",
    "EngineNotStarted",
    "GenerationFailed",
    "GrammarCompilerBusy",
    "InvalidRequest",
    "KvtierError",
    "MemoryBusy",
    "MemoryPressure",
    "MemoryShortAtStart",
    "QueueFull",
    "SchemaTooComplex",
    "ServerShuttingDown",
    "TurnUnavailable",
]


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose; ``code`` is a stable slug."""

    code: str = "kvtier_error"


class QueueFull(KvtierError):
    """Admission refused: the lane is busy and the bounded wait queue is full (HTTP 429)."""

    code = "queue_full"

    def __init__(self, queued: int, max_queue: int) -> None:
        super().__init__(f"admission queue is full ({queued}/{max_queue} waiting)")
        self.queued = queued
        self.max_queue = max_queue


class ServerShuttingDown(KvtierError):
    """Admission refused: shutdown has begun; in-flight requests still finish (HTTP 503)."""

    code = "shutting_down"

    def __init__(self, message: str = "server is shutting down; no new requests") -> None:
        super().__init__(message)


class EngineNotStarted(KvtierError):
    """The engine was used before ``start()`` / ``async with`` finished (HTTP 503)."""

    code = "engine_not_started"


class EngineClosed(KvtierError):
    """The engine was used after ``aclose()`` (HTTP 503)."""

    code = "engine_closed"


class InvalidRequest(KvtierError):
    """The request itself is malformed: empty prompt, bad params, unknown role (HTTP 400)."""

    code = "invalid_request"


class SchemaTooComplex(InvalidRequest):
    """A JSON schema or grammar over a named limit, or one the compiler crashed or stalled on (HTTP 400).

    ``param`` names the request field (``response_format.json_schema.schema``,
    ``tools.0.function.parameters``) when known; ``limit`` the limit's name
    (``ref_hops``, ``depth``, ...; ``compile`` when the compiler failed).
    """

    code = "schema_too_complex"

    def __init__(self, message: str, *, limit: str, param: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.param = param


class GrammarCompilerBusy(QueueFull):
    """Every grammar compiler stayed busy past its deadline (HTTP 429, like a full queue)."""

    code = "grammar_compiler_busy"

    def __init__(self, message: str, workers: int = -1) -> None:
        KvtierError.__init__(self, message)
        self.queued = -1
        self.max_queue = workers


class ContextTooLong(InvalidRequest):
    """The prompt (plus ``max_tokens``) is over a limit: the model's context or ``max_prompt_tokens`` (HTTP 400).

    ``limit_name`` says which limit (shown to the client); ``max_tokens`` is
    the completion budget counted against it (0 when only the prompt counts).
    """

    code = "context_length_exceeded"

    def __init__(
        self,
        prompt_tokens: int,
        limit: int,
        *,
        max_tokens: int = 0,
        limit_name: str = "the limit",
    ) -> None:
        if max_tokens:
            message = (
                f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: "
                f"{prompt_tokens + max_tokens} tokens do not fit {limit_name} of {limit}; "
                "shorten the prompt or ask for fewer max_tokens"
            )
        else:
            message = f"the prompt has {prompt_tokens} tokens; {limit_name} is {limit}"
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.max_tokens = max_tokens


class GenerationFailed(KvtierError):
    """The model step raised on the engine thread mid-request (HTTP 500, or an SSE error event)."""

    code = "generation_failed"


class MemoryPressure(KvtierError):
    """The request's projected memory does not fit the memory budget and nothing more can be
    reclaimed (HTTP 503); the server keeps serving smaller requests."""

    code = "memory_pressure"


class MemoryBusy(MemoryPressure):
    """Admission refused for memory that running requests hold (HTTP 503 where it reaches a client).

    Nothing more can be moved out of memory now, but the request fits beside
    the least memory the process has held (its weights, no request running,
    nothing cached): the engine API waits for a running request to end and
    asks again, within ``EngineConfig.memory_relief_timeout_s``.
    """


class MemoryShortAtStart(MemoryPressure):
    """The in-turn guard refused a request before its prefill (HTTP 503 where it reaches a client).

    Nothing of the request has run or been produced. Admission decided on a
    reading without the rows that started since (or joined in the same
    step), and nothing can be reclaimed inside a turn; the engine API takes
    such a request back to admission once, where relief can run.
    """


class TurnUnavailable(KvtierError):
    """A ``RunWhenIdle`` step was refused: the gateway is stopping and grants no more turns."""

    code = "turn_unavailable"
