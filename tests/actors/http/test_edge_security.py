"""The HTTP edge against browsers, proxies and hostile input, over a scripted engine.

Host allowlist (DNS rebinding), admin routes closed by default (key or an
opt-in loopback pass; ``X-Forwarded-For`` only from trusted proxies), a POST
that is not JSON gets 415 (CSRF), 500s without the engine's text, deep JSON in
tool-call arguments, calls to undeclared tools, ``/health`` without the model
path, and keys that would silently disable auth.
"""

from __future__ import annotations

import io
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from actors.cli import build_parser
from actors.cli.serve import run, serve_config
from actors.engine.config import ConfigError, EngineConfig
from actors.http import HttpSettings, HttpState, create_app
from actors.http._access import LOOPBACK_HOSTS, client_address, host_allowed, parse_networks
from actors.runtime import configure_logging

from .fake_engine import FakeEngine, Script
from .test_server import _body, _read_all, restore_signals, running

pytestmark = pytest.mark.anyio

__all__ = ["restore_signals"]  # NOTE: the imported autouse fixture must stay in this module.

CHAT = "/v1/chat/completions"
FLUSH = "/admin/cache/flush"
HELLO = {"messages": [{"role": "user", "content": "hi"}]}
JSON = {"content-type": "application/json"}


@dataclass
class AdminEngine(FakeEngine):
    """A scripted engine with the admin operations: counts the flushes that reached it."""

    flushes: int = 0

    async def flush(self, *, timeout: float | None = None) -> None:
        self.flushes += 1

    async def demote_cache(self, **_: Any) -> None:
        return None


def _client(engine: FakeEngine, settings: HttpSettings | None = None, *,
            peer: tuple[str, int] = ("127.0.0.1", 50000),
            base_url: str = "http://127.0.0.1:8080") -> httpx.AsyncClient:
    app = create_app(engine, settings or HttpSettings(), state=HttpState(new_id=lambda: "abc"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=peer),
                             base_url=base_url)


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code, err
    return dict(err)


# ------------------------------------------------------------------ Host allowlist


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example",
                                  "127.0.0.2", "[::2]:8080", ""])
async def test_foreign_host_is_400_on_a_loopback_server(host: str) -> None:
    """A loopback-bound server answers 400 invalid_host to a Host it does not own, before any engine call."""
    engine = FakeEngine()
    settings = HttpSettings.from_config(EngineConfig(host="127.0.0.1"))
    async with _client(engine, settings) as c:
        chat = await c.post(CHAT, json=HELLO, headers={"host": host})
        stats = await c.get("/stats", headers={"host": host})
    _error(chat, 400, "invalid_host")
    _error(stats, 400, "invalid_host")
    assert engine.calls == []


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "LOCALHOST:1", "127.0.0.1",
                                  "127.0.0.1:8080", "[::1]", "[::1]:8080", "[0:0:0:0:0:0:0:1]:80"])
async def test_loopback_names_are_served_with_or_without_a_port(host: str) -> None:
    """localhost, 127.0.0.1 and [::1] (any port, any case, any IPv6 spelling) are answered."""
    settings = HttpSettings.from_config(EngineConfig(host="::1"))
    async with _client(FakeEngine(), settings) as c:
        r = await c.post(CHAT, json=HELLO, headers={"host": host})
    assert r.status_code == 200, r.text


def test_allowlist_defaults_follow_the_bind_address_and_the_option() -> None:
    """Loopback binds get the loopback names; other binds, '*' and explicit lists mean what they say."""
    def hosts(**options: Any) -> tuple[str, ...] | None:
        return HttpSettings.from_config(EngineConfig(**options)).allowed_hosts

    assert hosts() == LOOPBACK_HOSTS
    assert hosts(host="localhost") == LOOPBACK_HOSTS
    assert hosts(host="0.0.0.0") is None
    assert hosts(host="127.0.0.1", allowed_hosts="*") is None
    assert hosts(host="0.0.0.0", allowed_hosts="llm.internal, ::1,Proxy:8443") == (
        "llm.internal", "[::1]", "proxy:8443")
    assert EngineConfig.from_env({"KVTIER_ALLOWED_HOSTS": "a.example"}).allowed_hosts == (
        "a.example",)
    with pytest.raises(ConfigError, match="allowed_hosts"):
        EngineConfig(allowed_hosts="a.example,,b")


