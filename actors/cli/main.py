"""The ``kvtier`` command line: ``serve``, ``fetch-default-model``, ``cache``, ``replay``.

Each subcommand lives in the module that owns it and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this module only
dispatches, importing the owner lazily so ``kvtier replay`` never pays for
MLX or FastAPI imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    return _load(args._module).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
