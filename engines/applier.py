"""The engine's applier thread: every engine operation (begin, load, finalize, abort) runs
here, in order, so the worker's main thread (which alone owns the socket) keeps
heartbeats flowing while a long load or finalize runs.

Rules: results go back through `out` and a wake-up pipe, never through the socket. Every
received bucket is verified against its checksum before use (a frame, a referenced slot or
a group's broadcast); frames and referenced slots are hashed by `engines.verify.Verifier` as
they arrive, so that hashing overlaps the load of the bucket before. An engine exception
becomes a typed `failed`, logged loudly; it never escapes the thread. Each sync's phases
(hashing, waiting for it, loading, finalize, canary, and what the engine reports) go back
with `finalized`. The steps after the loads (finalize, commit, served, rehash) are
`engines.postload`'s; this module receives, verifies and loads.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, TypeAlias, cast

import structlog
import torch

from engines import postload
from engines.base import (
    DigestsBeforeFinalize,
    Engine,
    LoadsBuckets,
    LoadsRefs,
    Parts,
    ReceivesGroup,
    TakesDigestParts,
    TakesSlices,
)
from engines.delta import BaseStore, Key, loaded_of
from engines.postload import Rehash, Rehashed
from engines.prefetch import Prefetcher, StreamItem
from engines.session import Begin, Job
from engines.tiles import Tiles, assembled
from engines.verify import Verifier, Verifying
from messages import coverage, schema, stream
from messages.bounded import LRU
from messages.buckets import Assembler, Sliced, has_patches, has_pieces, host_buffer, iter_buckets
from messages.checksums import bucket_hash
from messages.distgroup import PEER_FAILED, GroupError
from messages.errors import ErrorCode, MessageError, WeightSyncError
from messages.slices import WHOLE

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from messages.codec import Frame

log = structlog.get_logger()
STREAM_DEPTH = 2  # group buckets received ahead of the one being applied
CANCELS_KEPT = 8  # aborted syncs remembered that never received a group bucket: a few in a row

# What `accept` started for a bucket (a `LoadJob`'s payload): for a group load, its receive
# by the prefetcher (None: the engine's workers receive it themselves); for any other, its
# hashing by the verifier.
Received: TypeAlias = "Future[torch.Tensor] | None"
Pending: TypeAlias = "Received | Verifying"


@dataclass(frozen=True, slots=True)
class LoadJob:
    """A bucket for the applier, with what `Applier.accept` started for it."""

    msg: schema.Load
    payload: Pending


class Applier(threading.Thread):
    """Runs engine operations in order on one thread; results go back via `out` + pipe."""

    def __init__(
        self,
        engine: Engine,
        wake_fd: int,
        failpoints: dict[str, float] | None = None,
        collective_bind: str = "",
        delta_base: bool = False,
    ) -> None:
        super().__init__(name="engine-applier", daemon=True)
        self.engine = engine
        self.failpoints = failpoints or {}
        self.jobs: queue.Queue[Job | LoadJob | Rehash | None] = queue.Queue()
        # reports for the worker's Session, and the answers to its rehash requests
        self.out: queue.Queue[schema.Message | Rehashed] = queue.Queue()
        self.wake_fd = wake_fd
        self.current: str | None = None
        self.failed: set[str] = set()
        self.verifier = Verifier(parts=isinstance(engine, TakesDigestParts) and engine.digest_parts)
        self.phases: dict[str, float] = {}  # this sync's seconds per phase
        self.pass_bytes: dict[str, int] = {}  # and the bytes a phase's pass went over (checksum)
        self.collective_bind = collective_bind
        self.prefetcher: Prefetcher | None = None  # made on the first group load
        info = engine.describe()
        self._spec = {p.name for p in info.spec}
        # its ranks take slices: it declared each rank's map (a sender cuts for it)
        self.slices = isinstance(engine, TakesSlices) and info.slices is not None and bool(info.slices.ranks)
        self.boxed = 0  # buckets holding a box it has loaded (the fail_slices_at failpoint counts them)
        self.base = BaseStore(delta_base)  # the base copy delta patches apply to
        self.pieces = Assembler()  # tensors larger than a bucket, until their last piece
        # a replay cut for other layouts than this engine's (`Load.cut_for`): whole tensors
        # are assembled from its boxes (engines/tiles.py)
        self.key = info.slices.key if info.slices is not None else None
        self.assembling = False
        self.tiles = Tiles()
        # sync_id -> set when that sync's group stream must stop (the main thread's abort);
        # read and written by the main and the applier thread, under the lock
        self._cancels: LRU[str, threading.Event] = LRU(CANCELS_KEPT)
        self._cancels_lock = threading.Lock()

    def accept(self, msg: schema.Load, payload: Frame | None) -> None:
        """Called by the main thread as a `load` arrives: start hashing it (a frame, a
        referenced slot) or receiving it (by a group) now, while the applier may still load earlier buckets."""
        pending: Pending = self.prefetch(msg) if msg.group is not None else self.verifier.submit(msg, payload)
        self.jobs.put(LoadJob(msg, pending))

    def _add(self, phase: str, seconds: float, nbytes: int | None = None) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if nbytes is not None:
            self.pass_bytes[phase] = self.pass_bytes.get(phase, 0) + nbytes

    def prefetch(self, msg: schema.Load) -> Received:
        """Start receiving a group bucket now. None: the engine receives by itself
        (vLLM workers)."""
        if isinstance(self.engine, ReceivesGroup):
            return None
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(self.collective_bind, depth=STREAM_DEPTH, failpoints=self.failpoints)
            self.prefetcher.start()
        return self.prefetcher.submit(msg, self._cancelled(msg.sync_id))

    def _release(self, fut: Received) -> None:
        """The bucket's buffer may be reused once its receive ended and we are done with it."""
        prefetcher = self.prefetcher  # made once, never replaced
        if fut is not None and prefetcher is not None:
            fut.add_done_callback(lambda _f: prefetcher.release())

    def submit(self, job: Job, payload: Frame | None = None) -> None:
        """A job from the engine's `Session`, run in order (a bucket through `accept`)."""
        if isinstance(job, schema.Load):
            self.accept(job, payload)
        else:
            self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)

    def rehash(self, asked: int) -> None:
        """Called by the main thread: digest the weights again once the jobs before run."""
        self.jobs.put(Rehash(asked))

    def _emit(self, item: schema.Message | Rehashed) -> None:
        self.out.put(item)
        os.write(self.wake_fd, b"x")

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                self.verifier.stop()
                return
            if isinstance(job, Rehash):  # no sync to fail: it answers for itself
                postload.rehash(self.engine, job, self._emit)
                continue
            try:
                self._run(job)
            except WeightSyncError as err:
                self._fail(job, err.code.value, err.message)
            except Exception as exc:  # an engine bug: report it as a typed failure, loudly
                op = type(job).__name__
                log.exception("engine_operation_crashed", op=op)
                self._fail(job, ErrorCode.ENGINE_FAILED.value, f"{op}: {type(exc).__name__}: {exc}")

    def _run(self, job: Job | LoadJob) -> None:
        if isinstance(job, Begin):
            self._do_begin(job)
        elif isinstance(job, LoadJob):
            self._do_load(job)
        elif isinstance(job, schema.OpenStream):
            self._do_stream(job)
        elif isinstance(job, schema.Finalize):
            self._do_finalize(job)
        elif isinstance(job, schema.Commit):
            postload.commit(self.engine, job, self._emit)
        elif isinstance(job, schema.Served):
            postload.served(self.engine, job)
        elif isinstance(job, schema.Abort):
            self._do_abort(job)
        else:  # a job the engine's Session never makes: our bug
            raise WeightSyncError(f"unknown applier job {type(job).__name__}", code=ErrorCode.INTERNAL)

    def _fail(self, job: Job | LoadJob, code: str, message: str) -> None:
        msg = job.msg if isinstance(job, LoadJob) else job
        seq, source = (msg.seq, msg.source) if isinstance(msg, schema.Load) else (None, None)
        self.failed.add(msg.sync_id)
        log.warning("engine_operation_failed", sync_id=msg.sync_id, seq=seq, code=code, reason=message)
        peer = PEER_FAILED in message  # its group lost another member: the daemon looks for it
        self._emit(
            schema.Failed(
                sync_id=msg.sync_id, code=code, message=message[:4000], seq=seq, source=source, peer=peer
            )
        )

    def _do_begin(self, msg: Begin) -> None:
        t0 = time.perf_counter()
        self.engine.begin(msg.sync_id, msg.version)
        self.base.discard()
        self.pieces.clear()
        self.tiles.clear()
        self.assembling = False  # set by this sync's loads (a replay's `cut_for`), not a past one's
        self.current = msg.sync_id
        self.phases = {"begin": time.perf_counter() - t0}
        self.pass_bytes = {}
        log.info("sync_begun", sync_id=msg.sync_id, version=msg.version)

    def _do_load(self, job: LoadJob) -> None:
        msg, pending = job.msg, job.payload
        # `accept` chose the payload's kind by the same test: msg.group
        received = cast("Received", pending) if msg.group is not None else None
        if msg.sync_id in self.failed:
            if msg.group is not None:
                self._release(received)
            return  # already reported; the orchestrator is aborting this sync
        if msg.hold:  # a replay of base + deltas: keep what it loads until it ends
            self.base.hold()
        self.assembling = bool(msg.cut_for) and self.key not in msg.cut_for
        t0 = time.perf_counter()
        try:
            self._boxes(msg.tensors)  # before any path hands them on (workers, refs, groups)
            if msg.group is not None:
                self._load_group(msg, received)
            else:
                self._load_verified(msg, cast("Verifying", pending))
        finally:
            if msg.group is not None:
                self._release(received)
        seconds = time.perf_counter() - t0
        self._add("load", seconds)
        self._emit(schema.Loaded(sync_id=msg.sync_id, seq=msg.seq, source=msg.source, seconds=seconds))

    def cancel_stream(self, sync_id: str) -> None:
        """Called by the main thread (an abort): the stream of `sync_id` stops receiving,
        or never starts when its job has not run yet; so do its announced buckets' receives
        (joining their group included)."""
        with self._cancels_lock:
            self._cancels.setdefault(sync_id, threading.Event()).set()

    def _cancelled(self, sync_id: str) -> threading.Event:
        """The event that stops `sync_id`'s receives; only this sync's matters now, so the
        others' go (those the main thread set for syncs that never got here stay bounded)."""
        with self._cancels_lock:
            for sid in [k for k in self._cancels if k != sync_id]:
                del self._cancels[sid]
            return self._cancels.setdefault(sync_id, threading.Event())

    def _do_stream(self, msg: schema.OpenStream) -> None:
        """Receive, verify and apply every bucket of a group stream, then answer once
        with `prepared` (buckets, bytes, the chain of their checksums, the digest)."""
        if msg.sync_id in self.failed:
            return
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(self.collective_bind, depth=STREAM_DEPTH, failpoints=self.failpoints)
            self.prefetcher.start()
        out: queue.Queue[StreamItem] = queue.Queue()
        cancelled = self._cancelled(msg.sync_id)
        if cancelled.is_set():
            return  # aborted before its stream began
        free = threading.Semaphore(STREAM_DEPTH)  # this stream's buffers (the receiver's)
        # With keys (the store speaks CURVE) every bucket must carry this sync's MAC.
        key = stream.mac_key(msg.group.token, msg.sync_id) if msg.group.store_key else None
        self.prefetcher.submit_stream(msg, out, cancelled, free)
        chain, names = stream.Chain(), set[str]()
        t_start = time.perf_counter()
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = out.get(timeout=0.5)
                except queue.Empty:
                    if cancelled.is_set():
                        return  # superseded or aborted while the receiver was elsewhere
                    continue
                finally:
                    self._add("receive_wait", time.perf_counter() - t0)
                if item[0] == "error":
                    if cancelled.is_set():
                        return  # aborted by the daemon: it knows, nothing to report
                    self._stream_failed(item[1], chain.buckets)
                if item[0] == "end":
                    h = item[1]
                    break
                _, h, raw, view = item
                try:
                    self._stream_bucket(h, raw, view, chain, names, key)
                finally:
                    free.release()
        except BaseException:
            cancelled.set()  # the receiver stops; the group closes behind it
            raise
        if h.seq != chain.buckets or h.checksum != chain.value:
            raise WeightSyncError(
                f"received {chain.buckets} buckets chaining to {chain.value:#018x}; the "
                f"trainer sent {h.seq} chaining to {h.checksum:#018x}",
                code=ErrorCode.CHECKSUM_MISMATCH,
            )
        if not h.partial:
            missing = coverage.unsent(self._spec, names)
            if missing:
                raise WeightSyncError(
                    f"{len(missing)} tensor(s) of this model not sent: {coverage.listed(missing)} "
                    f"(send them, or push with --partial)",
                    code=ErrorCode.INCOMPLETE_SYNC,
                )
        digest = self.engine.prepare_digest() if isinstance(self.engine, DigestsBeforeFinalize) else None
        self._emit(
            schema.Prepared(
                sync_id=msg.sync_id,
                buckets=chain.buckets,
                nbytes=chain.nbytes,
                chain=chain.value,
                digest=digest,
                seconds=time.perf_counter() - t_start,
            )
        )

    def _stream_failed(self, exc: BaseException, received: int) -> NoReturn:
        if isinstance(exc, GroupError):
            raise WeightSyncError(f"stream, after {received} buckets: {exc}", code=exc.code)
        if isinstance(exc, MessageError):
            raise WeightSyncError(f"stream, after {received} buckets: {exc.reason}", code=exc.code)
        raise exc

    def _stream_bucket(
        self,
        h: stream.Header,
        raw: bytes,
        view: torch.Tensor,
        chain: stream.Chain,
        names: set[str],
        key: bytes | None = None,
    ) -> None:
        """raw: the payload past the bucket's bytes (metadata, then the MAC if any)."""
        if h.seq != chain.buckets:
            raise WeightSyncError(
                f"stream bucket seq {h.seq} arrived where {chain.buckets} was due", code=ErrorCode.BAD_MESSAGE
            )
        meta_raw, tag = raw[: h.meta_len], raw[h.meta_len :]
        t0 = time.perf_counter()
        buf = host_buffer(view if view.device.type == "cpu" else view.cpu())
        try:
            stream.check_mac(key, h, buf, meta_raw, tag)  # before anything is decoded or applied
            metas = stream.decode_metas(h, meta_raw)
        except MessageError as exc:
            raise WeightSyncError(exc.reason, code=exc.code) from None
        got, _, hashed = bucket_hash(buf, metas)
        if got != h.checksum:
            raise WeightSyncError(f"bucket seq {h.seq} arrived corrupted", code=ErrorCode.CHECKSUM_MISMATCH)
        t1 = time.perf_counter()
        self._add("checksum", t1 - t0, hashed)
        self._apply_metas(metas, buf)
        self._add("load", time.perf_counter() - t1)
        chain.add(h.checksum, h.data_len)
        names.update(t.name for t in metas)

    def _load_verified(self, msg: schema.Load, fut: Verifying) -> None:
        """A bucket by frame or reference, once the verifier has matched its checksum."""
        t0 = time.perf_counter()
        v = self.verifier.result(fut)  # raises CHECKSUM_MISMATCH / the reference's refusal
        self._add("checksum_wait", time.perf_counter() - t0)
        self._add("checksum", v.seconds, v.hashed)
        if (
            msg.ref is not None
            and not msg.ref.via  # workers map shared memory themselves; another transport's is read here
            and isinstance(self.engine, LoadsRefs)
            and not has_patches(msg.tensors)
            and not has_pieces(msg.tensors)
        ):
            # its workers read the slot (a delta's patches are rebuilt here first, below)
            self.engine.load_ref(msg.tensors, msg.ref, msg.checksum, parts=v.parts)
            if self.base.keeping:  # its workers' boxes too: a delta patches them here
                self.base.stage_loaded(loaded_of(msg.tensors, v.buf), v.parts, set())
            return
        self._apply(msg, v.buf, v.parts)

    def _load_group(self, msg: schema.Load, fut: Received) -> None:
        buf = self._group_bytes(msg, fut)
        if buf is None:  # the engine's own workers received and loaded it (vLLM)
            return
        t0 = time.perf_counter()
        got, _, hashed = bucket_hash(buf, msg.tensors)
        if got != msg.checksum:
            raise WeightSyncError(f"bucket seq {msg.seq} arrived corrupted", code=ErrorCode.CHECKSUM_MISMATCH)
        self._add("checksum", time.perf_counter() - t0, hashed)
        self._apply(msg, buf)

    def _apply(self, msg: schema.Load, buf: Buffer, parts: Parts = None) -> None:
        self._apply_metas(msg.tensors, buf, parts)

    def _apply_metas(self, metas: Sequence[schema.TensorMeta], buf: Buffer, parts: Parts = None) -> None:
        """Hand verified bytes to the engine: whole (`load_bucket`) or as tensor views.
        Delta patches are rebuilt on the base first (engines/delta.py); every loaded
        tensor is staged as the next base when the engine keeps one. A piece of a tensor
        larger than a bucket is assembled first; the tensor loads once its last piece is in."""
        tiled = self.assembling and any(m.box is not None for m in metas)
        if has_pieces(metas) or tiled:  # pieces, and boxes of another layout: assembled first
            for group, data, group_parts in assembled(
                metas, buf, parts, self.pieces, self.tiles if tiled else None, self._add
            ):
                self._apply_metas(group, data, group_parts)
            return
        boxes = self._boxes(metas)
        if self.slices and not isinstance(self.engine, LoadsBuckets):
            self._apply_parts(metas, buf, parts, boxes)
            return
        if has_patches(metas):
            # an engine that digests its whole model (not what it received) may skip loading
            # unchanged tensors its model already holds
            loaded, rebuilt, skip = self.base.rebuild(metas, buf, skip_same=not self.verifier.parts)
            parts = None if parts is None else {**parts, **rebuilt}
            tensors = [(n, t) for n, _, t in loaded]
            if not tensors:
                pass  # every tensor unchanged and already in the model
            elif isinstance(self.engine, LoadsBuckets):  # all in one dense bucket, boxes as boxes
                full = {m.name: tuple(m.shape) for m in metas}
                items = [(n, t if p == WHOLE else Sliced(t, p, full[n])) for n, p, t in loaded]
                (dense,) = iter_buckets(items, 2**62)
                self.engine.load_bucket(dense.tensors, dense.frame(), parts=parts)
            else:
                self.engine.load(tensors)
            self.base.stage_loaded(loaded, parts, skip)
            return
        if isinstance(self.engine, LoadsBuckets):  # (a vLLM engine's workers take their own boxes)
            self.engine.load_bucket(metas, buf, parts=parts)
            if self.base.keeping:  # its workers' boxes too: a delta patches them here
                self.base.stage_loaded(loaded_of(metas, buf), parts, set())
            return
        loaded = loaded_of(metas, buf)
        self.engine.load([(n, t) for n, _, t in loaded])
        self.base.stage_loaded(loaded, parts, set())
        del loaded  # drop the views before acknowledging (the frame can be freed)

    def _boxes(self, metas: Sequence[schema.TensorMeta]) -> bool:
        """Whether a bucket holds a box of a tensor; refused unless this engine takes slices."""
        boxes = any(m.box is not None for m in metas)
        if boxes and not self.slices and not self.assembling:  # cut for a layout it did not declare
            why = "a bucket holds a box of a tensor, and this engine takes whole tensors only"
            raise WeightSyncError(why, code=ErrorCode.BAD_MESSAGE)
        return boxes

    def _apply_parts(
        self, metas: Sequence[schema.TensorMeta], buf: Buffer, parts: Parts, boxes: bool
    ) -> None:
        """An engine whose ranks take slices: each tensor with its part (a box, or whole),
        patches rebuilt first on what its base holds, all staged by key (engines/delta.py)."""
        if not isinstance(self.engine, TakesSlices):  # `self.slices` says it is
            raise WeightSyncError("an engine that takes slices without load_parts", code=ErrorCode.INTERNAL)
        skip: set[Key] = set()
        if has_patches(metas):
            items, _, skip = self.base.rebuild(metas, buf, skip_same=not self.verifier.parts)
        else:
            items = loaded_of(metas, buf)
        self.boxed += boxes
        if boxes and self.failpoints.get("fail_slices_at") == self.boxed:  # fault injection:
            self.engine.load_parts(items[: max(1, len(items) // 2)])  # a rank's load failing mid-bucket
            raise WeightSyncError(f"failpoint fail_slices_at={self.boxed}", code=ErrorCode.ENGINE_FAILED)
        if items:
            self.engine.load_parts(items)
        self.base.stage_loaded(items, parts, skip)
        del items  # drop the views before acknowledging (the frame can be freed)

    def _group_bytes(self, msg: schema.Load, fut: Received) -> Buffer | None:
        """The bucket the prefetcher received by broadcast (None: the engine's workers
        received it themselves)."""
        group, size = msg.group, msg.size
        if group is None or size is None:  # the codec refuses such a load; for the type checker
            raise WeightSyncError(f"bucket seq {msg.seq}: not a group load", code=ErrorCode.INTERNAL)
        # With keys (the store speaks CURVE) the broadcast bytes must carry this sync's MAC.
        key = stream.mac_key(group.token, msg.sync_id) if group.store_key else None
        try:
            if isinstance(self.engine, ReceivesGroup):  # the engine's own workers receive (vLLM)
                if key is not None and msg.mac is None:
                    raise WeightSyncError(
                        f"bucket seq {msg.seq}: no MAC, and this group needs one", code=ErrorCode.UNAUTHORIZED
                    )
                self.base.invalidate()  # bytes this thread never sees cannot be a base
                self.engine.load_group(
                    msg.tensors,
                    group.to_wire(),
                    size,
                    msg.checksum,
                    self.collective_bind,
                    seq=msg.seq,
                    next_bucket=self._queued_next(msg),
                    mac=None if key is None or msg.mac is None else (key.hex(), msg.source, msg.mac.hex()),
                )
                return None
            if fut is None:  # `prefetch` started one for every group load the engine leaves to it
                raise WeightSyncError(f"bucket seq {msg.seq}: no receive started", code=ErrorCode.INTERNAL)
            buf = fut.result(timeout=group.timeout + 5.0)
        except GroupError as exc:
            raise WeightSyncError(f"bucket seq {msg.seq}: {exc}", code=exc.code) from None
        except FutureTimeout:
            raise WeightSyncError(
                f"bucket seq {msg.seq}: not received within {group.timeout + 5.0}s",
                code=ErrorCode.TIMEOUT,
            ) from None
        host = host_buffer(buf if buf.device.type == "cpu" else buf.cpu())
        try:
            stream.check_load_mac(key, msg.source, msg.seq, host, msg.mac)
        except MessageError as exc:
            raise WeightSyncError(exc.reason, code=exc.code) from None
        return host

    def _queued_next(self, msg: schema.Load) -> dict[str, int] | None:
        """{seq, size} of the group load right behind `msg` in the queue (same sync and
        group), whose receive the vLLM workers may post before loading `msg`; else None."""
        with self.jobs.mutex:
            job: Job | LoadJob | None = self.jobs.queue[0] if self.jobs.queue else None
        if not isinstance(job, LoadJob):
            return None
        nxt = job.msg
        if (
            nxt.sync_id != msg.sync_id
            or nxt.group is None
            or msg.group is None
            or nxt.group.id != msg.group.id
            or nxt.sync_id in self.failed
            or nxt.size is None
        ):
            return None
        return {"seq": nxt.seq, "size": nxt.size}

    def _close_group(self, stop: bool = False) -> None:
        """Leave the group (the daemon plans a new one); `stop`: for good."""
        if self.prefetcher is not None:
            if stop:
                self.prefetcher.stop()
                self.prefetcher.join(timeout=10)
            else:
                self.prefetcher.close_group()
        if isinstance(self.engine, ReceivesGroup):
            self.engine.close_group()

    def shutdown_group(self) -> None:
        self._close_group(stop=True)

    def _do_finalize(self, msg: schema.Finalize) -> None:
        self.verifier.close_maps()  # every bucket is in; the trainer may unlink its slots
        if msg.sync_id in self.failed:
            return
        unfinished = self.pieces.incomplete()
        if unfinished:
            raise WeightSyncError(
                f"{len(unfinished)} tensor(s) only partly received: {', '.join(unfinished[:4])}",
                code=ErrorCode.INCOMPLETE_SYNC,
            )
        postload.finalize(
            self.engine,
            msg,
            self._emit,
            phases=self.phases,
            pass_bytes=self.pass_bytes,
            base=self.base,
            prefetcher=self.prefetcher,
            failpoints=self.failpoints,
        )

    def _do_abort(self, msg: schema.Abort) -> None:
        self.verifier.close_maps()
        self._close_group()  # the daemon plans a new group after a failed sync
        self.base.discard()
        self.pieces.clear()
        self.tiles.clear()
        if self.current == msg.sync_id:
            self.engine.abort()
            self.current = None
            log.info("sync_aborted", sync_id=msg.sync_id)
