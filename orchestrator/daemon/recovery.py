"""Feeding the spooled version back to engines: rollback (all engines, as a sync the FSM
runs like any other, its buckets and finish fed through the dispatcher as a trainer's
would be) and catch-up (one rejoining engine, privately: the core paces it with
`SendSpooled`, one command per bucket; this module reads the bucket and sends it).

Rules: this module never decides when a state changes (the core does) and never touches
a socket itself: it calls the service, on the service's task. At most `window` spooled
buckets are read into memory per feed, so a rollback costs the same memory as a
trainer's sync. A spool read error ends the feed with a typed failure.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import structlog
import zmq

from messages import codec, schema
from messages.errors import ErrorCode, WeightSyncError
from messages.replies import JsonObject
from orchestrator.core import commands as cmd
from orchestrator.core import events as ev
from orchestrator.core.records import Limits
from orchestrator.daemon.spool import Spool, SpoolEntry
from orchestrator.daemon.transport import OnReply, Outgoing

log = structlog.get_logger()
RECOVERY_WINDOW = Limits().recovery_window  # spooled buckets a rollback has in flight


class Requests(Protocol):
    """The daemon's own requests (a rollback's buckets and finish), answered through
    `on_reply` like a trainer's would be (the dispatcher)."""

    async def local_request(
        self, msg: schema.Bucket | schema.Finish, payload: list[zmq.Frame], on_reply: OnReply
    ) -> None: ...


class Engines(Protocol):
    def send_engine(self, engine_id: str, frames: Outgoing) -> bool: ...


def tensor_metas(entry: SpoolEntry) -> tuple[schema.TensorMeta, ...]:
    """The spooled bucket's metas (a delta's patches included), as they were sent."""
    return tuple(msgspec.convert(t, schema.TensorMeta) for t in entry.tensors)


@dataclass
class Feed:
    sync_id: str
    version: int
    entries: list[SpoolEntry]
    window: int
    digest: str = ""  # a rollback finishes expecting it (the served version's)
    next: int = 0
    inflight: set[tuple[int, int]] = field(default_factory=set)
    finishing: bool = False
    hold: bool = False  # engines keep what the replay loads until it ends (`Spool.layered`)
    refused: str | None = None  # its finish was refused and left it running: why (it is aborted)

    def due(self) -> list[int]:
        n: list[int] = []
        while self.next < len(self.entries) and len(self.inflight) + len(n) < self.window:
            n.append(self.next)
            self.next += 1
        return n


