"""``kvtier cache list | purge``: what the SSD tier keeps on disk, and removing it.

The SSD tier keeps prompts' token ids on disk (each file's header holds the
prefix whose KV it caches). ``list`` shows each fingerprint directory (one
per model, KV scheme, MLX release and device) with its files and bytes, and
marks the one ``--model`` would use. ``purge`` removes files durably
(``actors.ssd_writer.purge_tier``): ``--all``, ``--stale-fingerprints``
(every directory but the current one) or ``--older-than AGE`` (entries not
used for that long). A directory a running server holds is left untouched
and the command exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "parse_age", "run"]

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """Seconds of an age such as ``90``, ``30s``, ``15m``, ``12h``, ``7d``, ``2w``."""
    match = _AGE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not an age: {text!r} (a number with s, m, h, d or w, e.g. 7d)"
        )
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``list`` and ``purge`` and their flags."""
    subs = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = subs.add_parser("list", help="fingerprint directories, their files and bytes")
    purge = subs.add_parser("purge", help="remove SSD tier files durably")
    for sub in (listing, purge):
        sub.add_argument(
            "--ssd-cache",
            type=Path,
            default=None,
            metavar="DIR",
            help="the SSD tier's directory (default: $KVTIER_SSD_CACHE, else $KVTIER_HOME/kv)",
        )
        sub.add_argument(
            "--model",
            default=None,
            help="mark (list) or keep (purge --stale-fingerprints) this model's directory "
            "(default for --stale-fingerprints: the default model)",
        )
        sub.add_argument(
            "--kv-quant",
            default=None,
            help="the KV scheme the server runs with (default: $KVTIER_KV_QUANT, else none)",
        )
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
    what = purge.add_mutually_exclusive_group(required=True)
    what.add_argument("--all", action="store_true", help="every file and fingerprint directory")
    what.add_argument(
        "--stale-fingerprints",
        action="store_true",
        help="every fingerprint directory except the one the model and KV scheme use now",
    )
    what.add_argument(
        "--older-than",
        type=parse_age,
        default=None,
        metavar="AGE",
        help="entries not used for AGE (e.g. 7d, 12h, 30m), in every directory",
    )
    purge.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")


def _root(args: argparse.Namespace) -> str | None:
    if args.ssd_cache is not None:
        return str(args.ssd_cache.expanduser())
    from actors.engine.config import SETTINGS
    from kernels import env_text, kvtier_home

    # NOTE: the variable kvtier serve reads for --ssd-cache, read the same way.
    env = env_text(SETTINGS["ssd_cache"].env)
    if env is not None and env.lower() == "off":
        return None
    if env is not None:
        return os.path.expanduser(env)

    return str(kvtier_home() / "kv")


def current_fingerprint(model: str | None, kv_quant: str | None) -> str:
    """The fingerprint directory a server of ``model`` (default: the default model) with ``kv_quant`` uses.

    Loads the model lazily (no weight is evaluated; the weights digest
    comes from its memo when the model was loaded before). Raises
    ``ValueError`` when the default model is not fetched yet (a purge
    command downloads nothing) and what loading raises.
    """
    import kernels
    from actors.backend import runtime_identity
    from actors.engine import EngineConfig
    from actors.ssd_writer import cold_fingerprint
    from kernels.cache import FORMAT_VERSION

    values: dict[str, Any] = {} if kv_quant is None else {"kv_quant": kv_quant}
    config = EngineConfig.from_env(**values)
    if model is None:
        path = kernels.default_model_dir()
        if not kernels.is_converted_dir(path):
            raise ValueError(
                "the default model is not fetched; name the model the server runs with --model"
            )
        model = str(path)
    loaded = kernels.load_model(model, lazy=True, fuse=False, few_row=False)
    scheme = kernels.resolve_kv_scheme(config.kv_quant, loaded.path, missing_config="error")
    return cold_fingerprint(
        model=loaded.identity.fingerprint,
        kv_scheme=scheme.cache_key,
        runtime=runtime_identity(),
        format_version=FORMAT_VERSION,
    )


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


