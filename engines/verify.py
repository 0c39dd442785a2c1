"""Verify buckets by frame or by reference on their own thread, as they arrive, so that bucket N+1
is hashed while the applier loads bucket N.

Rules: one thread owns the hashing and its shared-memory mappings; jobs run in arrival
order. A bucket is handed to the engine only after its checksum matched (the applier
waits on the future first), so a corrupted byte is never applied. Engines that keep their
digest elsewhere (vLLM: the workers) get every tensor's digest part from the same pass
(`messages.buckets.hash_bucket`): the bytes are read once for both. xxh3 releases the
GIL, so the hashing runs on another core while the applier copies.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import zmq

from messages import schema, transports
from messages.buckets import hash_bucket
from messages.errors import ErrorCode, MessageError, WeightSyncError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from messages.codec import Frame


@dataclass(slots=True)
class Verified:
    buf: Buffer  # the bucket's bytes: the received frame's buffer or a view of the trainer's slot
    parts: dict[str, bytes] | None  # per-tensor digest parts, when the engine asked for them
    seconds: float  # hashing time on the verifier thread
    hashed: int  # the bytes that hashing read (counted by messages.checksums.bucket_hash)


# Below this many bytes a bucket is hashed by the applier itself: hashing it takes less
# than handing it to another thread and back (tiny buckets are control-path bound).
THREAD_MIN_BYTES = 1 << 20

# A bucket being verified: hashing on the verifier thread, or a small frame left to `result`.
Verifying: TypeAlias = "Future[Verified] | tuple[schema.Load, Frame]"


class Verifier:
    def __init__(self, parts: bool = False) -> None:
        self.parts = parts
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-verify")
        self._readers: dict[str, transports.Reader] = {}  # per "ref" transport, this thread's only

    def submit(self, msg: schema.Load, frame: Frame | None) -> Verifying:
        """Hash `msg`'s bucket (its `frame`, or the bytes its reference names) on the
        verifier thread; a small frame is left to `result` (the applier)."""
        if msg.ref is None and frame is not None and len(frame) < THREAD_MIN_BYTES:
            return (msg, frame)
        return self._pool.submit(self._verify, msg, frame)

    def result(self, pending: Verifying) -> Verified:
        """The verified bucket (raises CHECKSUM_MISMATCH, or the reference's refusal)."""
        if isinstance(pending, tuple):
            return self._verify(*pending)
        return pending.result()

    def _verify(self, msg: schema.Load, frame: Frame | None) -> Verified:
        t0 = time.perf_counter()
        ref = msg.ref
        buf: Buffer
        if ref is not None:
            try:
                buf = transports.view(ref, self._readers)
            except MessageError as exc:
                raise WeightSyncError(f"bucket seq {msg.seq}: {exc.reason}", code=exc.code) from None
        elif frame is None:  # the codec refuses such a load (one payload frame); for the type checker
            raise WeightSyncError(f"bucket seq {msg.seq}: no payload frame", code=ErrorCode.BAD_MESSAGE)
        else:
            buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
        got, parts, hashed = hash_bucket(buf, msg.tensors, self.parts)
        if got != msg.checksum:
            raise WeightSyncError(f"bucket seq {msg.seq} arrived corrupted", code=ErrorCode.CHECKSUM_MISMATCH)
        return Verified(buf, parts, time.perf_counter() - t0, hashed)

    def close_maps(self) -> None:
        """Once the jobs queued before this have run, unmap the trainer's slots that are
        gone (kept ones stay mapped for its next push)."""
        self._pool.submit(self._prune)

    def _prune(self) -> None:
        for r in self._readers.values():
            r.prune()

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        transports.close_readers(self._readers)
