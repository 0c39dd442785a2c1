"""A broadcast relayed down a chain of ranks, for gloo on TCP.

gloo's own broadcast is a binomial tree without pipelining: the root sends its whole
copy to ceil(log2(n)) members one after the other, so with 4 engines the trainer's link
carries 3 copies (measured on the lab of hosts: 3.6x one copy over the trainer's link,
docs/BENCHMARKS.md). A relay passes the bytes down the chain of ranks instead,
0 -> 1 -> ... -> n-1, in chunks: each member receives chunk i from the one before it and
sends it on while chunk i+1 arrives. Every link carries one copy in and one out, and the
chain costs one copy's time plus one chunk per hop.

Rules:
- Every member of a group makes the same choice (`relays`: gloo with more than two
  members; NCCL has pipelined rings and trees of its own) and cuts a broadcast into the
  same chunks (`chunk_elems`, from its size alone), tagging them from the same counter:
  the members broadcast the same sizes in the same order, so their tags agree.
- One thread per group runs the relays in the order they were started; a relay is
  complete once its chunks arrived here and went on to the next member (its buffer is
  then free to reuse).
- A member that dies or leaves fails its neighbours' sends and receives at once (the
  connection closes); each call waits at most until the broadcast's deadline.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any

import torch

RELAY_CHUNKS = 16  # a broadcast is cut in about this many chunks
RELAY_CHUNK_MIN = 64 << 10  # bytes: below it, per-chunk costs outweigh the pipeline
RELAY_CHUNK_MAX = 1 << 20  # bytes: above it, filling the chain costs more than a hop's worth
TAG_SPACE = 1 << 30


def relays(backend: str, world_size: int) -> bool:
    """Whether a group's broadcasts are relayed down its chain (see the module's rules)."""
    return backend == "gloo" and world_size > 2


def chunk_elems(numel: int, element_size: int) -> int:
    """Elements per chunk of a broadcast of `numel` elements (the last chunk may be shorter)."""
    nbytes = numel * element_size
    chunk = min(RELAY_CHUNK_MAX, max(RELAY_CHUNK_MIN, nbytes // RELAY_CHUNKS))
    return max(1, chunk // max(1, element_size))


class RelayWork:
    """One relayed broadcast: `is_completed` and `wait`, like the backend's own work."""

    def __init__(self, flat: torch.Tensor, tag: int, deadline: float) -> None:
        self.flat = flat
        self.tag = tag
        self.deadline = deadline
        self.error: BaseException | None = None
        self._done = threading.Event()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the relay ends (at most `timeout`); raise its failure, if any."""
        left = None if timeout is None else max(0.0, timeout.total_seconds())
        if not self._done.wait(left):
            raise TimeoutError(f"relayed broadcast timed out after {left}s")
        if self.error is not None:
            raise self.error
        return True

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class Relayer:
    """The group's relay thread: runs each started relay, in order."""

    def __init__(self, pg: Any, rank: int, world_size: int, name: str) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self._tag = 0
        self._jobs: queue.SimpleQueue[RelayWork | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"relay-{name}", daemon=True)
        self._thread.start()

    def start(self, tensor: torch.Tensor, deadline: float) -> RelayWork:
        """Queue the relay of `tensor` (contiguous; every member's of the same size)."""
        if not tensor.is_contiguous():
            raise ValueError("a relayed broadcast needs a contiguous tensor")
        flat = tensor.view(-1)
        step = chunk_elems(flat.numel(), flat.element_size())
        work = RelayWork(flat, self._tag, deadline)
        self._tag = (self._tag + -(-flat.numel() // step) + 1) % TAG_SPACE
        self._jobs.put(work)
        return work

    def stop(self, wait: float = 0.0) -> None:
        """No relay starts after the one running (which ends by its deadline or the group's
        shutdown, whichever comes first); wait up to `wait` seconds for the thread to end."""
        self._jobs.put(None)
        if wait > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.pg = None  # the group's last reference goes with its owner, not this thread

    def _serve(self) -> None:
        while (work := self._jobs.get()) is not None:
            try:
                self._relay(work)
            except BaseException as exc:  # the caller's `wait` raises it
                work.finish(exc)
                while (w := self._jobs.get()) is not None:  # fail what was queued behind it
                    w.finish(RuntimeError("an earlier relayed broadcast in this group failed"))
                return
            else:
                work.finish()

    def _relay(self, work: RelayWork) -> None:
        pg, rank, n = self.pg, self.rank, self.world_size
        flat = work.flat
        if flat.numel() == 0:
            return
        step = chunk_elems(flat.numel(), flat.element_size())
        chunks = [flat[i : i + step] for i in range(0, flat.numel(), step)]
        recvs = [pg.recv([c], rank - 1, work.tag + i) for i, c in enumerate(chunks)] if rank > 0 else []
        sends = []
        for i, c in enumerate(chunks):
            if recvs:
                recvs[i].wait(_left(work.deadline))
            if rank < n - 1:
                sends.append(pg.send([c], rank + 1, work.tag + i))
        for s in sends:
            s.wait(_left(work.deadline))


def _left(deadline: float) -> datetime.timedelta:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("relayed broadcast passed its deadline (timed out)")
    return datetime.timedelta(seconds=left)