def test_host_matching_rules() -> None:
    """An entry without a port matches any port; with a port only that one; junk matches nothing."""
    allowed = ("llm.internal", "proxy:8443", "[::1]")
    assert host_allowed(b"llm.internal:1234", allowed)
    assert host_allowed(b"proxy:8443", allowed)
    assert not host_allowed(b"proxy:80", allowed)
    assert not host_allowed(b"proxy", allowed)
    assert host_allowed(b"[::1]:9", allowed)
    assert not host_allowed(None, allowed)
    assert not host_allowed(b"llm.internal@evil.example", allowed)
    assert not host_allowed(b"llm.internal/x", allowed)
    assert not host_allowed("llm.internal\u00e9".encode(), allowed)


async def test_real_loopback_server_refuses_a_rebinding_host() -> None:
    """On a real socket, a loopback-bound server answers Host: evil.example with 400 and serves Host: 127.0.0.1."""
    settings = HttpSettings.from_config(EngineConfig(host="127.0.0.1"))
    async with running(settings=settings) as srv:
        for host, expected in ((b"evil.example", 400), (f"127.0.0.1:{srv.port}".encode(), 200)):
            async with await anyio.connect_tcp("127.0.0.1", srv.port) as stream:
                await stream.send(b"GET /stats HTTP/1.1\r\nHost: " + host
                                  + b"\r\nConnection: close\r\n\r\n")
                status, _, body = _body(await _read_all(stream))
            assert status == expected, body
            if expected == 400:
                assert body["error"]["code"] == "invalid_host"


# -------------------------------------------------------------------- content type


async def test_text_plain_post_to_an_admin_route_is_415_even_from_loopback() -> None:
    """A browser's "simple" text/plain POST cannot reach an admin route, even with the loopback pass on."""
    engine = AdminEngine()
    async with _client(engine, HttpSettings(admin_loopback=True)) as c:
        plain = await c.post(FLUSH, content=b"", headers={"content-type": "text/plain"})
        bare = await c.post(FLUSH)
        ok = await c.post(FLUSH, headers=JSON)
    _error(plain, 415, "unsupported_media_type")
    _error(bare, 415, "unsupported_media_type")
    assert ok.status_code == 503  # no SSD tier: the handler ran
    assert engine.flushes == 1


# -------------------------------------------------------------------------- admin


async def test_admin_without_key_or_opt_in_is_403_even_from_loopback() -> None:
    """With no key and no --admin-loopback, admin routes answer 403 admin_forbidden to everyone."""
    engine = AdminEngine()
    for peer in (("127.0.0.1", 1), ("::1", 1), ("10.1.2.3", 1)):
        async with _client(engine, HttpSettings(), peer=peer) as c:
            r = await c.post(FLUSH, headers=JSON)
            drain = await c.post("/admin/cache/drain", headers=JSON)
        _error(r, 403, "admin_forbidden")
        _error(drain, 403, "admin_forbidden")
    assert engine.flushes == 0


async def test_admin_loopback_opt_in_admits_loopback_clients_only() -> None:
    """--admin-loopback lets 127.0.0.1 and ::1 in without a key; a remote client still gets 403."""
    engine = AdminEngine()
    settings = HttpSettings(admin_loopback=True)
    for peer in (("127.0.0.1", 1), ("::1", 1)):
        async with _client(engine, settings, peer=peer) as c:
            assert (await c.post(FLUSH, headers=JSON)).status_code == 503
    async with _client(engine, settings, peer=("10.1.2.3", 1)) as c:
        _error(await c.post(FLUSH, headers=JSON), 403, "admin_forbidden")
    assert engine.flushes == 2


async def test_admin_takes_the_api_key_unless_an_admin_key_is_set() -> None:
    """The API key opens admin routes; with --admin-key only that key does, and it opens nothing else."""
    engine = AdminEngine()
    remote = ("10.1.2.3", 1)
    async with _client(engine, HttpSettings(api_key="user"), peer=remote) as c:
        _error(await c.post(FLUSH, headers=JSON), 401, "invalid_api_key")
        assert (await c.post(FLUSH, headers={**JSON, "Authorization": "Bearer user"})
                ).status_code == 503
    assert engine.flushes == 1
    settings = HttpSettings(api_key="user", admin_key="root")
    async with _client(engine, settings, peer=remote) as c:
        user = await c.post(FLUSH, headers={**JSON, "Authorization": "Bearer user"})
        root = await c.post(FLUSH, headers={**JSON, "Authorization": "Bearer root"})
        models_as_root = await c.get("/v1/models", headers={"Authorization": "Bearer root"})
        models_as_user = await c.get("/v1/models", headers={"Authorization": "Bearer user"})
    _error(user, 401, "invalid_api_key")
    assert root.status_code == 503
    _error(models_as_root, 401, "invalid_api_key")
    assert models_as_user.status_code == 200
    assert engine.flushes == 2
    async with _client(engine, HttpSettings(admin_key="root"), peer=remote) as c:
        _error(await c.post(FLUSH, headers=JSON), 401, "invalid_api_key")
        assert (await c.post(FLUSH, headers={**JSON, "Authorization": "Bearer root"})
                ).status_code == 503
    assert engine.flushes == 3


