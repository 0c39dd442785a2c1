"""The broadcast groups the core keeps between syncs, for reuse: the one source's group,
each sharded push's source's, and the trainer connection that hosts each group's store.

Rules: a kept group is reused while its members stay and its trainer stays connected. It
goes when one of its engines is lost or registers anew (`leave`), when the trainer
connection hosting its store closes (`trainer_closed`; the running sync's own groups stay
until that sync ends), or when a sync that used it fails (`sync_failed`: members may have
died or hold a half-done broadcast). Plain bookkeeping: no clock, no I/O, no commands.
"""

from __future__ import annotations

from collections.abc import Iterable

from messages.bounded import LRU
from messages.schema import MAX_SOURCES, Begin
from orchestrator.core.records import GroupRecord, SyncRecord

# The bounded maps (messages.bounded.LRU, least recently used first):
MAX_SOURCE_GROUPS = MAX_SOURCES  # sharded pushes' groups kept for reuse: one per source a push may have
GROUP_CONNS_KEPT = MAX_SOURCE_GROUPS + 1  # the trainer connection of each group kept (shared + sources)


class KeptGroups:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.shared: GroupRecord | None = None  # the group the one source's syncs reuse
        # sharded pushes' sources' groups, by session
        self.sources: LRU[str, GroupRecord] = LRU(MAX_SOURCE_GROUPS)
        # the trainer connection that began a group's last sync, by session: its store lives in
        # that trainer, so the group goes when the connection closes (trainer_closed)
        self.conns: LRU[str, bytes] = LRU(GROUP_CONNS_KEPT)
        self.chosen_count = 0

    def new_id(self) -> str:
        return f"g{self.chosen_count + 1}.{self.run_id}"[:128]

    def chosen(self, group: GroupRecord, shared: bool = True, conn: bytes = b"") -> None:
        """`group` carries this sync's bytes: the one source's group (`shared`), which the
        next sync reuses while its members stay and its trainer (`conn`, which hosts the
        store) stays connected, or one source's of a sharded push, which that source's next
        sharded push reuses (by its store's session)."""
        if conn:
            self.conns[group.session] = conn
        known = self.shared if shared else self.sources.get(group.session)
        if group is not known:
            self.chosen_count += 1
        if shared:
            self.shared = group
        else:
            self.sources[group.session] = group  # past the limit: sources that went away

    def of_source(self, msg: Begin) -> GroupRecord | None:
        """The group a sharded push's source used last (reused while its members stay)."""
        return self.sources.get(msg.offer.session) if msg.offer is not None else None

    def trainer_closed(self, conn: bytes, running: Iterable[GroupRecord]) -> None:
        """The trainer connection `conn` closed: the groups whose store it hosted go, but
        those of the running sync (`running`), which that sync's end drops."""
        keep = set(running)
        for session in [k for k, c in self.conns.items() if c == conn]:  # no use counted
            del self.conns[session]
            if self.shared is not None and self.shared.session == session and self.shared not in keep:
                self.shared = None
            sg = self.sources.peek(session)
            if sg is not None and sg not in keep:
                del self.sources[session]

    def sync_failed(self, s: SyncRecord) -> None:
        """The groups a failed sync used are not reused."""
        if s.group is not None and s.group is self.shared:
            self.shared = None
        for g in s.groups.values():
            self.sources.pop(g.session, None)

    def leave(self, engine_id: str) -> None:
        """`engine_id` is lost or a new process: no kept group has its ranks any more (the
        next sync by a group plans a new one without stale ranks)."""
        g = self.shared
        if g is not None and any(eid == engine_id for eid, _, _ in g.members):
            self.shared = None
        for session, sg in list(self.sources.items()):
            if any(eid == engine_id for eid, _, _ in sg.members):
                del self.sources[session]
