"""The wire schema: one msgspec Struct per message, with each field's constraints beside it.

Rules: this module is the trust boundary's single source of truth. Every id, integer,
string and list a peer can send has an explicit type, range, length or pattern here, and
`messages.codec` checks them once, while decoding MessagePack (`msgspec.msgpack`), so code
past decode never re-checks by hand. New fields get defaults; unknown fields are ignored.
`TYPE` is the header's `type` tag; payload frames are never part of a struct. The field
tables of docs/PROTOCOL.md are made from these (`python -m messages.protocol_doc`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta

from messages.dtypes import Dtype
from messages.errors import ErrorCode
from messages.fields import *  # noqa: F403  # the field types and bounds (re-exported): the constraints are the documentation

# A JSON value: what status views, journal rows and reply bodies are made of.
Json = Union[None, bool, int, float, str, list["Json"], dict[str, "Json"]]
JsonObject = dict[str, Json]

PROTOCOL_VERSION = 8
"""Major version of the wire protocol, checked on every message (independent of the package)."""

REPORT_INTERVAL = 0.002
"""Seconds between two progress reports (`loaded`, cumulative) of one engine."""

DEFAULT_ADDR = "tcp://127.0.0.1:5555"  # the daemon's trainer socket
DEFAULT_ENGINE_ADDR = "tcp://127.0.0.1:5556"  # the daemon's engine socket

# 16 MiB: measured fastest on this project's 2-core host (`python -m bench --bucket-bytes
# 8MiB,16MiB,32MiB,64MiB`): receive buffers past glibc's 32 MiB mmap threshold are fresh
# mappings that page-fault on every bucket, in the daemon and in every engine.
DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024


class _Wire(msgspec.Struct, frozen=True):
    def to_wire(self) -> JsonObject:
        """Plain MessagePack-able data (spool manifests, tests): JSON-shaped (bytes as
        base64; tuples stay tuples, JSON arrays once encoded)."""
        out: JsonObject = msgspec.to_builtins(self)
        return out


PartHash = Annotated[bytes, Meta(min_length=16, max_length=16, description="16 bytes (xxh3-128)")]
PatchKind = Literal["same", "sparse", "xor"]
INDEX32_MAX = 2**31 - 1  # a sparse patch of a tensor up to this many elements has int32 indices


class Patch(_Wire, frozen=True):
    """A delta entry (protocol v3, optional): the entry's bytes patch the engine's base copy
    of the tensor instead of holding it. `same`: no bytes, the tensor is unchanged;
    `sparse`: `count` flat indices (int32, or int64 past 2**31 elements) then `count`
    values; `xor`: zstd of the XOR of the new and the base bytes. `base` and `result` are
    the digest parts (`messages.buckets.Digester`) of the tensor the patch applies to and of
    the one it yields: an engine whose base differs refuses (STALE_BASE), and a rebuild
    that differs fails the sync (CHECKSUM_MISMATCH) before the tensor reaches the model."""

    kind: PatchKind
    base: PartHash
    result: PartHash
    count: Size = 0


# A box of a tensor: one (start, length) per dimension (messages/slices.py)
BoxWire = Annotated[tuple[tuple[Dim, Dim], ...], Meta(min_length=1, max_length=MAX_RANK)]


class TensorMeta(_Wire, frozen=True, omit_defaults=True):
    """One tensor of a bucket. dtype and shape are the full tensor's, also when `patch`
    says the bytes at [offset, offset + nbytes) are a patch of it, or `start` says they are
    a piece of it: bytes [start, start + nbytes) of the full tensor. A tensor larger than a
    bucket travels as pieces, in order, one per bucket, and its receiver assembles it
    before it loads it (protocol v7). `box` (protocol v8, optional): the bytes are that box
    of the full tensor, contiguous (an engine rank's slice, messages/slices.py); with
    `start`, a piece of the box's bytes."""

    name: TensorName
    dtype: Dtype
    shape: Shape
    offset: Size
    nbytes: Size
    patch: Patch | None = None
    start: Size | None = None
    box: BoxWire | None = None


Tensors = Annotated[tuple[TensorMeta, ...], Meta(max_length=MAX_TENSORS_PER_BUCKET)]


class ParamSpec(_Wire, frozen=True):
    """What an engine expects for one checkpoint tensor (sent at register)."""

    name: TensorName
    dtype: Dtype
    shape: Shape


# what one rank loads of one tensor: "whole", or a box
PartWire = Union[Literal["whole"], BoxWire]
LayoutKey = Annotated[str, Meta(max_length=32, pattern=r"^[0-9a-f]{1,32}\Z")]


class Slices(_Wire, frozen=True):
    """What an engine's ranks load of the checkpoint (messages/slices.py): the layout's
    key (one per layout: engines of one layout share it) and the bytes each rank loads.
    `ranks` (each rank's map, name -> part): the engine takes slices, a sender may cut for
    it (an engine that only declares its layout sends none and takes whole tensors)."""

    key: LayoutKey
    rank_bytes: Annotated[tuple[Size, ...], Meta(min_length=1, max_length=MAX_GROUP)]
    ranks: Annotated[
        tuple[Annotated[dict[TensorName, PartWire], Meta(max_length=MAX_SPEC)], ...],
        Meta(max_length=MAX_GROUP),
    ] = ()


class Probe(_Wire, frozen=True):
    """A canary: greedy-decode `max_tokens` after `prompt`; `expected` is the trainer's answer."""

    prompt: Annotated[tuple[TokenId, ...], Meta(min_length=1, max_length=MAX_PROBE_TOKENS)]
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_PROBE_TOKENS)] = 8
    expected: Tokens | None = None


