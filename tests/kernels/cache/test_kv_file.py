"""The cold-tier KV file codec and file port: round trips, behaviour after restore, faults."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama, mamba
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from kernels.cache import declare_min_reusable_offset
from kernels.cache._file_port import (
    BytesLike,
    FilePort,
    LockUnavailable,
    OsFilePort,
    ShortRead,
    full_fsync,
)
from kernels.cache._kv_format import (
    ALIGNMENT,
    TEMP_SUFFIX,
    CacheFileWriteError,
    CacheKindUnsupported,
    EntryPlan,
    KvFileHeader,
)
from kernels.cache._kv_header import read_header
from kernels.cache._kv_reader import read_tensors
from kernels.cache._kv_restore import materialize
from kernels.cache._kv_writer import (
    KvFileWriter,
    WriterState,
    plan_entry,
    tensor_bytes,
    tensors_bytes,
)

FP = "fp-test"

# --- helpers ---------------------------------------------------------------------


def tiny_llama(dtype: Any = mx.float32, head_dim: int | None = None) -> Any:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        tie_word_embeddings=True,
        head_dim=head_dim,
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_mamba() -> Any:
    mx.random.seed(0)
    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    model = mamba.Model(args)
    mx.eval(model.parameters())
    return model


def raw(a: Any) -> bytes:
    """The array's bytes in row-major order (bit-exact comparison, bf16 included)."""
    x = mx.contiguous(a)
    mx.eval(x)
    # NOTE: mlx's stubs do not declare mx.array's buffer protocol (it has one).
    return bytes(memoryview(x).cast("B")) if x.size else b""  # type: ignore[arg-type]


def write_entry(
    caches: Sequence[Any],
    tokens: Sequence[int],
    directory: Path,
    *,
    port: FilePort | None = None,
    name: str = "entry.kvt",
) -> Path:
    plan = plan_entry(
        caches,
        model_id="tiny",
        fingerprint=FP,
        namespace="ns",
        tokenizer_hash="tok",
        tokens=tokens,
        created_at=1700000000.5,
    )
    final = directory / name
    with KvFileWriter(port or OsFilePort(), plan) as writer:
        writer.begin(str(directory))
        for i in range(len(plan.tensors)):
            writer.write_tensor(i, tensor_bytes(plan, i))
        writer.commit(str(final))
    plan.release_arrays()
    return final


def roundtrip(
    caches: Sequence[Any], tokens: Sequence[int], directory: Path
) -> tuple[list[Any], KvFileHeader]:
    path = write_entry(caches, tokens, directory)
    port = OsFilePort()
    header = read_header(port, str(path), expected_fingerprint=FP)
    host = read_tensors(port, str(path), header, verify=True)
    return materialize(header, host), header


def assert_same_state(a: Any, b: Any) -> None:
    """Bit-exact equality of the logical state two caches would persist."""
    assert type(a) is type(b)
    assert getattr(a, "_kvtier_min_reusable_offset", None) == getattr(
        b, "_kvtier_min_reusable_offset", None
    )
    if isinstance(a, CacheList):
        assert len(a.caches) == len(b.caches)
        for x, y in zip(a.caches, b.caches, strict=True):
            assert_same_state(x, y)
    elif isinstance(a, ArraysCache):
        assert len(a.cache) == len(b.cache)
        assert getattr(a, "_kvtier_offset", 0) == getattr(b, "_kvtier_offset", 0)
        # NOTE: mlx-lm infers ``cache`` as ``list[None]`` from its ``[None] * size`` initializer.
        slots_a = cast("list[mx.array | None]", a.cache)
        slots_b = cast("list[mx.array | None]", b.cache)
        for x, y in zip(slots_a, slots_b, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert y is not None
                assert x.dtype == y.dtype
                assert x.shape == y.shape
                assert raw(x) == raw(y)
    elif isinstance(a, RotatingKVCache):
        assert (a.offset, a._idx, a.max_size, a.keep) == (b.offset, b._idx, b.max_size, b.keep)
        assert (a.keys is None) == (b.keys is None)
        if a.keys is not None:
            assert b.keys is not None
            assert a.values is not None
            assert b.values is not None
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert x.dtype == y.dtype
                assert x.shape == y.shape
                assert raw(x) == raw(y)
    elif isinstance(a, QuantizedKVCache):
        assert (a.offset, a.bits, a.group_size) == (b.offset, b.bits, b.group_size)
        assert (a.keys is None) == (b.keys is None)
        for xs, ys in ((a.keys or (), b.keys or ()), (a.values or (), b.values or ())):
            for x, y in zip(xs, ys, strict=True):
                assert x.dtype == y.dtype
                assert raw(x[..., : a.offset, :]) == raw(y[..., : b.offset, :])
    else:
        assert isinstance(a, KVCache)
        assert a.offset == b.offset
        assert (a.keys is None) == (b.keys is None)
        if a.keys is not None:
            assert b.keys is not None
            assert a.values is not None
            assert b.values is not None
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert x.dtype == y.dtype
                assert raw(x[..., : a.offset, :]) == raw(y[..., : b.offset, :])


def greedy(model: Any, cache: list[Any], first: int, n: int = 5) -> tuple[list[int], list[bytes]]:
    """Feed ``first`` then ``n - 1`` greedy tokens; the tokens and each step's logits bytes."""
    tok, out, logits = first, [], []
    for _ in range(n):
        y = model(mx.array([[tok]]), cache=cache)[0, -1]
        mx.eval(y)
        logits.append(raw(y))
        tok = int(mx.argmax(y).item())  # type: ignore[arg-type]  # mlx stubs: .item() is int|float|complex
        out.append(tok)
    return out, logits


def kv_step(
    cache: Any, *, seed: int, heads: int = 2, dim: int = 32, dtype: Any = mx.float32
) -> Any:
    mx.random.seed(seed)
    k = mx.random.normal((1, heads, 1, dim)).astype(dtype)
    v = mx.random.normal((1, heads, 1, dim)).astype(dtype)
    return cache.update_and_fetch(k, v)


def fetched_bytes(out: Any) -> list[bytes]:
    flat: list[Any] = []
    for part in out:
        if isinstance(part, tuple | list):
            flat.extend(part)
        else:
            flat.append(part)
    return [raw(x) for x in flat]


PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5]


