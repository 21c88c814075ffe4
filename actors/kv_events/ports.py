"""The publisher's socket port: a PUB socket and, optionally, a ROUTER socket for replays.

:class:`ZmqSockets` is the real one (pyzmq, the ``cluster`` extra), bound
when it is built, so a taken port or a bad endpoint fails ``kvtier serve``
at startup rather than later. Tests pass a scripted fake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["EventSockets", "ReplayAsk", "ZmqSockets", "check_endpoint"]


class ReplayAsk(Protocol):
    """Called with (client identity, start seq) for each well-formed replay request."""

    def __call__(self, client: bytes, start_seq: int) -> None: ...


class EventSockets(Protocol):
    """Where the publisher's frames go."""

    async def publish(self, frames: Sequence[bytes]) -> bool:
        """Send one batch on the PUB socket without waiting; ``False`` if it was not taken."""
        ...

    async def send_replay(self, frames: Sequence[Sequence[bytes]]) -> int:
        """Send replay answers on the ROUTER socket without waiting; how many were not taken."""
        ...

    async def serve_replays(self, ask: ReplayAsk) -> None:
        """Read replay requests until cancelled, calling ``ask`` for each valid one."""
        ...

    def close(self) -> None:
        """Close the sockets (pending frames are dropped)."""
        ...


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a ``tcp://HOST:PORT`` or ``ipc://PATH`` address to bind; else ``ValueError``."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return endpoint
    raise ValueError(f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")


class ZmqSockets:
    """:class:`EventSockets` over pyzmq's asyncio sockets, bound at construction.

    ``hwm``: the PUB socket's high-water mark (batches queued per slow
    subscriber before ZeroMQ drops them; vLLM's default).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *,
                 hwm: int = 100_000) -> None:
        import zmq
        import zmq.asyncio

        self._zmq: Any = zmq
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router: Any = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(check_endpoint(endpoint))
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(check_endpoint(replay_endpoint))
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> tuple[str, str | None]:
        """The bound endpoints (a ``:0`` port resolved): PUB, replay."""
        zmq = self._zmq
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        rep = None if self._router is None else self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        return pub, rep

    async def publish(self, frames: Sequence[bytes]) -> bool:
        """See :meth:`EventSockets.publish`."""
        try:
            await self._pub.send_multipart(list(frames), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            return False
        return True

    async def send_replay(self, frames: Sequence[Sequence[bytes]]) -> int:
        """See :meth:`EventSockets.send_replay`."""
        if self._router is None:
            return len(frames)
        lost = 0
        for parts in frames:
            try:
                await self._router.send_multipart(list(parts), flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                lost += 1
        return lost

    async def serve_replays(self, ask: ReplayAsk) -> None:
        """See :meth:`EventSockets.serve_replays` (returns at once without a replay socket)."""
        if self._router is None:
            return
        while True:
            frames = await self._router.recv_multipart()
            # NOTE: vLLM's shape: [identity, b"", start seq as 8 bytes big-endian];
            # anything else is ignored (the asker times out), never answered wrongly.
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            ask(bytes(frames[0]), int.from_bytes(frames[2], "big"))

    def close(self) -> None:
        """See :meth:`EventSockets.close`."""
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