class Ref(_Wire, frozen=True, omit_defaults=True):
    """Where a bucket lies, for a transport that carries references (messages.transports):
    the transport (`via`; "" names the first one, for peers that predate it), the
    segment's name, and the bytes' offset and size in it."""

    name: SegmentName
    offset: Size
    size: Size
    via: Annotated[str, Meta(max_length=32, pattern=r"^([a-z][a-z0-9_-]{0,31})?\Z")] = ""


class CollectiveOffer(_Wire, frozen=True):
    """Trainer -> orchestrator in `begin`: the trainer (rank 0) hosts the group's
    rendezvous store (messages/rendezvous.py) at host:port for as long as its client lives
    (`session`), and can speak `backends`. `token` admits a member to the store; with keys,
    `store_key` is the store's CURVE public key and buckets carry a MAC keyed from `token`."""

    host: Host
    port: Port
    session: Id
    token: StoreToken = ""
    store_key: CurveKey = ""
    backends: Annotated[tuple[Backend, ...], Meta(min_length=1, max_length=2)] = ("gloo",)
    # v3: the trainer frames its broadcasts (messages/stream.py), so engines that can take
    # the stream receive the whole sync without a message from the daemon per bucket
    stream: bool = False


class GroupRef(_Wire, frozen=True):
    """Orchestrator -> engine in each collective `load`: the bucket's bytes arrive by a
    broadcast from rank 0 of group `id`, whose store is at host:port. `rank` is this
    engine's first rank (a vLLM engine's TP worker r is rank + r)."""

    id: Id
    host: Host
    port: Port
    rank: Annotated[int, Meta(ge=1, lt=MAX_GROUP, description=f"1..{MAX_GROUP - 1}")]
    world_size: Annotated[int, Meta(ge=2, le=MAX_GROUP, description=f"2..{MAX_GROUP}")]
    backend: Backend
    timeout: Seconds
    token: StoreToken = ""  # the store's admission secret (from the trainer's offer)
    store_key: CurveKey = ""  # the store's CURVE public key ("" without keys)


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every message: `v` and `type` (the tag) lead each header."""

    TYPE: ClassVar[str] = ""
    PAYLOAD: ClassVar[str] = "none"  # "none" | "bucket" (one frame unless a ref is set)
    v: int = PROTOCOL_VERSION


# -- trainer -> orchestrator ------------------------------------------------------------


class Hello(Message, frozen=True, tag="hello"):
    id: RequestId = 0
    client: Annotated[str, Meta(max_length=256)] = ""


class Begin(Message, frozen=True, tag="begin"):
    sync_id: Id
    version: Version
    id: RequestId = 0
    # A sharded push (v6): `sources` sources each push a disjoint part of one version; this
    # is source `source`. The first source's begin opens the sync; the others' begins join
    # it (the reply names its sync_id, whatever sync_id they proposed).
    sources: SourceCount = 1
    source: SourceIndex = 0
    # the sources' shared assignment (which source sends which tensor), as a hash: every
    # source of one sync must present the same one (a rank that planned otherwise is refused)
    plan: Checksum | None = None
    expected_buckets: Count | None = None
    probes: Annotated[tuple[Probe, ...], Meta(max_length=MAX_PROBES)] = ()
    host: Host = ""  # the trainer's host: engines on it may read buckets from shared memory
    transport: Transport = FRAMES  # "auto": the daemon picks the best every end offers
    # the group this trainer hosts, for a transport that needs one
    offer: CollectiveOffer | None = msgspec.field(default=None, name="collective")
    # a delta sync: its patches apply to this version, which the fleet must serve (else
    # STALE_BASE, and the trainer pushes dense)
    base: Version | None = None
    # the trainer's bucket size: the daemon sizes its fan-out's queues for the window a
    # trainer keeps with it (messages.fanout.window_cap); None: from the first bucket
    bucket_bytes: Size | None = None
    # who begins: a random token the trainer chooses once and carries in its buckets and
    # finish too; a source's seat belongs to the token that began it (None: to the
    # connection that began it)
    seat: Checksum | None = None


class Bucket(Message, frozen=True, tag="bucket"):
    PAYLOAD: ClassVar[str] = "bucket"
    sync_id: Id
    seq: Seq
    tensors: Tensors
    checksum: Checksum
    id: RequestId = 0
    source: SourceIndex = 0
    ref: Ref | None = msgspec.field(default=None, name="shm")  # a "ref" transport's bucket
    # Set on the collective path: the bucket's `size` bytes travel by the group's
    # broadcast; a payload frame comes too only when the daemon spools (begin says so).
    size: Size | None = None
    # collective, with keys: BLAKE3 tag of the broadcast bytes (messages/stream.py load_mac)
    mac: Mac | None = None
    seat: Checksum | None = None  # the token of the begin that took this source's seat


class Finish(Message, frozen=True, tag="finish"):
    sync_id: Id
    buckets: Count
    id: RequestId = 0
    source: SourceIndex = 0
    digest: Digest | None = None
    # True: the trainer sends a subset of the engines' tensors on purpose; otherwise a
    # finish that leaves an engine tensor unsent is INCOMPLETE_SYNC, before any finalize.
    partial: bool = False
    # v3, a collective stream: the chain over the buckets' checksums (messages/stream.py)
    chain: Checksum | None = None
    seat: Checksum | None = None  # the token of the begin that took this source's seat
    # v8, a push cut into slices: per layout key, each rank's digest over the slices of
    # this source's tensors it was sent (messages/slices.py: rank_digests)
    slice_digests: Annotated[
        dict[LayoutKey, Annotated[tuple[Digest, ...], Meta(max_length=MAX_GROUP)]], Meta(max_length=MAX_GROUP)
    ] = {}


class Abort(Message, frozen=True, tag="abort"):
    """Trainer -> orchestrator (give the sync up) and orchestrator -> engine (drop it)."""

    sync_id: Id
    id: RequestId = 0
    reason: Text = ""
    # Trainer -> orchestrator only: the error that made the trainer give up (the sync's
    # failure code in status, metrics and journal; None: ABORTED), and who asked.
    code: ErrorCode | None = None
    by: Literal["trainer", "operator"] = "trainer"


class Status(Message, frozen=True, tag="status"):
    id: RequestId = 0


# -- replies ----------------------------------------------------------------------------


class Ok(Message, frozen=True, tag="ok"):
    """The body's keys travel at the top level of the header (see `codec`)."""

    id: RequestId = 0
    body: dict[str, Any] = {}


