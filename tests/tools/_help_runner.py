"""Run ``python <script> --help`` for many tools/ scripts from one parent that imported the libraries once.

Usage: ``python tests/tools/_help_runner.py JOBS OUT.json SCRIPT...`` (paths
relative to the repository root, the working directory).

Each script runs in a forked child of this process, as ``__main__`` with
``sys.argv = [script, "--help"]`` and ``sys.path[0]`` its own folder (what
``python <script>`` gives it), its stdout and stderr in files of its own. The
parent imported only third-party libraries before forking (MLX, mlx-lm and
transformers are most of a script's ~3 s start); every module of kvtier
(``actors``, ``kernels``, ``messages``, ``tools``) and every script's own
imports still run fresh in the child, so a moved module or a renamed name
still fails there. OUT.json maps each script to ``[exit status, stdout,
stderr]``.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import tempfile
import traceback
from pathlib import Path

# NOTE: the heavy third-party imports behind kvtier's packages (measured with
# ``python -X importtime``); an optional one that is missing is left for the
# child to fail on exactly as a fresh process would.
_PRELOAD = (
    "numpy", "mlx.core", "mlx.nn", "transformers", "mlx_lm", "mlx_lm.utils",
    "mlx_lm.tokenizer_utils", "mlx_lm.models.cache", "httpx", "anyio", "pydantic", "fastapi",
    "starlette.applications", "uvicorn", "structlog", "jinja2", "huggingface_hub", "orjson",
    "prometheus_client",
)
_OWN = ("actors", "kernels", "messages", "tools", "tests")


def _child(script: str, base_path: list[str], out: Path, err: Path) -> int:
    """In the forked child: run ``script --help`` as ``__main__``; its exit status."""
    with out.open("wb") as o, err.open("wb") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
    sys.argv = [script, "--help"]
    sys.path[:] = [str(Path(script).resolve().parent), *base_path]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  NOTE: any failure is reported, not hidden: the
        # traceback and status 1, what a fresh interpreter does with an uncaught exception.
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main(argv: list[str]) -> None:
    """Fork one child per script, ``jobs`` at a time; write the results to OUT.json."""
    jobs, out_json, scripts = int(argv[0]), Path(argv[1]), argv[2:]
    # NOTE: a fresh ``python <script>`` has the script's folder first and then
    # what site gives every interpreter; this runner's own folder is dropped.
    base_path = list(sys.path[1:])
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert not [m for m in sys.modules if m.split(".")[0] in _OWN], "kvtier must load in the child"
    work = Path(tempfile.mkdtemp(prefix="kvtier-help-"))
    running: dict[int, str] = {}
    results: dict[str, list[object]] = {}
    pending = list(scripts)

    def reap() -> None:
        pid, status = os.wait()
        script = running.pop(pid)
        index = scripts.index(script)
        results[script] = [os.waitstatus_to_exitcode(status),
                           (work / f"{index}.out").read_text(errors="replace"),
                           (work / f"{index}.err").read_text(errors="replace")]

    while pending or running:
        while pending and len(running) < jobs:
            script = pending.pop(0)
            index = scripts.index(script)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                # NOTE: a forked child must not return into the parent's loop
                # nor run its exit handlers; os._exit ends it with the script's status.
                os._exit(_child(script, base_path, work / f"{index}.out", work / f"{index}.err"))
            running[pid] = script
        reap()
    out_json.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
