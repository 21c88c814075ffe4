"""``EngineConfig``: every engine and server option, defined once.

Each field carries its default, its bounds, its unit (in the description)
and a :class:`Setting`: the ``KVTIER_...`` environment variable, the
``kvtier serve`` flag, and the factor between the flag/env unit and the
field's own unit (byte caps are bytes in the config, GB on the command line).
``kvtier serve`` builds its flags from these fields (:func:`add_flags`),
``Engine(...)`` validates its keyword options through this model, and the
HTTP layer takes its request defaults from it.

Sources, lowest precedence first: the field default, the environment
(:meth:`EngineConfig.from_env`), explicit values (keyword options or flags).
``EngineConfig(...)`` itself never reads the environment: a value built in
code means what it says; ``Engine(**options)`` and ``kvtier serve`` read it.

Units: "GB" in a flag or variable name means GiB (2**30 bytes) everywhere,
the unit of the default caps (prompt cache: a quarter of available memory in
[256 MiB, 8 GiB]; spill queue: 2 GiB), so ``--prompt-cache 8`` is exactly the
largest default. "MB" (``KVTIER_MLX_CACHE_LIMIT_MB``) means MiB.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from messages.gateway import GenerationParams

__all__ = [
    "GIB",
    "MIB",
    "ConfigError",
    "EngineConfig",
    "Scope",
    "Setting",
    "add_flags",
    "config_from_flags",
    "env_values",
    "flag_dest",
    "gb_to_bytes",
    "option_names",
]

GIB = 1024**3
MIB = 1024**2

Scope = Literal["engine", "sampling", "server", "ssd"]
"""Who reads a field: the engine, request sampling defaults, the HTTP server,
or the SSD tier (defined now, consumed by the cold tier)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """Where a field comes from besides code: its variable, its flag, its edge unit.

    ``scale``: the flag/env value times ``scale`` is the field value (GiB →
    bytes: ``GIB``). ``shown_default``: what help says when the default is
    not a plain value.
    """

    env: str
    flag: str
    scope: Scope = "engine"
    unit: str = ""
    scale: int = 1
    metavar: str | None = None
    shown_default: str | None = None


class ConfigError(ValueError):
    """An option has a bad value, or an unknown option was given (message names it and its source)."""


_DEFAULT_PARAMS = GenerationParams()


def gb_to_bytes(gb: float, *, unit: int = GIB) -> int:
    """A size in GB (GiB: 2**30 bytes; ``unit`` for MiB) to bytes; non-finite or negative is a ``ConfigError``."""
    if isinstance(gb, bool) or not isinstance(gb, int | float) or not math.isfinite(gb) or gb < 0:
        raise ConfigError(f"a size must be a finite number >= 0, got {gb!r}")
    return int(gb * unit)


_SECRETS = ("api_key", "admin_key")
"""Fields whose variable is read even when blank (so a blank key is refused, not ignored)."""


def _checked_key(value: Any) -> Any:
    """A key as given, or a ``ValueError`` for one that would disable or break auth.

    NOTE: a blank, whitespace-only or ``off``/``none`` key used to mean "no
    auth" silently, and a key with surrounding whitespace never matched
    (clients' tokens are stripped). To run without auth, leave the key unset.
    """
    if not isinstance(value, str):
        return value
    if not value.strip():
        raise ValueError("is blank; unset it to run without auth")
    if value.strip().lower() in ("off", "none", "no", "false", "0"):
        raise ValueError(f"{value.strip()!r} is not a key; unset it to run without auth")
    if any(not ("!" <= c <= "~") for c in value):
        raise ValueError("must be printable ASCII without spaces (it travels in an HTTP header)")
    return value


