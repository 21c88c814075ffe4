"""Fuzz the cold tier's file reader: ``read_header``, then both restore paths.

The product's path (``open_file``, the reader's ``pass_over``, then
``land_entry`` reading the file into MLX arrays and hashing it again) and
the old one (``read_tensors`` + ``materialize``) run on every input whose
header parses; they must agree: both reject it with a typed error, or both
accept it and build caches whose arrays hold exactly the same bytes.

Every input is a candidate ``.kvt`` file. The reader treats files as
untrusted, so for every input it must either raise one of its typed errors
(``CacheFileCorrupt``, ``CacheFileIncompatible``) or accept the file, read
its tensors with hash verification and build caches from them. Anything
else (another exception, a hang, a huge allocation) is a crash.

The first byte of an input picks how it is used: even, the rest is the file
as is (the header hash rejects almost every random edit); odd, the header
region's hash is recomputed first, so edits of the JSON reach the
validators behind it. Seeds are small valid files made by the codec (an
empty entry, plain KV, rotating, recurrent state), written to a temporary
corpus directory.

    .venv/bin/python tools/fuzz/kv_file_fuzz.py -runs=1000000        # atheris (pip install -e '.[fuzz]')
    .venv/bin/python tools/fuzz/kv_file_fuzz.py --engine random --runs 100000

``--engine random`` is a pure-Python mutation loop over the same target
(bit flips, byte edits, truncation, growth, splices; re-hashed or not) for
machines where atheris does not install. Files live in a ``CrashFS`` (in
memory), so the run never touches the disk. The last line says how many
inputs ran and how many were accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np  # noqa: F401 - NOTE: imported before instrumentation (not fuzzed).
import xxhash
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

try:
    import atheris
except ImportError:  # pragma: no cover - depends on the optional 'fuzz' extra
    atheris = None

# NOTE: the crash model lives with the tests (tests/crash/crash_fs.py), not in
# the installed package; the repository root makes it importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _instrumented() -> contextlib.AbstractContextManager[Any]:
    if atheris is None:
        return contextlib.nullcontext()
    return atheris.instrument_imports(include=["kernels.cache"])


with _instrumented():
    from kernels.cache import cache_arrays
    from kernels.cache._file_port import OsFilePort
    from kernels.cache._kv_format import PREAMBLE_SIZE, CacheFileCorrupt, CacheFileIncompatible
    from kernels.cache._kv_header import read_header
    from kernels.cache._kv_landing import land_entry
    from kernels.cache._kv_reader import open_file, read_tensors
    from kernels.cache._kv_restore import materialize
    from kernels.cache._kv_writer import KvFileWriter, plan_entry, tensor_bytes
    from tests.crash.crash_fs import CrashFS

FP = "fp-fuzz"
PATH = "/f/entry.kvt"
_PRE = struct.Struct("<8sIIQQ")


# --- seeds -----------------------------------------------------------------------------


def _seed_caches() -> Iterator[tuple[list[Any], list[int]]]:
    yield [KVCache()], []
    kv = KVCache()
    k = mx.arange(2 * 2 * 4, dtype=mx.float32).reshape(1, 2, 2, 4)
    kv.update_and_fetch(k, k + 1)
    yield [kv], [5, 6]
    rot = RotatingKVCache(max_size=3, keep=1)
    for i in range(4):
        x = mx.full((1, 1, 1, 4), float(i))
        rot.update_and_fetch(x, x)
    yield [rot], [1, 2, 3, 4]
    arrays = ArraysCache(2)
    arrays[1] = mx.ones((1, 2, 3))
    yield [arrays], [9]


def seeds() -> list[bytes]:
    """Small valid files made by the real writer."""
    out: list[bytes] = []
    port = OsFilePort()
    with tempfile.TemporaryDirectory() as d:
        for n, (caches, tokens) in enumerate(_seed_caches()):
            plan = plan_entry(
                caches, model_id="m", fingerprint=FP, namespace="", tokenizer_hash="t",
                tokens=tokens, created_at=1.0,
            )  # fmt: skip
            final = os.path.join(d, f"{n}.kvt")
            with KvFileWriter(port, plan) as w:
                w.begin(d)
                for i in range(len(plan.tensors)):
                    w.write_tensor(i, tensor_bytes(plan, i))
                w.commit(final)
            with open(final, "rb") as f:
                out.append(f.read())
    return out


# --- the target --------------------------------------------------------------------------


def rehash(data: bytes) -> bytes:
    """``data`` with its preamble's header hash recomputed (when the preamble parses)."""
    if len(data) < PREAMBLE_SIZE:
        return data
    magic, version, header_len, _, reserved = _PRE.unpack_from(data)
    end = PREAMBLE_SIZE + header_len
    if end > len(data):
        return data
    digest = xxhash.xxh3_64_intdigest(data[PREAMBLE_SIZE:end])
    return _PRE.pack(magic, version, header_len, digest, reserved) + data[PREAMBLE_SIZE:]