async def test_forwarded_for_decides_only_behind_a_trusted_proxy() -> None:
    """X-Forwarded-For is ignored from untrusted peers; from a trusted proxy it names the client,
    and a trusted proxy that names nobody gets no loopback pass."""
    engine = AdminEngine()
    untrusted = HttpSettings(admin_loopback=True)
    proxied = HttpSettings(admin_loopback=True, trusted_proxies=("127.0.0.1",))
    spoof = {**JSON, "X-Forwarded-For": "127.0.0.1"}
    remote = {**JSON, "X-Forwarded-For": "203.0.113.9"}
    async with _client(engine, untrusted, peer=("10.1.2.3", 1)) as c:
        _error(await c.post(FLUSH, headers=spoof), 403, "admin_forbidden")
    async with _client(engine, proxied, peer=("127.0.0.1", 1)) as c:
        _error(await c.post(FLUSH, headers=remote), 403, "admin_forbidden")
        _error(await c.post(FLUSH, headers=JSON), 403, "admin_forbidden")
        chained = {**JSON, "X-Forwarded-For": "127.0.0.1, 203.0.113.9"}
        _error(await c.post(FLUSH, headers=chained), 403, "admin_forbidden")
        assert (await c.post(FLUSH, headers=spoof)).status_code == 503
    assert engine.flushes == 1


def test_client_address_reads_forwarded_hops_right_to_left() -> None:
    """The first untrusted hop from the right is the client; junk or no header from a trusted peer is unknown."""
    trusted = parse_networks(["127.0.0.1", "10.0.0.0/8"])
    assert client_address("192.0.2.1", [b"127.0.0.1"], trusted) == "192.0.2.1"
    assert client_address("127.0.0.1", [b"198.51.100.1, 203.0.113.9, 10.0.0.5"],
                          trusted) == "203.0.113.9"
    assert client_address("127.0.0.1", [b"198.51.100.1", b"10.0.0.5"], trusted) == "198.51.100.1"
    assert client_address("127.0.0.1", [b"10.0.0.7, 127.0.0.1"], trusted) == "10.0.0.7"
    assert client_address("127.0.0.1", [], trusted) is None
    assert client_address("127.0.0.1", [b"unknown"], trusted) is None
    with pytest.raises(ValueError, match="not an IP"):
        parse_networks(["proxy.local"])


async def test_real_server_ignores_forwarded_for_unless_configured() -> None:
    """On a real socket (uvicorn), X-Forwarded-For from 127.0.0.1 does not change who the client is
    unless --trusted-proxies names the peer."""
    async def flush(settings: HttpSettings) -> int:
        async with running(AdminEngine(), settings=settings) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
            r = await c.post(FLUSH, headers={**JSON, "X-Forwarded-For": "203.0.113.9"})
        return r.status_code

    assert await flush(HttpSettings(admin_loopback=True)) == 503
    assert await flush(HttpSettings(admin_loopback=True, trusted_proxies=("127.0.0.1",))) == 403


# --------------------------------------------------------------------- 500 bodies


@pytest.mark.usefixtures("restore_structlog")
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_failure_text_stays_in_the_log(stream: bool) -> None:
    """A 500 (or stream error event) says nothing of the engine's error text but names the request
    id; the log line with that id carries the text."""
    out = io.StringIO()
    configure_logging(format="json", level="info", stream=out)
    engine = FakeEngine(scripts=[Script(fail_after=1)])
    async with _client(engine) as c:
        r = await c.post(CHAT, json={**HELLO, "stream": stream})
    rid = r.headers["x-request-id"]
    if stream:
        events = [json.loads(b.removeprefix("data: ")) for b in r.text.split("\n\n") if b.strip()]
        err = events[-1]["error"]
    else:
        err = _error(r, 500, "generation_failed")
    assert err["code"] == "generation_failed"
    assert "scripted engine failure" not in r.text
    assert rid in err["message"]
    logged = [json.loads(line) for line in out.getvalue().splitlines()]
    [line] = [e for e in logged if e["event"] == "http.engine_error"]
    assert line["request_id"] == rid
    assert "scripted engine failure" in line["detail"]


# ------------------------------------------------------------------ request bodies


def _with_call(arguments: str, name: str = "f") -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


