"""Compiling grammars where a compiler crash cannot take the server down.

llguidance is native code: a grammar it recurses too deep on overflows the
stack and kills the process (SIGSEGV), whatever Python does. So every
grammar is first validated by :class:`GrammarCompiler` in a child process
(``_grammar_child.py``, a fresh interpreter: no ``fork`` of a process that
has run MLX, which hangs the child), and only a grammar that compiled there
is compiled again in this process, on a thread whose stack is larger than
the child's (:func:`run_with_stack`).

The pool is bounded: ``workers`` children, each serving one grammar at a
time; a caller waits at most ``deadline_s`` for a free one
(:class:`GrammarCompilerBusy`), and a compile that takes longer than
``deadline_s`` kills its child. A child that dies (by a signal, or killed
at the deadline) is replaced on next use and the grammar is refused with
:class:`GrammarTooComplex`; the server keeps serving.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ._grammar_errors import GrammarCompilerBusy, GrammarTooComplex

__all__ = [
    "CHILD_STACK_BYTES",
    "COMPILE_STACK_BYTES",
    "CompileResult",
    "GrammarCompiler",
    "default_compiler",
    "run_with_stack",
]

MIB = 1 << 20
CHILD_STACK_BYTES = 2 * MIB
"""Stack of the child's validating thread."""
COMPILE_STACK_BYTES = 16 * MIB
"""Stack of the thread that compiles a grammar in this process.

NOTE: 8x the child's: llguidance's compile with the real tokenizer may use
somewhat more stack than its validation, and it visits ``$defs`` in its own
(hash) order, which differs between processes. A grammar the child
validated therefore never gets close to this stack's end.
"""
CHILD_ADDRESS_SPACE = 4 << 30
"""``RLIMIT_AS`` of a child: a runaway allocation aborts the child, not the machine."""

CHILD_START_S = 60.0
"""How long a new child may take to start (an interpreter and llguidance on a busy machine)."""

_CHILD = Path(__file__).with_name("_grammar_child.py")
_HEADER = struct.Struct(">I")
_MAX_REPLY = 1 << 20

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CompileResult:
    """llguidance's verdict: ``is_error`` and its messages (warnings when not an error)."""

    is_error: bool
    messages: tuple[str, ...]