def _off_is_none(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in ("", "off", "none"):
        return None
    return value


class EngineConfig(BaseModel):
    """Every option of an ``Engine`` and of ``kvtier serve``: default, bounds, unit, variable.

    Frozen, unknown keys rejected, non-finite floats rejected. See the module
    docstring for sources and units, and docs/engine.md for the table.
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", allow_inf_nan=False, validate_default=True
    )

    # --- engine -------------------------------------------------------------
    model: Annotated[
        str | None,
        Field(description="local mlx-lm model directory or Hugging Face id"),
        Setting("KVTIER_MODEL", "--model", metavar="PATH|ID",
                shown_default="the default model, SmolLM2-135M-Instruct, fetched on first use"),
    ] = None
    # NOTE: 256, not a few rows' worth: a load generator or agent fleet with 32-64
    # concurrent streams must queue, not get 429s (16 refused 40 of 64 requests at
    # 32 streams on the H200, docs/benchmarks/serving.md). A waiting request holds
    # only its prompt ids; the memory guard admits it when it gets a row.
    max_queue: Annotated[
        int,
        Field(ge=0, description="requests that may wait behind the generating ones; "
                                "more are refused (QueueFull, HTTP 429)"),
        Setting("KVTIER_MAX_QUEUE", "--max-queue", unit="requests"),
    ] = 256
    prefill_step_size: Annotated[
        int,
        Field(ge=1, description="prompt tokens per prefill engine turn"),
        Setting("KVTIER_PREFILL_STEP_SIZE", "--prefill-step-size", unit="tokens"),
    ] = 512
    # NOTE: 0 keeps the batch step's prefill budget at one chunk; the knob
    # exists to measure a chunk larger than the budget on a GPU (one forward
    # per prompt, one joining prompt per step), docs/batching.md.
    prefill_budget: Annotated[
        int,
        Field(ge=0, description="prompt tokens a batch step forwards while rows decode (a "
                                "joining row's first chunk always goes); 0 = one prefill chunk"),
        Setting("KVTIER_PREFILL_BUDGET", "--prefill-budget", unit="tokens"),
    ] = 0
    max_burst: Annotated[
        int,
        Field(ge=1, description="decode steps per engine turn while a request holds the lane; "
                                "1 = one gateway turn per token (a cancel still frees the lane "
                                "within one step)"),
        Setting("KVTIER_MAX_BURST", "--max-burst", unit="steps"),
    ] = 64
    max_batch: Annotated[
        int,
        Field(ge=1, le=256, description="rows decoded together in the batch lane; 1 = the "
                                        "serial lane only (docs/batching.md)"),
        Setting("KVTIER_MAX_BATCH", "--max-batch", unit="rows"),
    ] = 1
    prompt_cache_bytes: Annotated[
        int | None,
        Field(ge=0, description="RAM prompt-cache cap; 0 disables it"),
        Setting("KVTIER_PROMPT_CACHE_GB", "--prompt-cache", unit="GiB", scale=GIB, metavar="GB",
                shown_default="a quarter of available memory (CUDA: of the device's, if less), "
                              "within 0.25..8 GiB"),
    ] = None
    kv_quant: Annotated[
        Literal["off", "4", "8", "config"],
        Field(description="KV storage: off (model dtype), 4 / 8 (affine bits), "
                          "config (per-layer kv_config.json in the model directory)"),
        Setting("KVTIER_KV_QUANT", "--kv-quant"),
    ] = "off"
    max_prompt_tokens: Annotated[
        int | None,
        Field(ge=1, description="longest prompt; longer ones are refused before admission "
                                "(ContextTooLong, HTTP 400)"),
        Setting("KVTIER_MAX_PROMPT_TOKENS", "--max-prompt-tokens", unit="tokens",
                shown_default="the model's context"),
    ] = None
    stream_buffer: Annotated[
        int,
        Field(ge=1, description="events a request's stream holds before its tokens are "
                                "held back (the engine goes on with other requests)"),
        Setting("KVTIER_STREAM_BUFFER", "--stream-buffer", unit="events"),
    ] = 64
    stream_write_timeout_s: Annotated[
        float,
        Field(gt=0, description="deadline on every write to a request's stream (its event "
                                "buffer, an HTTP response): a reader that takes nothing for this "
                                "long loses its stream, and its engine turn ends within one step"),
        Setting("KVTIER_STREAM_WRITE_TIMEOUT", "--stream-write-timeout", unit="s"),
    ] = 30.0
    render_threads: Annotated[
        int,
        Field(ge=1, le=64, description="prompts rendered and tokenized at once at admission, "
                                       "each on a worker thread; more wait their turn in arrival "
                                       "order"),
        Setting("KVTIER_RENDER_THREADS", "--render-threads", unit="threads"),
    ] = 40
    render_inline_chars: Annotated[
        int,
        Field(ge=0, description="prompts of at most this many characters render on the event "
                                "loop, longer ones on a render thread; 0 = always a thread. A "
                                "render keeps the GIL (under a millisecond for 30k characters), "
                                "while each hop to a thread and back waits for the GIL beside "
                                "the engine thread"),
        Setting("KVTIER_RENDER_INLINE_CHARS", "--render-inline-chars", unit="chars"),
    ] = 65536
    batch_gather_s: Annotated[
        float,
        Field(ge=0, le=10, description="how long, at most, an idle batch lane's ready rows wait for "
                                       "requests announced at the same moment (an agent's "
                                       "turns sent together start in one step); 0 = no wait"),
        Setting("KVTIER_BATCH_GATHER", "--batch-gather", unit="s"),
    ] = 0.05
    background_in_chain: Annotated[
        bool,
        Field(description="under load, a background step due from its share (write-behind, "
                          "the SSD writer) runs inside the batch lane's running step chain, "
                          "between two steps, instead of ending the chain (docs/batching.md, "
                          "\"Background steps inside a chain\"); off until measured on a GPU: "
                          "on the 2-core CPU it cost served throughput"),
        Setting("KVTIER_BACKGROUND_IN_CHAIN", "--background-in-chain", metavar="on|off"),
    ] = False
    snapshot_min_new_tokens: Annotated[
        int,
        Field(ge=0, description="uncached prompt tokens a chat request needs before its "
                                "prompt-boundary snapshot is kept"),
        Setting("KVTIER_SNAPSHOT_MIN_NEW_TOKENS", "--snapshot-min-new-tokens", unit="tokens"),
    ] = 64
    ask_timeout_s: Annotated[
        float,
        Field(gt=0, description="deadline on every internal ask, admission included"),
        Setting("KVTIER_ASK_TIMEOUT", "--ask-timeout", unit="s"),
    ] = 30.0
    stats_timeout_s: Annotated[
        float,
        Field(gt=0, description="deadline on each actor's answer to a statistics ask; a busy "
                                "actor's section then reads {\"unavailable\": ...} instead of "
                                "holding /stats"),
        Setting("KVTIER_STATS_TIMEOUT", "--stats-timeout", unit="s"),
    ] = 0.5
    shutdown_timeout: Annotated[
        float,
        Field(ge=0, description="how long in-flight requests may take to finish once shutdown "
                                "begins (SIGTERM, Engine.aclose)"),
        Setting("KVTIER_SHUTDOWN_TIMEOUT", "--shutdown-timeout", unit="s"),
    ] = 120.0
    tensor_parallel: Annotated[
        bool,
        Field(description="tensor-parallel serving under mlx.launch: every rank loads its shard "
                          "of the model, rank 0 serves HTTP and drives the other ranks; needs "
                          "--max-batch 1 and no SSD tier (docs/tensor-parallel.md)"),
        Setting("KVTIER_TENSOR_PARALLEL", "--tensor-parallel", metavar="on|off"),
    ] = False
    device: Annotated[
        Literal["auto", "cpu"],
        Field(description="the device MLX computes on: auto = MLX's default (its GPU where it "
                          "has one: CUDA or Metal), cpu = the CPU even beside a GPU (e.g. CPU "
                          "replicas on a GPU host); one setting of the whole process"),
        Setting("KVTIER_DEVICE", "--device"),
    ] = "auto"
    warm_up: Annotated[
        Literal["auto", "on", "off"],
        Field(description="before the server is ready, run the batch lane once through its kinds "
                          "of step with short prompts, so that MLX compiles its kernels then and "
                          "not inside the first requests (on a fresh CUDA machine: seconds per "
                          "kernel); auto = on under CUDA, off elsewhere"),
        Setting("KVTIER_WARM_UP", "--warm-up"),
    ] = "auto"
    mlx_cache_limit_bytes: Annotated[
        int | None,
        Field(ge=0, description="MLX buffer-cache bound: freed buffers MLX keeps for reuse"),
        Setting("KVTIER_MLX_CACHE_LIMIT_MB", "--mlx-cache-limit", unit="MiB", scale=MIB,
                metavar="MB", shown_default="16 MiB on the CPU, 2048 MiB on Metal; under "
                                "CUDA the model's weight bytes (at least 2048 MiB, at most "
                                "half the device)"),
    ] = None
    memory_budget_bytes: Annotated[
        int | None,
        Field(gt=0, description="memory a request may count on: the process's resident memory plus its "
                                "projected KV and prefill workspace must fit, else RAM entries "
                                "are persisted and dropped, and failing that the request gets "
                                "MemoryPressure (HTTP 503)"),
        Setting("KVTIER_MEMORY_BUDGET_GB", "--memory-budget", unit="GiB", scale=GIB,
                metavar="GB", shown_default="the smaller of usable RAM and the device's "
                                            "memory"),
    ] = None

    # --- sampling defaults (a request's own fields win) -----------------------
    max_tokens: Annotated[
        int,
        Field(ge=1, description="completion tokens when a request names none"),
        Setting("KVTIER_MAX_TOKENS", "--max-tokens", scope="sampling", unit="tokens"),
    ] = _DEFAULT_PARAMS.max_tokens
    max_tokens_limit: Annotated[
        int,
        Field(ge=1, description="largest max_tokens an HTTP request may ask for (more: 400)"),
        Setting("KVTIER_MAX_TOKENS_LIMIT", "--max-tokens-limit", scope="sampling", unit="tokens"),
    ] = 32768
    temperature: Annotated[
        float,
        Field(ge=0, description="sampling temperature; 0 = greedy"),
        Setting("KVTIER_TEMPERATURE", "--temp", scope="sampling"),
    ] = _DEFAULT_PARAMS.temperature
    top_p: Annotated[
        float,
        Field(gt=0, le=1, description="nucleus sampling mass; 1 = off"),
        Setting("KVTIER_TOP_P", "--top-p", scope="sampling"),
    ] = _DEFAULT_PARAMS.top_p
    top_k: Annotated[
        int,
        Field(ge=0, description="top-k sampling; 0 = off"),
        Setting("KVTIER_TOP_K", "--top-k", scope="sampling", unit="tokens"),
    ] = _DEFAULT_PARAMS.top_k
    min_p: Annotated[
        float,
        Field(ge=0, le=1, description="min-p sampling; 0 = off"),
        Setting("KVTIER_MIN_P", "--min-p", scope="sampling"),
    ] = _DEFAULT_PARAMS.min_p

    # --- HTTP server ------------------------------------------------------------
    host: Annotated[
        str,
        Field(min_length=1, description="bind address (loopback only unless changed)"),
        Setting("KVTIER_HOST", "--host", scope="server"),
    ] = "127.0.0.1"
    port: Annotated[
        int,
        Field(ge=0, le=65535, description="bind port; 0 picks a free one"),
        Setting("KVTIER_PORT", "--port", scope="server"),
    ] = 8080
    api_key: Annotated[
        str | None,
        Field(repr=False, description="require 'Authorization: Bearer KEY' on every route but "
                                      "/health (prefer the variable: flags show in ps)"),
        Setting("KVTIER_API_KEY", "--api-key", scope="server", metavar="KEY",
                shown_default="no auth"),
    ] = None
    admin_key: Annotated[
        str | None,
        Field(repr=False, description="the key of the /admin/ routes (Bearer); unset, the API "
                                      "key opens them; with neither they answer 403 unless "
                                      "--admin-loopback is on"),
        Setting("KVTIER_ADMIN_KEY", "--admin-key", scope="server", metavar="KEY",
                shown_default="the API key"),
    ] = None
    admin_loopback: Annotated[
        bool,
        Field(description="let loopback clients call the /admin/ routes without a key (behind "
                          "a reverse proxy on this host, also set --trusted-proxies)"),
        Setting("KVTIER_ADMIN_LOOPBACK", "--admin-loopback", scope="server", metavar="on|off"),
    ] = False
    trusted_proxies: Annotated[
        tuple[str, ...],
        Field(description="comma list of proxy addresses/CIDRs whose X-Forwarded-For names "
                          "the client (for --admin-loopback); empty = the header is ignored"),
        Setting("KVTIER_TRUSTED_PROXIES", "--trusted-proxies", scope="server",
                metavar="ADDR,...", shown_default="none"),
    ] = ()
    allowed_hosts: Annotated[
        tuple[str, ...] | None,
        Field(description="comma list of Host header names the server answers (name or "
                          "name:port; others get 400); * = any"),
        Setting("KVTIER_ALLOWED_HOSTS", "--allowed-hosts", scope="server", metavar="HOST,...",
                shown_default="localhost, 127.0.0.1 and [::1] when bound to loopback, else any"),
    ] = None
    cache_namespace: Annotated[
        Literal["shared", "api-key"],
        Field(description="prompt-cache isolation: shared = clients share cached prefixes "
                          "unless a request sends cache_salt; api-key = each bearer token gets "
                          "its own namespace (with cache_salt: the pair)"),
        Setting("KVTIER_CACHE_NAMESPACE", "--cache-namespace", scope="server"),
    ] = "shared"
    max_body_bytes: Annotated[
        int,
        Field(ge=1, description="largest request body; more gets 413"),
        Setting("KVTIER_MAX_BODY_BYTES", "--max-body-bytes", scope="server", unit="bytes"),
    ] = 4 * MIB
    log_level: Annotated[
        Literal["debug", "info", "warning", "error", "critical"],
        Field(description="log level; debug also traces every actor message"),
        Setting("KVTIER_LOG_LEVEL", "--log-level", scope="server"),
    ] = "info"
    log_format: Annotated[
        Literal["console", "json"],
        Field(description="console (readable) or json (one object per line)"),
        Setting("KVTIER_LOG_FORMAT", "--log-format", scope="server"),
    ] = "console"

    # --- SSD cold tier (defined here; the tier consumes them) --------------------
    ssd_cache: Annotated[
        Path | None,
        Field(description="SSD cold-tier directory; off = no cold tier "
                          "(kvtier serve defaults to $KVTIER_HOME/kv, an embedded Engine to off)"),
        Setting("KVTIER_SSD_CACHE", "--ssd-cache", scope="ssd", metavar="DIR|off"),
    ] = None
    ssd_cache_max_bytes: Annotated[
        int | None,
        Field(ge=0, description="SSD tier cap; 0 = no cap (existing files are kept; a full "
                                "disk ends stores)"),
        Setting("KVTIER_SSD_CACHE_MAX_GB", "--ssd-cache-max", scope="ssd", unit="GiB",
                scale=GIB, metavar="GB",
                shown_default="the smaller of 32 GiB and a quarter of the free space"),
    ] = None
    ssd_cache_verify: Annotated[
        bool,
        Field(description="verify every tensor's hash on restore (the header hash is always "
                          "verified)"),
        Setting("KVTIER_SSD_CACHE_VERIFY", "--ssd-cache-verify", scope="ssd", metavar="on|off"),
    ] = True
    ssd_restore: Annotated[
        Literal["auto", "always"],
        Field(description="auto: restore an SSD hit only when reading it is predicted faster "
                          "than prefilling its tokens (restore-or-recompute); always: read "
                          "every usable file (e.g. to check what is on disk)"),
        Setting("KVTIER_SSD_RESTORE", "--ssd-restore", scope="ssd"),
    ] = "auto"
    ssd_demote_idle: Annotated[
        float,
        Field(ge=0, description="RAM entries unused this long move to the SSD tier; 0 = never"),
        Setting("KVTIER_SSD_DEMOTE_IDLE", "--ssd-demote-idle", scope="ssd", unit="s"),
    ] = 300.0
    ssd_writebehind: Annotated[
        bool,
        Field(description="write a debounced snapshot to SSD after each put (restart survival "
                          "without waiting for eviction)"),
        Setting("KVTIER_SSD_WRITEBEHIND", "--ssd-writebehind", scope="ssd", metavar="on|off"),
    ] = True
    ssd_spill_queue_bytes: Annotated[
        int,
        Field(ge=0, description="cap of the clones waiting to be written to SSD; 0 keeps only "
                                "the newest and the one in flight"),
        Setting("KVTIER_SSD_SPILL_QUEUE_GB", "--ssd-spill-queue", scope="ssd", unit="GiB",
                scale=GIB, metavar="GB"),
    ] = 2 * GIB
    # NOTE: on by default, taking effect only with the SSD tier (without it
    # nothing is checkpointed): the kill -9 loop's retries equalled the
    # uninterrupted answers (greedy and seeded, 20 of 20 each), and 100 is the
    # measured choice: a restart at 75 % of a 400-token answer resumes at 300
    # (0.21x a fresh run; 256 resumes at 256) for about 0.5 % of the engine
    # thread at 300 tokens (docs/cold-tier.md "Generation checkpoints").
    generation_checkpoint: Annotated[
        int,
        Field(ge=0, description="checkpoint an answer every N emitted tokens to the SSD tier so "
                                "that an identical request after a restart resumes it; 0 = off; "
                                "nothing is checkpointed without the SSD tier"),
        Setting("KVTIER_GENERATION_CHECKPOINT", "--generation-checkpoint", scope="ssd",
                unit="tokens", shown_default="100 tokens with the SSD tier, off without it"),
    ] = 100

    # --- KV events (docs/scale-out.md) -------------------------------------------
    kv_events: Annotated[
        str | None,
        Field(description="publish vLLM-format KV events (ZeroMQ PUB) for the RAM and SSD "
                          "tiers, bound at tcp://HOST:PORT or ipc://PATH; they carry prompt "
                          "token ids, so bind a loopback or private address; needs the cluster "
                          "extra; off = no events"),
        Setting("KVTIER_KV_EVENTS", "--kv-events", metavar="URL|off"),
    ] = None
    kv_events_replay: Annotated[
        str | None,
        Field(description="ZeroMQ ROUTER endpoint answering a late subscriber's replay request "
                          "(buffered batches from a sequence number on); off = no replay"),
        Setting("KVTIER_KV_EVENTS_REPLAY", "--kv-events-replay", metavar="URL|off"),
    ] = None
    kv_events_format: Annotated[
        Literal["array", "map"],
        Field(description="array: vLLM's array-like event structs (vLLM <= 0.23, Dynamo, "
                          "llm-d); map: named fields (newer vLLM)"),
        Setting("KVTIER_KV_EVENTS_FORMAT", "--kv-events-format"),
    ] = "array"

    @field_validator("kv_events", "kv_events_replay", mode="before")
    @classmethod
    def _endpoint(cls, value: Any) -> Any:
        value = _off_is_none(value)
        if isinstance(value, str):
            from actors.kv_events.ports import check_endpoint

            return check_endpoint(value)
        return value

    @field_validator("kv_quant", mode="before")
    @classmethod
    def _kv_quant_text(cls, value: Any) -> Any:
        # NOTE: the Engine API took 4 / 8 as ints and None as "off".
        if value is None:
            return "off"
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value.lower() if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("ssd_cache", "model", mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        return _off_is_none(value)

    @field_validator("api_key", "admin_key", mode="before")
    @classmethod
    def _key(cls, value: Any) -> Any:
        return _checked_key(value)

    @field_validator("trusted_proxies", "allowed_hosts", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = tuple(part.strip() for part in value.split(","))
        if isinstance(value, list | tuple) and any(not str(v).strip() for v in value):
            raise ValueError("an empty entry in the comma list")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            try:
                ipaddress.ip_network(entry.strip("[]"), strict=False)
            except ValueError:
                raise ValueError(f"not an IP address or network: {entry!r}") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.max_tokens > self.max_tokens_limit:
            raise ValueError("max_tokens (--max-tokens) must not exceed max_tokens_limit "
                             "(--max-tokens-limit)")
        if self.ssd_cache is not None and self.prompt_cache_bytes == 0:
            raise ValueError("the SSD tier (--ssd-cache) needs the RAM prompt cache: "
                             "--prompt-cache 0 with --ssd-cache set is not allowed "
                             "(pass --ssd-cache off, or a non-zero --prompt-cache)")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("--kv-events-replay needs --kv-events")
        if self.tensor_parallel and self.max_batch > 1:
            raise ValueError("--tensor-parallel serves the serial lane only: pass --max-batch 1 "
                             "(the batch lane is not mirrored across ranks)")
        if self.tensor_parallel and self.ssd_cache is not None:
            raise ValueError("--tensor-parallel has no SSD tier yet: pass --ssd-cache off "
                             "(each rank would need its own files, docs/tensor-parallel.md)")
        return self

    # --- derived sizes ----------------------------------------------------------

    @property
    def ssd_staging_entries(self) -> int:
        """How many restored SSD entries may wait for their landing at once (``HostStaging``).

        Every request that can hold a restored entry before its first turn gets
        a place: the serial lane's holder and its queue head (2), and with a
        batch lane each of its ``max_batch`` placed rows, which may all be SSD
        hits of one burst. A restore past this bound pushes the oldest waiting
        entry out and that request starts cold. NOTE: a waiting entry is an open
        file, not host bytes (only the kernel's reclaimable page cache holds
        it); the bound caps the descriptors held and the MLX memory the waiting
        landings will allocate, at most this many times the largest file
        (docs/cold-tier.md).
        """
        return 2 if self.max_batch <= 1 else self.max_batch + 2

    @property
    def max_cold_lookups(self) -> int:
        """How many SSD index lookups the RAM tier runs at once (a ``Take`` past it is answered from RAM).

        Every request that may wait for its first turn at once (the serial
        lane's holder and queue head, each placed batch row) may look up the
        SSD index together, with a floor of 4.
        """
        return max(4, self.max_batch + 2)

    @property
    def memory_relief_timeout_s(self) -> float:
        """How long admission waits for the memory actor's answer (``AdmitMemory``), in seconds.

        A relief is a settle turn, then up to four rounds of four asks
        (measure, demote, drain, release), each within ``ask_timeout_s``;
        one more ``ask_timeout_s`` for a relief already running ahead of it.
        """
        return self.ask_timeout_s * 18

    # --- construction -----------------------------------------------------------

    def __init__(self, **values: Any) -> None:
        """Validate ``values``; any problem is one ``ConfigError`` naming each option."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, "option")) from None

    @classmethod
    def build(cls, values: Mapping[str, Any], *, source: str = "option") -> Self:
        """Validate ``values``; any problem is one ``ConfigError`` naming each option and its flag/variable."""
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            raise ConfigError(_explain(exc, source)) from None

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, /, **values: Any
    ) -> Self:
        """Defaults, then ``KVTIER_*`` variables, then ``values`` (explicit values win)."""
        merged = env_values(os.environ if environ is None else environ)
        merged.update(values)
        return cls.build(merged)

    def replace(self, **values: Any) -> Self:
        """A validated copy with ``values`` changed (``ConfigError`` on a bad or unknown one)."""
        return type(self).build({**self.model_dump(exclude_unset=True), **values})

    # --- derived values ---------------------------------------------------------

    def default_params(self) -> GenerationParams:
        """The sampling parameters of a request that names none of its own."""
        return GenerationParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
        )


