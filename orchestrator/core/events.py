"""The core's inputs: one frozen dataclass per event; `TRIGGER` names its rows in the table.

Rules: events are plain data the service builds from decoded messages, the clock and
its own observations (a trainer's connection closed, a bug surfaced, the spool changed).
The core (`fsm.Core.handle`) takes nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from messages.schema import Begin, Bucket, Failed, Finalized, Finish, Register
from orchestrator.core.records import Spooled


class Event:
    """Base of every event; those about one sync also have `sync_id`."""

    TRIGGER: ClassVar[str] = ""


class OfMessage(Event):
    """An event carrying a decoded message: its sync is the message's."""

    msg: Any

    @property
    def sync_id(self) -> str:
        return self.msg.sync_id


@dataclass(frozen=True, slots=True)
class BeginSync(OfMessage):
    TRIGGER: ClassVar[str] = "begin"
    msg: Begin


@dataclass(frozen=True, slots=True)
class BucketIn(OfMessage):
    TRIGGER: ClassVar[str] = "bucket"
    msg: Bucket
    nbytes: int  # the frame's size; the service verified its checksum


@dataclass(frozen=True, slots=True)
class FinishSync(OfMessage):
    TRIGGER: ClassVar[str] = "finish"
    msg: Finish


@dataclass(frozen=True, slots=True)
class AbortSync(Event):
    TRIGGER: ClassVar[str] = "abort"
    sync_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class EngineRegistered(Event):
    TRIGGER: ClassVar[str] = "register"
    msg: Register


@dataclass(frozen=True, slots=True)
class Heartbeat(Event):
    TRIGGER: ClassVar[str] = "heartbeat"
    engine_id: str


@dataclass(frozen=True, slots=True)
class Loaded(Event):
    TRIGGER: ClassVar[str] = "loaded"
    engine_id: str
    sync_id: str
    key: tuple[int, int]  # (sender, seq)


@dataclass(frozen=True, slots=True)
class EngineFinalized(OfMessage):
    TRIGGER: ClassVar[str] = "finalized"
    engine_id: str
    msg: Finalized


@dataclass(frozen=True, slots=True)
class EngineFailed(OfMessage):
    TRIGGER: ClassVar[str] = "failed"
    engine_id: str
    msg: Failed


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """The clock: deadlines, lost engines, and a rollback that is due."""

    TRIGGER: ClassVar[str] = "tick"


@dataclass(frozen=True, slots=True)
class TrainerGone(Event):
    TRIGGER: ClassVar[str] = "trainer_gone"
    sync_id: str


@dataclass(frozen=True, slots=True)
class EngineGone(Event):
    """An engine's connection closed (its process exited or was killed)."""

    TRIGGER: ClassVar[str] = "engine_gone"
    engine_id: str


@dataclass(frozen=True, slots=True)
class InternalError(Event):
    """A bug surfaced while the service handled an input: the running sync fails."""

    TRIGGER: ClassVar[str] = "internal"
    reason: str


@dataclass(frozen=True, slots=True)
class Shutdown(Event):
    TRIGGER: ClassVar[str] = "shutdown"


@dataclass(frozen=True, slots=True)
class SpoolChanged(Event):
    TRIGGER: ClassVar[str] = "spool_changed"
    spooled: Spooled | None
