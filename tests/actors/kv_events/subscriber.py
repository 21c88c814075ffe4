"""A plain ZeroMQ subscriber for tests: SUB socket + replay (DEALER), vLLM's decoder, a block index.

Applies batches in sequence order: a batch is applied once; a gap asks the
replay socket for what was missed; :meth:`resync` starts over from seq 0
(a late subscriber, or a server that restarted).
"""

from __future__ import annotations

import anyio
import zmq
import zmq.asyncio

from tests.actors.kv_events.vllm_structs import ARRAY_DECODER, BlockIndexMirror


class Subscriber:
    """Connects to ``pub`` (and ``replay``) and keeps :attr:`mirror` up to date."""

    def __init__(self, pub: str, replay: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(replay)
        self.mirror = BlockIndexMirror()
        self.last_seq = -1
        self.replays = 0

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return
        self.mirror.apply(ARRAY_DECODER.decode(payload))
        self.last_seq = seq

    async def replay_from(self, start: int) -> None:
        """Ask for every buffered batch from ``start`` on and apply the ones not applied yet."""
        self.replays += 1
        await self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        with anyio.fail_after(10):
            while True:
                _, seq_raw, payload = await self._replay.recv_multipart()
                seq = int.from_bytes(seq_raw, "big", signed=True)
                if seq == -1:
                    return
                self._apply(seq, payload)

    async def resync(self) -> None:
        """Start over: forget everything and replay the stream from seq 0."""
        self.mirror = BlockIndexMirror()
        self.last_seq = -1
        await self.replay_from(0)

    async def pump(self, quiet: float = 0.5, limit: float = 20.0) -> None:
        """Apply live batches until none arrived for ``quiet`` seconds (a gap is replayed)."""
        with anyio.fail_after(limit):
            while await self._sub.poll(int(quiet * 1000)):
                _, seq_raw, payload = await self._sub.recv_multipart()
                seq = int.from_bytes(seq_raw, "big")
                if seq > self.last_seq + 1:
                    await self.replay_from(self.last_seq + 1)
                self._apply(seq, payload)

    def close(self) -> None:
        """Close the sockets."""
        self._sub.close(0)
        self._replay.close(0)
        self._ctx.term()
