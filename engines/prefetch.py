"""Receive collective buckets ahead of the applier, so bucket N+1 crosses the network
while bucket N is verified and copied into the model.

Rules: one thread owns the group (it alone joins, receives and closes it), receiving in
the order the daemon announced the buckets, at most `depth` buckets ahead: a buffer is
reused only after the applier released the bucket received into it. Each announced
bucket gets a future; the applier takes them in the same order and releases each one
after use, also when it skips a bucket of a failed sync. Closing is queued like a
receive, so it never races a broadcast in progress.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from concurrent.futures import Future
from typing import Any

from messages.collective import Member


class Prefetcher(threading.Thread):
    def __init__(self, bind: str = "", depth: int = 2, failpoints: dict[str, Any] | None = None) -> None:
        super().__init__(name="engine-collective-receiver", daemon=True)
        self.member = Member(bind, slots=depth)
        self.failpoints = failpoints or {}
        self._slots = threading.Semaphore(depth)
        self._jobs: queue.Queue[tuple[str, Any, Future | None] | None] = queue.Queue()

    def submit(self, msg: Any) -> Future:
        """Receive this announced bucket (a `load` with `group`) as soon as a buffer is free."""
        fut: Future = Future()
        self._jobs.put(("receive", msg, fut))
        return fut

    def release(self) -> None:
        """The applier is done with the oldest received bucket: its buffer may be reused."""
        self._slots.release()

    def close_group(self) -> None:
        self._jobs.put(("close", None, None))

    def stop(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, msg, fut = job
            if kind == "close" or fut is None:
                self.member.close()
                continue
            self._slots.acquire()
            try:
                if self.failpoints.get("kill_in_broadcast", -1) == msg.seq:  # fault injection
                    self.member.ensure(msg.group.to_wire())
                    os.kill(os.getpid(), signal.SIGKILL)
                fut.set_result(self.member.receive(msg.group.to_wire(), msg.size))
            except BaseException as exc:  # handed to the applier, which reports it typed
                fut.set_exception(exc)
        self.member.close()
