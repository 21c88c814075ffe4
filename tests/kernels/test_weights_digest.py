"""The weights digest hashes every byte, and its memo saves the re-read without being trusted blindly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels import ModelLoadError, weights_digest
from kernels.model import FileKey, OsWeightFiles, WeightsMemo
from kernels.model._weights import MEMO_NAME

DATA_BYTES = 8 << 20


def write_weights(path: Path, *, flip_at: int | None = None) -> None:
    """A safetensors-shaped file: 8-byte header length, JSON header, 8 MiB of patterned data."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [DATA_BYTES // 4], "data_offsets": [0, DATA_BYTES]}})
    data = bytearray((i * 7) & 0xFF for i in range(256)) * (DATA_BYTES // 256)
    if flip_at is not None:
        data[flip_at] ^= 0x01
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(data))


class CountingFiles:
    """:class:`WeightFiles` over the OS that counts the bytes it reads."""

    def __init__(self) -> None:
        self.inner = OsWeightFiles()
        self.bytes_read = 0

    def key(self, path: Path) -> FileKey:
        """Forward."""
        return self.inner.key(path)

    def chunks(self, path: Path) -> Iterator[memoryview]:
        """Forward, counting."""
        for chunk in self.inner.chunks(path):
            self.bytes_read += len(chunk)
            yield chunk


@pytest.fixture
def memo_path(tmp_path: Path) -> Path:
    """A private home for the memo."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    return home / MEMO_NAME


def test_one_byte_between_the_old_sample_windows_changes_the_digest(tmp_path: Path) -> None:
    """Two weight files differing in one byte a quarter into the data (no sampled window) differ."""
    write_weights(tmp_path / "a" / "model.safetensors")
    write_weights(tmp_path / "b" / "model.safetensors", flip_at=DATA_BYTES // 4)
    write_weights(tmp_path / "c" / "model.safetensors")
    digests = [weights_digest(tmp_path / d, memo=WeightsMemo(None)) for d in "abc"]
    assert digests[0] != digests[1]
    assert digests[0] == digests[2]


def test_the_memo_avoids_reading_the_weights_again(tmp_path: Path, memo_path: Path) -> None:
    """A second digest through a memo loaded from disk reads no weight byte and gives the same digest."""
    write_weights(tmp_path / "m" / "model.safetensors")
    first = CountingFiles()
    digest = weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path), files=first)
    assert first.bytes_read >= DATA_BYTES
    assert memo_path.stat().st_mode & 0o077 == 0
    again = CountingFiles()
    assert weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path), files=again) == digest
    assert again.bytes_read == 0


def test_a_rewritten_file_is_read_again(tmp_path: Path, memo_path: Path) -> None:
    """Same size, other bytes, a new mtime: the memo's entry does not match, the digest changes."""
    f = tmp_path / "m" / "model.safetensors"
    write_weights(f)
    before = weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path))
    write_weights(f, flip_at=12345)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    counting = CountingFiles()
    after = weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path), files=counting)
    assert counting.bytes_read >= DATA_BYTES
    assert after != before


def forge(memo_path: Path, weights: Path, digest: str) -> None:
    """Write a memo that claims ``digest`` for the current version of ``weights``."""
    key = OsWeightFiles().key(weights).as_list()
    memo_path.write_text(json.dumps({"version": 1, "entries": [{"key": key, "xxh3_128": digest}]}))


def test_a_memo_others_may_write_is_ignored(tmp_path: Path, memo_path: Path) -> None:
    """A group/other-writable memo claiming another digest is not used: the file is hashed."""
    f = tmp_path / "m" / "model.safetensors"
    write_weights(f)
    honest = weights_digest(tmp_path / "m", memo=WeightsMemo(None))
    forge(memo_path, f, "0" * 32)
    memo_path.chmod(0o600)
    assert weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path)) != honest  # trusted: used
    forge(memo_path, f, "0" * 32)
    memo_path.chmod(0o666)
    counting = CountingFiles()
    assert weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path), files=counting) == honest
    assert counting.bytes_read >= DATA_BYTES


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        b'{"version": 1, "entries": [{"key": [1, 2], "xxh3_128": "00"}]}',
        b"[" * 100_000,
        b" " * (2 << 20),
    ],
    ids=["garbage", "not-an-object", "bad-entry", "deep", "oversized"],
)
def test_a_malformed_memo_counts_as_empty(tmp_path: Path, memo_path: Path, content: bytes) -> None:
    """Garbage, wrong shapes, deep nesting and an oversized memo are ignored and then replaced."""
    write_weights(tmp_path / "m" / "model.safetensors")
    honest = weights_digest(tmp_path / "m", memo=WeightsMemo(None))
    memo_path.write_bytes(content)
    memo_path.chmod(0o600)
    assert weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path)) == honest
    again = CountingFiles()
    assert weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path), files=again) == honest
    assert again.bytes_read == 0


def test_a_bad_entry_is_dropped_and_the_good_ones_kept(tmp_path: Path, memo_path: Path) -> None:
    """One malformed entry next to a valid one: the valid one still saves the read."""
    f = tmp_path / "m" / "model.safetensors"
    write_weights(f)
    honest = weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path))
    body = json.loads(memo_path.read_text())
    body["entries"].insert(0, {"key": [-1, 0, 0, 0, 0], "xxh3_128": "zz"})
    memo_path.write_text(json.dumps(body))
    counting = CountingFiles()
    assert weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path), files=counting) == honest
    assert counting.bytes_read == 0


def test_a_directory_without_weights_is_a_load_error(tmp_path: Path) -> None:
    """No model*.safetensors: ModelLoadError naming the directory."""
    with pytest.raises(ModelLoadError, match="no model"):
        weights_digest(tmp_path, memo=WeightsMemo(None))


def test_an_entry_with_a_malformed_digest_for_the_right_key_is_not_used(
    tmp_path: Path, memo_path: Path
) -> None:
    """A memo entry matching the file's key but holding no hex digest (and a non-object entry) is dropped."""
    f = tmp_path / "m" / "model.safetensors"
    write_weights(f)
    honest = weights_digest(tmp_path / "m", memo=WeightsMemo(None))
    key = OsWeightFiles().key(f).as_list()
    entries = [5, {"key": key, "xxh3_128": "z" * 32}]
    memo_path.write_text(json.dumps({"version": 1, "entries": entries}))
    memo_path.chmod(0o600)
    counting = CountingFiles()
    assert weights_digest(tmp_path / "m", memo=WeightsMemo(memo_path), files=counting) == honest
    assert counting.bytes_read >= DATA_BYTES


_HEAP_PROBE = """
import os
import sys
from pathlib import Path
from kernels.model import OsWeightFiles

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

for chunk in OsWeightFiles().chunks(Path(sys.argv[1])):
    pass
del chunk
before = rss()
block = bytearray(b"\\x01") * (8 << 20)
del block
print(rss() - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm; glibc's malloc")
def test_hashing_leaves_the_allocator_returning_freed_blocks_to_the_os(tmp_path: Path) -> None:
    """After a weights file was hashed, an 8 MiB block freed goes back to the OS (the read
    buffer left glibc's mmap threshold alone: a 16 MiB heap buffer had raised it, and a
    server that hashed a new model idled ~20 MiB higher for its life)."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(20 << 20))
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, str(weights)], cwd=repo,
                         capture_output=True, text=True, timeout=60, check=True)
    kept = int(out.stdout)
    assert kept < 2 << 20, f"{kept / (1 << 20):.1f} MiB of a freed 8 MiB block stayed resident"
