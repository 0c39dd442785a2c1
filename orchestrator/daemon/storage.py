"""The storage thread: journal and spool writes, in order, off the event loop.

Rules: one thread runs every durable write (SQLite rows, spool files, fsync, rename) in
the order submitted, so the event loop keeps answering `status` and heartbeats while a
large spool is fsynced. The loop never touches the journal or the spool while the
thread runs; it submits a job and continues that batch's effects (tell engines, reply)
when the job is done. What a job raises is re-raised where the loop awaits it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


class Storage:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-storage")

    def submit(self, jobs: list[Callable[[], object]]) -> asyncio.Future[None]:
        """Run `jobs` one after the other on the storage thread; an awaitable for the end."""

        def run() -> None:
            for job in jobs:
                job()

        return asyncio.wrap_future(self._pool.submit(run))

    def close(self) -> None:
        """Wait for what was submitted, then stop the thread."""
        self._pool.shutdown(wait=True)