class Error(Message, frozen=True, tag="error"):
    code: Annotated[str, Meta(max_length=64)]
    message: LongText
    id: RequestId = 0
    state: Annotated[str, Meta(max_length=64)] | None = None
    version: Version | None = None
    sync_id: Annotated[str, Meta(max_length=MAX_ID_LEN)] | None = None
    details: dict[str, Any] | None = None


# -- engine -> orchestrator -------------------------------------------------------------


class Register(Message, frozen=True, tag="register"):
    engine_id: Id
    backend: Id
    id: RequestId = 0
    model: Text = ""
    transports: Annotated[tuple[Id, ...], Meta(max_length=16)] = (FRAMES,)
    version: Version | None = None
    digest: Digest | None = None
    finalize_count: Count = 0
    pid: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    host: Host = ""
    spec: Annotated[tuple[ParamSpec, ...], Meta(max_length=MAX_SPEC)] = ()
    cast_ok: bool = False
    # Members this engine brings to a collective group (its TP workers); 0: none.
    collective_ranks: Annotated[int, Meta(ge=0, le=MAX_GROUP - 1)] = 0
    collective_backends: Annotated[tuple[Backend, ...], Meta(max_length=2)] = ()
    collective_stream: bool = False  # v3: takes a framed collective stream (messages/stream.py)
    # labels every output with the version it was generated by (vLLM's weight version):
    # the daemon sends it `commit` once every participant finalized, before READY
    labels: bool = False
    # keeps a base copy of the served version's tensors and rebuilds delta patches on it
    delta: bool = False
    # hands the versions it holds to readers (verl's rollout side, engines/holding.py): the
    # daemon sends it `served` once a version it finalized is the daemon's served version
    # (READY written to the journal), and never for a sync that failed
    served_notice: bool = False
    # v4: takes buckets by frame and by reference from the daemon's fan-out (one publish per bucket
    # for the whole fleet); the register reply then names the address (`fanout`)
    fanout: bool = False
    slices: Slices | None = None  # what each of its ranks loads (recorded from its loaders)


