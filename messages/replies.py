"""Reply bodies, typed: what the daemon answers and the trainer reads, one msgspec Struct
each, built by the side that answers and decoded once where it arrives (`decode`).

Rules: a body travels as the `ok` message's fields (messages.codec), so it is encoded with
`body()` and decoded with `decode(fields, Type)`: a body that does not match its type is
BAD_MESSAGE, never a KeyError deep in the reader. Fields a newer daemon adds are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from messages.errors import ErrorCode, make_error
from messages.schema import FRAMES
from messages.schema import Json as Json  # where readers import them from
from messages.schema import JsonObject as JsonObject

R = TypeVar("R", bound=msgspec.Struct)

# the key of a status view (and a begin reply) that holds the group plan of the transport
# that needs one (its wire name, kept since protocol v2)
GROUP_KEY = "collective"


class BeginReply(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to `begin`: the sync as the daemon opened it, and the limits the
    trainer's window keeps within."""

    sync_id: str
    version: int
    state: str  # LOADING_BUCKETS (or where a repeated begin found its sync)
    kind: str = "sync"
    transport: str = FRAMES  # what the daemon chose (a transport's name, or "mixed")
    engines: tuple[str, ...] = ()  # the participants
    ref_engines: tuple[str, ...] = msgspec.field(default=(), name="shm_engines")  # read by reference
    via: str = ""  # the "ref" transport those engines read (mixed: the others take frames)
    group: dict[str, Any] | None = msgspec.field(default=None, name="collective")  # the group plan
    stream: bool = False  # a group's stream: engines answer once, with `prepared`
    spool_copy: bool = False  # a group: the trainer also sends the daemon each bucket
    repeated: bool = False  # a repeated begin (its first reply was lost), answered again
    buckets: int = 0
    bytes: int = 0
    acked: int = 0
    started_at: float = 0.0
    trainer_connected: bool = True
    prepared: int = 0
    max_pending: int | None = None  # unanswered bucket requests per source
    fanout_bytes: int | None = None  # per source's share of the fan-out's queue (None: no fan-out)
    # the largest bucket frame the daemon takes in this sync (None: no limit but max_frame_bytes)
    bucket_bytes: int | None = None
    # every participant takes slices: layout key -> each rank's map (`Slices.ranks`); the
    # sender cuts for them (messages/cuts.py). Empty: whole tensors.
    layouts: dict[str, tuple[dict[str, Any], ...]] = {}


class BucketAck(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to `bucket`, once every engine applied it. Cumulative: `through`
    acknowledges every bucket of this source up to that seq (their own replies never come);
    a bucket acknowledged ahead of a gap has none."""

    seq: int
    source: int = 0
    through: int | None = None
    duplicate: bool = False  # a resend of a seq every engine had applied


class RegisterReply(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to an engine's `register`: where it stands and where the daemon is."""

    engine_id: str
    state: str  # the engine's: READY (it holds the served version) or STALE
    daemon_state: str
    version: int | None = None  # the version the daemon serves
    fanout: str | None = None  # where to take published buckets (protocol v4)


class HeartbeatReply(msgspec.Struct, frozen=True, kw_only=True):
    """Sent only when the daemon does not know the engine (silence means known): it
    registers again."""

    known: bool


class EngineFinal(msgspec.Struct, frozen=True, kw_only=True):
    """One participant of a READY sync: what its finalize reported."""

    engine_id: str
    digest: str
    finalize_count: int
    # lists, not tuples: the body a trainer gets back in SyncResult is plain JSON
    probes: list[list[int]]  # the canaries' greedy tokens, per probe
    seconds: float
    phases: dict[str, float]  # where its finalize's time went
    pass_bytes: dict[str, int] = {}  # the bytes a phase's pass went over (checksum: hashed)


class SyncSummary(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An ended sync as `status.last_sync` shows it and the finish's answer starts with;
    optional fields are left out when unset."""

    sync_id: str
    version: int
    status: str  # READY, FAILED, ABORTED, or ROLLED_BACK for the daemon's own rollback
    kind: str  # sync, or rollback
    buckets: int
    bytes: int
    seconds: float
    engine_ids: list[str]  # the participants
    transport: str
    stream: bool = False  # it travelled on a group's stream
    group: str | None = None  # the group, its size and backend
    world_size: int | None = None
    backend: str | None = None


class FinishReply(SyncSummary, frozen=True, kw_only=True, omit_defaults=True):
    """The answer to `finish` (sent when the sync completes READY; a failure is an error),
    and the status's `last_sync` of a READY sync."""

    digest: str  # what every participant holds
    engines: list[EngineFinal]
    # a rollback: the failed sync it repairs, as status's last_sync showed it (its shape
    # depends on how that sync ended, a daemon restart included: left untyped)
    rolled_back_from: dict[str, Any] | None = None


class EngineView(msgspec.Struct, frozen=True, kw_only=True):
    """One engine as `status` shows it (the fields a trainer acts on; the rest is display)."""

    engine_id: str
    state: str  # READY, STALE, LOADING, FINALIZING, JOINING or LOST
    version: int | None = None  # the version it holds (verified only when READY)
    digest: str | None = None
    finalize_count: int = 0
    labels: bool = False  # it labels its outputs (vLLM): serving a version once `label` says it
    label: str | None = None  # the label it set last (None: none yet)
    server_error: str | None = None  # its server (vllm-server) does not answer: why


class StatusReply(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to `status`, as far as a trainer acts on it (`TrainerClient.fleet`): the
    full object is documented JSON for people and tools (docs/PROTOCOL.md), and its
    display-only parts are left out of this type."""

    state: str
    version: int | None = None  # the served version (None: none, or not READY)
    last_ready_version: int | None = None  # the last version the fleet committed
    served_by: int | None = None  # engines serving `version` now (None: an older daemon)
    digest: str | None = None
    dirty: bool = False
    engines: tuple[EngineView, ...] = ()
    min_engines: int = 1
    rollback_pending: bool = False

    def live(self) -> list[EngineView]:
        return [e for e in self.engines if e.state != "LOST"]


def body(reply: msgspec.Struct) -> JsonObject:
    """The fields a reply travels as."""
    out = msgspec.to_builtins(reply)
    if not isinstance(out, dict):
        raise TypeError(f"{type(reply).__name__} is not a struct")
    return out


def decode(fields: Mapping[str, object], cls: type[R]) -> R:
    """The reply `cls` from the fields that arrived; BAD_MESSAGE if they do not match."""
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:
        raise make_error(ErrorCode.BAD_MESSAGE, f"{cls.__name__}: {exc}") from None
