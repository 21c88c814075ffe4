"""``kvtier serve``: SSD sub-options given while the tier is off warn once and are ignored (rule D5-5).

Each case runs the real ``main(["serve", ...])`` up to its first startup
failure (the port is already taken, so no model is loaded) and reads the
structlog events it emitted.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from actors.cli import build_parser, main
from actors.cli.serve import serve_config
from actors.engine.config import SETTINGS, option_names

EVENT = "serve.ssd_options_ignored"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No SSD variable from the caller's environment; serve's default tier under tmp_path."""
    import actors.runtime

    for name in option_names("ssd"):
        monkeypatch.delenv(SETTINGS[name].env, raising=False)
    monkeypatch.delenv("KVTIER_PROMPT_CACHE_GB", raising=False)
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    # NOTE: keep the process-wide structlog setup untouched (capture_logs owns it here).
    monkeypatch.setattr(actors.runtime, "configure_logging", lambda *a, **k: None)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A listening port, so that serve stops with exit 1 right after its flag handling."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield int(busy.getsockname()[1])


def _serve_events(port: int, *argv: str) -> list[MutableMapping[str, Any]]:
    with capture_logs() as logs:
        rc = main(["serve", "--model", "/nonexistent", "--port", str(port), *argv])
    assert rc == 1  # the busy port, after the flags were accepted
    return [e for e in logs if e["event"] == EVENT]


def test_sub_flags_with_the_ram_tier_off_warn_once_naming_each(busy_port: int) -> None:
    """--prompt-cache 0 turns the tier off: the two sub-flags given are named in one warning."""
    events = _serve_events(busy_port, "--prompt-cache", "0", "--ssd-demote-idle", "10",
                           "--ssd-cache-verify", "on")
    assert len(events) == 1
    assert events[0]["log_level"] == "warning"
    assert events[0]["options"] == ["--ssd-cache-verify (KVTIER_SSD_CACHE_VERIFY)",
                                    "--ssd-demote-idle (KVTIER_SSD_DEMOTE_IDLE)"]


def test_a_variable_with_the_tier_off_warns(busy_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KVTIER_SSD_* variable counts as given: with --ssd-cache off it is named in the warning."""
    monkeypatch.setenv("KVTIER_SSD_CACHE_MAX_GB", "4")
    events = _serve_events(busy_port, "--ssd-cache", "off", "--ssd-restore", "always")
    assert [e["options"] for e in events] == [["--ssd-cache-max (KVTIER_SSD_CACHE_MAX_GB)",
                                               "--ssd-restore (KVTIER_SSD_RESTORE)"]]


def test_tier_off_without_sub_options_does_not_warn(busy_port: int) -> None:
    """With the tier off and no sub-option given, the defaults alone print no warning."""
    assert _serve_events(busy_port, "--prompt-cache", "0") == []
    assert _serve_events(busy_port, "--ssd-cache", "off") == []


@pytest.mark.parametrize("tier", [[], ["--ssd-cache", "DIR"]])
def test_sub_options_with_the_tier_on_do_not_warn(
    busy_port: int, tmp_path: Path, tier: list[str]
) -> None:
    """With the tier on (serve's default or named), its sub-options are used and nothing warns."""
    tier = [tmp_path.as_posix() if a == "DIR" else a for a in tier]
    argv = [*tier, "--ssd-demote-idle", "10", "--ssd-writebehind", "off", "--ssd-spill-queue", "1"]
    assert _serve_events(busy_port, *argv) == []


def test_sub_options_keep_their_defaults_when_not_given() -> None:
    """Tracking which sub-options were given leaves serve's config at the EngineConfig defaults."""
    argv = ["serve", "--ssd-cache", "off"]
    config = serve_config(build_parser(argv).parse_args(argv))
    for name in option_names("ssd"):
        if name != "ssd_cache":
            assert getattr(config, name) == type(config).model_fields[name].default, name
