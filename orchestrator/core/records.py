"""What the core keeps about engines, syncs, the spool and its limits: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from messages import transports
from messages.checksums import DIGEST_SCHEME, add_digests
from messages.errors import WeightSyncError
from messages.replies import GROUP_KEY, Json, JsonObject
from messages.schema import Backend, Finalized, ParamSpec, Prepared, Probe
from orchestrator.core.states import EngineState
from orchestrator.core.table import Life, engine_move


@dataclass(slots=True)
class Epoch:
    """One per core, shared by its engine records: bumped whenever one is made or changes
    state. A sync's cache of its live participants is good while the count it was made at
    holds (it only grows, so a stale cache is never taken for a fresh one)."""

    value: int = 0


@dataclass(eq=False, slots=True)
class EngineRecord:
    engine_id: str
    backend: str
    model: str = ""
    host: str = ""
    pid: int | None = None
    transports: tuple[str, ...] = (transports.FRAMES,)
    state: EngineState = EngineState.STALE
    version: int | None = None
    digest: str | None = None
    finalize_count: int = 0
    last_seen: float = 0.0
    closed: bool = False  # its connection closed since its last heartbeat
    goodbye: bool = False  # it said it stops (out at once; a closed connection has a grace)
    lost_at: float | None = None  # when it was counted LOST (its record goes lost_expiry later)
    spec: dict[str, ParamSpec] = field(default_factory=dict)
    cast_ok: bool = False
    probes: tuple[tuple[int, ...], ...] = ()
    collective_ranks: int = 0  # members it brings to a group (0: cannot join)
    collective_backends: tuple[str, ...] = ()
    collective_stream: bool = False  # takes the framed group stream (protocol v3)
    labels: bool = False  # labels its outputs with the version (told at commit)
    label: str | None = None  # the label it reported last (None: none set by us)
    delta: bool = False  # keeps a base copy: takes delta patches against the served version
    served_notice: bool = False  # hands versions to readers: told `served` once one is durable
    slices: JsonObject | None = None  # what each of its ranks loads: {key, rank_bytes} (register)
    # it takes slices: each rank's map (`Slices.ranks`, wire form), which senders cut for
    layout: tuple[dict[str, Any], ...] = ()
    # its last heartbeat said its server (vllm-server) does not answer, and why; None: it
    # answers, or the engine has no server of its own. Not a lifecycle state: the engine
    # process is live and keeps its record; `serves` leaves it out.
    server_error: str | None = None
    epoch: Epoch = field(default_factory=Epoch, repr=False, compare=False)  # its core's

    def __post_init__(self) -> None:
        self.epoch.value += 1

    def move(self, move: Life) -> None:
        """Its lifecycle (core.table.ENGINE_ROWS); a move outside it is INTERNAL."""
        self.state = engine_move(self.state, move)
        self.epoch.value += 1

    def view(self) -> JsonObject:
        return {
            "engine_id": self.engine_id,
            "backend": self.backend,
            "state": self.state.value,
            "version": self.version,
            "digest": self.digest,
            "finalize_count": self.finalize_count,
            "model": self.model,
            "host": self.host,
            "pid": self.pid,
            "transports": list(self.transports),
            "collective_ranks": self.collective_ranks,
            "labels": self.labels,  # it labels outputs: served once `label` says the version
            **({"label": self.label} if self.labels else {}),
            "delta": self.delta,
            "server_error": self.server_error,
            **({"slices": self.slices} if self.slices is not None else {}),
        }

    def serves(self, version: int | None) -> bool:
        """Whether it serves `version` now: READY at it, and its server (if any) answers."""
        return (
            version is not None
            and self.state is EngineState.READY
            and self.version == version
            and self.server_error is None
        )


@dataclass(frozen=True, slots=True)
class GroupRecord:
    """The group of a trainer session and a set of engines: reused while both
    stay the same, replaced (a new id) when an engine joins or is lost, or a sync on it
    fails. Rank 0 is the trainer; each engine holds `ranks` consecutive ranks."""

    id: str
    session: str
    host: str  # the trainer's store
    port: int
    backend: Backend
    members: tuple[tuple[str, int, int], ...]  # (engine_id, first rank, ranks)
    timeout: float
    token: str = field(default="", repr=False)  # the store's admission secret: never shown
    store_key: str = ""  # the store's CURVE public key ("" without keys)

    @property
    def world_size(self) -> int:
        return 1 + sum(n for _, _, n in self.members)

    def rank_of(self, engine_id: str) -> int:
        return next(r for eid, r, _ in self.members if eid == engine_id)

    def view(self) -> JsonObject:
        return {
            "group": self.id,
            "backend": self.backend,
            "world_size": self.world_size,
            "store": f"{self.host}:{self.port}",
            "timeout_s": self.timeout,
            "members": {eid: {"rank": r, "ranks": n} for eid, r, n in self.members},
        }


@dataclass(slots=True)
class BucketRecord:
    nbytes: int
    forwarded_at: float
    checksum: int = 0  # as first sent: a resend must carry the same (the same bytes)
    acked_by: set[str] = field(default_factory=set)
    done: bool = False


@dataclass(slots=True)
class SyncRecord:
    sync_id: str
    version: int
    sources: int
    expected_buckets: int | None
    probes: tuple[Probe, ...]
    participants: tuple[str, ...]
    started_at: float
    last_activity: float
    # the largest bucket frame of this sync (the opener's size within what the fan-out's
    # queue holds: messages.fanout.max_bucket); None: none passes the daemon (a broadcast)
    bucket_bytes: int | None = None
    buckets: dict[tuple[int, int], BucketRecord] = field(default_factory=dict)
    # (engine_id, source) -> highest seq the engine applied every bucket through
    through: dict[tuple[str, int], int] = field(default_factory=dict)
    acked_through: dict[int, int] = field(default_factory=dict)  # source -> every seq up to it acked
    finished: dict[int, int] = field(default_factory=dict)
    expected_digest: str | None = None
    finalize_sent: set[str] = field(default_factory=set)
    finalized: dict[str, Finalized] = field(default_factory=dict)
    finalize_started: float | None = None
    commit_sent: bool = False  # every participant finalized: labelling engines told `commit`
    committed: set[str] = field(default_factory=set)  # labelling engines that set the label
    nbytes: int = 0
    # How its bytes travel (messages.transports): the transport's name and what it carries;
    # with a "ref" transport (`via`), the engines that read the references, and `mixed`:
    # the others take frames the daemon cuts from them
    transport: str = transports.FRAMES
    carries: str = "frame"
    via: str = ""
    ref_engines: tuple[str, ...] = ()
    mixed: bool = False
    group: GroupRecord | None = None  # the group this sync's bytes are broadcast in
    groups: dict[int, GroupRecord] = field(default_factory=dict)  # each source's (a sharded push)
    kind: str = "sync"  # "sync" (a trainer's) | "rollback" (the daemon replays its spool)
    rollback_of: JsonObject | None = None  # the failed sync a rollback repairs
    error: WeightSyncError | None = None  # why it failed (set as it closes)
    # tensor name -> the source (source) that sent it: completeness over the union of the
    # sources, and a tensor two sources send is refused (DUPLICATE_TENSOR)
    names: dict[str, int] = field(default_factory=dict)
    # tensor name -> the parts of it sent: its boxes, None for the whole (per-rank coverage)
    parts: dict[str, set[tuple[tuple[int, int], ...] | None]] = field(default_factory=dict)
    # Sources (a sharded push has `sources` of them; a plain push one, source 0): when each
    # began, when each was last heard, whose connection closed (its grace running), and
    # each one's digest over its own tensors (added up into the version's at the last finish)
    begun: dict[int, float] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)
    lost: dict[int, float] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    # a push cut into slices: source -> {layout key: each rank's digest over its tensors}
    slice_digests: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    # source -> who holds its seat: ("seat", the begin's token) or ("conn", the connection
    # that began it without one). Only the holder's begin, buckets and finish are taken.
    seats: dict[int, tuple[str, object]] = field(default_factory=dict)
    plan: int | None = None  # the sources' assignment (a hash every source's begin carries)
    host: str = ""  # the opening source's host: the one its shared memory was planned for
    # The group's stream (protocol v3): engines receive every bucket from the trainer
    # and answer once with `prepared`; the daemon sees no bucket of it (unless it spools).
    stream: bool = False
    prepared: dict[str, Prepared] = field(default_factory=dict)
    members: frozenset[str] = field(init=False)  # the participants, for membership tests
    forwarded: dict[int, int] = field(default_factory=dict)  # source -> every seq up to it forwarded
    # engines whose group receive failed because another member failed or left (a closed
    # connection): engine id -> (when, what it said); the culprit is looked for first
    peer_faults: dict[str, tuple[float, str]] = field(default_factory=dict)
    low: dict[int, int] = field(default_factory=dict)  # source -> the lowest live engine's mark
    _marks: dict[int, dict[int, int]] = field(default_factory=dict)  # source -> {mark: engines}
    _marks_at: int = field(init=False, default=-1)  # the Epoch `_marks` was counted at
    _alive: tuple[tuple[str, ...], frozenset[str]] = field(init=False)
    _alive_at: int = field(init=False, default=-1)  # the Epoch `_alive` was made at

    def __post_init__(self) -> None:
        self.members = frozenset(self.participants)

    def marks(self, source: int, alive: frozenset[str], epoch: Epoch) -> tuple[dict[int, int], int]:
        """How many live participants stand at each of `source`'s marks (every bucket up
        to it applied; -1: none), and the lowest mark the buckets are done through. Counted
        again only after an engine changed (Epoch); a lowest mark never moves down."""
        if self._marks_at != epoch.value:
            self._marks, self._marks_at = {}, epoch.value
        counts = self._marks.get(source)
        low = self.low.get(source, -1)
        if counts is None:
            counts = self._marks[source] = {}
            for x in alive:
                k = self.through.get((x, source), -1)
                counts[k] = counts.get(k, 0) + 1
            low = max(low, min(counts, default=low))
        return counts, low

    def alive(self, engines: dict[str, EngineRecord], epoch: Epoch) -> tuple[tuple[str, ...], frozenset[str]]:
        """The participants not lost, in order and as a set: made again only after an
        engine changed (Epoch), so a fleet's per-bucket and per-report work stays O(1)."""
        if self._alive_at != epoch.value:
            live = tuple(x for x in self.participants if engines[x].state != EngineState.LOST)
            self._alive, self._alive_at = (live, frozenset(live)), epoch.value
        return self._alive

    chain: int | None = None  # the trainer's, from its finish
    finished_at: float | None = None  # when the last source finished (the prepare deadline runs)

    def heard(self, source: int, now: float) -> None:
        """A message of source `source`: it is alive (its grace, if running, ends)."""
        self.last_activity = self.seen[source] = now
        self.lost.pop(source, None)

    @property
    def trainer_lost_at(self) -> float | None:
        """When the first source whose connection closed lost it (None: all connected)."""
        return min(self.lost.values()) if self.lost else None

    @property
    def shown(self) -> str:
        """The transport as replies and status name it ("mixed": references and frames)."""
        return "mixed" if self.mixed else self.transport

    def sources_view(self) -> list[Json]:
        """Each source of the sync and its progress (status: `sync.sources`)."""
        sent: dict[int, list[int]] = {}
        for (k, _), b in self.buckets.items():
            row = sent.setdefault(k, [0, 0, 0])
            row[0] += 1
            row[1] += b.nbytes
            row[2] += b.done
        out: list[Json] = []
        for k in range(self.sources):
            buckets, nbytes, acked = sent.get(k, [0, 0, 0])
            out.append(
                {
                    "source": k,
                    "begun": k in self.begun,
                    "buckets": buckets,
                    "bytes": nbytes,
                    "acked": acked,
                    "finished": k in self.finished,
                    "connected": k not in self.lost,
                }
            )
        return out

    @property
    def bucket_count(self) -> int:
        """Buckets this sync moved: the daemon's own count, or on the group's stream
        (which the daemon does not see) what the engines prepared."""
        if self.stream and self.prepared:
            return max(p.buckets for p in self.prepared.values())
        return len(self.buckets)

    @property
    def byte_count(self) -> int:
        if self.stream and self.prepared:
            return max(p.nbytes for p in self.prepared.values())
        return self.nbytes

    def view(self) -> JsonObject:
        return {
            "sync_id": self.sync_id,
            "version": self.version,
            "kind": self.kind,
            "buckets": self.bucket_count,
            "bytes": self.byte_count,
            "acked": sum(1 for b in self.buckets.values() if b.done),
            "engines": list(self.participants),
            "transport": self.shown,
            "shm_engines": list(self.ref_engines),
            "started_at": self.started_at,
            GROUP_KEY: self.group.view() if self.group else None,
            "trainer_connected": self.trainer_lost_at is None,
            **({"stream": True, "prepared": len(self.prepared)} if self.stream else {}),
            **({"source_count": self.sources, "sources": self.sources_view()} if self.sources > 1 else {}),
        }

    def rank_digests(self) -> dict[str, tuple[str, ...]]:
        """A push cut into slices: per layout key, each rank's digest, the sources' added up
        (empty until every source finished, or when the push was not cut)."""
        if not self.slice_digests or len(self.slice_digests) < max(1, self.sources):
            return {}
        keys = set.intersection(*(set(d) for d in self.slice_digests.values()))
        return {
            key: tuple(
                add_digests(r) for r in zip(*(d[key] for d in self.slice_digests.values()), strict=True)
            )
            for key in sorted(keys)
        }