def _when(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.datetime.fromtimestamp(ns / 1e9).astimezone().isoformat(timespec="seconds")


def _list(args: argparse.Namespace, root: str) -> int:
    from actors.ssd_writer import list_tier
    from kernels.cache import OsFilePort

    current = (
        current_fingerprint(args.model, args.kv_quant)
        if args.model is not None or args.kv_quant is not None
        else None
    )
    usages = list_tier(OsFilePort(), root)
    total = sum(u.total_bytes for u in usages)
    files = sum(u.entries + u.other_files for u in usages)
    if args.json:
        print(json.dumps({
            "root": root,
            "total_bytes": total,
            "total_files": files,
            "current": current,
            "fingerprints": [
                {
                    "name": u.name, "path": u.path, "entries": u.entries,
                    "entry_bytes": u.entry_bytes, "other_files": u.other_files,
                    "other_bytes": u.other_bytes, "total_bytes": u.total_bytes,
                    "last_used": _when(u.newest_mtime_ns),
                    "current": None if current is None else u.name == current,
                }
                for u in usages
            ],
        }))  # fmt: skip
        return 0
    print(f"SSD tier at {root}: {len(usages)} fingerprint directories, "
          f"{_size(total)} in {files} files")  # fmt: skip
    for u in usages:
        mark = "  (current)" if u.name == current else ""
        temp = f", {u.other_files} temp files" if u.other_files else ""
        print(f"  {u.name}{mark}: {u.entries} entries, {_size(u.total_bytes)}{temp}, "
              f"last used {_when(u.newest_mtime_ns) or '-'}")  # fmt: skip
    if current is not None and all(u.name != current for u in usages):
        print(f"  (the current fingerprint {current} has no directory yet)")
    return 0


def _purge(args: argparse.Namespace, root: str) -> int:
    from actors.ssd_writer import purge_tier
    from kernels.cache import OsFilePort

    older_than_ns: int | None = None
    if args.all:
        keep: str | None = None
        remove_dirs = True
    elif args.stale_fingerprints:
        keep = current_fingerprint(args.model, args.kv_quant)
        remove_dirs = True
    else:
        keep, remove_dirs = None, False
        older_than_ns = time.time_ns() - int(args.older_than * 1e9)
    report = purge_tier(
        OsFilePort(),
        root,
        select_dir=lambda name: name != keep,
        older_than_ns=older_than_ns,
        remove_dirs=remove_dirs,
        dry_run=args.dry_run,
    )
    if args.json:
        print(json.dumps({
            "root": root, "dry_run": args.dry_run, "kept": keep,
            "removed_files": report.removed_files, "removed_bytes": report.removed_bytes,
            "removed_dirs": report.removed_dirs, "busy": report.busy, "failed": report.failed,
        }))  # fmt: skip
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {report.removed_files} files ({_size(report.removed_bytes)}) under {root}")
        if keep is not None:
            print(f"kept the current fingerprint directory {keep}")
        for d in report.removed_dirs:
            print(f"removed {d}")
        for d in report.busy:
            print(f"kvtier cache: {d} is in use by a running server; left as it is",
                  file=sys.stderr)  # fmt: skip
        for p in report.failed:
            print(f"kvtier cache: could not remove {p} durably", file=sys.stderr)
    return 1 if report.busy or report.failed else 0


def run(args: argparse.Namespace) -> int:
    """List or purge; 0 on success, 1 when something could not be done (said on stderr)."""
    from kernels import KernelError, UntrustedPath

    root = _root(args)
    if root is None:
        print("kvtier cache: the SSD tier is off (KVTIER_SSD_CACHE=off); name it with --ssd-cache",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        return _list(args, root) if args.action == "list" else _purge(args, root)
    except UntrustedPath as exc:
        print(f"kvtier cache: {exc}", file=sys.stderr)
        return 1
    except (KernelError, ValueError, OSError) as exc:
        print(f"kvtier cache: {exc}", file=sys.stderr)
        return 1