class Target:
    """Reads one input as a file; counts what happened."""

    def __init__(self) -> None:
        self.runs = 0
        self.accepted = 0

    def __call__(self, data: bytes) -> None:
        self.runs += 1
        if not data:
            return
        body = data[1:]
        if data[0] & 1:
            body = rehash(body)
        fs = CrashFS()
        fs.makedirs("/f")
        fs.put_file(PATH, body)
        try:
            header = read_header(fs, PATH, expected_fingerprint=FP)
        except (CacheFileCorrupt, CacheFileIncompatible):
            return
        try:
            host = read_tensors(fs, PATH, header, verify=True)
        except (CacheFileCorrupt, CacheFileIncompatible):
            host = None
        landed = self._land(fs, header)
        if (host is None) != (landed is None):
            raise AssertionError(
                f"the restore paths disagree: old {'rejected' if host is None else 'accepted'}, "
                f"landing {'rejected' if landed is None else 'accepted'}"
            )
        if host is None or landed is None:
            return
        self.accepted += 1
        # NOTE: an accepted file must also build caches: every check the
        # builder relies on has to be in the validator.
        old = _bytes(materialize(header, host))
        if old != landed:
            raise AssertionError("the landing's arrays differ from the old path's")

    def _land(self, fs: CrashFS, header: Any) -> list[tuple[tuple[int, ...], bytes]] | None:
        """The product's path inline: open, the pass, the landing; ``None``: a typed rejection."""
        try:
            entry = open_file(fs, PATH, header, verify=True)
        except (CacheFileCorrupt, CacheFileIncompatible):
            return None
        try:
            entry.pass_over()
            return _bytes(land_entry(entry))
        except (CacheFileCorrupt, CacheFileIncompatible):
            return None
        finally:
            entry.close()


def _bytes(caches: list[Any]) -> list[tuple[tuple[int, ...], bytes]]:
    """Every array of ``caches`` (slack included) as (shape, bytes)."""
    out: list[tuple[tuple[int, ...], bytes]] = []
    for a in cache_arrays(caches):
        x: Any = mx.contiguous(a)
        mx.eval(x)
        # NOTE: mlx's stubs do not declare mx.array's buffer protocol (it has one).
        out.append((tuple(a.shape), bytes(memoryview(x).cast("B")) if x.size else b""))
    return out


# --- engines -----------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    """One to four random edits of ``data`` (the fallback engine's mutator)."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        if op == 0 and buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 2 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif op == 3:
            buf += bytes(rng.randrange(1, 64))
        elif op == 4 and len(buf) > PREAMBLE_SIZE + 1:
            # NOTE: edits inside the JSON text are the interesting ones.
            end = min(len(buf), PREAMBLE_SIZE + 4096)
            i = rng.randrange(PREAMBLE_SIZE + 1, end)
            buf[i] = rng.choice(b'0123456789-+.eE,:[]{}"nulltrufas ')
        elif op == 5 and buf:
            other = rng.choice(pool)
            i = rng.randrange(len(buf))
            j = rng.randrange(len(other))
            n = rng.randrange(1, 256)
            buf[i : i + n] = other[j : j + n]
        elif op == 6 and len(buf) > 8:
            i = rng.randrange(len(buf) - 8)
            buf[i : i + 8] = struct.pack("<q", rng.choice([0, -1, 1, 2**31, 2**62, 2**63 - 1]))
    return bytes([rng.randrange(256)]) + bytes(buf)