# --- round trips with a real model ------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "fp32"])
def test_plain_kv_round_trip_continues_identically(tmp_path: Path, dtype: Any) -> None:
    """A restored KVCache is bit-exact and a 5-token greedy continuation matches the original."""
    model = tiny_llama(dtype)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=cache)
    restored, header = roundtrip(cache, PROMPT[:-1], tmp_path)
    assert header.tokens == tuple(PROMPT[:-1])
    assert header.trimmable
    for a, b in zip(cache, restored, strict=True):
        assert_same_state(a, b)
    got = greedy(model, restored, PROMPT[-1])
    want = greedy(model, cache, PROMPT[-1])
    assert got == want


def test_plain_kv_restores_with_step_slack(tmp_path: Path) -> None:
    """Plain KV lands in ceil((offset+1)/step)*step capacity and the next step writes in place."""
    model = tiny_llama()
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    path = write_entry(cache, PROMPT, tmp_path)
    port = OsFilePort()
    header = read_header(port, str(path))
    for step, cap in ((256, 256), (4, 12), (9, 18)):
        restored = materialize(header, read_tensors(port, str(path), header), step=step)
        assert restored[0].keys.shape[2] == cap
        kv_step(restored[0], seed=1, dim=16)
        assert restored[0].keys.shape[2] == cap
        assert restored[0].offset == len(PROMPT) + 1


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_round_trip_continues_identically(tmp_path: Path, bits: int) -> None:
    """QuantizedKVCache (4 and 8 bit) round-trips bit-exactly and continues identically."""
    model = tiny_llama(mx.bfloat16, head_dim=32)
    plain = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=plain)
    cache = [c.to_quantized(group_size=32, bits=bits) for c in plain]
    restored, header = roundtrip(cache, PROMPT[:-1], tmp_path)
    assert header.layers[0].kind == "quantized"
    assert header.layers[0].bits == bits
    assert header.layers[0].head_dim == 32
    assert [t.dtype for t in header.layers[0].tensors[:3]] == ["uint32", "bfloat16", "bfloat16"]
    for a, b in zip(cache, restored, strict=True):
        assert_same_state(a, b)
    assert greedy(model, restored, PROMPT[-1]) == greedy(model, cache, PROMPT[-1])


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [(5, 0), (6, 5), (12, 0), (12, 3)],
    ids=["before-wrap", "wrapped-by-decode", "oversize-prefill", "oversize-then-wrapped"],
)
def test_rotating_round_trip_continues_identically(
    tmp_path: Path, prefill: int, decode: int
) -> None:
    """RotatingKVCache before and after wrap restores its exact ring state and continues identically."""
    model = tiny_llama()
    cache = [RotatingKVCache(max_size=8, keep=4) for _ in model.layers]
    tokens = list(range(10, 10 + prefill + decode))
    model(mx.array([tokens[:prefill]]), cache=cache)
    for t in tokens[prefill:]:
        model(mx.array([[t]]), cache=cache)
    mx.eval([c.keys for c in cache])
    if prefill + decode > 8:
        assert cache[0].offset > cache[0].max_size  # the ring has wrapped
    restored, header = roundtrip(cache, tokens, tmp_path)
    assert header.layers[0].kind == "rotating"
    assert header.trimmable == (prefill + decode < 8)
    for a, b in zip(cache, restored, strict=True):
        assert_same_state(a, b)
    assert greedy(model, restored, 77, n=6) == greedy(model, cache, 77, n=6)


