"""The HTTP layer's own state: settings, ports, in-flight responses, counters."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from actors.engine.config import EngineConfig

from ._access import LOOPBACK_HOSTS, is_loopback, normalize_host, parse_networks
from ._convert import Defaults
from ._isolation import CacheNamespaceMode
from ._timeline import TimelineWindow

__all__ = ["HttpSettings", "HttpState", "allowed_hosts"]


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Configuration of the HTTP app (``kvtier serve`` builds it from flags).

    ``model_aliases``: extra names accepted in the ``model`` field besides the
    engine's ``model_id`` (e.g. the path given to ``--model``).
    ``api_key``: when set, every route but ``/health`` and ``/`` needs ``Bearer <key>``.
    ``cache_namespace``: ``api-key`` gives each bearer token its own prompt-cache namespace.
    ``admin_key``: the key of the ``/admin/`` routes (``None``: ``api_key``
    opens them). With neither, admin routes answer 403 unless
    ``admin_loopback`` lets loopback clients in without a key.
    ``trusted_proxies``: addresses or CIDRs whose ``X-Forwarded-For`` names
    the client (for ``admin_loopback``); any other peer's header is ignored.
    ``allowed_hosts``: the ``Host`` names the server answers (``name`` or
    ``name:port``); ``None`` accepts any (``from_config`` restricts a
    loopback-bound server to :data:`LOOPBACK_HOSTS`).
    ``choice_window``: how many choices of one request (``n``, a batch of
    prompts) generate at once; ``from_config`` uses the batch lane's rows.
    """

    defaults: Defaults = field(default_factory=Defaults)
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    cache_namespace: CacheNamespaceMode = "shared"
    max_body_bytes: int = EngineConfig().max_body_bytes
    admin_key: str | None = None
    admin_loopback: bool = False
    trusted_proxies: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None
    choice_window: int = 8

    def __post_init__(self) -> None:
        parse_networks(self.trusted_proxies)  # NOTE: a bad entry fails here, not per request.
        if self.choice_window < 1:
            raise ValueError(f"choice_window must be at least 1, got {self.choice_window}")

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, model_aliases: tuple[str, ...] = ()
    ) -> HttpSettings:
        """The HTTP settings of ``config`` (``kvtier serve`` builds them from its flags)."""
        return cls(
            defaults=Defaults.from_config(config),
            model_aliases=model_aliases,
            api_key=config.api_key,
            cache_namespace=config.cache_namespace,
            max_body_bytes=config.max_body_bytes,
            admin_key=config.admin_key,
            admin_loopback=config.admin_loopback,
            trusted_proxies=config.trusted_proxies,
            allowed_hosts=allowed_hosts(config.host, config.allowed_hosts),
            choice_window=config.max_batch,
        )


def allowed_hosts(bind: str, configured: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The ``Host`` allowlist of a server bound to ``bind`` (``None``: any name).

    ``configured`` ``None`` (the default): the loopback names when ``bind`` is
    a loopback address, else any name (a public server's names are not known
    here; it needs ``--api-key``, which a rebinding page cannot send).
    ``("*",)``: any name.
    """
    if configured is None:
        return LOOPBACK_HOSTS if is_loopback(bind) else None
    if "*" in configured:
        return None
    return tuple(normalize_host(h) for h in configured)


def _new_id() -> str:
    return uuid.uuid4().hex[:24]


@dataclass
class HttpState:
    """Mutable per-app state. Lives on the event loop only (no locks needed).

    Invariant: ``in_flight`` counts generation responses between admission
    and the moment their stream was released; ``idle`` is set iff it is 0.
    """

    clock: Callable[[], float] = time.time
    new_id: Callable[[], str] = _new_id
    monotonic: Callable[[], float] = time.monotonic
    """The per-request timeline's clock (the engine's: ``time.monotonic``)."""
    timelines: TimelineWindow = field(default_factory=TimelineWindow)
    connection_stats: Callable[[], dict[str, int]] | None = None
    """The server's connection figures (``serve`` sets it; ``None``: no server of ours)."""
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False
    in_flight: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    disconnects: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        """A generation response began."""
        self.in_flight += 1
        if self.idle.is_set():
            self.idle = anyio.Event()

    def leave(self) -> None:
        """A generation response ended (normally, by error or by disconnect)."""
        self.in_flight -= 1
        assert self.in_flight >= 0
        if self.in_flight == 0:
            self.idle.set()

    async def wait_idle(self) -> None:
        """Until no generation response is in flight."""
        while self.in_flight:
            await self.idle.wait()

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready HTTP statistics for ``/stats``."""
        return {
            "in_flight": self.in_flight,
            "shutting_down": self.shutting_down,
            "responses_by_status": {str(k): v for k, v in sorted(self.statuses.items())},
            "client_disconnects": self.disconnects,
            "uptime_s": round(self.clock() - self.started_at, 3),
            "timeline": self.timelines.snapshot(),
            **({} if self.connection_stats is None
               else {"connections": self.connection_stats()}),
        }
