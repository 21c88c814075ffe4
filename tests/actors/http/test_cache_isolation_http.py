"""The ``cache_salt`` request field and ``--cache-namespace api-key`` at the HTTP edge.

Scripted engine: the field's validation (400 naming it) and what reaches the
engine's parameters. Real engine (tiny Llama, prompt cache on): what a client
sees in ``usage.prompt_tokens_details.cached_tokens`` per salt and per API key.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from actors.engine import Engine
from actors.engine.config import ConfigError, EngineConfig, add_flags, config_from_flags
from actors.http import HttpSettings, HttpState, create_app
from tests.tiny_models import tiny_llama, tiny_tokenizer

from .fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = {"messages": [{"role": "user", "content": "hi"}]}
SECRET = "You are the assistant of ACME. The launch code is 7 3 9 1 and must stay secret. " * 2


def _fake_client(engine: FakeEngine, settings: HttpSettings) -> httpx.AsyncClient:
    app = create_app(engine, settings, state=HttpState(new_id=lambda: "abc"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.mark.parametrize("salt", ["", "x" * 257, 7, None])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_bad_cache_salt_is_a_400_naming_the_field(path: str, salt: object) -> None:
    """An empty, over-long (> 256) or non-string cache_salt gets a 400 whose param is
    cache_salt, on both generation routes, and never reaches the engine (null is the
    field's absence and is accepted)."""
    engine = FakeEngine()
    body = HELLO if path == CHAT else {"prompt": "hi"}
    async with _fake_client(engine, HttpSettings()) as c:
        r = await c.post(path, json={**body, "cache_salt": salt})
    if salt is None:
        assert r.status_code == 200, r.text
        assert engine.calls[0].params is not None
        assert engine.calls[0].params.cache_salt is None
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"
    assert engine.calls == []


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_the_salt_reaches_the_engine_and_shared_mode_sets_no_scope(path: str) -> None:
    """cache_salt arrives in the engine's GenerationParams; in shared mode the API key plays
    no part in the namespace (cache_scope None)."""
    engine = FakeEngine()
    body = HELLO if path == CHAT else {"prompt": "hi"}
    async with _fake_client(engine, HttpSettings()) as c:
        r = await c.post(path, json={**body, "cache_salt": "tenant-a"},
                         headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200, r.text
    params = engine.calls[0].params
    assert params is not None
    assert (params.cache_salt, params.cache_scope) == ("tenant-a", None)


async def test_api_key_mode_scopes_by_bearer_token_and_never_carries_the_key() -> None:
    """With cache_namespace=api-key one token always gives one scope, two tokens two scopes,
    no token no scope; the scope is a digest (the key itself never travels in the params)."""
    engine = FakeEngine()
    scopes: list[str | None] = []
    async with _fake_client(engine, HttpSettings(cache_namespace="api-key")) as c:
        for auth in ("Bearer key-one", "bearer  key-one ", "Bearer key-two", None):
            headers = {"Authorization": auth} if auth is not None else {}
            r = await c.post(CHAT, json=HELLO, headers=headers)
            assert r.status_code == 200, r.text
            params = engine.calls[-1].params
            assert params is not None
            scopes.append(params.cache_scope)
    assert scopes[0] == scopes[1] is not None
    assert scopes[2] is not None
    assert scopes[2] != scopes[0]
    assert scopes[3] is None
    assert all("key-" not in (s or "") for s in scopes)


def test_the_flag_and_variable_reach_the_http_settings() -> None:
    """--cache-namespace api-key (or KVTIER_CACHE_NAMESPACE) sets the HTTP settings' mode;
    the default is shared; another value is a ConfigError naming the option."""
    parser = argparse.ArgumentParser()
    add_flags(parser, environ={})
    flagged = config_from_flags(parser.parse_args(["--cache-namespace", "api-key"]))
    assert HttpSettings.from_config(flagged).cache_namespace == "api-key"
    assert EngineConfig.from_env({"KVTIER_CACHE_NAMESPACE": "api-key"}).cache_namespace == "api-key"
    assert HttpSettings.from_config(EngineConfig()).cache_namespace == "shared"
    with pytest.raises(ConfigError, match="KVTIER_CACHE_NAMESPACE"):
        EngineConfig.from_env({"KVTIER_CACHE_NAMESPACE": "per-user"})


# --- through a real engine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tok))


Post = Callable[..., Any]


async def _serving(model: Any, tok: Any, settings: HttpSettings) -> AsyncIterator[Post]:
    async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=1 << 26,
                                  snapshot_min_new_tokens=8) as engine:
        app = create_app(engine, settings)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:

            async def cached(key: str | None = None, **extra: Any) -> int:
                messages = [{"role": "system", "content": SECRET},
                            {"role": "user", "content": "What is the code?"}]
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = await c.post(CHAT, json={"messages": messages, "max_tokens": 3, **extra},
                                 headers=headers)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                assert usage["prompt_tokens"] > 60
                return int(usage["prompt_tokens_details"]["cached_tokens"])

            yield cached


@pytest.fixture
async def shared(model: Any, tok: Any) -> AsyncIterator[Post]:
    """POST the secret-prompt chat to an app over a real engine in shared mode; cached_tokens."""
    async for post in _serving(model, tok, HttpSettings()):
        yield post


@pytest.fixture
async def per_key(model: Any, tok: Any) -> AsyncIterator[Post]:
    """The same with cache_namespace=api-key (no key required: a front proxy authenticates)."""
    async for post in _serving(model, tok, HttpSettings(cache_namespace="api-key")):
        yield post


async def test_cached_tokens_follow_the_salt_over_http(shared: Post) -> None:
    """Over HTTP, a request under another salt or none reports 0 cached tokens for a prompt a
    salted client sent; the same salt reports the prefix (shared mode)."""
    assert await shared(cache_salt="victim") == 0
    assert await shared(cache_salt="attacker") == 0
    assert await shared() == 0
    assert await shared(cache_salt="victim") > 60


async def test_api_key_mode_gives_each_key_its_own_cache(per_key: Post) -> None:
    """In api-key mode another key reuses nothing of a key's prompt, the same key reuses it,
    and a salt under the same key is a namespace of its own (the pair)."""
    assert await per_key("key-victim") == 0
    assert await per_key("key-attacker") == 0
    assert await per_key() == 0
    assert await per_key("key-victim", cache_salt="s") == 0
    assert await per_key("key-attacker", cache_salt="s") == 0
    assert await per_key("key-victim") > 60
    assert await per_key("key-victim", cache_salt="s") > 60
