"""The exhaustive crash checker of the cold tier (the engine behind ``tests/crash``).

A **workload** is a short sequence of steps run against the real actors
over a :class:`CrashFS`: the SSD tier (``actors.ssd_writer``: index, store
worker, reader) and, for put and flush steps, the spill queue and the
durability coordinator (a stub gateway grants every engine turn at once).
Steps: store an entry, store a trimmable descendant (supersede), store
past the byte cap (evict), scrub (the idle scrubber re-verifies every
entry), restore (every entry read back through the reader, verifying, LRU
touched), restart (a clean stop and a new tier on the same files: a startup scan),
put (the RAM tier tells the coordinator; write-behind off) and flush. The
file system records every operation; after each one, every state a crash
may leave (:meth:`CrashSpace.states`) is restarted the way the tier starts
(directory lock, header scan, ``core.ScanLoaded``, its removals), and so is
every state a second crash during that startup may leave. Each is checked:

1. startup never fails;
2. no temp file survives the startup;
3. the files of our fingerprint directory fit the byte cap;
4. no indexed file serves bytes that differ from what was stored (read with
   hash verification OFF, so the write protocol alone must guarantee it;
   verification is the second line of defence, not the first);
5. every prefix acknowledged durable before the crash (a store answered
   ``stored``, or a put before a flush answered ``durable: true``) is
   served after it: by its own file or by a trimmable descendant that may
   be cut to it — unless the tier evicted it (its file was unlinked as an
   LRU victim) before the crash;
6. the startup never evicts over the cap. The cap is the one the tier ran
   under, so this means no crash leaves more than the cap in valid entry
   files: a removed file's room is reused only once its removal is durable.
   (Without this, the startup's LRU eviction, going by modification times a
   crash may have rolled back, could drop an acknowledged entry and keep
   one that was evicted or never acknowledged.)
7. (generation checkpoints) the checkpoint the answer's retry resumes
   after the startup (``find_checkpoint``, then its tensors read with hash
   verification OFF) is whole and exactly one that was written, and its
   sample index is at least that of the newest checkpoint answered
   ``stored`` before the crash (unless the answer completed since): the
   previous checkpoint survives every crash before the new one is durable,
   and no torn or stale one is resumed.

The forward run itself is checked too (after every step, settled): no temp
file left, every entry file on disk is indexed or counted as a leftover
with its size, indexed plus leftover bytes fit the cap, the cap holds on
disk after every single file-system operation, every restored entry equals
the original.

The tier runs on the test's event loop with its worker-thread hops made
inline (``ColdTier.run``), so the order of file operations is a pure
function of the workload and runs are reproducible. New kinds of work plug
in as :class:`Step` objects.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from actors.checkpoints import CHECKPOINT_SUFFIX, checkpoint_dir, find_checkpoint
from actors.durability import DurabilityConfig
from actors.engine.wiring import spawn_durability, spawn_spill_queue, spawn_ssd_writer
from actors.runtime import Actor, ActorSystem, AskTimeout, Context, SequentialIds
from actors.ssd_writer import FileIdentity, SsdWriterConfig, core, io
from actors.ssd_writer.actor import ColdTier
from kernels.cache import (
    TEMP_SUFFIX,
    CacheFileCorrupt,
    CacheFileIncompatible,
    EntryPlan,
    GenerationCheckpoint,
    KvFileHeader,
    read_header,
    read_tensors,
)
from kernels.cache._file_port import FilePort
from kernels.cache._kv_writer import plan_entry, tensor_bytes
from messages import (
    Body,
    EntryMeta,
    Envelope,
    Request,
    Restore,
    RestoreResult,
    SsdStats,
    SsdStatsRequest,
    Store,
    StoreResult,
)
from messages.durability import Flush, FlushResult, Schedule
from messages.gateway import RunWhenIdle, TurnDone
from messages.spill_queue import CheckpointRecord, RemoveCheckpoints
from messages.ssd_writer import ScrubWake, SsdIndex, SsdIndexEntry, SsdIndexRequest
from tests.crash.crash_fs import (
    CrashFS,
    CrashSpace,
    CrashState,
    Fault,
    FaultingPort,
    FaultKind,
    OpRecord,
)

T = TypeVar("T")
B = TypeVar("B", bound=Body)

ROOT = "/kv"
IDENTITY = FileIdentity(model_id="crash-model", fingerprint="fp-crash", tokenizer_hash="tok-crash")
FP_DIR = posixpath.join(ROOT, IDENTITY.fingerprint)
CAP = 70_000
"""Two entries fit (each ~32.8 KB on disk), a third evicts the least recently used."""
ASK_S = 10.0
ENTRY_SUFFIX = core.ENTRY_SUFFIX


# --- entries -------------------------------------------------------------------------


@dataclass(frozen=True)
class EntrySpec:
    """One prefix entry the workloads store: its identity, plan template and tensor bytes."""

    name: str
    namespace: str
    tokens: tuple[int, ...]
    header_len: int
    plan: EntryPlan
    tensors: tuple[bytes, ...]

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """(namespace, tokens)."""
        return (self.namespace, self.tokens)

    @property
    def path(self) -> str:
        """Where the tier puts its file."""
        return posixpath.join(
            FP_DIR, core.namespace_dir(self.namespace), core.entry_name(self.tokens)
        )

    def fresh_plan(self) -> EntryPlan:
        """A plan the store worker may consume (the template's header, no arrays)."""
        return EntryPlan(
            header=self.plan.header, header_len=self.header_len, _arrays=[None] * len(self.tensors)
        )


def _spec(name: str, namespace: str, tokens: tuple[int, ...], seed: int) -> EntrySpec:
    n = len(tokens)
    cache = KVCache()
    keys = (mx.arange(n * 2, dtype=mx.float32) + seed).reshape(1, 1, n, 2)
    cache.update_and_fetch(keys, keys + 0.5)
    plan = plan_entry(
        [cache],
        model_id=IDENTITY.model_id,
        fingerprint=IDENTITY.fingerprint,
        namespace=namespace,
        tokenizer_hash=IDENTITY.tokenizer_hash,
        tokens=tokens,
        created_at=1.0,
    )
    tensors = tuple(bytes(tensor_bytes(plan, i)) for i in range(len(plan.tensors)))
    plan.release_arrays()
    return EntrySpec(name, namespace, tokens, plan.header_len, plan, tensors)


@functools.cache
def entries() -> dict[str, EntrySpec]:
    """The workloads' entries: A, its trimmable descendant A+, B (another namespace), C."""
    specs = [
        _spec("A", "", (1, 2, 3), 0),
        _spec("A+", "", (1, 2, 3, 4), 0),
        _spec("B", "ns-b", (7, 8, 9), 100),
        _spec("C", "", (5, 6, 7), 200),
    ]
    return {s.name: s for s in specs}


@functools.cache
def originals() -> dict[tuple[str, tuple[int, ...]], tuple[bytes, ...]]:
    """(namespace, tokens) -> the tensor bytes stored for it."""
    return {s.key: s.tensors for s in entries().values()}


# --- generation checkpoints ----------------------------------------------------------


CKPT_KEY = "c0ffee00" * 4
"""The request key of the one answer the checkpoint workloads checkpoint."""
CKPT_PROMPT = (1, 2, 3)
CKPT_INDEXES = (2, 4, 6)
"""The sample indexes of the answer's checkpoints, in the order the workloads write them."""
CKPT_DIR = checkpoint_dir(ROOT, IDENTITY.fingerprint)


@dataclass(frozen=True)
class CheckpointSpec:
    """One checkpoint of the answer: its sample index, tokens, plan template and tensor bytes."""

    sample_index: int
    tokens: tuple[int, ...]
    header_len: int
    plan: EntryPlan
    tensors: tuple[bytes, ...]

    def fresh_plan(self) -> EntryPlan:
        """A plan the store worker may consume (the template's header, no arrays)."""
        return EntryPlan(
            header=self.plan.header, header_len=self.header_len, _arrays=[None] * len(self.tensors)
        )


def _ckpt_spec(n: int) -> CheckpointSpec:
    tokens = CKPT_PROMPT + tuple(10 + i for i in range(n))
    cache = KVCache()
    # NOTE: contents differ per sample index, so bytes name the checkpoint they came from.
    keys = (mx.arange(len(tokens) * 2, dtype=mx.float32) + 1000 * n).reshape(1, 1, len(tokens), 2)
    cache.update_and_fetch(keys, keys + 0.25)
    record = GenerationCheckpoint(CKPT_KEY, len(CKPT_PROMPT), 50 + n, n, None)
    plan = plan_entry(
        [cache], model_id=IDENTITY.model_id, fingerprint=IDENTITY.fingerprint, namespace="",
        tokenizer_hash=IDENTITY.tokenizer_hash, tokens=tokens, created_at=1.0, checkpoint=record,
    )  # fmt: skip
    tensors = tuple(bytes(tensor_bytes(plan, i)) for i in range(len(plan.tensors)))
    plan.release_arrays()
    return CheckpointSpec(n, tokens, plan.header_len, plan, tensors)


@functools.cache
def checkpoints() -> dict[int, CheckpointSpec]:
    """Sample index -> the answer's checkpoint at that index."""
    return {n: _ckpt_spec(n) for n in CKPT_INDEXES}


def _meta(spec: EntrySpec) -> EntryMeta:
    # NOTE: every workload entry is a trimmable KV entry with no minimum
    # reusable offset (plain KV caches).
    return EntryMeta(
        offset=len(spec.tokens), nbytes=sum(map(len, spec.tensors)), trimmable=True,
        min_reusable_offset=0,
    )  # fmt: skip


class RamEntries:
    """The RAM tier as the durability coordinator and the spill queue see it (scripted).

    ``put`` registers an entry under a new handle; the coordinator's
    :class:`Cloner` calls (``clone``/``dispose``) and the spill queue's
    releases (``dispose``) keep the handle table exact, so a write of a
    released clone is caught by :class:`ScriptedSource`.
    """

    def __init__(self) -> None:
        self.live: dict[str, EntrySpec] = {}
        self._ids = itertools.count(1)

    def put(self, spec: EntrySpec) -> str:
        """A RAM entry for ``spec``; its handle."""
        handle = f"ram-{spec.name}-{next(self._ids)}"
        self.live[handle] = spec
        return handle

    def clone(self, handle: str) -> tuple[str, EntryMeta] | None:
        """See ``actors.durability.Cloner.clone``."""
        spec = self.live.get(handle)
        if spec is None:
            return None
        copy = f"clone-{spec.name}-{next(self._ids)}"
        self.live[copy] = spec
        return copy, _meta(spec)

    def dispose(self, handle: str) -> None:
        """See ``Cloner.dispose`` / ``HandleReleaser.dispose`` (``KeyError`` when unknown)."""
        del self.live[handle]


class LiveHandles(Protocol):
    """The handle table a :class:`ScriptedSource` checks (:class:`RamEntries` or a test's own)."""

    @property
    def live(self) -> Mapping[str, EntrySpec]:
        """Live handle -> the entry it holds."""
        ...


class ScriptedSource:
    """A :class:`TensorSource` over the prepared entries (no engine, no MLX at run time).

    A handle registered in ``ram`` must still be live when it is planned (a
    released clone is never written); other handles (direct ``Store`` steps)
    are taken at their word.
    """

    def __init__(self, ram: LiveHandles | None = None) -> None:
        self._by_tokens = {(s.namespace, s.tokens): s for s in entries().values()}
        self._ram = ram

    async def plan(self, handle: str, *, namespace: str, tokens: tuple[int, ...]) -> EntryPlan:
        """The entry's plan."""
        if handle.startswith(("ram-", "clone-")) and (
            self._ram is None or handle not in self._ram.live
        ):
            raise KeyError(f"handle {handle} is not live")
        return self._by_tokens[(namespace, tokens)].fresh_plan()

    async def tensor(self, plan: EntryPlan, index: int) -> bytes:
        """Tensor ``index`` of the entry."""
        return self._by_tokens[(plan.header.namespace, plan.header.tokens)].tensors[index]

    async def finish(self, plan: EntryPlan) -> None:
        """Nothing to release."""

    async def checkpoint_views(
        self,
        handle: str,
        *,
        namespace: str,
        tokens: tuple[int, ...],
        checkpoint: GenerationCheckpoint,
        base: KvFileHeader | None = None,
    ) -> tuple[EntryPlan, list[bytes | bytearray | memoryview]]:
        """The checkpoint's plan and tensor bytes (``CheckpointSource``).

        NOTE: the workloads' checkpoints carry no ``writer``, so no delta
        base is ever offered: their contents differ per sample index (bytes
        name the checkpoint they came from), which a delta's append-only
        rule would not hold for. A delta changes what the write reads, not
        the file operations these runs crash between.
        """
        if base is not None:
            raise AssertionError("the crash workloads never offer a delta base")
        spec = checkpoints()[checkpoint.sample_index]
        if tokens != spec.tokens or checkpoint.request_key != CKPT_KEY:
            raise KeyError(f"no checkpoint {checkpoint.sample_index} for these tokens")
        return spec.fresh_plan(), list(spec.tensors)


# --- traces and steps --------------------------------------------------------------------


@dataclass
class Trace:
    """What a forward run did: acknowledgements, evictions, forward-run problems."""

    fs: CrashFS
    acks: list[tuple[tuple[str, tuple[int, ...]], int]] = field(default_factory=list)
    ends: list[tuple[tuple[str, tuple[int, ...]], int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    store_results: list[StoreResult] = field(default_factory=list)
    untracked: list[tuple[str, str]] = field(default_factory=list)
    flushes: list[FlushResult] = field(default_factory=list)
    scrubbed: int = 0
    bounds: list[tuple[str, int]] = field(default_factory=list)
    fault_phase: str | None = None
    fault_superseded: bool = False
    ckpt_acks: list[tuple[int, int]] = field(default_factory=list)
    """(sample index, operation count) of each checkpoint write answered ``stored``."""
    ckpt_done: list[int] = field(default_factory=list)
    """Crash points from which the answer is complete (the first operation of its checkpoints' removal)."""
    ckpt_written: int = 0

    def prefix_at(self, point: int) -> tuple[str, ...]:
        """Labels of the steps run up to the one a crash after ``point`` operations interrupts.

        A crash point is a function of these steps alone (a run is
        deterministic): two workloads that share them share the point.
        """
        labels: list[str] = []
        for name, end in self.bounds:
            labels.append(name)
            if point <= end:
                break
        return tuple(labels)

    def required_at(self, point: int) -> set[tuple[str, tuple[int, ...]]]:
        """Prefixes a crash after ``point`` operations must not lose."""
        events = sorted(
            [(at, 0, key) for key, at in self.acks] + [(at, 1, key) for key, at in self.ends],
            key=lambda e: (e[0], e[1]),
        )
        live: set[tuple[str, tuple[int, ...]]] = set()
        for at, kind, key in events:
            if at > point:
                break
            if kind == 0:
                live.add(key)
            else:
                live.discard(key)
        return live


    def checkpoint_required_at(self, point: int) -> int | None:
        """The sample index a crash after ``point`` operations must resume at least (``None``: any).

        The newest checkpoint answered ``stored`` before the crash, unless the
        answer completed since (completion voids its checkpoints; a file the
        crash kept after that is the same answer's, never a wrong one).
        """
        events = sorted([(at, 0, n) for n, at in self.ckpt_acks]
                        + [(at, 1, 0) for at in self.ckpt_done])
        required: int | None = None
        for at, kind, n in events:
            if at > point:
                break
            required = n if kind == 0 else None
        return required


class Run:
    """The live context of a forward run: the system, the tier, the trace.

    ``ram``: the scripted RAM tier; ``dirty``: prefixes put since this
    system's last durable flush (what the next durable flush acknowledges).
    """

    def __init__(self, system: ActorSystem, tier: ColdTier, trace: Trace, ram: RamEntries) -> None:
        self.system = system
        self.tier = tier
        self.trace = trace
        self.ram = ram
        self.dirty: set[tuple[str, tuple[int, ...]]] = set()

    async def ask(self, body: Request, expect: type[B]) -> B:
        """Ask the tier's index."""
        return await self.system.ask(self.tier.name, body, timeout=ASK_S, expect=expect)

    async def stats(self) -> SsdStats:
        """The index's statistics, asked."""
        return await self.ask(SsdStatsRequest(), SsdStats)

    async def index(self) -> SsdIndex:
        """The index's files, leftovers and writes in progress, asked."""
        return await self.ask(SsdIndexRequest(), SsdIndex)

    async def ask_durability(self, body: Request, expect: type[B]) -> B:
        """Ask the durability coordinator."""
        return await self.system.ask("durability", body, timeout=ASK_S, expect=expect)


class Step(Protocol):
    """One workload step."""

    # NOTE: read-only members, so frozen dataclass fields and properties both satisfy them.
    @property
    def label(self) -> str:
        """The step's name in a workload label."""
        ...

    @property
    def restarts(self) -> bool:
        """Whether the driver restarts the tier after this step."""
        ...

    async def run(self, run: Run) -> None:
        """Perform the step (its effects settle before the next)."""
        ...


@dataclass(frozen=True)
class StoreStep:
    """Store one entry; a ``stored`` answer acknowledges it durable."""

    entry: str
    restarts: bool = False

    @property
    def label(self) -> str:
        """The entry's name."""
        return self.entry

    async def run(self, run: Run) -> None:
        """Ask ``Store``; record the acknowledgement at the operation count of the answer."""
        spec = entries()[self.entry]
        meta = _meta(spec)
        body = Store(
            handle=f"h-{spec.name}", namespace=spec.namespace, tokens=spec.tokens, meta=meta
        )
        try:
            res = await run.ask(body, StoreResult)
        except AskTimeout:
            run.trace.problems.append(f"store {spec.name} was never answered")
            return
        run.trace.store_results.append(res)
        if res.stored:
            run.trace.acks.append((spec.key, run.trace.fs.op_count))


@dataclass(frozen=True)
class RestoreStep:
    """Restore every indexed entry through the tier's reader (hashes verified, LRU touched)."""

    label: str = "restore"
    restarts: bool = False

    async def run(self, run: Run) -> None:
        """Restore each entry; compare the staged bytes with the originals."""
        for entry in (await run.index()).entries:
            path = entry.path
            failures = (await run.stats()).restore_failures
            try:
                res = await run.ask(Restore(path=path), RestoreResult)
            except AskTimeout:
                run.trace.problems.append(f"restore of {path} was never answered")
                continue
            if not res.ok or res.staging_id is None:
                continue
            staged = run.tier.staging.take(res.staging_id)
            if staged is None:
                # NOTE: the answer comes before the reader's pass; a pass that
                # fails drops the staged entry (a miss) and reports a failure.
                await settle()
                if (await run.stats()).restore_failures == failures:
                    run.trace.problems.append(f"restore of {path} staged nothing")
                continue
            want = originals().get((entry.namespace, entry.tokens))
            try:
                # NOTE: the landing's reads (here into host buffers): a port
                # fault or a failed check there is a miss, as in the engine turn.
                served = tuple(bytes(b) for b in staged.file.take_host().buffers)
            except (OSError, CacheFileCorrupt):
                continue
            if want is None or served != want:
                run.trace.problems.append(
                    f"restore of {path} returned bytes that were never stored"
                )


@dataclass(frozen=True)
class ScrubStep:
    """One round of the idle scrubber per indexed entry (each re-verifies one file's hashes).

    The scrubber's own alarm is an hour away; the step wakes it directly
    (``ScrubWake``), and it picks files round robin from the index.
    """

    label: str = "scrub"
    restarts: bool = False

    async def run(self, run: Run) -> None:
        """Wake the scrubber once per entry, each after the previous round settled."""
        before = (await run.stats()).scrubbed
        for _ in range((await run.stats()).entries):
            await run.system.tell(run.tier.scrub_address, ScrubWake())
            await settle()
        run.trace.scrubbed += (await run.stats()).scrubbed - before


@dataclass(frozen=True)
class RestartStep:
    """Stop the tier cleanly and start a new one on the same files (a startup scan)."""

    label: str = "restart"
    restarts: bool = True

    async def run(self, run: Run) -> None:
        """Nothing: the driver restarts between systems."""


@dataclass(frozen=True)
class PutStep:
    """A put in the RAM tier: the durability coordinator gets ``Schedule`` (write-behind off)."""

    entry: str
    restarts: bool = False

    @property
    def label(self) -> str:
        """``put A``."""
        return f"put {self.entry}"

    async def run(self, run: Run) -> None:
        """Register the RAM entry and tell the coordinator the prefix is dirty."""
        spec = entries()[self.entry]
        handle = run.ram.put(spec)
        await run.system.tell(
            "durability", Schedule(namespace=spec.namespace, tokens=spec.tokens, handle=handle)
        )
        run.dirty.add(spec.key)


@dataclass(frozen=True)
class FlushStep:
    """Flush to a durable boundary; ``durable: true`` acknowledges every prefix put before it."""

    label: str = "flush"
    restarts: bool = False

    async def run(self, run: Run) -> None:
        """Ask ``Flush``; on ``durable`` acknowledge the prefixes put since the last one."""
        try:
            res = await run.ask_durability(Flush(), FlushResult)
        except AskTimeout:
            run.trace.problems.append("flush was never answered")
            return
        run.trace.flushes.append(res)
        if res.durable:
            at = run.trace.fs.op_count
            for key in sorted(run.dirty):
                run.trace.acks.append((key, at))
            run.dirty.clear()


@dataclass(frozen=True)
class CheckpointStep:
    """Write the answer's next checkpoint (sample index 2, then 4, then 6) through the SSD tier.

    A ``Store`` carrying the checkpoint record goes to the tier, which hands
    it to its store worker (``write_checkpoint``: the new file committed
    under its own name, then the older files of the key removed); a
    ``stored`` answer acknowledges it.
    """

    label: str = "ckpt"
    restarts: bool = False

    async def run(self, run: Run) -> None:
        """Ask ``Store``; record the acknowledgement at the operation count of the answer."""
        trace = run.trace
        spec = checkpoints()[CKPT_INDEXES[trace.ckpt_written % len(CKPT_INDEXES)]]
        trace.ckpt_written += 1
        record = CheckpointRecord(request_key=CKPT_KEY, prompt_len=len(CKPT_PROMPT),
                                  pending_token=50 + spec.sample_index,
                                  sample_index=spec.sample_index)
        body = Store(handle=f"ckpt-{spec.sample_index}", namespace="", tokens=spec.tokens,
                     meta=EntryMeta(offset=len(spec.tokens), nbytes=sum(map(len, spec.tensors)),
                                    trimmable=True, min_reusable_offset=0),
                     checkpoint=record)
        try:
            res = await run.ask(body, StoreResult)
        except AskTimeout:
            trace.problems.append(f"checkpoint {spec.sample_index} was never answered")
            return
        if res.stored:
            trace.ckpt_acks.append((spec.sample_index, trace.fs.op_count))
        else:
            trace.problems.append(f"checkpoint {spec.sample_index} was not stored: {res.reason}")


@dataclass(frozen=True)
class CheckpointDoneStep:
    """The answer completed: ``RemoveCheckpoints`` of its key (a tell, as the spill queue sends it)."""

    label: str = "done"
    restarts: bool = False

    async def run(self, run: Run) -> None:
        """Tell the tier; from here on no checkpoint of the answer is required."""
        # NOTE: from the removal's first operation on, a crash may lose the files.
        run.trace.ckpt_done.append(run.trace.fs.op_count + 1)
        await run.system.tell(run.tier.name, RemoveCheckpoints(request_key=CKPT_KEY))


ALPHABET: tuple[Step, ...] = (
    StoreStep("A"),
    StoreStep("A+"),
    StoreStep("B"),
    StoreStep("C"),
    ScrubStep(),
    RestoreStep(),
    RestartStep(),
)


DURABLE_ALPHABET: tuple[Step, ...] = (*ALPHABET, PutStep("A"), PutStep("A+"), FlushStep())
"""The cold tier's steps plus the durability coordinator's: put (write-behind off) and flush."""

CHECKPOINT_ALPHABET: tuple[Step, ...] = (
    CheckpointStep(),
    CheckpointDoneStep(),
    RestartStep(),
    StoreStep("A"),
)
"""Generation checkpoints of one answer (written, completed) among a restart and a prefix store."""


def workloads(max_len: int = 3, alphabet: Sequence[Step] = ALPHABET) -> list[tuple[Step, ...]]:
    """Every sequence of 1..``max_len`` steps over ``alphabet``."""
    out: list[tuple[Step, ...]] = []
    for n in range(1, max_len + 1):
        out.extend(itertools.product(alphabet, repeat=n))
    return out


def label(workload: Sequence[Step]) -> str:
    """``A -> B -> scrub``."""
    return " -> ".join(s.label for s in workload)


# --- the forward run -------------------------------------------------------------------------


class StepTable:
    """The turn runner's background-step registry (``StepRegistry``), as a dict."""

    def __init__(self) -> None:
        self.steps: dict[str, Callable[[], Any]] = {}

    def add(self, step_id: str, fn: Callable[[], Any]) -> object:
        """Register ``fn`` under ``step_id``."""
        self.steps[step_id] = fn
        return None

    def discard(self, step_id: str) -> None:
        """Forget ``step_id``."""
        self.steps.pop(step_id, None)


class GatewayStub(Actor):
    """Grants every ``RunWhenIdle`` at once: runs the registered step, answers ``TurnDone``."""

    def __init__(self, table: StepTable) -> None:
        self._table = table

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Run the step (the engine is always idle here)."""
        body = envelope.body
        if not isinstance(body, RunWhenIdle):
            raise TypeError(f"gateway stub has no rule for {body.kind!r}")
        fn = self._table.steps.pop(body.step_id, None)
        if fn is None:
            done = TurnDone(step_id=body.step_id, ok=False, error_code="unknown_step")
        else:
            fn()
            done = TurnDone(step_id=body.step_id, ok=True)
        await ctx.reply(envelope, done)


def _config(cap: int, fs: CrashFS) -> SsdWriterConfig:
    # NOTE: the scrubber's alarm is an hour away: only ScrubStep wakes it, so
    # no timer decides anything during a run.
    # NOTE: the entries here are a few tokens: any longer prefix restores
    # (min_restore_tokens=1, no MIN_RESTORE_TOKENS floor).
    return SsdWriterConfig(
        root=ROOT, identity=IDENTITY, max_bytes=cap, ask_timeout=ASK_S, scrub_interval_s=3600.0,
        min_restore_tokens=1, wall_clock_ns=lambda: fs.now_ns,
    )


class _Inline:
    """File work run on the loop itself (an ``IoRunner``): the crash model never blocks."""

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, here and now."""
        return fn(*args, **kwargs)


INLINE = _Inline()
"""The inline ``IoRunner`` every tier of the checker runs its file work on."""


async def settle() -> None:
    """Return once every other task waits on something (the tier is quiescent).

    NOTE: ``anyio.wait_all_tasks_blocked`` sleeps 0.1 s per retry; this
    yields instead (same test of asyncio's task waiters).
    """
    this = asyncio.current_task()
    for _ in range(100_000):
        await asyncio.sleep(0)
        if all(
            t is this or (t._fut_waiter is not None and not t._fut_waiter.done())  # type: ignore[attr-defined]
            for t in asyncio.all_tasks()
        ):
            return
    raise RuntimeError("the tier never settled")


def _entry_files(fs: CrashFS) -> dict[str, int]:
    return {p: n for p, n in fs.tree().items() if p.startswith(FP_DIR + "/")}


def _disk_bytes(fs: CrashFS) -> int:
    return sum(n for p, n in _entry_files(fs).items() if p.endswith((ENTRY_SUFFIX, TEMP_SUFFIX)))


def _covered(
    entries_: Iterable[core.IndexEntry | SsdIndexEntry], key: tuple[str, tuple[int, ...]]
) -> bool:
    ns, tokens = key
    n = len(tokens)
    for e in entries_:
        if e.namespace != ns or len(e.tokens) < n or e.tokens[:n] != tokens:
            continue
        if len(e.tokens) == n or (e.trimmable and e.min_reusable_offset <= n):
            return True
    return False


def _valid_entry(fs: CrashFS, path: str) -> bool:
    """Whether ``path`` holds a complete entry whose bytes are exactly what was stored."""
    try:
        header = read_header(fs, path, expected_fingerprint=IDENTITY.fingerprint)
        host = io.open_for_restore(
            fs, path, fingerprint=IDENTITY.fingerprint, namespace=header.namespace,
            tokens=header.tokens, verify=True, max_header_bytes=None,
        ).take_host()  # fmt: skip
    except (OSError, CacheFileCorrupt, CacheFileIncompatible):
        return False
    want = originals().get((header.namespace, header.tokens))
    return want == tuple(bytes(b) for b in host.buffers)


async def _check_forward(run: Run, fs: CrashFS, after: str) -> None:
    """The settled tier after a step: no temp file, index == entry files on disk, no reservation.

    An entry file on disk that the index neither holds nor counts as a
    leftover (with its size) is a problem unless it is a complete, exact
    entry: then it is recorded as *untracked* (it would be served after the
    next startup, but its bytes are not counted toward the cap until then).
    A leftover no longer on disk is fine: its removal may not be durable yet.
    A read-only tier (its scan could not list a directory) may leave files
    unindexed: it writes nothing.
    """
    problems = run.trace.problems
    files = _entry_files(fs)
    temps = sorted(p for p in files if p.endswith(TEMP_SUFFIX))
    if temps:
        problems.append(f"after {after}: temp files left: {temps}")
    index, stats = await run.index(), await run.stats()
    leftovers = dict(index.leftovers)
    on_disk = {p: n for p, n in files.items() if p.endswith(ENTRY_SUFFIX)}
    indexed = {e.path: e.file_bytes for e in index.entries}
    for path in sorted(set(indexed) & set(leftovers)):
        problems.append(f"after {after}: {path} is both indexed and a leftover")
    for path in sorted(set(indexed) | set(on_disk)):
        if path not in on_disk:
            problems.append(f"after {after}: indexed {path} is not on disk")
        elif path in leftovers:
            if leftovers[path] != on_disk[path]:
                problems.append(
                    f"after {after}: leftover {path} has {on_disk[path]} bytes, "
                    f"counted {leftovers[path]}"
                )
        elif path not in indexed:
            if stats.read_only:
                continue  # NOTE: a read-only tier writes nothing: no cap to keep.
            if _valid_entry(fs, path):
                run.trace.untracked.append((after, path))
            else:
                problems.append(f"after {after}: {path} is on disk, not indexed, and not valid")
        elif indexed[path] != on_disk[path]:
            problems.append(
                f"after {after}: {path} has {on_disk[path]} bytes, indexed {indexed[path]}"
            )
    if stats.bytes - stats.checkpoint_bytes != sum(indexed.values()):
        problems.append(f"after {after}: indexed_bytes {stats.bytes} != sum of entries")
    if stats.leftover_bytes != sum(leftovers.values()):
        problems.append(f"after {after}: leftover_bytes {stats.leftover_bytes} != their sum")
    if stats.bytes + stats.leftover_bytes > stats.max_bytes:
        problems.append(
            f"after {after}: {stats.bytes} indexed + {stats.leftover_bytes} leftover "
            f"bytes exceed the cap {stats.max_bytes}"
        )
    if stats.reserved_bytes or index.jobs:
        problems.append(
            f"after {after}: reservations left {stats.reserved_bytes} {list(index.jobs)}"
        )


def _extends(longer: tuple[str, tuple[int, ...]], key: tuple[str, tuple[int, ...]]) -> bool:
    # NOTE: every workload entry is trimmable with no minimum reusable offset,
    # so an entry serves each of its prefixes in its namespace.
    return longer[0] == key[0] and longer[1][: len(key[1])] == key[1]


async def _settle_requirements(
    run: Run, start: int, live: set[tuple[str, tuple[int, ...]]], ack_mark: int
) -> None:
    """Adjust the durability requirements of prefixes whose covering files this step unlinked.

    ``live``: the prefixes required when the step began; ``ack_mark``: how
    many acknowledgements there were then. For each prefix, the first unlink
    in this step of a file that could serve it (its own, or a descendant's)
    at operation ``u`` decides:

    - if an entry stored before ``u`` (earlier, or in this step: the
      supersession order, descendant durable before the ancestor goes)
      still covers it, the requirement simply continues;
    - otherwise the tier evicted what served it (an LRU victim under the
      cap, which a cache may do): a crash after ``u`` may lose it. If an
      entry acknowledged later in this step covers it again, it is required
      again from that acknowledgement on.
    """
    trace = run.trace
    ops = trace.fs.ops[start:]
    step_acks = trace.acks[ack_mark:]
    specs = list(entries().values())
    index = list((await run.index()).entries)
    for key in sorted(live):
        paths = {s.path for s in specs if _extends(s.key, key)}
        unlink = next((op for op in ops if op.kind == "unlink" and op.path in paths), None)
        if unlink is None:
            if not _covered(index, key) and not any(_valid_entry(trace.fs, p) for p in paths):
                trace.problems.append(f"{key} left the index and no valid file serves it")
                trace.ends.append((key, trace.fs.op_count))
            # NOTE: a valid file the index lost track of (an I/O error at the
            # startup scan) stays required: a restart after a crash must find it.
            continue
        later = {k: at for k, at in step_acks if at > unlink.index and _extends(k, key)}
        older = [e for e in index if (e.namespace, e.tokens) not in later]
        if _covered(older, key):
            continue
        trace.ends.append((key, unlink.index + 1))
        if later and _covered(index, key):
            trace.acks.append((key, min(later.values())))


def _note_fault(trace: Trace, port: FilePort, phase: str, superseded: bool = False) -> None:
    """Remember the step in which an injected fault fired, and whether it superseded a file."""
    if trace.fault_phase is None and getattr(port, "fired", False):
        trace.fault_phase = phase
        trace.fault_superseded = superseded


async def forward(
    workload: Sequence[Step],
    *,
    fs: CrashFS,
    port: FilePort | None = None,
    cap: int = CAP,
) -> Trace:
    """Run ``workload`` against the real tier actors over ``port`` (default: ``fs`` itself)."""
    trace = Trace(fs)
    port = fs if port is None else port
    cap_seen = [0]

    def probe(op: OpRecord) -> None:
        # NOTE: only these operations can add bytes on disk.
        if op.kind in ("create", "write", "truncate"):
            cap_seen[0] = max(cap_seen[0], _disk_bytes(fs))

    fs.on_change = probe
    steps = list(workload)
    i = 0
    config = _config(cap, fs)
    while True:
        async with ActorSystem(ids=SequentialIds()) as system:
            ram = RamEntries()
            # NOTE: file work runs inline on the loop: the simulated port never
            # blocks, and one thread makes the operation order deterministic
            # (so "every task waits" means "settled").
            tier = spawn_ssd_writer(system, config=config, source=ScriptedSource(ram), port=port,
                                    io_runner=INLINE)
            if any(isinstance(step, PutStep | FlushStep) for step in steps):
                # NOTE: the durability path: coordinator -> spill queue -> tier,
                # with every engine turn granted at once (write-behind off, so
                # no timer decides anything: a flush writes).
                table = StepTable()
                spawn_spill_queue(system, releaser=ram, writer=tier.name)
                system.spawn("gateway", functools.partial(GatewayStub, table))
                spawn_durability(
                    system, cloner=ram, steps=table, config=DurabilityConfig(write_behind=False)
                )
            run = Run(system, tier, trace, ram)
            try:
                await run.ask(SsdStatsRequest(), SsdStats)
            except AskTimeout:
                trace.problems.append("the tier never became ready")
            await settle()
            _note_fault(trace, port, "startup")
            await _check_forward(run, fs, "startup")
            # NOTE: a restart step ends once the new tier has started.
            trace.bounds.append((steps[i - 1].label if i else "start", fs.op_count))
            while i < len(steps) and not steps[i].restarts:
                start = fs.op_count
                live = trace.required_at(start)
                ack_mark = len(trace.acks)
                superseded = (await run.stats()).superseded
                await steps[i].run(run)
                await settle()
                _note_fault(trace, port, steps[i].label, (await run.stats()).superseded > superseded)
                await _check_forward(run, fs, steps[i].label)
                await _settle_requirements(run, start, live, ack_mark)
                trace.bounds.append((steps[i].label, fs.op_count))
                i += 1
        if i >= len(steps):
            break
        i += 1  # NOTE: a restart step: the next system starts on the same files.
    fs.on_change = None
    if cap_seen[0] > cap:
        trace.problems.append(f"{cap_seen[0]} bytes on disk at one point, cap {cap}")
    return trace


def run_forward(workload: Sequence[Step], **kw: Any) -> Trace:
    """:func:`forward` on a fresh event loop."""
    return anyio.run(functools.partial(forward, workload, **kw))


# --- restart after a crash ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What a restart on one crash state showed.

    ``indexed``: the index's paths after the startup; ``files``: every file
    left after its removals; ``servable``: the indexed entries that read
    back exactly as stored.
    """

    problems: list[str]
    servable: list[core.IndexEntry]
    indexed: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    evicted_over_cap: bool = False
    checkpoint: int | None = None
    """The sample index of the checkpoint the answer's retry would resume (``None``: none)."""


def restart(state: CrashState, cap: int = CAP, *, record: bool = False) -> tuple[Outcome, CrashFS]:
    """Start the tier on ``state`` as its start hook does, then check what it would serve.

    The same steps as ``SsdWriter._load``: lock the fingerprint directory,
    scan the headers, sync the scanned directories, ``core.ScanLoaded``,
    perform its removals durably and report them (``core.Removed``). With ``record`` the
    returned file system holds the crash spaces of the startup itself (a
    second crash during recovery).
    """
    fs = CrashFS.mount(state, record=record)
    problems: list[str] = []
    over_cap = False
    index = core.IndexState(root=ROOT, fingerprint=IDENTITY.fingerprint, max_bytes=cap)
    try:
        lock = io.lock_directory(fs, index.fingerprint_dir)
        if lock is None:
            problems.append("startup: the directory lock is held after a crash")
        # NOTE: the crash file system's clock is not the wall clock: the scan
        # ages checkpoints against it (none is old in a workload).
        scan = io.scan(
            fs, ROOT, IDENTITY.fingerprint, tokenizer_hash=IDENTITY.tokenizer_hash,
            max_header_bytes=None, now_ns=fs.now_ns,
        )  # fmt: skip
        if io.sync_directories(fs, scan.directories):
            problems.append("startup: a directory fsync failed")
        index, effects = core.handle(index, core.ScanLoaded(scan, lock is not None, 0.0))
        for effect in effects:
            if isinstance(effect, core.RemoveNow) and effect.reason == "over_cap":
                over_cap = True
                # NOTE: the cap is the same as before the crash: the tier must
                # never have left more than the cap where a crash can see it.
                problems.append(
                    f"the startup evicted over the cap: a crash left more than the cap in "
                    f"valid files ({list(effect.paths)} evicted)"
                )
            if isinstance(effect, core.RemoveNow):
                removal = io.remove_durably(fs, effect.paths)
                core.handle(index, core.Removed(removal.gone, removal.left, 0.0))
                if removal.left:
                    problems.append(f"startup could not remove {list(removal.left)}")
    except Exception as exc:  # noqa: BLE001 - NOTE: any escape is the violation "startup failed".
        return Outcome([f"startup failed: {exc!r}"], []), fs
    files = _entry_files(fs)
    temps = sorted(p for p in fs.tree() if p.endswith(TEMP_SUFFIX))
    if temps:
        problems.append(f"temp files survived the startup: {temps}")
    disk = sum(n for p, n in files.items() if p.endswith((ENTRY_SUFFIX, TEMP_SUFFIX)))
    if disk > cap or index.indexed_bytes > cap:
        problems.append(
            f"{disk} bytes on disk ({index.indexed_bytes} indexed) after startup, cap {cap}"
        )
    servable: list[core.IndexEntry] = []
    for entry in index.entries.values():
        want = originals().get((entry.namespace, entry.tokens))
        if want is None:
            problems.append(f"indexed {entry.path} holds tokens that were never stored")
            continue
        try:
            host = io.open_for_restore(
                fs, entry.path, fingerprint=IDENTITY.fingerprint, namespace=entry.namespace,
                tokens=entry.tokens, verify=False, max_header_bytes=None,
            ).take_host()  # fmt: skip
        except (CacheFileCorrupt, CacheFileIncompatible):
            continue  # NOTE: the reader refuses it (and removes it): a miss, not a wrong answer.
        except Exception as exc:  # noqa: BLE001 - NOTE: an escape from a read is a violation.
            problems.append(f"reading {entry.path} raised {exc!r}")
            continue
        if tuple(bytes(b) for b in host.buffers) != want:
            problems.append(f"{entry.path} serves bytes that differ from the stored ones")
            continue
        servable.append(entry)
    resumed = _resume_checkpoint(fs, problems)
    outcome = Outcome(problems, servable, tuple(sorted(index.entries)), tuple(sorted(fs.tree())))
    outcome.evicted_over_cap = over_cap
    outcome.checkpoint = resumed
    return outcome, fs


def _resume_checkpoint(fs: CrashFS, problems: list[str]) -> int | None:
    """What the answer's retry resumes after the startup: the sample index (``None``: runs fresh).

    The serving lookup (``find_checkpoint``: newest valid file of the key,
    older and corrupt ones removed) and then the tensors read with hash
    verification OFF: the write protocol alone must make a found checkpoint
    whole and exactly one that was written (never torn, never mixed).
    """
    try:
        found = find_checkpoint(fs, CKPT_DIR, CKPT_KEY, fingerprint=IDENTITY.fingerprint,
                                namespace="")
    except Exception as exc:  # noqa: BLE001 - NOTE: any escape is a violation.
        problems.append(f"the checkpoint lookup raised {exc!r}")
        return None
    if found is None:
        return None
    ck = found.header.checkpoint
    assert ck is not None
    spec = checkpoints().get(ck.sample_index)
    if spec is None or found.header.tokens != spec.tokens:
        problems.append(f"{found.path} is a checkpoint that was never written")
        return None
    try:
        host = read_tensors(fs, found.path, found.header, verify=False)
    except (CacheFileCorrupt, CacheFileIncompatible):
        return None  # NOTE: refused on read: the retry runs fresh, never wrong.
    except Exception as exc:  # noqa: BLE001 - NOTE: an escape from a read is a violation.
        problems.append(f"reading checkpoint {found.path} raised {exc!r}")
        return None
    if tuple(bytes(b) for b in host.buffers) != spec.tensors:
        problems.append(f"checkpoint {found.path} serves bytes that differ from the written ones")
        return None
    return ck.sample_index


@dataclass
class ActorOutcome:
    """What the real tier actors did on a crash state: index, files left, bytes each restore served."""

    indexed: tuple[str, ...]
    files: tuple[str, ...]
    served: dict[str, tuple[bytes, ...] | None]


async def actor_restart(state: CrashState, cap: int = CAP) -> ActorOutcome:
    """Start the real tier actors on ``state`` and restore every entry they index."""
    fs = CrashFS.mount(state)
    config = _config(cap, fs)
    async with ActorSystem(ids=SequentialIds()) as system:
        tier = spawn_ssd_writer(system, config=config, source=ScriptedSource(), port=fs,
                                io_runner=INLINE)
        await system.ask(tier.name, SsdStatsRequest(), timeout=ASK_S, expect=SsdStats)
        await settle()
        listing = await system.ask(tier.name, SsdIndexRequest(), timeout=ASK_S, expect=SsdIndex)
        indexed = tuple(e.path for e in listing.entries)
        namespaces = {e.path: e.namespace for e in listing.entries}
        files = tuple(sorted(fs.tree()))
        served: dict[str, tuple[bytes, ...] | None] = {}
        for path in indexed:
            # NOTE: a Restore names the namespace its Find asked in (cache isolation).
            ns = namespaces[path]
            res = await system.ask(
                tier.name, Restore(path=path, namespace=ns), timeout=ASK_S, expect=RestoreResult
            )
            staged = tier.staging.take(res.staging_id) if res.ok and res.staging_id else None
            served[path] = None if staged is None else tuple(bytes(b) for b in staged.file.take_host().buffers)
    return ActorOutcome(indexed, files, served)


# --- the crash sweep -----------------------------------------------------------------------------


def _observed(path: str) -> bool:
    # NOTE: only entry and checkpoint files are ever read at startup, served
    # or resumed. Temp files and the lock file are enumerated with one
    # content each; the mounted file system raises if the restart reads one,
    # so this cannot hide a bug.
    return path.endswith((ENTRY_SUFFIX, CHECKPOINT_SUFFIX))


def _state_key(state: CrashState) -> tuple[object, ...]:
    observed: list[tuple[str, int, int]] = []
    others: Counter[str] = Counter()
    for f in state.files:
        if f.observed:
            observed.append((f.path, f.digest(), f.mtime_ns))
        elif f.path.endswith(TEMP_SUFFIX):
            # NOTE: temp names are random; only their directory matters.
            others[posixpath.dirname(f.path) + "/*" + TEMP_SUFFIX] += 1
        else:
            others[f.path] += 1
    return (state.dirs, tuple(observed), tuple(sorted(others.items())))


@dataclass
class Report:
    """Totals of a sweep and every violation found."""

    workloads: int = 0
    ops: int = 0
    crash_points: int = 0
    shared_points: int = 0
    states: int = 0
    restarts: int = 0
    recovery_states: int = 0
    required_checks: int = 0
    checkpoint_checks: int = 0
    reduced_points: int = 0
    violations: list[str] = field(default_factory=list)
    untracked: list[str] = field(default_factory=list)

    def add(self, other: Report) -> None:
        """Accumulate ``other``."""
        self.workloads += other.workloads
        self.ops += other.ops
        self.crash_points += other.crash_points
        self.shared_points += other.shared_points
        self.states += other.states
        self.restarts += other.restarts
        self.recovery_states += other.recovery_states
        self.required_checks += other.required_checks
        self.checkpoint_checks += other.checkpoint_checks
        self.reduced_points += other.reduced_points
        self.violations.extend(other.violations)
        self.untracked.extend(other.untracked)

    def summary(self) -> str:
        """One line of totals."""
        return (
            f"{self.workloads} workloads, {self.crash_points} crash points "
            f"({self.crash_points - self.shared_points} distinct), "
            f"{self.states} crash states ({self.restarts} distinct restarts, "
            f"{self.recovery_states} more states of a crash during recovery), "
            f"{self.required_checks} acknowledged-prefix checks "
            f"({self.checkpoint_checks} of them acknowledged checkpoints), "
            f"{len(self.violations)} violations"
        )


class Sweeper:
    """Checks every crash state of traces; caches restarts of identical states.

    Each distinct crash state is restarted once with its own startup
    recorded; every state a second crash during that startup may leave is
    restarted too (recovery must survive a crash of its own), and the
    invariants are checked on all of them.
    """

    def __init__(self, cap: int = CAP) -> None:
        self.cap = cap
        self._cache: dict[tuple[object, ...], list[Outcome]] = {}
        self._plain: dict[tuple[object, ...], Outcome] = {}
        self._points: set[tuple[object, ...]] = set()
        self.recovery_states = 0

    def _outcomes(self, state: CrashState, report: Report) -> list[Outcome]:
        key = _state_key(state)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        report.restarts += 1
        first, fs = restart(state, self.cap, record=True)
        outcomes = [first]
        # NOTE: spaces[0] is the mounted state itself; the rest follow each
        # change the startup made (lock file, removals).
        for space in fs.spaces[1:]:
            for sub in space.states(observe=_observed):
                sub_key = _state_key(sub)
                again = self._plain.get(sub_key)
                if again is None:
                    again, _ = restart(sub, self.cap)
                    self._plain[sub_key] = again
                    self.recovery_states += 1
                    report.recovery_states += 1
                outcomes.append(again)
        self._cache[key] = outcomes
        return outcomes

    def check(
        self, name: str, trace: Trace, spaces: Sequence[CrashSpace], run_key: object = None
    ) -> Report:
        """Every crash point and state of one forward run.

        ``run_key`` names what, besides its steps, decides a run (a fault);
        a crash point reached by the same steps under the same key in an
        earlier run is the same point and is not checked twice.
        """
        report = Report(workloads=1, ops=trace.fs.op_count)
        report.violations.extend(f"{name}: forward run: {p}" for p in trace.problems)
        report.untracked.extend(f"{name}: after {after}: {path}" for after, path in trace.untracked)
        for space in spaces:
            report.crash_points += 1
            point_key = (run_key, trace.prefix_at(space.point), space.point)
            if point_key in self._points:
                report.shared_points += 1
                continue
            self._points.add(point_key)
            required = trace.required_at(space.point)
            ckpt_required = trace.checkpoint_required_at(space.point)
            for state in space.states(observe=_observed):
                report.states += 1
                where = f"{name}: {state.describe()} (last op: {space.last_op})"
                outcomes = self._outcomes(state, report)
                for depth, outcome in enumerate(outcomes):
                    tag = where if depth == 0 else f"{where}, then a crash during its startup"
                    report.violations.extend(f"{tag}: {p}" for p in outcome.problems)
                    # NOTE: a crash during a startup that evicted over the cap
                    # keeps whatever of that eviction reached the disk.
                    over_cap = outcome.evicted_over_cap or outcomes[0].evicted_over_cap
                    why = " (the startup evicted over the cap)" if over_cap else ""
                    if ckpt_required is not None:
                        report.required_checks += 1
                        report.checkpoint_checks += 1
                        got = outcome.checkpoint
                        if got is None or got < ckpt_required:
                            report.violations.append(
                                f"{tag}: acknowledged checkpoint {ckpt_required} is lost "
                                f"(the retry resumes {got})"
                            )
                    for ns_tokens in sorted(required):
                        report.required_checks += 1
                        if not _covered(outcome.servable, ns_tokens):
                            report.violations.append(
                                f"{tag}: acknowledged prefix {ns_tokens} is not served{why}"
                            )
            if space.reduced:
                report.reduced_points += 1
        return report


def sweep(
    workload_list: Iterable[Sequence[Step]],
    *,
    make_port: Callable[[CrashFS], FilePort] | None = None,
    sweeper: Sweeper | None = None,
    max_violations: int = 50,
) -> Report:
    """Forward-run and crash-check every workload (``make_port`` wraps the file system)."""
    sweeper = sweeper or Sweeper()
    total = Report()

    async def all_runs() -> None:
        for workload in workload_list:
            fs = CrashFS(record=True)
            port = make_port(fs) if make_port is not None else fs
            trace = await forward(workload, fs=fs, port=port, cap=sweeper.cap)
            total.add(sweeper.check(label(workload), trace, fs.spaces))
            if len(total.violations) >= max_violations:
                return

    anyio.run(all_runs)
    return total


# --- Nth-operation faults ------------------------------------------------------------------------

_MUTATING = frozenset(
    {"open_temp", "pwrite_all", "truncate", "fsync", "close", "replace", "fsync_dir", "unlink",
     "utime", "makedirs", "lock"}
)  # fmt: skip


def fault_kinds(method: str) -> tuple[FaultKind, ...]:
    """The faults injected into ``method``: ENOSPC only where space is used, short writes."""
    kinds: tuple[FaultKind, ...] = ("eio", "eintr")
    if method in _MUTATING:
        kinds = ("enospc", *kinds)
    if method == "pwrite_all":
        kinds = (*kinds, "short")
    return kinds


async def count_calls(workload: Sequence[Step]) -> Counter[str]:
    """Port calls of a clean run of ``workload``, by method."""
    fs = CrashFS()
    port = FaultingPort(fs)
    await forward(workload, fs=fs, port=port)
    return Counter(port.calls)


async def fault_list(
    workload: Sequence[Step], *, every_kind: bool = True, turn: int = 0
) -> list[Fault]:
    """Faults for every call of every method of ``workload`` (a clean run counts them).

    ``every_kind``: each call with each fault of :func:`fault_kinds`;
    otherwise each call once, the fault kinds taken in turn along the calls
    of a method, starting ``turn`` kinds further (a sweep passes each
    workload's index, so over several workloads every kind meets every
    position).
    """
    calls = await count_calls(workload)
    out: list[Fault] = []
    for method in sorted(calls):
        kinds = fault_kinds(method)
        for n in range(1, calls[method] + 1):
            if every_kind:
                out.extend(Fault(method, n, kind) for kind in kinds)
            else:
                out.append(Fault(method, n, kinds[(n - 1 + turn) % len(kinds)]))
    return out


STORE_FAILURE_REASONS = frozenset(
    {"disk_full", "fsync_failed", "io_error", "evict_failed", "read_only", "source_failed"}
)


@dataclass(frozen=True)
class FaultItem:
    """One violation or untracked file of a faulted run, with the fault's context."""

    fault: Fault
    phase: str | None
    superseded: bool
    untracked: bool
    text: str


async def check_fault(
    workload: Sequence[Step], fault: Fault, sweeper: Sweeper
) -> tuple[Report, list[FaultItem]]:
    """One faulted run of ``workload``: its forward checks and the crash sweep of its trace."""
    fs = CrashFS(record=True)
    port = FaultingPort(fs, fault)
    trace = await forward(workload, fs=fs, port=port, cap=sweeper.cap)
    name = f"{label(workload)} with {fault.kind} on {fault.method} #{fault.n}"
    if not port.fired:
        trace.problems.append("the fault never fired (the run diverged)")
    for res in trace.store_results:
        if not res.stored and res.reason not in STORE_FAILURE_REASONS:
            trace.problems.append(f"store failed with reason {res.reason!r}")
    report = sweeper.check(name, trace, fs.spaces, run_key=fault)
    items = [
        FaultItem(fault, trace.fault_phase, trace.fault_superseded, untracked, text)
        for untracked, texts in ((False, report.violations), (True, report.untracked))
        for text in texts
    ]
    return report, items


def fault_sweep(
    workload_list: Iterable[Sequence[Step]],
    *,
    every_kind: bool = True,
    sweeper: Sweeper | None = None,
    max_items: int = 10_000,
) -> tuple[Report, list[FaultItem], int]:
    """Every Nth-call fault of every workload: forward checks plus the crash sweep of its trace.

    Returns the totals, every violation and untracked file with the fault
    that led to it, and the number of faulted runs.
    """
    sweeper = sweeper or Sweeper()
    total = Report()
    items: list[FaultItem] = []
    runs = 0

    async def all_runs() -> None:
        nonlocal runs
        for turn, workload in enumerate(workload_list):
            for fault in await fault_list(workload, every_kind=every_kind, turn=turn):
                report, found = await check_fault(workload, fault, sweeper)
                runs += 1
                total.add(report)
                items.extend(found)
                if len(items) >= max_items:
                    return

    anyio.run(all_runs)
    return total, items, runs
