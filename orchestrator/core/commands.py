"""What the FSM asks the service to do: plain data, appended to the outbox by the FSM's
callbacks and executed, in order, by `service.py` (the only code that does I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from messages.errors import WeightSyncError
from messages.schema import Probe

@dataclass(frozen=True, slots=True)
class ForwardBucket:
    sync_id: str
    key: tuple[int, int]  # (sender, seq)
    engine_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AckBucket:
    sync_id: str
    key: tuple[int, int]


@dataclass(frozen=True, slots=True)
class SendFinalize:
    engine_id: str
    sync_id: str
    version: int
    probes: tuple[Probe, ...]


@dataclass(frozen=True, slots=True)
class SendAbort:
    engine_ids: tuple[str, ...]
    sync_id: str


@dataclass(frozen=True, slots=True)
class CompleteSync:
    """Answer every deferred request of the sync (finish, pending buckets)."""

    sync_id: str
    body: dict[str, Any] | None  # ok body, or None with `error`
    error: WeightSyncError | None = None
    summary: dict[str, Any] | None = None  # the sync's record as `status.last_sync` shows it


@dataclass(frozen=True, slots=True)
class Journal:
    kind: str  # "transition" | "sync"
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SpoolBegin:
    """Start writing this sync's buckets to the spool as they are forwarded."""

    sync_id: str
    version: int


@dataclass(frozen=True, slots=True)
class SpoolCommit:
    """Make the sync's spooled buckets durable and current, before READY is answered."""

    sync_id: str
    version: int
    digest: str


@dataclass(frozen=True, slots=True)
class SpoolDiscard:
    sync_id: str


@dataclass(frozen=True, slots=True)
class StartRollback:
    """Feed the spooled version to every engine as the (already begun) sync `sync_id`."""

    sync_id: str
    version: int


@dataclass(frozen=True, slots=True)
class StartCatchUp:
    """Feed the spooled version to one engine only, as its private sync `sync_id`."""

    engine_id: str
    sync_id: str
    version: int


@dataclass(frozen=True, slots=True)
class CatchUpAck:
    engine_id: str
    sync_id: str
    key: tuple[int, int]


@dataclass(frozen=True, slots=True)
class CatchUpDone:
    engine_id: str
    sync_id: str
    ok: bool
    reason: str = ""


Command = (ForwardBucket | AckBucket | SendFinalize | SendAbort | CompleteSync | Journal
           | SpoolBegin | SpoolCommit | SpoolDiscard | StartRollback | StartCatchUp | CatchUpAck
           | CatchUpDone)


@dataclass(slots=True)
class Result:
    reply: dict[str, Any] | None  # None: the reply is deferred until the sync completes
    commands: list[Command] = field(default_factory=list)


