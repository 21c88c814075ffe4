"""The grammar compiler's child process: validates llguidance grammars, one at a time.

Run as a script by path (``python -I .../_grammar_child.py STACK AS``), never
imported: it needs only the standard library and llguidance, so the child
starts without MLX or the kvtier packages. Protocol on stdin/stdout, one
request at a time: a 4-byte big-endian length and that many bytes of UTF-8
grammar in; a 4-byte length and a JSON ``[is_error, [messages]]`` out.
The child writes one byte ``R`` when it is ready, before the first request.
EOF on stdin ends the child (the parent closed the pipe or died).

Limits set here, before llguidance is imported: address space
(``RLIMIT_AS``, so a runaway allocation aborts this process, not the
machine), no core file, and the validating thread's stack (``STACK`` bytes,
no larger than the parent's compile thread, so whatever compiles here also
compiles in the parent).
"""

from __future__ import annotations

import json
import resource
import struct
import sys
import threading
from typing import Any

_HEADER = struct.Struct(">I")


def _read_exact(stream: Any, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _limit(kind: int, value: int) -> None:
    _soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, hard))


def main() -> int:
    """Serve validation requests until stdin closes."""
    stack = int(sys.argv[1])
    address_space = int(sys.argv[2])
    _limit(resource.RLIMIT_CORE, 0)
    if address_space > 0:
        _limit(resource.RLIMIT_AS, address_space)
    import llguidance

    threading.stack_size(stack)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    # NOTE: one byte once ready, so the parent's compile deadline never
    # counts this interpreter's start.
    sink.write(b"R")
    sink.flush()
    while True:
        header = _read_exact(source, _HEADER.size)
        if header is None:
            return 0
        body = _read_exact(source, _HEADER.unpack(header)[0])
        if body is None:
            return 0
        grammar = body.decode("utf-8")
        answer: list[Any] = []

        def validate(text: str = grammar, out: list[Any] = answer) -> None:
            try:
                is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
                out.append([bool(is_error), [str(m) for m in messages]])
            except (ValueError, TypeError) as exc:
                out.append([True, [str(exc)]])

        worker = threading.Thread(target=validate, name="grammar-validate")
        worker.start()
        worker.join()
        reply = json.dumps(answer[0] if answer else [True, ["the compiler raised"]]).encode()
        sink.write(_HEADER.pack(len(reply)) + reply)
        sink.flush()


if __name__ == "__main__":
    sys.exit(main())