def _settings() -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for name, info in EngineConfig.model_fields.items():
        setting = next((m for m in info.metadata if isinstance(m, Setting)), None)
        assert setting is not None, f"EngineConfig.{name} has no Setting"
        out[name] = setting
    return out


SETTINGS: dict[str, Setting] = _settings()
"""Each ``EngineConfig`` field's :class:`Setting`, in declaration order."""


def option_names(*scopes: Scope) -> tuple[str, ...]:
    """The field names of ``scopes`` (all fields when none is given)."""
    return tuple(n for n, s in SETTINGS.items() if not scopes or s.scope in scopes)


def _label(name: str) -> str:
    s = SETTINGS.get(name)
    if s is None:
        return name
    return f"{name} ({s.flag}, {s.env})"


def _explain(exc: ValidationError, source: str) -> str:
    lines: list[str] = []
    for err in exc.errors():
        loc = err.get("loc", ())
        name = str(loc[0]) if loc else ""
        if err.get("type") == "extra_forbidden":
            close = difflib.get_close_matches(name, list(SETTINGS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"unknown {source} {name!r}{hint}")
        elif name:
            lines.append(f"{_label(name)}: {err.get('msg')} (got {err.get('input')!r})"
                         if name not in _SECRETS
                         else f"{_label(name)}: {str(err.get('msg')).removeprefix('Value error, ')}")
        else:
            lines.append(str(err.get("msg")).removeprefix("Value error, "))
    return "; ".join(lines)


def _edge_value(name: str, raw: Any, origin: str) -> Any:
    """A flag or variable value in its edge unit, as the field's value."""
    setting = SETTINGS[name]
    if setting.scale == 1 or raw is None:
        return raw
    try:
        number = float(raw)
        return gb_to_bytes(number, unit=setting.scale)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{origin}: expected a finite number of {setting.unit} >= 0, got {raw!r}"
        ) from exc


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields set by ``KVTIER_*`` variables in ``environ`` (empty values are unset).

    NOTE: a key variable (``KVTIER_API_KEY``, ``KVTIER_ADMIN_KEY``) is taken as
    it is, blank included, so that a blank key is refused rather than read
    as "no auth".
    """
    out: dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        raw = environ.get(setting.env)
        if raw is not None and name in _SECRETS:
            out[name] = raw
            continue
        if raw is None or not raw.strip():
            continue
        out[name] = _edge_value(name, raw.strip(), setting.env)
    return out


# --- kvtier serve flags -----------------------------------------------------------

_GROUPS: dict[Scope, str] = {
    "engine": "engine",
    "sampling": "sampling defaults (a request's own fields win)",
    "server": "server",
    "ssd": "SSD cold tier",
}


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("on", "true", "1", "yes"):
        return True
    if low in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _shown_default(name: str, serve_defaults: Mapping[str, str]) -> str:
    if name in serve_defaults:
        return serve_defaults[name]
    info = EngineConfig.model_fields[name]
    setting = SETTINGS[name]
    if setting.shown_default is not None:
        return setting.shown_default
    value = info.default
    if value is None:
        return "off" if "off" in (setting.metavar or "") else "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if setting.scale != 1 and isinstance(value, int):
        return f"{value / setting.scale:g}"
    if isinstance(value, float):
        return f"{value:g}"  # NOTE: 30 s, not Python's 30.0 s
    return str(value)


def flag_dest(name: str) -> str:
    """The ``argparse`` attribute of a field's flag (``--prompt-cache`` → ``prompt_cache``)."""
    return SETTINGS[name].flag.removeprefix("--").replace("-", "_")


