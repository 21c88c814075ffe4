"""``kvtier serve`` flag parsing and validation (no model is loaded here)."""

from __future__ import annotations

import socket

import pytest

from actors.cli import build_parser, main


def test_flags_parse_with_mlx_lm_names() -> None:
    """The flags shared with mlx_lm.server parse under the same names, plus kvtier's own."""
    argv = ["serve", "--model", "m", "--host", "0.0.0.0", "--port", "9", "--max-tokens", "5",
            "--temp", "0.5", "--top-p", "0.9", "--top-k", "4", "--min-p", "0.1",
            "--prefill-step-size", "64", "--log-level", "DEBUG", "--max-queue", "2",
            "--api-key", "k", "--log-format", "json", "--max-body-bytes", "100",
            "--max-prompt-tokens", "50", "--prompt-cache", "0.5", "--kv-quant", "8",
            "--max-burst", "3"]
    args = build_parser(argv).parse_args(argv)
    assert (args.model, args.host, args.port, args.max_tokens) == ("m", "0.0.0.0", 9, 5)
    assert (args.temp, args.top_p, args.top_k, args.min_p) == (0.5, 0.9, 4, 0.1)
    assert (args.prefill_step_size, args.log_level, args.max_queue) == (64, "debug", 2)
    assert (args.api_key, args.log_format, args.max_body_bytes) == ("k", "json", 100)
    assert (args.max_prompt_tokens, args.prompt_cache, args.kv_quant) == (50, 0.5, "8")
    assert args.max_burst == 3


def test_defaults_bind_loopback() -> None:
    """By default the server binds 127.0.0.1:8080 with no API key unless KVTIER_API_KEY is set."""
    args = build_parser(["serve"]).parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 8080)
    assert args.kv_quant == "off"


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_API_KEY supplies the default API key."""
    monkeypatch.setenv("KVTIER_API_KEY", "from-env")
    assert build_parser(["serve"]).parse_args(["serve"]).api_key == "from-env"


@pytest.mark.parametrize(
    "bad",
    [
        ["--port", "70000"],
        ["--max-tokens", "0"],
        ["--max-tokens", "100", "--max-tokens-limit", "10"],
        ["--max-queue", "-1"],
        ["--max-burst", "0"],
        ["--max-prompt-tokens", "0"],
        ["--prompt-cache", "-1"],
        ["--top-p", "0"],
        ["--max-body-bytes", "0"],
    ],
)
def test_bad_flag_values_exit_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Out-of-range flag values exit 2 with a one-line reason, before any model work."""
    assert main(["serve", "--model", "/nonexistent", *bad]) == 2
    assert "kvtier serve:" in capsys.readouterr().err


def test_unknown_kv_quant_is_a_usage_error() -> None:
    """--kv-quant accepts only off, 4, 8 or config."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--kv-quant", "3"])
    assert info.value.code == 2


def test_busy_port_exits_1_before_loading(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A port already in use is reported with exit code 1 before any model is loaded."""
    import actors.runtime

    # NOTE: keep the process-wide structlog setup untouched for the rest of the suite.
    monkeypatch.setattr(actors.runtime, "configure_logging", lambda *a, **k: None)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = main(["serve", "--model", "/nonexistent", "--port", str(port)])
    assert rc == 1
    assert "cannot bind" in capsys.readouterr().err


@pytest.mark.anyio
async def test_accepted_connections_disable_nagle() -> None:
    """Connections accepted on the serve socket have TCP_NODELAY (no 40 ms delayed-ACK stalls)."""
    import asyncio

    from actors.cli.serve import _bind

    seen: list[int] = []

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        seen.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = _bind("127.0.0.1", 0)
    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert seen
    assert seen[0] != 0


@pytest.mark.parametrize(
    ("counts", "cap_named"),
    [
        ({"uncovered": 95}, True),
        ({"uncovered": 3, "pending": 1}, False),
        ({"dropped": 2}, False),
        ({"uncovered": 4, "lost": 1}, False),
    ],
)
def test_the_last_line_names_the_ssd_cap_when_it_alone_kept_the_flush_from_durable(
    counts: dict[str, int], cap_named: bool
) -> None:
    """A final flush short only of prefixes the tier's cap evicted says so (and the flag that helps);
    any other shortfall keeps the general reason."""
    from actors.cli.serve import not_durable_reason
    from messages.durability import FlushResult

    fields = {"pending": 0, "dropped": 0, "failed": 0, "uncovered": 0} | counts
    reason = not_durable_reason(FlushResult.model_validate({"durable": False, **fields}))
    assert reason.startswith("not durable: ")
    assert ("--ssd-cache-max" in reason) is cap_named
    if cap_named:
        assert f"{counts['uncovered']} cached prefixes" in reason
