"""Feeding the spooled version back to engines: rollback (all engines, as a sync the FSM
runs like any other) and catch-up (one rejoining engine, privately).

Rules: this module decides what to send next, never when a state changes (the FSM does)
and never touches a socket itself: it calls the service, on the service's task. At most
`window` spooled buckets are read into memory per feed, so a rollback costs the same
memory as a trainer's sync. A spool read error ends the feed with a typed failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from messages import codec, schema
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.core import fsm
from orchestrator.daemon.spool import Spool, SpoolEntry

if TYPE_CHECKING:
    from orchestrator.daemon.service import Service

log = structlog.get_logger()


def tensor_metas(entry: SpoolEntry) -> tuple[schema.TensorMeta, ...]:
    return tuple(schema.TensorMeta(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
                 for t in entry.tensors)


@dataclass
class Feed:
    sync_id: str
    version: int
    entries: list[SpoolEntry]
    window: int
    engine_id: str | None = None  # None: a rollback to every engine
    next: int = 0
    inflight: set[tuple[int, int]] = field(default_factory=set)
    finishing: bool = False

    def due(self) -> list[int]:
        n = []
        while self.next < len(self.entries) and len(self.inflight) + len(n) < self.window:
            n.append(self.next)
            self.next += 1
        return n


class Recovery:
    def __init__(self, service: Service, spool: Spool, window: int = 2) -> None:
        self.service = service
        self.spool = spool
        self.window = window
        self.rollback: Feed | None = None
        self.catchups: dict[str, Feed] = {}

    # -- commands from the FSM ----------------------------------------------------------
    def start_rollback(self, cmd: fsm.StartRollback) -> None:
        self.rollback = Feed(cmd.sync_id, cmd.version, self.spool.entries(), self.window)
        log.warning("rollback_started", sync_id=cmd.sync_id, version=cmd.version,
                    buckets=len(self.rollback.entries))

    def start_catchup(self, cmd: fsm.StartCatchUp) -> None:
        self.catchups[cmd.engine_id] = Feed(cmd.sync_id, cmd.version, self.spool.entries(),
                                            self.window, engine_id=cmd.engine_id)
        log.info("engine_catchup_started", engine_id=cmd.engine_id, sync_id=cmd.sync_id,
                 version=cmd.version)

    def catchup_acked(self, cmd: fsm.CatchUpAck) -> None:
        f = self.catchups.get(cmd.engine_id)
        if f is not None and f.sync_id == cmd.sync_id:
            f.inflight.discard(cmd.key)

    def catchup_done(self, cmd: fsm.CatchUpDone) -> None:
        f = self.catchups.get(cmd.engine_id)
        if f is not None and f.sync_id == cmd.sync_id:
            del self.catchups[cmd.engine_id]
        if cmd.ok:
            log.info("engine_rejoined", engine_id=cmd.engine_id, sync_id=cmd.sync_id)
        else:
            log.warning("engine_catchup_failed", engine_id=cmd.engine_id, sync_id=cmd.sync_id,
                        reason=cmd.reason)

    def sync_closed(self, sync_id: str) -> None:
        if self.rollback is not None and self.rollback.sync_id == sync_id:
            self.rollback = None

    # -- pumping (called by the service's loop) -----------------------------------------
    async def pump(self) -> None:
        for f in list(self.catchups.values()):
            await self._pump_catchup(f)
        if self.rollback is not None:
            await self._pump_rollback(self.rollback)

    def _due(self, f: Feed) -> list[tuple[int, SpoolEntry, zmq.Frame]] | None:
        """The spooled buckets `f` may send now (read from disk), or None if the spool
        cannot be read (the caller fails the feed)."""
        out = []
        for i in f.due():
            try:
                frame = zmq.Frame(self.spool.read(f.entries[i]))
            except OSError as exc:
                log.error("spool_read_failed", sync_id=f.sync_id, file=f.entries[i].file,
                          reason=str(exc))
                return None
            f.inflight.add((0, i))
            out.append((i, f.entries[i], frame))
        return out

    async def _pump_catchup(self, f: Feed) -> None:
        svc = self.service
        due = self._due(f)
        if due is None:
            await svc.execute(svc.core.handle_failed(f.engine_id, schema.Failed(
                sync_id=f.sync_id, code=ErrorCode.INTERNAL.value, message="spool unreadable"),
                time.monotonic()).commands)
            return
        for i, e, frame in due:
            header = codec.encode_header(schema.Load(
                sync_id=f.sync_id, version=f.version, seq=i, tensors=tensor_metas(e),
                checksum=e.checksum, sender=0))
            svc.send_engine(f.engine_id, [header, frame])

    async def _pump_rollback(self, f: Feed) -> None:
        svc = self.service
        due = self._due(f)
        if due is None:
            await svc.execute(svc.core.handle_abort(f.sync_id, "spool unreadable",
                                                    time.monotonic()).commands)
            return
        for i, e, frame in due:
            msg = schema.Bucket(sync_id=f.sync_id, seq=i, tensors=tensor_metas(e),
                                checksum=e.checksum, sender=0)
            await svc.local_request(msg, [frame], self._on_reply(f, (0, i)))
        if not f.inflight and f.next >= len(f.entries) and not f.finishing:
            f.finishing = True
            # partial: the spool replays exactly what the last READY sync sent (an adapter
            # push sends a subset); the digest, over everything each engine holds, proves
            # the engines are back at the served version.
            await svc.local_request(schema.Finish(sync_id=f.sync_id, buckets=len(f.entries),
                                                  digest=svc.core.served_digest, partial=True), [],
                                    self._on_finished(f))

    def _on_reply(self, f: Feed, key: tuple[int, int]) -> Callable[[Any, WeightSyncError | None], None]:
        def done(body: Any, err: WeightSyncError | None) -> None:
            f.inflight.discard(key)  # an error fails the sync itself; sync_closed ends the feed
        return done

    def _on_finished(self, f: Feed) -> Callable[[Any, WeightSyncError | None], None]:
        def done(body: Any, err: WeightSyncError | None) -> None:
            if err is None:
                log.warning("rollback_completed", sync_id=f.sync_id, version=f.version)
            else:
                log.error("rollback_failed", sync_id=f.sync_id, version=f.version,
                          code=err.code.value, reason=err.message)
        return done