def run_random(target: Target, corpus: list[bytes], runs: int, seed: int) -> None:
    """The pure-Python engine: mutate seeds (and earlier accepted inputs) ``runs`` times."""
    rng = random.Random(seed)
    pool = list(corpus)
    for s in corpus:
        target(b"\x00" + s)
    while target.runs < runs:
        candidate = mutate(rng, rng.choice(pool), pool)
        before = target.accepted
        target(candidate)
        if target.accepted > before and len(pool) < 256:
            pool.append(candidate[1:])


_HEADER_KEYS = (
    "format", "model_id", "fingerprint", "namespace", "tokenizer_hash", "created_at",
    "file_size", "tokens", "layers", "kind", "offset", "idx", "max_size", "keep", "bits",
    "group_size", "head_dim", "slots", "min_reusable_offset", "tensors", "children", "name",
    "dtype", "shape", "nbytes", "hash", "kv", "quantized", "rotating", "arrays", "mamba",
    "list", "keys", "values", "state.0", "float32", "bfloat16", "uint32", "int64", FP,
)  # fmt: skip
_JSON_WORDS = ("null", "true", "false", "-1", "0", "16384", "4611686018427387904", "1e400",
               "NaN", "[]", "{}", ":", ",")  # fmt: skip


def _dict_literal(word: str) -> str:
    escaped = "".join(c if c.isalnum() or c in "._-+:,[]{} " else f"\\x{ord(c):02x}" for c in word)
    return f'"{escaped}"'


def run_atheris(target: Target, corpus: list[bytes], argv: list[str]) -> None:
    """libFuzzer through atheris; ``argv`` carries libFuzzer flags (e.g. ``-runs=1000000``)."""
    assert atheris is not None
    with tempfile.TemporaryDirectory() as d:
        for n, s in enumerate(corpus):
            for mode in (0, 1):
                with open(os.path.join(d, f"seed-{n}-{mode}"), "wb") as f:
                    f.write(bytes([mode]) + s)
        limit = max(len(s) for s in corpus) * 2
        # NOTE: the header's JSON keys and values as a libFuzzer dictionary,
        # so mutations speak the format's vocabulary.
        words = [*_JSON_WORDS, *(f'"{k}"' for k in _HEADER_KEYS)]
        dictionary = os.path.join(d, "kvt.dict")
        with open(dictionary, "w", encoding="ascii") as f:
            f.writelines(f"{_dict_literal(w)}\n" for w in words)
        args = [argv[0], *argv[1:], f"-max_len={limit}", f"-dict={dictionary}", d]
        atheris.Setup(args, target)
        atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    """Parse our flags; pass the rest to libFuzzer."""
    argv = list(sys.argv if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("atheris", "random"), default=None)
    parser.add_argument("--runs", type=int, default=100_000, help="random engine: inputs to run")
    parser.add_argument("--seed", type=int, default=0, help="random engine: RNG seed")
    ours, rest = parser.parse_known_args(argv[1:])
    engine = ours.engine or ("atheris" if atheris is not None else "random")
    corpus = seeds()
    target = Target()
    started = time.perf_counter()

    def report() -> None:
        print(
            f"kv_file_fuzz: engine={engine} runs={target.runs} accepted={target.accepted} "
            f"seconds={time.perf_counter() - started:.0f}"
        )

    if engine == "random":
        # NOTE: an unexpected exception propagates (a crash) before this line.
        run_random(target, corpus, ours.runs, ours.seed)
        report()
        return 0
    if atheris is None:
        print("atheris is not installed: pip install -e '.[fuzz]' or use --engine random")
        return 2
    # NOTE: libFuzzer ends the process itself: "Done N runs" and exit 0
    # after -runs, or a crash-* file and a non-zero exit on a crash.
    run_atheris(target, corpus, [argv[0], *rest])
    return 0


if __name__ == "__main__":
    sys.exit(main())