class Heartbeat(Message, frozen=True, tag="heartbeat"):
    engine_id: Id
    id: RequestId = 0
    # vllm-server: None while its own server answers its health probe, else why not (unhealthy)
    server_error: Text | None = None


# (v7) a clean stop: out at once; a closed connection without it is lost after --engine-grace
class Goodbye(Message, frozen=True, tag="goodbye"):
    engine_id: Id
    id: RequestId = 0


class Loaded(Message, frozen=True, tag="loaded"):
    """Cumulative progress: every bucket of `source` up to `seq` is applied (-1: none
    yet), and so are the buckets in `also` (applied ahead of a gap, e.g. out of order)."""

    sync_id: Id
    seq: Annotated[int, Meta(ge=-1, le=2**31 - 1, description="-1..2**31-1")]
    id: RequestId = 0
    source: SourceIndex = 0
    seconds: Seconds = 0.0  # apply time of the `count` buckets this report newly covers
    also: Annotated[tuple[Seq, ...], Meta(max_length=MAX_ALSO)] = ()
    count: Count = 0  # buckets applied since the engine's previous report (metrics)
    # v6, a sharded push: other sources' cumulative marks in the same report, [source, seq]
    # each (every bucket of that source up to seq applied), so an engine's report costs one
    # message however many sources the sync has
    more: Annotated[tuple[tuple[SourceIndex, Seq], ...], Meta(max_length=MAX_SOURCES)] = ()


class Finalized(Message, frozen=True, tag="finalized"):
    sync_id: Id
    version: Version
    digest: Digest
    id: RequestId = 0
    finalize_count: Count = 0
    probes: Annotated[tuple[Tokens, ...], Meta(max_length=MAX_PROBES)] = ()
    seconds: Seconds = 0.0
    # where this engine's time went during the sync (begin, checksum, load, finalize, ...)
    phases: Annotated[dict[PhaseName, Seconds], Meta(max_length=MAX_PHASES)] = {}
    # the bytes a phase's pass went over, counted where it ran (checksum: bytes hashed)
    pass_bytes: Annotated[dict[PhaseName, Size], Meta(max_length=MAX_PHASES)] = {}
    # it holds a base copy of what it now serves (a delta may follow); None: unchanged
    # since it registered. A collective sync its own workers received leaves it none.
    delta: bool | None = None
    # an engine that takes slices: each rank's digest over the parts it holds, and the
    # bytes each rank was handed in this sync
    rank_digests: Annotated[tuple[Digest, ...], Meta(max_length=MAX_GROUP)] = ()
    rank_received: Annotated[tuple[Size, ...], Meta(max_length=MAX_GROUP)] = ()


class Prepared(Message, frozen=True, tag="prepared"):
    """v3, engine -> orchestrator once per collective stream: every bucket arrived, was
    verified and applied (phase one of the commit). `chain` is the checksum over the
    buckets' checksums in order, `digest` that of the weights now held (before the
    post-load step), when the engine can tell it before finalize."""

    sync_id: Id
    buckets: Count
    nbytes: Size
    chain: Checksum
    id: RequestId = 0
    digest: Digest | None = None
    seconds: Seconds = 0.0


class Committed(Message, frozen=True, tag="committed"):
    """Engine -> orchestrator after `commit`: from now on every output it generates carries
    `label` (the committed version, as text)."""

    sync_id: Id
    version: Version
    label: Label
    id: RequestId = 0


class Failed(Message, frozen=True, tag="failed"):
    sync_id: Annotated[str, Meta(max_length=MAX_ID_LEN)]  # "" when no sync applies
    code: Annotated[str, Meta(max_length=64)]
    message: Text
    id: RequestId = 0
    seq: Seq | None = None
    source: SourceIndex | None = None
    duplicate: bool = False
    peer: bool = False  # a group receive failed because another member failed or left


# -- orchestrator -> engine -------------------------------------------------------------