def _edge_default(name: str) -> Any:
    """The field default in its flag's unit (what ``args`` holds when the flag is left out)."""
    value = EngineConfig.model_fields[name].default
    scale = SETTINGS[name].scale
    if scale != 1 and isinstance(value, int):
        return value / scale
    return str(value) if isinstance(value, Path) else value


def _flag_type(name: str) -> dict[str, Any]:
    annotation = EngineConfig.model_fields[name].annotation
    if get_origin(annotation) is Literal:
        return {"choices": list(get_args(annotation)), "type": str.lower}
    if SETTINGS[name].scale != 1:
        return {"type": float}
    args = tuple(a for a in get_args(annotation) if a is not type(None))
    base = args[0] if args else annotation
    if base is bool:
        return {"type": _parse_bool}
    if base in (int, float):
        return {"type": base}
    return {"type": str}


def _metavar(name: str) -> str | None:
    setting = SETTINGS[name]
    if get_origin(EngineConfig.model_fields[name].annotation) is Literal:
        return None  # NOTE: argparse shows the choices
    if setting.unit == "s":
        return "SEC"
    kind = _flag_type(name)["type"]
    return "N" if kind is int else "X" if kind is float else None


def _flag_help(name: str, serve_defaults: Mapping[str, str]) -> str:
    """A flag's help: what it sets, then its unit, its default and its variable.

    NOTE: the field's description speaks of the setting, never of the
    field's Python value (``None``, bytes): a scaled flag (GiB, MiB) says its
    unit here, and what "unset" means is the shown default.
    """
    setting = SETTINGS[name]
    shown = _shown_default(name, serve_defaults)
    scaled = setting.scale != 1
    plain = setting.unit and not scaled and setting.shown_default is None
    unit = f"in {setting.unit}; " if scaled else ""
    default = f"{shown} {setting.unit}" if plain and name not in serve_defaults else shown
    description = EngineConfig.model_fields[name].description
    return f"{description} ({unit}default: {default}; env {setting.env})"


