"""Rank 0 tells the other ranks of a tensor-parallel group what to run next, over the group itself.

A command is a fixed header of ``HEADER_WORDS`` int32 (``op``, ``gen``,
``payload bytes``, a check word) and, when the payload is not empty, the
payload's bytes packed into int32 words. Both travel as ``all_sum`` over the
group: rank 0 contributes the values, every other rank zeros, so the sum
every rank reads is rank 0's command.

NOTE: the commands ride the same MLX stream as the sharded model's own
collectives (``kernels._device.generation_stream()``, where ``kernels.Generation``
runs its forwards), so they stay ordered with the forwards on every rank
without a second connection to configure; the price is one collective (and
a wait for the stream) per command. A collective on another stream could run
beside a forward's and pair with the wrong ``all_sum`` on another rank.
Engine thread only, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

__all__ = ["HEADER_WORDS", "MAX_PAYLOAD_BYTES", "Channel", "ChannelError", "Command"]

HEADER_WORDS: Final = 4
MAX_PAYLOAD_BYTES: Final = 1 << 30
_CHECK: Final = 0x6B76_5450  # "kvTP"


class ChannelError(RuntimeError):
    """A command header that rank 0 cannot have sent (the ranks are out of step)."""


@dataclass(frozen=True, slots=True)
class Command:
    """One command from rank 0: an operation code, a generation id and an opaque payload."""

    op: int
    gen: int
    payload: bytes = b""


class Channel:
    """Sends (rank 0) or receives (other ranks) commands over ``group`` (an ``mx.distributed.Group``)."""

    def __init__(self, group: Any, stream: Any = None) -> None:
        from kernels._device import generation_stream

        self._group = group
        self._stream = generation_stream() if stream is None else stream
        self.rank = int(group.rank())
        self.size = int(group.size())
        self.sent = 0

    def _sum(self, words: Any) -> Any:
        import mlx.core as mx

        with mx.stream(self._stream):
            out = mx.distributed.all_sum(words, group=self._group)
            mx.eval(out)
        return out

    def send(self, command: Command) -> None:
        """Rank 0: broadcast ``command`` (blocks until every rank took part in the sums)."""
        import mlx.core as mx
        import numpy as np

        if self.rank != 0:
            raise ChannelError("only rank 0 sends commands")
        if command.op <= 0:
            raise ValueError("command op must be > 0 (0 is what no sender looks like)")
        if len(command.payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"command payload of {len(command.payload)} bytes")
        n = len(command.payload)
        header = [command.op, command.gen, n, _CHECK ^ command.op ^ n]
        self._sum(mx.array(header, dtype=mx.int32))
        if n:
            padded = command.payload + b"\0" * (-n % 4)
            self._sum(mx.array(np.frombuffer(padded, dtype=np.int32)))
        self.sent += 1

    def receive(self) -> Command:
        """Another rank: wait for rank 0's next command (blocks in the collective meanwhile)."""
        import mlx.core as mx
        import numpy as np

        if self.rank == 0:
            raise ChannelError("rank 0 does not receive commands")
        op, gen, n, check = (int(v) for v in self._sum(mx.zeros((HEADER_WORDS,), mx.int32)).tolist())
        if op <= 0 or n < 0 or n > MAX_PAYLOAD_BYTES or check != _CHECK ^ op ^ n:
            raise ChannelError(f"a command header rank 0 cannot have sent: {[op, gen, n, check]}")
        payload = b""
        if n:
            words = self._sum(mx.zeros(((n + 3) // 4,), mx.int32))
            payload = np.array(words, dtype=np.int32).tobytes()[:n]
        return Command(op, gen, payload)
