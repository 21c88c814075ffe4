"""Cache isolation in the SSD index: a file serves only the namespace it was stored under."""

from __future__ import annotations

from actors.ssd_writer import core
from messages import Find, FindResult, Restore, RestoreResult
from messages.prompt_cache import cache_namespace

from .test_core import answer, deliver, entry, env, loaded

SALT_A = cache_namespace("tenant-a")
SALT_B = cache_namespace("tenant-b")


def _find(state: core.IndexState, prompt: tuple[int, ...], ns: str) -> FindResult:
    _, fx = deliver(state, env(Find(tokens=prompt, namespace=ns)))
    (body,) = [e.body for e in fx if isinstance(e, core.Answer)]
    assert isinstance(body, FindResult)
    return body


def test_find_offers_a_salted_file_to_its_namespace_only() -> None:
    """A file stored under salt A is a candidate for A's prompts, never for salt B's or the
    shared namespace's, even with the very same tokens."""
    prompt = tuple(range(1, 40))
    a = entry(prompt[:30], ns=SALT_A)
    state = loaded(a)
    assert _find(state, prompt, SALT_A).path == a.path
    assert _find(state, prompt, SALT_B).path is None
    assert _find(state, prompt, "").path is None


def test_restore_refuses_a_file_of_another_namespace() -> None:
    """A Restore naming another namespace than the file's is answered gone (counted as a
    failed restore) and nothing is read; the file's own namespace gets the read."""
    a = entry(tuple(range(1, 31)), ns=SALT_A)
    state = loaded(a)
    request = env(Restore(path=a.path, namespace=SALT_B, reply_to="r"))
    _, fx = deliver(state, request)
    body = answer(fx, request)
    assert isinstance(body, RestoreResult)
    assert (body.ok, body.reason) == (False, "gone")
    assert not any(isinstance(e, core.StartRead) for e in fx)
    assert state.restore_failures == 1
    request = env(Restore(path=a.path, namespace=SALT_A, reply_to="r"))
    _, fx = deliver(state, request)
    assert fx == [core.StartRead(request, a.path, SALT_A, a.tokens)]


def test_the_same_tokens_under_two_namespaces_are_two_files() -> None:
    """Salts A and B storing the same tokens get different paths (one directory per
    namespace) and both stay indexed: neither replaces the other."""
    tokens = tuple(range(1, 21))
    a, b = entry(tokens, ns=SALT_A), entry(tokens, ns=SALT_B)
    assert a.path != b.path
    state = loaded(a, b)
    assert set(state.entries) == {a.path, b.path}
    assert _find(state, (*tokens, 99), SALT_B).path == b.path