def test_mamba_recurrent_state_continues_identically(tmp_path: Path) -> None:
    """ArraysCache recurrent state of a Mamba model round-trips and continues identically."""
    model = tiny_mamba()
    cache = model.make_cache()
    model(mx.array([PROMPT[:-1]]), cache=cache)
    for c in cache:
        c._kvtier_offset = len(PROMPT) - 1
    restored, header = roundtrip(cache, PROMPT[:-1], tmp_path)
    assert [x.kind for x in header.layers] == ["arrays", "arrays"]
    assert not header.trimmable
    for a, b in zip(cache, restored, strict=True):
        assert_same_state(a, b)
    assert greedy(model, restored, PROMPT[-1]) == greedy(model, cache, PROMPT[-1])


# --- round trips with tiny arrays -------------------------------------------------


def _filled_kv(n: int, dtype: Any = mx.float32, seed: int = 0) -> KVCache:
    c = KVCache()
    mx.random.seed(seed)
    c.update_and_fetch(
        mx.random.normal((1, 2, n, 32)).astype(dtype), mx.random.normal((1, 2, n, 32)).astype(dtype)
    )
    return c


def _filled_rotating(n: int, max_size: int = 6, keep: int = 2) -> RotatingKVCache:
    c = RotatingKVCache(max_size=max_size, keep=keep)
    for i in range(n):
        kv_step(c, seed=100 + i)
    return c


def _arrays_with_none(offset: int) -> ArraysCache:
    c = ArraysCache(3)
    mx.random.seed(5)
    c[0] = mx.random.normal((1, 3, 8))
    c[2] = mx.random.normal((1, 4, 2)).astype(mx.bfloat16)
    # NOTE: the recurrent-offset stamp the registry puts on ArraysCache (same spelling).
    vars(c)["_kvtier_offset"] = offset
    return c


def test_arrays_cache_with_none_slot_round_trips(tmp_path: Path) -> None:
    """ArraysCache keeps its None slot, dtypes, stamp and min reusable offset."""
    c = _arrays_with_none(4)
    declare_min_reusable_offset(c, 4)
    restored, header = roundtrip([c], [1, 2, 3, 4], tmp_path)
    assert [t.name for t in header.layers[0].tensors] == ["state.0", "state.2"]
    assert header.layers[0].slots == 3
    assert header.min_reusable_offset == 4
    assert restored[0].cache[1] is None
    assert_same_state(c, restored[0])


def test_cache_list_round_trips_and_updates_identically(tmp_path: Path) -> None:
    """A nested CacheList restores every member; KV members update identically afterwards."""
    n = 7
    inner = CacheList(_filled_kv(n, mx.bfloat16, seed=1), _arrays_with_none(n))
    outer = CacheList(_filled_rotating(n), inner)
    declare_min_reusable_offset(outer, 3)
    restored, header = roundtrip([outer, _filled_kv(n)], list(range(n)), tmp_path)
    assert [x.kind for x in header.layers] == ["list", "kv"]
    assert [x.kind for x in header.layers[0].children] == ["rotating", "list"]
    assert_same_state(outer, restored[0])
    assert_same_state(inner, restored[0].caches[1])
    for a, b, dtype in (
        (outer.caches[0], restored[0].caches[0], mx.float32),
        (inner.caches[0], restored[0].caches[1].caches[0], mx.bfloat16),
    ):
        for s in range(3):
            assert fetched_bytes(kv_step(a, seed=s, dtype=dtype)) == fetched_bytes(
                kv_step(b, seed=s, dtype=dtype)
            )


@pytest.mark.parametrize("kind", ["kv-bf16", "kv-fp16", "q4", "q8", "rot-pre", "rot-wrap"])
def test_update_and_fetch_after_restore_matches(tmp_path: Path, kind: str) -> None:
    """After restore, further update_and_fetch calls return bit-identical keys and values."""
    n = 9
    dtype = mx.float32
    cache: Any
    if kind.startswith("kv"):
        dtype = mx.bfloat16 if kind == "kv-bf16" else mx.float16
        cache = _filled_kv(n, dtype)
    elif kind.startswith("q"):
        cache = _filled_kv(n).to_quantized(group_size=32, bits=int(kind[1:]))
    else:
        n = 4 if kind == "rot-pre" else 11
        cache = _filled_rotating(n)
    restored, _ = roundtrip([cache], list(range(n)), tmp_path)
    for s in range(4):
        got = fetched_bytes(kv_step(restored[0], seed=s, dtype=dtype))
        want = fetched_bytes(kv_step(cache, seed=s, dtype=dtype))
        assert got == want


def test_empty_caches_round_trip(tmp_path: Path) -> None:
    """Caches that never saw a token (keys None) round-trip as fresh caches."""
    caches = [KVCache(), QuantizedKVCache(group_size=64, bits=4), RotatingKVCache(max_size=4)]
    restored, header = roundtrip(caches, [], tmp_path)
    assert header.tensors == ()
    for a, b in zip(caches, restored, strict=True):
        assert_same_state(a, b)


