"""kernels._env: the one reader of the switches and knobs kvtier takes from the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kernels
import kernels._env
from kernels import env_switch, env_text


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no ", "Off"])
def test_an_off_word_in_any_case_turns_a_switch_off(value: str) -> None:
    """0/false/off/no, any case, surrounding blanks ignored, turn the switch off."""
    assert env_switch("KVTIER_X", {"KVTIER_X": value}) is False


@pytest.mark.parametrize(
    "env", [{}, {"KVTIER_X": ""}, {"KVTIER_X": "  "}, {"KVTIER_X": "1"}, {"KVTIER_X": "yes"}]
)
def test_a_switch_is_on_unless_it_says_off(env: dict[str, str]) -> None:
    """Unset, blank and any other word leave the switch on."""
    assert env_switch("KVTIER_X", env) is True


def test_text_is_stripped_and_blank_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """env_text strips the value, reads None for unset or blank, and defaults to the process's environment."""
    assert env_text("KVTIER_X", {"KVTIER_X": " 4 "}) == "4"
    assert env_text("KVTIER_X", {"KVTIER_X": " "}) is None
    assert env_text("KVTIER_X", {}) is None
    monkeypatch.setenv("KVTIER_X", "/tmp/home ")
    assert env_text("KVTIER_X") == "/tmp/home"


@pytest.mark.parametrize(("env", "on"), [({}, False), ({"KVTIER_X": " "}, False), ({"KVTIER_X": "1"}, True),
                                         ({"KVTIER_X": "off"}, False)])
def test_a_switch_off_by_default_is_on_only_when_set(env: dict[str, str], on: bool) -> None:
    """default=False: unset or blank leave the switch off; a word other than an off word turns it on."""
    assert env_switch("KVTIER_X", env, default=False) is on


def test_every_variable_kernels_names_is_in_the_modules_table() -> None:
    """Every ``KVTIER_*`` name a kernels module spells out is a row of kernels._env's table."""
    root = Path(kernels.__file__).parent
    named = {m for path in root.rglob("*.py")
             for m in re.findall(r"[\"'](KVTIER_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8"))}
    listed = set(re.findall(r"``(KVTIER_[A-Z0-9_]+)``", kernels._env.__doc__ or ""))
    assert len(named) > 20, named  # NOTE: the scan found the modules' names at all.
    assert named <= listed, sorted(named - listed)