class Recovery:
    def __init__(
        self,
        spool: Spool,
        requests: Requests,
        engines: Engines,
        feed: Callable[[ev.Event], Awaitable[None]],
        window: int = RECOVERY_WINDOW,
    ) -> None:
        self.requests = requests
        self.engines = engines
        self.feed = feed
        self.spool = spool
        self.window = window
        self.rollback: Feed | None = None

    # -- commands from the FSM ----------------------------------------------------------
    def start_rollback(self, cmd: cmd.StartRollback) -> None:
        self.rollback = Feed(
            cmd.sync_id,
            cmd.version,
            self.spool.entries(),
            self.window,
            digest=cmd.digest,
            hold=self.spool.layered,
        )
        log.warning(
            "rollback_started", sync_id=cmd.sync_id, version=cmd.version, buckets=len(self.rollback.entries)
        )

    def send_spooled(self, c: cmd.SendSpooled) -> ev.Event | None:
        """Spooled bucket `c.seq`, read from disk and sent to one catching-up engine; the
        event that fails the catch-up if the spool cannot be read."""
        try:
            e = self.spool.entry(c.seq)
            frame = zmq.Frame(self.spool.read(e))
        except (OSError, IndexError) as exc:
            log.error("spool_read_failed", sync_id=c.sync_id, seq=c.seq, reason=str(exc))
            return ev.EngineFailed(
                c.engine_id,
                schema.Failed(sync_id=c.sync_id, code=ErrorCode.INTERNAL.value, message="spool unreadable"),
            )
        if c.seq == 0:
            log.info("engine_catchup_started", engine_id=c.engine_id, sync_id=c.sync_id, version=c.version)
        header = codec.encode_header(
            schema.Load(
                sync_id=c.sync_id,
                version=c.version,
                seq=c.seq,
                tensors=tensor_metas(e),
                checksum=e.checksum,
                source=0,
                hold=self.spool.layered,
                cut_for=self.spool.cut_for,
            )
        )
        self.engines.send_engine(c.engine_id, [header, frame])
        return None

    def catchup_done(self, cmd: cmd.CatchUpDone) -> None:
        if cmd.ok:
            log.info("engine_rejoined", engine_id=cmd.engine_id, sync_id=cmd.sync_id)
        else:
            log.warning(
                "engine_catchup_failed", engine_id=cmd.engine_id, sync_id=cmd.sync_id, reason=cmd.reason
            )

    def holds(self, sync_id: str) -> bool:
        """`sync_id` is a rollback whose engines must hold what it loads (`Feed.hold`)."""
        return self.rollback is not None and self.rollback.sync_id == sync_id and self.rollback.hold

    def cut_for(self, sync_id: str) -> tuple[str, ...]:
        """`sync_id` is the rollback: the layout keys its spooled boxes were cut for."""
        return self.spool.cut_for if self.rollback is not None and self.rollback.sync_id == sync_id else ()

    def sync_closed(self, sync_id: str) -> None:
        if self.rollback is not None and self.rollback.sync_id == sync_id:
            self.rollback = None

    # -- pumping (called by the service's loop) -----------------------------------------
    async def pump(self) -> None:
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
                log.error("spool_read_failed", sync_id=f.sync_id, file=f.entries[i].file, reason=str(exc))
                return None
            f.inflight.add((0, i))
            out.append((i, f.entries[i], frame))
        return out

    async def _pump_rollback(self, f: Feed) -> None:
        if f.refused is not None:  # a refused finish is not sent again: the rollback is over
            why, f.refused = f.refused, None
            await self.feed(ev.AbortSync(f.sync_id, f"its finish was refused: {why}", by="daemon"))
            return
        due = self._due(f)
        if due is None:
            await self.feed(ev.AbortSync(f.sync_id, "spool unreadable", by="daemon"))
            return
        for i, e, frame in due:
            msg = schema.Bucket(
                sync_id=f.sync_id, seq=i, tensors=tensor_metas(e), checksum=e.checksum, source=0
            )
            await self.requests.local_request(msg, [frame], self._on_reply(f, (0, i)))
        if not f.inflight and f.next >= len(f.entries) and not f.finishing:
            f.finishing = True
            # partial: the spool replays exactly what the last READY sync sent (an adapter
            # push sends a subset); the digest, over everything each engine holds, proves
            # the engines are back at the served version.
            await self.requests.local_request(
                schema.Finish(
                    sync_id=f.sync_id, buckets=len(f.entries), digest=f.digest or None, partial=True
                ),
                [],
                self._on_finished(f),
            )

    def _on_reply(self, f: Feed, key: tuple[int, int]) -> OnReply:
        def done(body: JsonObject | None, err: WeightSyncError | None) -> None:
            f.inflight.discard(key)  # an error fails the sync itself; sync_closed ends the feed

        return done

    def _on_finished(self, f: Feed) -> OnReply:
        def done(body: JsonObject | None, err: WeightSyncError | None) -> None:
            if err is None:
                log.warning("rollback_completed", sync_id=f.sync_id, version=f.version)
            else:
                log.error(
                    "rollback_failed",
                    sync_id=f.sync_id,
                    version=f.version,
                    code=err.code.value,
                    reason=err.message,
                )
                # A refusal that failed the sync ended the feed (`sync_closed`); one that
                # left it running would hold it until --sync-timeout: the next pump aborts it.
                f.refused = f"{err.code.value}: {err.message}"

        return done