def test_token_ids_of_every_width_round_trip(tmp_path: Path) -> None:
    """Token ids from 0 to 2**32-1 round-trip; the planned header length fits the encoded one."""
    tokens = [
        0,
        1,
        9,
        *(10**k for k in range(1, 10)),
        *(10**k - 1 for k in range(2, 10)),
        2**32 - 1,
    ]
    state = ArraysCache(1)
    state[0] = mx.ones((1, 2))
    _, header = roundtrip([state], tokens, tmp_path)
    assert header.tokens == tuple(tokens)
    with pytest.raises(ValueError, match="token"):
        plan_entry(
            [state], model_id="", fingerprint="", namespace="", tokenizer_hash="", tokens=[2**32]
        )


def test_materialized_arrays_do_not_alias_host_buffers(tmp_path: Path) -> None:
    """Overwriting the host buffers after materialize leaves the restored caches unchanged."""
    cache = [_filled_kv(5)]
    path = write_entry(cache, range(5), tmp_path)
    port = OsFilePort()
    header = read_header(port, str(path))
    host = read_tensors(port, str(path), header)
    restored = materialize(header, host)
    before = raw(restored[0].keys)
    for buf in host.buffers:
        buf[:] = b"\xff" * len(buf)
    assert raw(restored[0].keys) == before
    assert_same_state(cache[0], restored[0])


@pytest.mark.parametrize(
    "dtype", [mx.bfloat16, mx.float16, mx.float32, mx.uint32], ids=["bf16", "fp16", "fp32", "u32"]
)
def test_tensor_bytes_reads_back_exact_bytes(dtype: Any) -> None:
    """tensor_bytes returns row-major bytes of sliced and transposed tensors for every dtype."""
    k = (mx.arange(1 * 2 * 3 * 32).reshape(1, 2, 3, 32) % 251).astype(dtype)
    state = ArraysCache(2)
    state[0] = k.transpose(0, 3, 1, 2)  # a non-contiguous view
    state[1] = k[..., :2, 5:9]  # a strided slice
    caches: list[Any] = [state]
    if dtype != mx.uint32:
        kv = KVCache()
        kv.update_and_fetch(k, k)  # held in a 256-slot buffer, persisted as a slice
        caches.append(kv)
    plan = plan_entry(
        caches, model_id="m", fingerprint=FP, namespace="", tokenizer_hash="", tokens=[1, 2, 3]
    )
    as_uint = {2: mx.uint16, 4: mx.uint32}[dtype.size]
    wants = [state[0], state[1], k, k][: len(plan.tensors)]
    for i, want_array in enumerate(wants):
        want = np.array(want_array.view(as_uint)).tobytes()
        got = bytes(tensor_bytes(plan, i))
        assert got == want
        assert len(got) == plan.tensors[i].nbytes


def test_plan_layout_is_aligned_and_sized() -> None:
    """Every tensor offset is 16 KiB aligned, after the header, and within the planned size."""
    plan = plan_entry(
        [_filled_kv(3), CacheList(_filled_rotating(3), _arrays_with_none(3))],
        model_id="m",
        fingerprint=FP,
        namespace="n",
        tokenizer_hash="t",
        tokens=[1, 2, 3],
    )
    assert (32 + plan.header_len) % ALIGNMENT == 0
    ends = [t.offset + t.nbytes for t in plan.tensors]
    assert all(t.offset % ALIGNMENT == 0 and t.offset >= 32 + plan.header_len for t in plan.tensors)
    assert plan.file_size == max(ends)


def test_plan_rejects_mismatched_tokens_and_unknown_kinds() -> None:
    """plan_entry refuses offsets that disagree with the tokens and classes it cannot encode."""
    common: dict[str, Any] = {
        "model_id": "m",
        "fingerprint": FP,
        "namespace": "",
        "tokenizer_hash": "",
    }
    with pytest.raises(ValueError, match="offset"):
        plan_entry([_filled_kv(3)], tokens=[1, 2], **common)
    with pytest.raises(CacheKindUnsupported):
        plan_entry([ChunkedKVCache(4)], tokens=[], **common)
    with pytest.raises(ValueError, match="token"):
        plan_entry([KVCache()], tokens=[-1], **common)
    ints = KVCache()
    ints.update_and_fetch(mx.zeros((1, 1, 2, 4), mx.int32), mx.zeros((1, 1, 2, 4), mx.int32))
    with pytest.raises(CacheKindUnsupported, match="not encodable"):
        plan_entry([ints], tokens=[1, 2], **common)


# --- writer faults ---------------------------------------------------------------


