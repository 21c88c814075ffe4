"""The prompt cache's cold lookup keeps the request's namespace all the way to the file read."""

from __future__ import annotations

from actors.prompt_cache import core
from messages import Envelope, Take
from messages.prompt_cache import cache_namespace
from messages.ssd_writer import Find, FindResult, Restore

SALTED = cache_namespace("tenant-a")
PROMPT = tuple(range(1, 21))


def _run(state: core.CoreState, body: Take | FindResult, causation: str | None = None) -> list[
    core.Effect
]:
    envelope = Envelope("m-1", "c-1", causation, "gateway", "prompt_cache", 0.0, body)
    _, effects = core.handle(state, core.Received(envelope, 0.0))
    return [e for e in effects if not isinstance(e, core.SetAlarm)]


def test_find_and_restore_carry_the_takes_namespace() -> None:
    """A salted Take asks Find in its namespace, and the Restore of the file found names the
    same namespace (so the index refuses a file of any other)."""
    state = core.CoreState(cap_bytes=1000, spill_enabled=True, cold_lookups=True)
    (ask,) = _run(state, Take(tokens=PROMPT, namespace=SALTED, reply_to="gateway"))
    assert isinstance(ask, core.AskCold)
    assert ask.body == Find(tokens=PROMPT, namespace=SALTED)
    _, _ = core.handle(state, core.ColdAskSent(ask.take_id, "ask-1", 0.0))
    found = FindResult(choice="restore", path="/f.kvt", cached_tokens=12, entry_tokens=14,
                       file_bytes=100)
    (restore,) = _run(state, found, causation="ask-1")
    assert isinstance(restore, core.AskCold)
    assert restore.body == Restore(path="/f.kvt", namespace=SALTED, ticket=ask.take_id)
