"""What the daemon holds for the syncs in flight: how each sync's buckets travel (its
route), the requests waiting for an answer, and which trainer connections a sync belongs
to. A bucket's bytes are not kept here: they travel with the core's event and command
(`Pending`, an opaque handle to the core) and go when the last of those does.

Rules: plain bookkeeping owned by the loop task; the dispatcher adds, the effects runner
answers and forgets. A sync's entries go when it completes (`close`), so nothing here
outlives the sync it belongs to.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from messages import schema
from messages.replies import JsonObject
from orchestrator.core.commands import SyncOpened
from orchestrator.daemon.transport import Waiter

Key = tuple[str, tuple[int, int]]  # (sync_id, (source, seq))


@dataclass(slots=True, weakref_slot=True, eq=False)
class Pending:
    """A bucket between its arrival and its forwarding (its frame, if it has one)."""

    msg: schema.Bucket
    frame: Any


class Inflight:
    def __init__(self) -> None:
        self.routes: dict[str, SyncOpened] = {}
        self.held: weakref.WeakSet[Pending] = weakref.WeakSet()  # bucket frames still referenced
        self.bucket_waiters: dict[Key, list[Waiter]] = defaultdict(list)
        self.finish_waiters: dict[str, list[Waiter]] = defaultdict(list)
        # trainer connections per sync, each with the source (source) it speaks for
        self.owners: dict[str, dict[bytes, int]] = defaultdict(dict)
        # the sync's bucket size and sources, from its begin's reply: its fan-out queue's size
        self.bucket_bytes: dict[str, tuple[int, int]] = {}

    def own(self, sync_id: str, ident: bytes, source: int) -> None:
        """The trainer connection `ident` speaks for `source` of `sync_id`, which accepted
        its request: noted only while the sync runs here (a refused request, or one for a
        sync that is gone, leaves nothing)."""
        if sync_id in self.routes:
            self.owners[sync_id][ident] = source

    def tracked(self) -> int:
        """Syncs this bookkeeping holds anything of (at most the running one, once the
        effects of the ended ones ran)."""
        kept = {*self.routes, *self.owners, *self.bucket_bytes, *self.finish_waiters}
        return len(kept | {sync_id for sync_id, _ in self.bucket_waiters})

    def pending_on(self, ident: bytes) -> int:
        """Bucket requests of this trainer connection still unanswered."""
        return sum(1 for ws in self.bucket_waiters.values() for w in ws if w.ident == ident)

    def connection_closed(self, ident: bytes) -> list[tuple[str, int]]:
        """The (sync, source) pairs that lost their last trainer connection with `ident`:
        a sharded push loses a source when that source's last connection closes."""
        orphaned = []
        for sync_id, owners in list(self.owners.items()):
            source = owners.pop(ident, None)
            if source is not None and source not in owners.values():
                orphaned.append((sync_id, source))
            if not owners:
                del self.owners[sync_id]
        return orphaned

    def close(self, sync_id: str) -> tuple[list[Waiter], list[Waiter]]:
        """Forget the sync; its (bucket, finish) waiters, to be answered by the caller."""
        self.routes.pop(sync_id, None)
        self.owners.pop(sync_id, None)
        self.bucket_bytes.pop(sync_id, None)
        buckets = [
            w for k in [k for k in self.bucket_waiters if k[0] == sync_id] for w in self.bucket_waiters.pop(k)
        ]
        return buckets, self.finish_waiters.pop(sync_id, [])

    def view(self, effect_batches: int) -> JsonObject:
        return {
            "pending_buckets": len(self.held),
            "unacked_bucket_requests": sum(len(w) for w in self.bucket_waiters.values()),
            "effect_batches": effect_batches,
            "tracked_syncs": self.tracked(),
        }
