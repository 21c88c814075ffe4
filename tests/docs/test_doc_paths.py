"""Every repository path a doc names in inline code exists in the tree.

The docs name files (`actors/gateway/core.py`, `tools/bench/runtime.py ...`);
when a file moves and its doc does not, a reader follows a dead name. This
test reads docs/*.md, docs/benchmarks/*.md and README.md, takes each inline
code span, and checks every token in it that starts with a top-level package
folder against the working tree.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("actors", "kernels", "messages", "tools", "tests", "docs")

DOCS = sorted(
    p.relative_to(REPO).as_posix()
    for p in [*REPO.glob("docs/*.md"), *REPO.glob("docs/benchmarks/*.md"), REPO / "README.md"]
    if p.is_file()
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_SPAN = re.compile(r"(`+)(.+?)\1")
# NOTE: a path token stops at whitespace, quotes, brackets and ':' (so
# `tests/x.py::test_y` and `file.py:120` check the file) and may hold one
# `{a,b}` alternation and `*` globs.
_TOKEN = re.compile(
    r"(?<![\w./-])((?:" + "|".join(ROOTS) + r")/(?:[^\s:`'\"()\[\],;{}]|\{[^{}\s]*\})*)"
)


def _expand(token: str) -> list[str]:
    """``a/{b,c}.py`` -> ``[a/b.py, a/c.py]``; other tokens unchanged."""
    match = re.search(r"\{([^{}]*)\}", token)
    if match is None:
        return [token]
    head, tail = token[: match.start()], token[match.end():]
    return [out for alt in match.group(1).split(",") for out in _expand(head + alt + tail)]


def _exists(path: str, root: Path) -> bool:
    """A file or folder, a glob with a match, or a module named without ``.py``."""
    path = path.rstrip(".").rstrip("/")
    if "*" in path or "?" in path:
        return any(root.glob(path))
    return (root / path).exists() or (root / f"{path}.py").exists()


def missing_paths(text: str, root: Path) -> list[tuple[int, str]]:
    """``(line, path)`` for each path named in an inline code span that ``root`` lacks.

    Fenced code blocks are skipped (they hold examples and command output);
    placeholders such as ``actors/<name>/core.py`` are not paths.
    """
    missing: list[tuple[int, str]] = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for span in _SPAN.finditer(line):
            for token in _TOKEN.findall(span.group(2)):
                if "<" in token or ">" in token:
                    continue
                missing.extend((number, path) for path in _expand(token) if not _exists(path, root))
    return missing


def test_checker_flags_a_missing_path_and_accepts_real_ones(tmp_path: Path) -> None:
    """The checker reports a named file that is absent and none that exist (it is not vacuous)."""
    (tmp_path / "actors" / "gateway").mkdir(parents=True)
    (tmp_path / "actors" / "gateway" / "core.py").write_text("")
    (tmp_path / "actors" / "gateway" / "actor.py").write_text("")
    text = "\n".join([
        "The core is `actors/gateway/core.py`; run `python tools/gone.py --x 1`.",
        "Both: `actors/gateway/{core,actor}.py`, `actors/gateway/*.py`, `actors/gateway`.",
        "A module: `actors/gateway/core`; a test id `actors/gateway/core.py::test_a`.",
        "A placeholder `actors/<name>/core.py`; a pair `actors/gateway/{core,shell}.py`.",
        "```",
        "actors/in_a_fence.py is an example, `actors/fenced.py` too",
        "```",
        "Globs must match: `actors/gateway/*.c`.",
    ])
    assert missing_paths(text, tmp_path) == [
        (1, "tools/gone.py"),
        (4, "actors/gateway/shell.py"),
        (8, "actors/gateway/*.c"),
    ]


@pytest.mark.parametrize("doc", DOCS)
def test_doc_names_only_existing_paths(doc: str) -> None:
    """Each path the doc names in inline code exists in the repository."""
    missing = missing_paths((REPO / doc).read_text(encoding="utf-8"), REPO)
    assert not missing, f"{doc} names paths that do not exist:\n" + "\n".join(
        f"  {doc}:{line}: {path}" for line, path in missing
    )