class _Child:
    """One child process and its pipes."""

    def __init__(self, stack_bytes: int, address_space: int) -> None:
        # NOTE: -I: no user site, no PYTHON* variables, no script directory on
        # sys.path; the venv's site-packages (llguidance) stay.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(_CHILD), str(stack_bytes), str(address_space)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            close_fds=True)
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.out_fd = self.proc.stdout.fileno()

    def ready(self, timeout: float) -> bool:
        """Wait for the child's ready byte (its interpreter and llguidance loaded)."""
        return self._read(1, time.monotonic() + timeout) == b"R"

    def ask(self, grammar: str, deadline: float) -> CompileResult | None:
        """The child's verdict, or ``None`` when it died or ran past ``deadline``."""
        data = grammar.encode("utf-8")
        try:
            self.stdin.write(_HEADER.pack(len(data)) + data)
            self.stdin.flush()
        except (BrokenPipeError, ValueError):
            return None
        header = self._read(_HEADER.size, deadline)
        if header is None:
            return None
        size = _HEADER.unpack(header)[0]
        if size > _MAX_REPLY:
            return None
        body = self._read(size, deadline)
        if body is None:
            return None
        try:
            is_error, messages = json.loads(body)
        except ValueError:
            return None
        return CompileResult(bool(is_error), tuple(str(m) for m in messages))

    def _read(self, n: int, deadline: float) -> bytes | None:
        data = b""
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.out_fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.out_fd, n - len(data))
            if not chunk:
                return None  # NOTE: EOF: the child died
            data += chunk
        return data

    def kill(self) -> int | None:
        """Stop the child (SIGKILL if still running) and reap it; its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.stdin.close()
        except BrokenPipeError:
            pass
        code = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


class GrammarCompiler:
    """A bounded pool of child processes that validate grammars (see the module docstring).

    Thread-safe; callers block (on a worker thread, never the event loop)
    for at most about ``2 * deadline_s``. Children start on first use.
    """

    def __init__(self, *, workers: int = 2, deadline_s: float = 5.0,
                 stack_bytes: int = CHILD_STACK_BYTES,
                 address_space: int = CHILD_ADDRESS_SPACE) -> None:
        if workers < 1 or deadline_s <= 0:
            raise ValueError("workers must be >= 1 and deadline_s > 0")
        self.workers = workers
        self.deadline_s = deadline_s
        self._stack = stack_bytes
        self._address_space = address_space
        self._idle: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # NOTE: None: a slot whose child starts on first use
        self._lock = threading.Lock()
        self._closed = False
        self.crashes = 0
        """Children that died or were killed at the deadline (a count, for tests and stats)."""

    def validate(self, grammar: str) -> CompileResult:
        """llguidance's verdict on ``grammar``, computed in a child.

        Raises :class:`GrammarTooComplex` when the child died or ran past
        the deadline, :class:`GrammarCompilerBusy` when no child was free
        within the deadline.
        """
        try:
            child = self._idle.get(timeout=self.deadline_s)
        except queue.Empty:
            raise GrammarCompilerBusy(
                f"every grammar compiler ({self.workers}) stayed busy for "
                f"{self.deadline_s:g} s; try again") from None
        keep: _Child | None = None
        try:
            if self._closed:
                raise GrammarCompilerBusy("the grammar compiler is closed")
            if child is None or child.proc.poll() is not None:
                if child is not None:
                    child.kill()
                child = _Child(self._stack, self._address_space)
                if not child.ready(CHILD_START_S):
                    child.kill()
                    child = None
                    raise GrammarCompilerBusy(
                        f"the grammar compiler did not start within {CHILD_START_S:g} s")
            deadline = time.monotonic() + self.deadline_s
            result = child.ask(grammar, deadline)
            if result is None:
                status = child.proc.poll()
                if status is None and time.monotonic() < deadline:
                    # NOTE: its pipe closed before the deadline: it is dying; read how.
                    try:
                        status = child.proc.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        status = None
                child.kill()
                with self._lock:
                    self.crashes += 1
                how = (f"the compiler died by signal {-status}" if status is not None and status < 0
                       else f"the compiler exited with status {status}" if status is not None
                       else f"no answer within {self.deadline_s:g} s")
                raise GrammarTooComplex(f"schema too complex to compile ({how})")
            keep = child
            return result
        finally:
            self._idle.put(keep)

    def close(self) -> None:
        """Stop every idle child (busy ones are stopped when their caller returns them)."""
        self._closed = True
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()


_DEFAULT: GrammarCompiler | None = None
_DEFAULT_LOCK = threading.Lock()


def default_compiler() -> GrammarCompiler:
    """The process's compiler pool (made on first use, closed at exit)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = GrammarCompiler()
            atexit.register(_DEFAULT.close)
        return _DEFAULT


_STACK_LOCK = threading.Lock()


def run_with_stack(fn: Callable[[], T], stack_bytes: int = COMPILE_STACK_BYTES) -> T:
    """``fn()`` on a fresh thread with a ``stack_bytes`` stack; blocks; re-raises its exception.

    NOTE: the thread's stack is set explicitly because the default differs
    by platform (8 MiB on Linux, 512 KiB for macOS threads): the compile
    must not depend on which worker thread asked.
    """
    out: list[Any] = []
    errors: list[Exception] = []

    def body() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - NOTE: handed to the caller, re-raised there
            errors.append(exc)

    with _STACK_LOCK:
        # NOTE: threading.stack_size is process-wide and read at thread start;
        # set it only around this start (a thread another module starts
        # meanwhile gets a larger stack, which is harmless).
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=body, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if errors:
        raise errors[0]
    return out[0]  # type: ignore[no-any-return]