class FaultPort:
    """Delegates to OsFilePort; the ``nth`` call of ``method`` fails with ``err``.

    ``err == "short"``: the write puts half its bytes on disk, then raises ENOSPC.
    """

    def __init__(self, method: str, nth: int, err: int | str) -> None:
        self.inner = OsFilePort()
        self.method, self.nth, self.err = method, nth, err
        self.calls: dict[str, int] = {}
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            count = self.calls.get(name, 0)
            self.calls[name] = count + 1
            if name == self.method and count == self.nth:
                self.fired = True
                if self.err == "short":
                    fd, data, offset = args
                    half = memoryview(data).cast("B")[: len(memoryview(data).cast("B")) // 2]
                    self.inner.pwrite_all(fd, half, offset)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                assert isinstance(self.err, int)
                raise OSError(self.err, os.strerror(self.err))
            return target(*args, **kwargs)

        return call


def _fault_cases() -> list[Any]:
    cases = []
    # NOTE: the fixture entry has 4 tensors; pwrite_all call 4 is the header.
    for nth in range(5):
        for err in (errno.ENOSPC, errno.EIO, "short"):
            cases.append(pytest.param("pwrite_all", nth, err, id=f"pwrite{nth}-{err}"))
    for method in ("open_temp", "truncate", "fsync", "close", "replace", "fsync_dir"):
        for err in (errno.ENOSPC, errno.EIO):
            cases.append(pytest.param(method, 0, err, id=f"{method}-{err}"))
    return cases


@pytest.mark.parametrize(("method", "nth", "err"), _fault_cases())
def test_writer_faults_leave_no_file_behind(
    tmp_path: Path, method: str, nth: int, err: int | str
) -> None:
    """Each write/fsync/replace/fsync_dir failure raises CacheFileWriteError and leaves no file."""
    port = FaultPort(method, nth, err)
    caches = [_filled_kv(4), _filled_kv(4, mx.bfloat16)]
    with pytest.raises(CacheFileWriteError) as info:
        write_entry(caches, range(4), tmp_path, port=port)
    assert port.fired
    assert info.value.fsync_failed == (method in ("fsync", "close", "fsync_dir"))
    assert info.value.errno == (errno.ENOSPC if err == "short" else err)
    assert os.listdir(tmp_path) == []


def test_failed_fsync_is_never_retried_into_success(tmp_path: Path) -> None:
    """After a failed fsync the writer stays failed: commit again raises, no file appears."""
    plan = plan_entry(
        [_filled_kv(2)],
        model_id="m",
        fingerprint=FP,
        namespace="",
        tokenizer_hash="",
        tokens=[1, 2],
    )
    writer = KvFileWriter(FaultPort("fsync", 0, errno.EIO), plan)
    writer.begin(str(tmp_path))
    for i in range(len(plan.tensors)):
        writer.write_tensor(i, tensor_bytes(plan, i))
    final = str(tmp_path / "x.kvt")
    with pytest.raises(CacheFileWriteError) as first:
        writer.commit(final)
    assert first.value.fsync_failed
    with pytest.raises(CacheFileWriteError) as second:
        writer.commit(final)
    assert second.value.fsync_failed
    assert writer.state is WriterState.FAILED
    assert os.listdir(tmp_path) == []


def test_abort_and_context_exit_remove_the_temp_file(tmp_path: Path) -> None:
    """An uncommitted writer leaves nothing: abort() and an exception inside ``with`` unlink the temp."""
    plan = plan_entry(
        [_filled_kv(2)],
        model_id="m",
        fingerprint=FP,
        namespace="",
        tokenizer_hash="",
        tokens=[1, 2],
    )
    writer = KvFileWriter(OsFilePort(), plan)
    temp = writer.begin(str(tmp_path))
    assert temp.endswith(TEMP_SUFFIX)
    assert os.stat(temp).st_mode & 0o777 == 0o600
    writer.abort()
    assert os.listdir(tmp_path) == []

    def fail_mid_write() -> None:
        with KvFileWriter(OsFilePort(), plan) as w2:
            w2.begin(str(tmp_path))
            w2.write_tensor(0, tensor_bytes(plan, 0))
            raise KeyError("caller failed mid-write")

    with pytest.raises(KeyError):
        fail_mid_write()
    assert os.listdir(tmp_path) == []


def test_writer_rejects_wrong_sizes_and_incomplete_commits(tmp_path: Path) -> None:
    """write_tensor refuses a buffer of the wrong size; commit refuses unwritten tensors."""
    plan: EntryPlan = plan_entry(
        [_filled_kv(2)],
        model_id="m",
        fingerprint=FP,
        namespace="",
        tokenizer_hash="",
        tokens=[1, 2],
    )
    with KvFileWriter(OsFilePort(), plan) as w:
        w.begin(str(tmp_path))
        with pytest.raises(ValueError, match="bytes"):
            w.write_tensor(0, b"\x00" * 3)
        w.write_tensor(0, tensor_bytes(plan, 0))
        with pytest.raises(RuntimeError, match="not written"):
            w.commit(str(tmp_path / "x.kvt"))
    assert os.listdir(tmp_path) == []


# --- the OS port ------------------------------------------------------------------


def test_pwrite_all_survives_short_writes_and_eintr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwrite_all loops over short writes and EINTR until every byte is on disk."""
    real = os.pwrite
    calls = {"n": 0}

    def flaky(fd: int, data: BytesLike, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise InterruptedError
        return real(fd, memoryview(data)[:3], offset)

    monkeypatch.setattr(os, "pwrite", flaky)
    port = OsFilePort()
    fd = port.open_temp(str(tmp_path / "f"))
    try:
        port.pwrite_all(fd, b"0123456789abcdef", 5)
    finally:
        port.close(fd)
    assert (tmp_path / "f").read_bytes() == b"\x00" * 5 + b"0123456789abcdef"
    assert calls["n"] > 6


def test_pread_reports_short_reads(tmp_path: Path) -> None:
    """pread_into/pread_exact raise ShortRead at end of file instead of returning less."""
    (tmp_path / "f").write_bytes(b"abcdef")
    port = OsFilePort()
    fd = port.open_read(str(tmp_path / "f"))
    try:
        assert port.pread_exact(fd, 3, 2) == b"cde"
        with pytest.raises(ShortRead):
            port.pread_exact(fd, 10, 0)
    finally:
        port.close(fd)


def test_open_temp_is_exclusive_and_refuses_symlinks(tmp_path: Path) -> None:
    """open_temp never reuses an existing name and never follows a symlink."""
    port = OsFilePort()
    (tmp_path / "exists").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        port.open_temp(str(tmp_path / "exists"))
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(OSError, match=r"exists|Too many|symbolic"):
        port.open_temp(str(tmp_path / "link"))
    assert not (tmp_path / "target").exists()


def test_full_fsync_falls_back_only_when_unsupported() -> None:
    """On macOS F_FULLFSYNC is used; fsync is the fallback only for 'unsupported' errnos."""
    synced: list[int] = []
    op = 51  # F_FULLFSYNC's value on macOS

    def failing(code: int) -> Callable[[int, int], object]:
        def fn(fd: int, op: int) -> object:
            raise OSError(code, os.strerror(code))

        return fn

    calls: list[tuple[int, int]] = []

    def ok(fd: int, op_: int) -> object:
        calls.append((fd, op_))
        return 0

    kw: dict[str, Any] = {"fsync_fn": synced.append, "platform": "darwin", "fullfsync_op": op}
    full_fsync(2, fcntl_fn=ok, **kw)
    assert calls == [(2, op)]
    assert synced == []
    full_fsync(3, fcntl_fn=failing(errno.ENOTSUP), **kw)
    assert synced == [3]
    with pytest.raises(OSError):
        full_fsync(4, fcntl_fn=failing(errno.EIO), **kw)
    assert synced == [3]


def test_full_fsync_uses_fsync_off_macos() -> None:
    """Off macOS full_fsync is plain fsync (which on Linux also flushes the drive cache)."""
    synced: list[int] = []
    full_fsync(7, fsync_fn=synced.append, platform="linux")
    assert synced == [7]


def test_makedirs_fsyncs_parents_of_created_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """makedirs creates every missing level and fsyncs the parent of each one it created."""
    port = OsFilePort()
    synced: list[str] = []
    monkeypatch.setattr(port, "fsync_dir", synced.append)
    target = tmp_path / "a" / "b" / "c"
    port.makedirs(str(target))
    assert target.is_dir()
    assert synced == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    synced.clear()
    port.makedirs(str(target))
    assert synced == []


def test_lock_is_exclusive_until_released(tmp_path: Path) -> None:
    """A second lock on the same path raises LockUnavailable until the first is released."""
    port = OsFilePort()
    path = str(tmp_path / "lock")
    with port.lock(path), pytest.raises(LockUnavailable):
        port.lock(path)
    second = port.lock(path)
    second.release()
    second.release()


def test_scandir_stat_and_utime(tmp_path: Path) -> None:
    """scandir/stat report size and mtime without following symlinks; utime sets the LRU clock."""
    port = OsFilePort()
    (tmp_path / "f").write_bytes(b"12345")
    (tmp_path / "d").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "f")
    port.utime(str(tmp_path / "f"), 1_000_000_000_000_000_000)
    entries = {e.name: e for e in port.scandir(str(tmp_path))}
    assert entries["f"].size == 5
    assert entries["f"].is_file
    assert entries["f"].mtime_ns == 1_000_000_000_000_000_000
    assert entries["d"].is_dir
    assert entries["l"].is_symlink
    assert not entries["l"].is_file
    assert sorted(port.listdir(str(tmp_path))) == ["d", "f", "l"]
    st = port.stat(str(tmp_path / "f"))
    assert (st.size, st.mtime_ns, st.is_file) == (5, 1_000_000_000_000_000_000, True)
    assert isinstance(port, FilePort)


def _address(buf: Any) -> int:
    """Where a buffer's first byte lives (an MLX array's or a memoryview's)."""
    view = memoryview(buf).cast("B")
    return int(np.asarray(view).__array_interface__["data"][0])


@pytest.mark.parametrize("migrate", [True, False])
def test_host_read_views_a_device_copy_where_host_reads_migrate(
    monkeypatch: pytest.MonkeyPatch, migrate: bool
) -> None:
    """Where host reads migrate pages (CUDA managed memory) a tensor's view is of a copy, never the entry's buffer, with equal bytes; elsewhere it shares."""
    from kernels.cache import _kv_writer

    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", migrate)
    # NOTE: 256 tokens fill the cache's buffer exactly: the planned arrays are
    # the entry's own contiguous buffers, the case a view would share.
    cache = _filled_kv(256, mx.bfloat16)
    plan = plan_entry([cache], model_id="tiny", fingerprint=FP, namespace="ns",
                      tokenizer_hash="tok", tokens=list(range(256)))
    arrays = [a for a in plan._arrays if a is not None]
    assert arrays
    for i, a in enumerate(arrays):
        mx.eval(a)
        view = tensor_bytes(plan, i)
        assert bytes(view) == raw(a)
        assert (_address(view) != _address(a)) is migrate
    plan.release_arrays()


def test_host_copies_work_on_each_thread_that_makes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host-read copies made on one thread, then on another (an engine thread replaced in the same
    process), both hold the tensor's bytes: the copy stream is the calling thread's own."""
    from kernels.cache import _kv_writer

    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", True)
    cache = _filled_kv(64, mx.float32)
    plan = plan_entry([cache], model_id="tiny", fingerprint=FP, namespace="ns",
                      tokenizer_hash="tok", tokens=list(range(64)))
    expected = raw(next(a for a in plan._arrays if a is not None))
    got: list[bytes] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            got.append(bytes(tensor_bytes(plan, 0)))
        except BaseException as exc:  # noqa: BLE001 - NOTE: re-raised on the test's thread below.
            errors.append(exc)

    for _ in range(2):
        worker = threading.Thread(target=read)
        worker.start()
        worker.join()
    read()
    if errors:
        raise errors[0]
    assert got == [expected] * 3


def test_a_migrating_host_read_copies_a_whole_group_into_one_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where host reads migrate pages, one read of several tensors makes ONE device-side copy (one
    host allocation on CUDA): every view lies in one buffer, back to back, holds its tensor's bytes,
    and none is the entry's own memory."""
    from kernels.cache import _kv_writer

    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", True)
    cache = _filled_kv(256, mx.bfloat16)
    plan = plan_entry([cache], model_id="tiny", fingerprint=FP, namespace="ns",
                      tokenizer_hash="tok", tokens=list(range(256)))
    indices = [i for i, a in enumerate(plan._arrays) if a is not None]
    assert len(indices) >= 2
    views = tensors_bytes(plan, indices)
    starts = [_address(v) for v in views]
    for view, i, start, nxt in zip(views, indices, starts, [*starts[1:], None], strict=True):
        a = plan._arrays[i]
        assert bytes(view) == raw(a)
        assert start != _address(a)
        if nxt is not None:
            assert nxt == start + plan.tensors[i].nbytes


def _migrating_read(monkeypatch: pytest.MonkeyPatch, mode: str) -> tuple[EntryPlan, list[int], list[memoryview]]:
    """A 256-token bf16 entry's plan, its tensors' indices and their views read with KVTIER_CUDA_HOST_READ=``mode``
    where host reads migrate."""
    from kernels.cache import _kv_writer

    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", True)
    monkeypatch.setenv(_kv_writer.HOST_READ_ENV, mode)
    cache = _filled_kv(256, mx.bfloat16)
    plan = plan_entry([cache], model_id="tiny", fingerprint=FP, namespace="ns",
                      tokenizer_hash="tok", tokens=list(range(256)))
    indices = [i for i, a in enumerate(plan._arrays) if a is not None]
    return plan, indices, tensors_bytes(plan, indices)


def test_direct_host_reads_view_each_tensor_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_CUDA_HOST_READ=direct (a diagnostic) skips the one-buffer copy where host reads migrate: each view is its own tensor's contiguous array, bytes equal."""
    plan, indices, views = _migrating_read(monkeypatch, "direct")
    for view, i in zip(views, indices, strict=True):
        a = plan._arrays[i]
        assert bytes(view) == raw(a)
        # NOTE: 256 tokens fill the buffer: the contiguous array is the entry's own.
        assert _address(view) == _address(a)
    plan.release_arrays()


def test_host_reads_copy_a_group_into_host_memory_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_CUDA_HOST_READ=host (a diagnostic): the group's one-buffer copy is copied again into host-owned bytes, back to back, bytes equal."""
    plan, indices, views = _migrating_read(monkeypatch, "host")
    for view, i in zip(views, indices, strict=True):
        assert isinstance(view.obj, bytearray)
        assert bytes(view) == raw(plan._arrays[i])
    assert views[0].obj is views[-1].obj
    plan.release_arrays()


@pytest.mark.parametrize(("switch", "clears"), [(None, 0), ("on", 1), ("off", 0)])
def test_release_host_copies_clears_the_buffer_cache_only_when_switched_on(
    monkeypatch: pytest.MonkeyPatch, switch: str | None, clears: int
) -> None:
    """Where host reads migrate, dropping views keeps MLX's buffer cache unless KVTIER_CUDA_RELEASE_CACHE=on empties it."""
    from kernels.cache import _kv_writer

    calls: list[None] = []
    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", True)
    monkeypatch.setattr(mx, "clear_cache", lambda: calls.append(None))
    if switch is None:
        monkeypatch.delenv(_kv_writer.RELEASE_CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(_kv_writer.RELEASE_CACHE_ENV, switch)
    _kv_writer.release_host_copies()
    assert len(calls) == clears


@pytest.mark.parametrize("mixed", [False, True])
def test_the_one_buffer_copy_of_strided_slices_holds_each_tensors_row_major_bytes(mixed: bool) -> None:
    """The one-buffer copy of strided slices (a checkpoint delta's K and V, one row of a wider batch
    buffer) lays every tensor's row-major bytes out in turn, views back to back, whether the
    tensors share a dtype and trailing shape (one concatenation on the first axis) or not."""
    from kernels.cache import _kv_writer

    wide = [mx.arange(2 * 3 * 9 * 4, dtype=mx.float32).reshape(2, 3, 9, 4) * (k + 1) for k in range(4)]
    arrays: list[Any] = [w[1:2, :, 5:, :] for w in wide]
    if mixed:
        arrays.insert(2, mx.arange(7, dtype=mx.uint8))
        arrays.append(wide[0][0:1, :, :2, :].astype(mx.bfloat16))
    mx.eval(arrays)
    assert _kv_writer._stackable(arrays) is not mixed
    sizes = [a.nbytes for a in arrays]
    views = _kv_writer._flat_host_views(range(len(arrays)), arrays, sizes)
    assert [bytes(v) for v in views] == [raw(a) for a in arrays]
    starts = [_address(v) for v in views]
    assert starts == [starts[0] + sum(sizes[:i]) for i in range(len(sizes))]


def test_a_read_back_past_the_buffer_bound_is_cut_into_several_buffers_byte_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors whose bytes pass FLAT_GROUP_BYTES (one MLX dimension holds < 2**31) are read into
    several buffers, each within the bound unless a lone tensor is larger, every view byte-exact
    and in order; empty tensors keep empty views."""
    from kernels.cache import _kv_writer

    monkeypatch.setattr(_kv_writer, "FLAT_GROUP_BYTES", 256)
    wide = [mx.arange(2 * 3 * 9 * 4, dtype=mx.float32).reshape(2, 3, 9, 4) * (k + 1) for k in range(5)]
    # NOTE: 3 x 4 x 4 x 4 = 192 bytes a slice: one a buffer; the 864-byte tensor is larger than the bound.
    arrays: list[Any] = [w[1:2, :, 5:, :] for w in wide]
    arrays.insert(1, mx.zeros((0, 4), dtype=mx.float32))
    arrays.insert(3, wide[0][0:1, :, :, :2].astype(mx.bfloat16) * 0 + wide[1][1:2, :, :, :2].astype(mx.bfloat16))
    arrays.append(wide[2] * 3)
    arrays.append(mx.arange(5, dtype=mx.uint8))
    mx.eval(arrays)
    sizes = [a.nbytes for a in arrays]
    views = _kv_writer._flat_host_views(range(len(arrays)), arrays, sizes)
    assert [bytes(v) for v in views] == [raw(a) for a in arrays]
    buffers: list[Any] = []
    for v in views:
        if len(v) and not any(v.obj is b for b in buffers):
            buffers.append(v.obj)
    assert len(buffers) >= 4
    for b in buffers:
        size = memoryview(b).nbytes
        assert size <= 256 or sum(1 for v in views if len(v) and v.obj is b) == 1


@pytest.mark.slow
def test_a_read_back_of_more_than_two_gib_succeeds() -> None:
    """2.3 GB of tensors (more than one MLX dimension holds, as 64 rows of the 8B shape reaching
    their checkpoints together) read back whole and in place: one buffer would raise OverflowError."""
    from kernels.cache import _kv_writer

    arrays = [mx.full((1100, 1024, 1024), k + 1, dtype=mx.uint8) for k in range(2)]
    mx.eval(arrays)
    sizes = [a.nbytes for a in arrays]
    assert sum(sizes) > 2**31
    views = _kv_writer._flat_host_views(range(2), arrays, sizes)
    assert [len(v) for v in views] == sizes
    for k, v in enumerate(views):
        assert v[0] == v[len(v) // 2] == v[-1] == k + 1
