"""`kvtier serve --help` reads as written for people: no Python-isms, units that agree."""

from __future__ import annotations

import argparse
import re

import pytest

from actors.cli.main import build_parser

_GIB_MIB = {"GB", "MB", "GiB", "MiB"}


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser(["serve", "--help"])
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices["serve"]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def _one_line(text: str) -> str:
    return " ".join(text.split())


def problems(parser: argparse.ArgumentParser) -> list[str]:
    """Every Python-ism or unit contradiction in the parser's help texts, one line each.

    Each option's help is checked as ``--help`` renders it (``%(default)s``
    expanded, lines joined); the usage line is left out (``--host HOST``).
    """
    found: list[str] = []
    formatter = parser._get_formatter()
    for action in _options(parser):
        flag = action.option_strings[-1]
        text = _one_line(formatter._expand_help(action)) if action.help else ""
        for word in ("None", "True", "False"):
            if re.search(rf"\b{word}\b", text):
                found.append(f"{word!r} in {flag}: {text}")
        for match in re.finditer(r"\b(\w+) \1\b", text):
            found.append(f"doubled word {match.group(0)!r} in {flag}")
        if action.metavar in _GIB_MIB and "in bytes" in text:
            found.append(f"{flag} {action.metavar} says 'in bytes'")
        if action.type is float and action.metavar == "N":
            found.append(f"{flag} takes a float but its metavar is N (a count)")
    return found


def test_serve_help_has_no_python_isms_and_units_agree() -> None:
    """No None/True/False, no doubled word, no 'in bytes' beside a GB/MB metavar, no N on a float."""
    parser = _serve_parser()
    assert len(_options(parser)) > 40  # every EngineConfig field has its flag
    assert problems(parser) == []


def test_scaled_flags_name_their_unit_and_zero_means_what_it_does() -> None:
    """--prompt-cache, --memory-budget, --ssd-cache-max say GiB, --mlx-cache-limit MiB; --ssd-cache-max 0 = no cap."""
    helps = {a.option_strings[-1]: _one_line(str(a.help)) for a in _options(_serve_parser())}
    for flag in ("--prompt-cache", "--memory-budget", "--ssd-cache-max", "--ssd-spill-queue"):
        assert "(in GiB; default:" in helps[flag], helps[flag]
    assert "(in MiB; default:" in helps["--mlx-cache-limit"]
    assert "0 = no cap" in helps["--ssd-cache-max"]
    assert "default: from the device: 8 rows on the CPU, 32 on CUDA" in helps["--max-batch"]
    assert "default: 30 s;" in helps["--ask-timeout"]


@pytest.mark.parametrize(
    ("flag", "kwargs", "expected"),
    [
        (
            "--cap",
            {"metavar": "GB", "help": "cap in bytes (flag in GiB)"},
            "--cap GB says 'in bytes'",
        ),
        ("--temp", {"type": float, "metavar": "N", "help": "temperature"}, "--temp takes a float"),
        ("--model", {"help": "model id; None = the default"}, "'None' in"),
        ("--on", {"help": "turn it on (default: False)"}, "'False' in"),
        ("--rows", {"help": "rows (default: 8 rows rows)"}, "doubled word 'rows rows'"),
    ],
)
def test_each_check_refuses_what_it_names(
    flag: str, kwargs: dict[str, object], expected: str
) -> None:
    """A parser with one such flag is reported, by the check that names it."""
    parser = argparse.ArgumentParser(prog="demo", add_help=False)
    parser.add_argument(flag, **kwargs)  # type: ignore[arg-type]
    found = problems(parser)
    assert len(found) == 1, found
    assert found[0].startswith(expected), found
