"""The SSD tier's directories are used only when this user's and writable by nobody else."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from actors.engine import ConfigError, Engine
from actors.ssd_writer import check_tier_dirs
from kernels import ModelIdentity, UntrustedPath
from tests.tiny_models import kv_llama, tiny_tokenizer

IDENTITY = ModelIdentity(
    model_id="tiny-llama",
    name="tiny-llama",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    weights_digest="w0",
    dtype="float32",
    quantization=None,
)


def tier_tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """root/fp/ns, each mode 0700."""
    root = tmp_path / "kv"
    ns = root / "kvtfp" / "0123456789abcdef"
    ns.mkdir(parents=True, mode=0o700)
    for d in (root, root / "kvtfp", ns):
        d.chmod(0o700)
    return root, root / "kvtfp", ns


@pytest.mark.parametrize("which", [0, 1, 2], ids=["root", "fingerprint", "namespace"])
@pytest.mark.parametrize("bits", [0o020, 0o002], ids=["group", "other"])
def test_a_tier_directory_others_may_write_is_refused(tmp_path: Path, which: int, bits: int) -> None:
    """Group or other write on the root, our fingerprint dir or a namespace dir: UntrustedPath naming it."""
    dirs = tier_tree(tmp_path)
    check_tier_dirs(str(dirs[0]), "kvtfp")
    dirs[which].chmod(0o700 | bits)
    with pytest.raises(UntrustedPath, match="writable by its group or others") as info:
        check_tier_dirs(str(dirs[0]), "kvtfp")
    assert info.value.path == str(dirs[which])


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_tier_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    """A namespace directory owned by another uid: UntrustedPath."""
    _, _, ns = tier_tree(tmp_path)
    os.chown(ns, 4242, -1)
    with pytest.raises(UntrustedPath, match="belongs to uid 4242"):
        check_tier_dirs(str(tmp_path / "kv"), "kvtfp")


def test_absent_directories_pass(tmp_path: Path) -> None:
    """A tier that does not exist yet is created private later: nothing to refuse."""
    check_tier_dirs(str(tmp_path / "nothing"), "kvtfp")
    check_tier_dirs(str(tmp_path / "nothing"), None)


@pytest.mark.anyio
async def test_an_engine_on_a_group_writable_tier_does_not_start(tmp_path: Path) -> None:
    """Engine start with a group-writable ssd_cache root fails with a ConfigError naming the directory."""
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o770)
    tok: Any = tiny_tokenizer()
    engine = Engine.from_loaded(
        kv_llama(vocab_size=len(tok)), tok, model_id="tiny", identity=IDENTITY,
        prompt_cache_bytes=1 << 24, ssd_cache=root,
    )
    try:
        with pytest.raises(ConfigError, match="writable by its group or others"):
            await engine.start()
    finally:
        await engine.aclose()
    assert sorted(p.name for p in root.iterdir()) == []