@pytest.mark.parametrize("depth", [101, 5_000, 100_000])
async def test_deeply_nested_tool_call_arguments_are_400(depth: int) -> None:
    """Tool-call arguments nested past 100 levels get a 400 naming the field (json.loads used to
    raise RecursionError: a 500), and the engine is never called."""
    engine = FakeEngine()
    body = _with_call("[" * depth + "]" * depth)
    async with _client(engine) as c:
        r = await c.post(CHAT, content=json.dumps(body).encode(), headers=JSON)
        after = await c.post(CHAT, json=HELLO)
    err = _error(r, 400, "invalid_value")
    assert err["param"] == "messages.1.tool_calls.0.function.arguments"
    assert "100 levels" in err["message"]
    assert after.status_code == 200
    assert len(engine.calls) == 1


async def test_nesting_at_the_limit_and_brackets_in_strings_are_accepted() -> None:
    """100 levels pass, and brackets inside JSON strings (escaped quotes too) do not count."""
    engine = FakeEngine()
    deep = "[" * 100 + "]" * 100
    quoted = json.dumps({"text": "[" * 500 + '\\"' + "{" * 500})
    async with _client(engine) as c:
        for arguments in (deep, quoted):
            r = await c.post(CHAT, json=_with_call(arguments))
            assert r.status_code == 200, r.text
    assert engine.calls[0].payload[1]["tool_calls"][0]["function"]["arguments"] == json.loads(deep)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ROGUE = ("<tool_call>\n", '{"name": "delete_everything", "arguments": {}}', "\n</tool_call>")


@pytest.mark.parametrize("tools", [[WEATHER], None])
async def test_call_to_an_undeclared_tool_stays_content(tools: list[Any] | None) -> None:
    """A generated call whose name is not among the request's tools is not reported as a tool call:
    its text is the answer's content and finish_reason is stop (streamed too)."""
    body: dict[str, Any] = {**HELLO, **({"tools": tools} if tools else {})}
    engine = FakeEngine(scripts=[Script(tokens=ROGUE, eos=True), Script(tokens=ROGUE, eos=True)])
    async with _client(engine) as c:
        whole = (await c.post(CHAT, json=body)).json()
        streamed = await c.post(CHAT, json={**body, "stream": True})
    choice = whole["choices"][0]
    assert choice["message"].get("tool_calls") is None, choice
    assert choice["message"]["content"] == "".join(ROGUE)
    assert choice["finish_reason"] == "stop"
    chunks = [json.loads(b.removeprefix("data: ")) for b in streamed.text.split("\n\n")
              if b.strip() and b != "data: [DONE]"]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "".join(ROGUE)


# -------------------------------------------------------------------------- health


async def test_health_does_not_name_the_model_path() -> None:
    """/health (no key needed) answers only its status, never the --model path."""
    engine = FakeEngine(model_id="/home/alice/models/secret-finetune")
    async with _client(engine, HttpSettings(api_key="k")) as c:
        r = await c.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}
    assert "alice" not in r.text


# ------------------------------------------------------------------------ API keys


@pytest.mark.parametrize("value", ["", "   ", "off", "None", " key", "key ", "k\u00e9y", "a b"])
def test_a_key_that_would_disable_or_break_auth_is_refused_at_startup(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """KVTIER_API_KEY/--api-key (and the admin key) blank, whitespace, 'off', padded or non-ASCII:
    kvtier serve exits 2 naming the variable, instead of serving without auth."""
    monkeypatch.setenv("KVTIER_API_KEY", value)
    args = build_parser(["serve"]).parse_args(["serve"])
    with pytest.raises(ConfigError, match="KVTIER_API_KEY"):
        serve_config(args)
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "KVTIER_API_KEY" in err
    monkeypatch.delenv("KVTIER_API_KEY")
    with pytest.raises(ConfigError, match="KVTIER_ADMIN_KEY"):
        EngineConfig.from_env({"KVTIER_ADMIN_KEY": value})
    flags = build_parser(["serve"]).parse_args(["serve", "--api-key", value])
    with pytest.raises(ConfigError, match="--api-key"):
        serve_config(flags)


def test_unset_key_means_no_auth_and_a_good_key_is_kept() -> None:
    """An absent variable is no auth; a printable key is used as given (and not echoed in errors)."""
    assert EngineConfig.from_env({}).api_key is None
    assert EngineConfig.from_env({"KVTIER_API_KEY": "s3cr3t-K"}).api_key == "s3cr3t-K"
    with pytest.raises(ConfigError) as info:
        EngineConfig(api_key="s3cret with space")
    assert "s3cret" not in str(info.value)


def test_h11_has_a_safe_floor() -> None:
    """pyproject pins h11>=0.16 (request smuggling, CVE-2025-43859) and the installed one meets it."""
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[3]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "h11>=0.16" in [d.replace(" ", "") for d in deps]
    major, minor = (int(x) for x in version("h11").split(".")[:2])
    assert (major, minor) >= (0, 16)
