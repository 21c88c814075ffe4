"""The child-process grammar compiler: a compiler crash or stall costs a child, never this process."""

from __future__ import annotations

import threading
import time
from typing import Any

import llguidance
import pytest

from kernels.engine import (
    CHILD_STACK_BYTES,
    COMPILE_STACK_BYTES,
    GrammarCompiler,
    GrammarCompilerBusy,
    GrammarTooComplex,
    prepare_grammar,
    run_with_stack,
)
from tests.kernels.test_schema_limits import ref_chain
from tests.tool_models import tool_tokenizer


def _grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar of a schema, without kvtier's walk (to reach the compiler raw)."""
    return str(llguidance.LLMatcher.grammar_from_json_schema(schema))


@pytest.fixture
def compiler() -> Any:
    """A private pool (so a test's crashes and deadlines touch no other test)."""
    pool = GrammarCompiler(workers=1, deadline_s=5.0)
    yield pool
    pool.close()


def test_the_3000_ref_chain_kills_the_child_not_this_process(compiler: GrammarCompiler) -> None:
    """llguidance 1.9.1 overflows its stack on a 3,000-hop chain: the child dies by SIGSEGV, we get a 400-able error."""
    with pytest.raises(GrammarTooComplex, match="signal 11"):
        compiler.validate(_grammar(ref_chain(3000)))
    assert compiler.crashes == 1
    # NOTE: the dead child is replaced on next use.
    assert not compiler.validate(_grammar({"type": "integer"})).is_error
    assert compiler.crashes == 1


def test_a_child_killed_by_a_signal_is_replaced(compiler: GrammarCompiler) -> None:
    """SIGKILL to the idle child between two requests: the next compile starts a new one."""
    assert not compiler.validate(_grammar({"type": "string"})).is_error
    child = compiler._idle.queue[0]
    assert child is not None
    child.proc.kill()
    child.proc.wait()
    assert not compiler.validate(_grammar({"type": "boolean"})).is_error
    assert compiler._idle.queue[0] is not child


def test_a_grammar_the_compiler_refuses_is_an_error_not_a_crash(compiler: GrammarCompiler) -> None:
    """llguidance's own refusal comes back as is_error with its message (the child lives on)."""
    result = compiler.validate(_grammar({"enum": [f"value-{i}" for i in range(100_000)]}))
    assert result.is_error
    assert "too big" in result.messages[0]
    assert compiler.crashes == 0


def test_a_compile_past_the_deadline_kills_its_child() -> None:
    """A 1 ms deadline on a 10,000-value enum (tens of ms): refused as too complex, child replaced."""
    pool = GrammarCompiler(workers=1, deadline_s=0.001)
    try:
        # NOTE: warm the child first so the deadline measures the compile, not the start.
        pool.deadline_s = 5.0
        pool.validate(_grammar({"type": "null"}))
        pool.deadline_s = 0.001
        with pytest.raises(GrammarTooComplex, match="no answer within"):
            pool.validate(_grammar({"enum": [f"v{i}" for i in range(10_000)]}))
        pool.deadline_s = 5.0
        assert not pool.validate(_grammar({"type": "null"})).is_error
    finally:
        pool.close()


def test_no_free_child_within_the_deadline_is_busy() -> None:
    """With the only child taken, a caller waits the deadline, then gets GrammarCompilerBusy."""
    pool = GrammarCompiler(workers=1, deadline_s=0.3)
    try:
        slot = pool._idle.get()
        start = time.monotonic()
        with pytest.raises(GrammarCompilerBusy):
            pool.validate(_grammar({"type": "null"}))
        assert 0.25 < time.monotonic() - start < 2.0
        pool._idle.put(slot)
        assert not pool.validate(_grammar({"type": "null"})).is_error
    finally:
        pool.close()


def test_the_child_stack_is_the_smaller_one() -> None:
    """The parent's compile thread has 8x the child's stack: what the child compiled cannot overflow it."""
    assert COMPILE_STACK_BYTES >= 8 * CHILD_STACK_BYTES
    pool = GrammarCompiler(workers=1, stack_bytes=256 << 10)
    try:
        # NOTE: 100 hops overflow a 256 KiB stack; the default child's 2 MiB takes them.
        with pytest.raises(GrammarTooComplex, match="signal"):
            pool.validate(_grammar(ref_chain(100)))
    finally:
        pool.close()
    tok = tool_tokenizer()
    grammar = _grammar(ref_chain(400))
    assert prepare_grammar(tok, grammar, len(tok._tokenizer)) is not None


def test_run_with_stack_returns_raises_and_restores_the_default() -> None:
    """The value and the exception come back to the caller; the process default stack is unchanged."""
    before = threading.stack_size()
    assert run_with_stack(lambda: threading.current_thread().name) == "grammar-compile"
    with pytest.raises(ZeroDivisionError):
        run_with_stack(lambda: 1 // 0)
    assert threading.stack_size() == before