@dataclass(frozen=True, slots=True)
class Spooled:
    """What the daemon's spool holds (set by the service; None without a spool)."""

    version: int
    digest: str
    buckets: int
    probes: tuple[Probe, ...] = ()  # the version's canaries: replayed by a rollback or catch-up
    chain: int = 0  # delta versions on top of the last dense one (replayed in order)
    scheme: str = DIGEST_SCHEME  # what made `digest` (messages.checksums): replayed only if ours
    # a version cut into slices: per layout key, each rank's digest (checked on replay)
    slice_digests: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class CatchUp:
    """One engine being brought to the served version from the spool."""

    sync_id: str
    version: int
    total: int
    last_progress: float
    through: dict[int, int] = field(default_factory=dict)  # source -> highest seq applied
    sent: int = 0  # spooled buckets sent so far (seqs 0..sent-1; the spool's source is 0)
    finalize_sent: bool = False

    @property
    def applied(self) -> int:
        return sum(t + 1 for t in self.through.values())


@dataclass(frozen=True, slots=True)
class Limits:
    min_engines: int = 1
    engine_timeout: float = 15.0
    sync_timeout: float = 300.0
    bucket_timeout: float = 300.0
    finalize_timeout: float = 600.0
    history: int = 50
    trainer_grace: float = 2.0  # seconds a sync outlives its trainer's closed connection
    engine_grace: float = 2.0  # seconds an engine outlives its closed connection (no goodbye)
    # seconds past engine_grace a group member's report of a failed peer waits for the
    # culprit to be counted lost before the reporters are named
    peer_fault_slack: float = 1.0
    host: str = ""  # this daemon's host (it can read a trainer's shared memory if equal)
    spool: bool = False  # the service keeps the last READY version on disk
    max_frame_bytes: int = 4 * 1024**3  # one bucket's bytes
    max_pending: int = 64  # unanswered bucket requests per trainer connection
    fanout_bytes: int | None = None  # the fan-out's per-connection queue budget (None: no fan-out)
    max_delta_chain: int = 16  # delta versions the spool replays on top of a dense one
    recovery_window: int = 2  # spooled buckets a catch-up (or rollback) has in flight
    lost_expiry: float = 3600.0  # seconds a LOST engine's record is kept before it is forgotten

    def pending_per_source(self, sources: int) -> int:
        """Unanswered bucket requests each of a sync's `sources` connections may have:
        they share `max_pending` (and the fan-out's queue)."""
        return max(1, self.max_pending // max(1, sources))