class Load(Message, frozen=True, tag="load"):
    PAYLOAD: ClassVar[str] = "bucket"
    sync_id: Id
    version: Version
    seq: Seq
    tensors: Tensors
    checksum: Checksum
    id: RequestId = 0
    source: SourceIndex = 0
    ref: Ref | None = msgspec.field(default=None, name="shm")  # a "ref" transport's bucket
    group: GroupRef | None = None  # collective: receive `size` bytes by broadcast
    size: Size | None = None
    mac: Mac | None = None  # collective, with keys: the trainer's tag of those bytes
    # a replay (rollback, catch-up) of a version kept as base + deltas: later buckets of
    # this sync patch what this one loads, so an engine without a base keeps it meanwhile
    hold: bool = False
    # a replay of a version cut into slices: the layout keys its boxes were cut for (an
    # engine of another layout assembles whole tensors from them)
    cut_for: Annotated[tuple[LayoutKey, ...], Meta(max_length=MAX_GROUP)] = ()


class OpenStream(Message, frozen=True, tag="stream"):
    """v3, orchestrator -> engine once per sync on the collective stream: join `group` and
    receive the trainer's framed buckets until its END header, then answer `prepared`."""

    sync_id: Id
    version: Version
    group: GroupRef
    id: RequestId = 0


class FanoutOpen(Message, frozen=True, tag="fanout"):
    """v4, orchestrator -> engines on the fan-out, the first message of a sync there: who
    takes this sync's published buckets, by frame (bytes attached) or by reference. An
    engine named in neither takes none of them (it gets its buckets one by one, if any)."""

    sync_id: Id
    version: Version
    # who takes frames (bytes attached), who reads the references
    frames: Annotated[tuple[Id, ...], Meta(max_length=MAX_FLEET)] = msgspec.field(default=(), name="inline")
    refs: Annotated[tuple[Id, ...], Meta(max_length=MAX_FLEET)] = msgspec.field(default=(), name="shm")
    # seconds between two progress reports of one engine during this sync: longer for a
    # larger fleet, so that the daemon's report load stays bounded
    report_interval: Annotated[float, Meta(ge=REPORT_INTERVAL, le=1.0)] = REPORT_INTERVAL
    id: RequestId = 0


class Finalize(Message, frozen=True, tag="finalize"):
    sync_id: Id
    version: Version
    id: RequestId = 0
    probes: Annotated[tuple[Probe, ...], Meta(max_length=MAX_PROBES)] = ()
    # v8: the version's digest when the daemon knows it (an engine whose ranks hold only
    # slices reports it; the daemon checks each rank's digest instead)
    digest: Digest | None = None


class Commit(Message, frozen=True, tag="commit"):
    """Orchestrator -> a labelling engine, once every participant of the sync finalized
    (the version is committed fleet-wide): label what it generates from now on `version`."""

    sync_id: Id
    version: Version
    id: RequestId = 0


class Served(Message, frozen=True, tag="served"):
    """Orchestrator -> an engine that registered `served_notice`, after the daemon's READY
    for `version` is durable (journal row and spool written): `version` with `digest` is
    the served version now. Sent once per READY sync to each such participant, and to such
    an engine that comes to serve the served version later (a catch-up's finalize, a
    register with the served version and digest). An engine acts on it only if it holds
    exactly that version and digest."""

    version: Version
    digest: Digest
    sync_id: Annotated[str, Meta(max_length=MAX_ID_LEN)] = ""  # the sync that made it served, if any
    id: RequestId = 0


MESSAGE_TYPES: dict[str, type[Message]] = {}
for _cls in (
    Hello,
    Begin,
    Bucket,
    Finish,
    Abort,
    Status,
    Ok,
    Error,
    Register,
    Heartbeat,
    Goodbye,
    Loaded,
    Finalized,
    Failed,
    Prepared,
    Committed,
    Load,
    OpenStream,
    FanoutOpen,
    Finalize,
    Commit,
    Served,
):
    _cls.TYPE = str(_cls.__struct_config__.tag)  # the header's `type`, for code that reads TYPE
    MESSAGE_TYPES[_cls.TYPE] = _cls
del _cls

# What each receiver accepts, by header `type` (the codec refuses any other): the wire's
# directions, named once here for the daemon, the engines, the trainer and the fan-out.
FROM_TRAINER = ("hello", "begin", "bucket", "finish", "abort", "status")
FROM_ENGINE = ("register", "heartbeat", "goodbye", "loaded", "prepared", "finalized", "committed", "failed")
TO_ENGINE = ("load", "stream", "finalize", "commit", "served", "abort", "ok", "error")
TO_TRAINER = ("ok", "error")
PUBLISHED = ("fanout", "load")  # what the fan-out carries
