"""Verify inline and shm buckets on their own thread, as they arrive, so that bucket N+1
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
from typing import Any

from messages import schema
from messages.buckets import hash_bucket
from messages.errors import ErrorCode, MessageError, WeightSyncError
from messages.shm import Reader


@dataclass(slots=True)
class Verified:
    buf: Any  # the bucket's bytes: the received frame's buffer or a view of the trainer's slot
    parts: dict[str, bytes] | None  # per-tensor digest parts, when the engine asked for them
    seconds: float  # hashing time on the verifier thread
    hashed: int  # the bytes that hashing read (counted by messages.checksums.bucket_hash)


# Below this many bytes a bucket is hashed by the applier itself: hashing it takes less
# than handing it to another thread and back (tiny buckets are control-path bound).
THREAD_MIN_BYTES = 1 << 20


class Verifier:
    def __init__(self, parts: bool = False) -> None:
        self.parts = parts
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-verify")
        self._reader = Reader()  # the trainer's shm slots, mapped by this thread only

    def submit(self, msg: schema.Load, frame: Any) -> Future[Verified] | tuple[schema.Load, Any]:
        """Hash `msg`'s bucket (inline `frame`, or the shm slot `msg.shm` names) on the
        verifier thread; a small inline bucket is left to `result` (the applier)."""
        if msg.shm is None and frame is not None and len(frame) < THREAD_MIN_BYTES:
            return (msg, frame)
        return self._pool.submit(self._verify, msg, frame)

    def result(self, pending: Future[Verified] | tuple[schema.Load, Any]) -> Verified:
        """The verified bucket (raises CHECKSUM_MISMATCH, or the shm refusal)."""
        if isinstance(pending, tuple):
            return self._verify(*pending)
        return pending.result()

    def _verify(self, msg: schema.Load, frame: Any) -> Verified:
        t0 = time.perf_counter()
        if msg.shm is not None:
            try:
                buf = self._reader.view(msg.shm.name, msg.shm.offset, msg.shm.size)
            except MessageError as exc:
                raise WeightSyncError(f"bucket seq {msg.seq}: {exc.reason}", code=exc.code) from None
        else:
            buf = frame.buffer if hasattr(frame, "buffer") else frame
        got, parts, hashed = hash_bucket(buf, msg.tensors, self.parts)
        if got != msg.checksum:
            raise WeightSyncError(f"bucket seq {msg.seq} arrived corrupted", code=ErrorCode.CHECKSUM_MISMATCH)
        return Verified(buf, parts, time.perf_counter() - t0, hashed)

    def close_maps(self) -> None:
        """Once the jobs queued before this have run, unmap the trainer's slots that are
        gone (kept ones stay mapped for its next push)."""
        self._pool.submit(self._reader.prune)

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reader.close()
