"""What the core asks the service to do: plain data the service executes in order.

Rules: a command carries everything the service needs to carry it out (which engines
get a bucket and how, what to journal, what to answer); the service never reads the
core's records to fill in the rest. Persisting commands (`Journal`, `Spool*`) are
written before engines are told and before any reply (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from messages.errors import WeightSyncError
from messages.replies import JsonObject
from messages.schema import Probe
from orchestrator.core.records import GroupRecord


@dataclass(frozen=True, slots=True)
class SyncOpened:
    """A sync began: how its buckets travel, so the service can read what arrives."""

    sync_id: str
    version: int
    kind: str  # "sync" | "rollback"
    carries: str  # what its transport carries (messages.transports.Carrier)
    mixed: bool  # references, and frames cut from them for the engines that cannot read them
    spool: bool  # its buckets are written to the spool as they are forwarded
    stream: bool = False  # a group's stream: the trainer hears of a failure unasked


@dataclass(frozen=True, slots=True)
class ForwardBucket:
    sync_id: str
    key: tuple[int, int]  # (source, seq)
    version: int
    engine_ids: tuple[str, ...]
    ref_engines: tuple[str, ...] = ()  # read the bucket by its reference
    group: GroupRecord | None = None  # a group: each engine hears of it and receives by broadcast
    spool: bool = False  # write the bucket to the spool before any engine is told
    handle: object = None  # the bucket's bytes as the service handed them in (BucketIn.handle)


@dataclass(frozen=True, slots=True)
class OpenStreams:
    """Tell each engine to join `group` and receive the trainer's stream of
    sync `sync_id` (one message per engine per sync; no message per bucket)."""

    sync_id: str
    version: int
    engine_ids: tuple[str, ...]
    group: GroupRecord


@dataclass(frozen=True, slots=True)
class AckBucket:
    sync_id: str
    key: tuple[int, int]  # (source, seq): every participant applied it
    through: int = -1  # every bucket of that source up to this seq is acknowledged


@dataclass(frozen=True, slots=True)
class SendFinalize:
    engine_id: str
    sync_id: str
    version: int
    probes: tuple[Probe, ...]
    digest: str | None = None  # the version's, when known


@dataclass(frozen=True, slots=True)
class SendCommit:
    """Tell a labelling engine the version is committed fleet-wide: label its outputs."""

    engine_id: str
    sync_id: str
    version: int


@dataclass(frozen=True, slots=True)
class SendServed:
    """Tell an engine that hands versions to readers that `version` (with `digest`) is the
    served version. Issued with the READY it follows (persisted first), or for a version
    already served, so the engine never hears it of a version the journal lacks."""

    engine_id: str
    sync_id: str
    version: int
    digest: str


@dataclass(frozen=True, slots=True)
class SendAbort:
    engine_ids: tuple[str, ...]
    sync_id: str


@dataclass(frozen=True, slots=True)
class EngineForgotten:
    """A LOST engine's record expired (`Limits.lost_expiry`): the daemon forgets its id
    (its routing id, its metrics); registering again makes it new."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class EngineLost:
    """An engine was counted lost, and why (logged: an operator sees it happen)."""

    engine_id: str
    cause: str


@dataclass(frozen=True, slots=True)
class CompleteSync:
    """Answer every deferred request of the sync (finish, pending buckets)."""

    sync_id: str
    body: dict[str, Any] | None  # ok body, or None with `error`
    error: WeightSyncError | None = None
    summary: JsonObject | None = None  # the sync's record as `status.last_sync` shows it
    state: str = ""  # the daemon's state after it
    dirty: bool = False


@dataclass(frozen=True, slots=True)
class Journal:
    kind: str  # "transition" | "sync"
    data: JsonObject


@dataclass(frozen=True, slots=True)
class SpoolBegin:
    """Start writing this sync's buckets to the spool as they are forwarded."""

    sync_id: str
    version: int
    base: int | None = None  # a delta sync: the spooled version it extends (base + deltas)


@dataclass(frozen=True, slots=True)
class SpoolCommit:
    """Make the sync's spooled buckets durable and current, before READY is answered."""

    sync_id: str
    version: int
    digest: str
    probes: tuple[Probe, ...] = ()  # kept with the version: a rollback re-checks them
    slice_digests: dict[str, tuple[str, ...]] = field(default_factory=dict)  # and each rank's digest


@dataclass(frozen=True, slots=True)
class SpoolDiscard:
    sync_id: str


@dataclass(frozen=True, slots=True)
class StartRollback:
    """Feed the spooled version to every engine as the (already begun) sync `sync_id`,
    then finish it expecting `digest`."""

    sync_id: str
    version: int
    digest: str


@dataclass(frozen=True, slots=True)
class SendSpooled:
    """Send spooled bucket `seq` of the served version to one engine, as a `load` of its
    private catch-up sync `sync_id` (the shell reads the bytes; the core paces them)."""

    engine_id: str
    sync_id: str
    version: int
    seq: int


@dataclass(frozen=True, slots=True)
class CatchUpDone:
    engine_id: str
    sync_id: str
    ok: bool
    reason: str = ""


Command = (
    SyncOpened
    | ForwardBucket
    | OpenStreams
    | AckBucket
    | SendFinalize
    | SendCommit
    | SendServed
    | SendAbort
    | EngineLost
    | EngineForgotten
    | CompleteSync
    | Journal
    | SpoolBegin
    | SpoolCommit
    | SpoolDiscard
    | StartRollback
    | SendSpooled
    | CatchUpDone
)
PERSIST = (Journal, SpoolBegin, SpoolCommit, SpoolDiscard)


@dataclass(slots=True)
class Result:
    """What an input did. Its answer is one of four, said here and nowhere else: `reply`
    (answer now with this body), `later` (the answer comes with a later command: an
    AckBucket or the sync's CompleteSync), `refusal` (the input is refused with this error
    once its commands, which ended the sync it disturbed, persisted), or none (the input
    gets no answer)."""

    reply: JsonObject | None
    commands: list[Command] = field(default_factory=list)
    later: bool = False
    refusal: WeightSyncError | None = None