def add_flags(
    parser: argparse.ArgumentParser,
    *,
    serve_defaults: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    tracked: Collection[str] = (),
) -> None:
    """Add one flag per ``EngineConfig`` field; help shows the default, its unit and the variable.

    A flag left out takes its ``KVTIER_*`` variable (parsed like the flag),
    else the field default (in the flag's unit). ``serve_defaults`` names
    fields whose ``kvtier serve`` default differs, with the text help shows;
    their flags default to ``None`` so :func:`config_from_flags` can fill them.
    The flags of ``tracked`` fields default to ``None`` as well (help still
    shows the field default, which :func:`config_from_flags` then applies), so
    a value in ``args`` means the flag or its variable was given.
    """
    env = os.environ if environ is None else environ
    shown = dict(serve_defaults or {})
    groups: dict[Scope, argparse._ArgumentGroup] = {}
    for name, setting in SETTINGS.items():
        group = groups.get(setting.scope)
        if group is None:
            group = groups[setting.scope] = parser.add_argument_group(_GROUPS[setting.scope])
        kwargs: dict[str, Any] = {"dest": flag_dest(name), **_flag_type(name)}
        kwargs["default"] = None if name in shown or name in tracked else _edge_default(name)
        raw = env.get(setting.env)
        if raw is not None and name in _SECRETS:
            kwargs["default"] = raw  # NOTE: as given: a blank key is refused (env_values).
        elif raw is not None and raw.strip():
            # NOTE: a string default goes through `type` like a typed flag, so a
            # bad variable is reported the way a bad flag is (exit 2).
            kwargs["default"] = raw.strip()
        kwargs["metavar"] = setting.metavar or _metavar(name)
        kwargs["help"] = _flag_help(name, shown).replace("%", "%%")
        group.add_argument(setting.flag, **kwargs)


def config_from_flags(
    args: argparse.Namespace, *, serve_defaults: Mapping[str, Any] | None = None
) -> EngineConfig:
    """The ``EngineConfig`` of flags parsed by :func:`add_flags` (variables already folded in).

    ``serve_defaults`` fills the fields whose flag and variable were both
    absent (``None`` in ``args``). Raises ``ConfigError``.
    """
    values: dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        raw = getattr(args, flag_dest(name), None)
        if raw is not None:
            values[name] = _edge_value(name, raw, setting.flag)
    for name, value in (serve_defaults or {}).items():
        values.setdefault(name, value)
    return EngineConfig.build(values, source="flag")
