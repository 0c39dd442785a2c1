"""How one trainer client's buckets travel (messages.transports): the slots of each
transport that carries references, and the group this client hosts for a transport that
needs one, both kept across its pushes; and the window the daemon's begin reply allows.
"""

from __future__ import annotations

from messages import schema, transports
from messages.fanout import window_cap
from messages.liblog import get_logger
from messages.replies import BeginReply
from orchestrator.trainer.group import TrainerGroup

log = get_logger("trainer")


class Routes:
    def __init__(self, addr: str, group_host: str = "", curve: bool = False) -> None:
        self.addr = addr
        self.group_host = group_host  # this host's address for the group's store
        self.curve = curve
        self.rings: dict[str, transports.Rings] = {}  # per "ref" transport
        self.group: TrainerGroup | None = None

    def slots(
        self, asked: transports.Transport | None, window: int, bucket_bytes: int
    ) -> tuple[transports.Slots | None, str]:
        """The slots of the "ref" transport this push offers, and its name: the one asked
        for, or with "auto" (`asked` None) the most preferred whose slots can be had here;
        (None, ""): frames (no such transport, or no room for its slots)."""
        wanted = transports.of_kind("ref") if asked is None else (asked,) if asked.carries == "ref" else ()
        for t in wanted:
            if t.rings is None or not t.available():
                continue
            rings = self.rings.get(t.name)
            if rings is None:
                rings = self.rings[t.name] = t.rings()
            ring = rings.get(window, bucket_bytes)
            if ring is not None:
                return ring, t.name
        return None, ""

    def drop_rings(self) -> None:
        """Release every transport's slots (after a failed push an engine may still read
        one)."""
        for rings in self.rings.values():
            rings.drop()

    def offer(self) -> schema.CollectiveOffer:
        """This client's group offer (its store, started once)."""
        if self.group is None:
            self.group = TrainerGroup(self.addr, self.group_host, curve=self.curve)
        return self.group.offer()

    def group_for(self, started: BeginReply, asked: str) -> TrainerGroup | None:
        """The group this push broadcasts in, as the daemon planned it (None: it did not)."""
        if started.group is not None and self.group is not None:
            self.group.plan(
                {
                    **started.group,
                    "spool_copy": started.spool_copy,
                    "stream": started.stream,
                    "sync_id": started.sync_id,
                }
            )
            return self.group
        t = transports.get(asked)
        if t is not None and t.needs_group:
            log.warning(
                "collective_not_used",
                transport=started.transport,
                reason="some engine cannot join a group with this trainer",
            )
        return None

    def close(self) -> None:
        self.drop_rings()
        if self.group is not None:
            self.group.close()


def pending_cap(started: BeginReply, bucket_bytes: int) -> int | None:
    """The window the daemon's begin reply allows: its max_pending, and where buckets go
    through its fan-out (frames, references), within the fan-out's per-connection budget
    for this bucket size (messages.fanout.window_cap), which its queues are sized for."""
    if started.max_pending is None:
        return None
    budget = started.fanout_bytes if started.group is None else None
    return window_cap(budget, bucket_bytes, started.max_pending)
