"""The core's inputs: one frozen dataclass per event; `TRIGGER` names it in the table.

Rules: events are plain data the service builds from decoded messages, the clock and
its own observations (a trainer's connection closed, a bug surfaced, the spool changed,
what a bucket's bytes hashed to, whether a connection is still open). The core
(`Core.handle`) takes nothing else: facts that need I/O are found by the service and
carried here, and the core decides what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from messages.errors import ErrorCode
from messages.schema import Begin, Bucket, Committed, Failed, Finalized, Finish, Prepared, Register
from orchestrator.core.records import Spooled
from orchestrator.core.table import Trigger


class Event:
    """Base of every event; those about one sync also have `sync_id`."""

    TRIGGER: ClassVar[Trigger]


class OfMessage(Event):
    """An event carrying a decoded message: its sync is the message's."""

    msg: Begin | Bucket | Finish | Finalized | Committed | Prepared | Failed  # each subclass: its own

    @property
    def sync_id(self) -> str:
        return str(self.msg.sync_id)


@dataclass(frozen=True, slots=True)
class BeginSync(OfMessage):
    TRIGGER: ClassVar[Trigger] = Trigger.BEGIN
    msg: Begin
    conn: bytes = b""  # the trainer connection it came on (a source's seat without a token)


@dataclass(frozen=True, slots=True)
class BucketIn(OfMessage):
    """A bucket, with what the service found out about its bytes (it holds them)."""

    TRIGGER: ClassVar[Trigger] = Trigger.BUCKET
    msg: Bucket
    nbytes: int  # its size: the frame's, the reference's, or the broadcast's `size`
    has_payload: bool = True  # a frame came with it (its bytes, or a broadcast's spool copy)
    checksum_ok: bool | None = None  # the bytes (frame or reference) hashed right; None: not read
    ref_error: str | None = None  # the reference could not be read (why)
    pending: int = 0  # bucket requests of this connection still unanswered
    handle: object = None  # the service's hold on the bytes: opaque here, passed on to ForwardBucket
    conn: bytes = b""  # the trainer connection it came on


@dataclass(frozen=True, slots=True)
class FinishSync(OfMessage):
    TRIGGER: ClassVar[Trigger] = Trigger.FINISH
    msg: Finish
    conn: bytes = b""  # the trainer connection it came on


@dataclass(frozen=True, slots=True)
class AbortSync(Event):
    TRIGGER: ClassVar[Trigger] = Trigger.ABORT
    sync_id: str
    reason: str = ""
    code: ErrorCode | None = None  # why the trainer gave up (None: ABORTED)
    by: str = "trainer"  # trainer | operator | daemon


@dataclass(frozen=True, slots=True)
class EngineRegistered(Event):
    TRIGGER: ClassVar[Trigger] = Trigger.REGISTER
    msg: Register
    other_connection: bool = False  # the id is known on another, still open, connection


@dataclass(frozen=True, slots=True)
class Heartbeat(Event):
    TRIGGER: ClassVar[Trigger] = Trigger.HEARTBEAT
    engine_id: str
    registered_here: bool = True  # from the connection that registered this id
    server_error: str | None = None  # its server does not answer (vllm-server): why


@dataclass(frozen=True, slots=True)
class Loaded(Event):
    TRIGGER: ClassVar[Trigger] = Trigger.LOADED
    engine_id: str
    sync_id: str
    key: tuple[int, int]  # (source, seq): every bucket of source up to seq is applied
    also: tuple[int, ...] = ()  # seqs of that source applied beyond a gap
    more: tuple[tuple[int, int], ...] = ()  # other sources' (source, seq) marks, cumulative


@dataclass(frozen=True, slots=True)
class EngineFinalized(OfMessage):
    TRIGGER: ClassVar[Trigger] = Trigger.FINALIZED
    engine_id: str
    msg: Finalized


@dataclass(frozen=True, slots=True)
class EngineCommitted(OfMessage):
    TRIGGER: ClassVar[Trigger] = Trigger.COMMITTED
    engine_id: str
    msg: Committed


@dataclass(frozen=True, slots=True)
class EnginePrepared(OfMessage):
    TRIGGER: ClassVar[Trigger] = Trigger.PREPARED
    engine_id: str
    msg: Prepared


@dataclass(frozen=True, slots=True)
class EngineFailed(OfMessage):
    TRIGGER: ClassVar[Trigger] = Trigger.FAILED
    engine_id: str
    msg: Failed


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """The clock: deadlines, lost engines, and a rollback that is due."""

    TRIGGER: ClassVar[Trigger] = Trigger.TICK


@dataclass(frozen=True, slots=True)
class TrainerGone(Event):
    TRIGGER: ClassVar[Trigger] = Trigger.TRAINER_GONE
    sync_id: str  # "" when the connection began no running sync
    source: int = 0  # the source whose last connection closed (a sharded push has several)
    conn: bytes = b""  # the connection that closed


@dataclass(frozen=True, slots=True)
class EngineGone(Event):
    """An engine's connection closed (its process exited or was killed), or it said
    goodbye (it stops cleanly)."""

    TRIGGER: ClassVar[Trigger] = Trigger.ENGINE_GONE
    engine_id: str
    goodbye: bool = False


@dataclass(frozen=True, slots=True)
class InternalError(Event):
    """A bug surfaced while the service handled an input: the running sync fails."""

    TRIGGER: ClassVar[Trigger] = Trigger.INTERNAL
    reason: str


@dataclass(frozen=True, slots=True)
class Shutdown(Event):
    TRIGGER: ClassVar[Trigger] = Trigger.SHUTDOWN


@dataclass(frozen=True, slots=True)
class SpoolChanged(Event):
    TRIGGER: ClassVar[Trigger] = Trigger.SPOOL_CHANGED
    spooled: Spooled | None
