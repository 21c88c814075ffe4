"""The ``kvtier`` command line: ``serve``, ``fetch-default-model``, ``cache``, ``replay``.

Each subcommand lives in the module that owns it and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this module only
dispatches, importing the owner lazily so ``kvtier replay`` never pays for
MLX or FastAPI imports.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast


class _Subcommand(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# name -> (owning module, one-line help)
_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("actors.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "fetch-default-model": (
        "actors.cli.fetch",
        "download and convert the default model (SmolLM2-135M-Instruct)",
    ),
    "cache": ("actors.cli.cache", "list or purge the SSD tier's files (prompts' token ids at rest)"),
    "replay": ("actors.cli.replay", "replay a recorded JSONL trace and compare it"),
}


def _load(module: str) -> _Subcommand:
    return cast("_Subcommand", importlib.import_module(module))


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Build the parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: serve MLX language models with a tiered KV cache.",
    )
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in _SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text)
        if name == chosen:
            _load(module).add_arguments(sub)
            sub.set_defaults(_module=module)
    return parser


def shadowed_packages() -> list[str]:
    """kvtier's top-level packages that another installed distribution's module of the same name hides.

    NOTE: kvtier's packages are top-level (``kernels``, ``messages``);
    Hugging Face's ``kernels`` distribution (a dependency of transformers
    5.25 and later) installs a module of that name into site-packages,
    where it wins over an editable install's. Found without importing
    anything (``find_spec`` of a top-level name runs no package code).
    """
    home = Path(__file__).resolve().parents[2]
    hidden: list[str] = []
    for name in ("actors", "kernels", "messages"):
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or Path(origin).resolve().parent.parent != home:
            hidden.append(f"{name} ({origin or 'not found'})")
    return hidden


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script."""
    hidden = shadowed_packages()
    if hidden:
        # NOTE: said before any subcommand imports them: the alternative is an
        # ImportError about a name that kvtier's own package does export.
        print(
            "kvtier: another installed package hides kvtier's own: "
            + ", ".join(hidden)
            + ". Hugging Face's 'kernels' (pulled in by transformers >= 5.25) is the known one: "
            "install kvtier with transformers < 5.25, or in an environment without it.",
            file=sys.stderr,
        )
        return 2
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    return _load(args._module).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
