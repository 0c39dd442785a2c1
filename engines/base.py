"""The `Engine` protocol (docs/ARCHITECTURE.md, engines): what the worker loop drives.

Rules: `load` validates every tensor of a bucket (name, shape, dtype) before it touches a
parameter, then copies in place (parameter storage and `data_ptr` stay the same), and
raises a `DataError` (UNKNOWN_TENSOR / SHAPE_MISMATCH) with nothing applied. `finalize`
is the backend's post-load step and is NOT idempotent, exactly like vLLM's
`process_weights_after_loading`; the worker guarantees it runs once per sync. `begin`
prepares a new sync (undoes what finalize did to the checkpoint-format weights).
Optional capabilities are protocols of their own, checked with isinstance by the
applier: `LoadsBuckets` (takes the received bucket as is: the vLLM engine hands it to
its workers by reference or through shared memory, without unpacking), `LoadsRefs` (its
workers read the trainer's slot), `ReceivesGroup` (receives a group's bucket
itself: the vLLM engine's workers each join the group and receive inside vLLM, posting
the next bucket's receive before loading this one), `TakesDigestParts` (the engine
process hashes each bucket once, for checksum and digest) and `ReportsPhases`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Required, TypedDict, runtime_checkable

import torch

from messages.dtypes import dtype_name
from messages.errors import make_error
from messages.schema import ParamSpec, Probe, Ref, Slices, TensorMeta
from messages.slices import Part
from messages.specs import spec_refusal

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from messages.replies import JsonObject


@dataclass(frozen=True, slots=True)
class EngineInfo:
    backend: str
    model: str
    spec: tuple[ParamSpec, ...]
    transports: tuple[str, ...] | None = None  # None: every transport registered (messages.transports)
    cast_ok: bool = False
    collective_ranks: int = 1  # group members it brings (a vLLM engine: one per TP/PP worker)
    extra: JsonObject = field(default_factory=dict)  # backend details, JSON-shaped
    slices: Slices | None = None  # what each of its ranks loads (messages/slices.py), if it knows


class EngineOptions(TypedDict, total=False):
    """What `weightsync engine` hands a backend's `make_engine`
    (engines.worker.ENGINE_FACTORIES); each backend reads the options it knows."""

    model: Required[str]  # the checkpoint directory
    threads: int | None  # torch: intra-op threads
    tp: int  # torch: tensor-parallel ranks (engines.torch_engine: vLLM's Llama partition)
    vllm_mp: bool  # vllm: V1 multiprocessing
    vllm_slices: bool  # vllm: its workers take slices (engines/vllm/base.py)
    llm_args: JsonObject  # vllm: keyword arguments of vllm.LLM (--vllm-arg, parsed as JSON)
    url: str | None  # vllm-server: the server's base URL
    pause_mode: str  # vllm-server: keep | wait | abort
    collective_host: str  # this host's address for a group's sockets
    lora_rank: int
    lora_targets: list[str]


@runtime_checkable
class Engine(Protocol):
    finalize_count: int

    def describe(self) -> EngineInfo: ...

    def begin(self, sync_id: str, version: int) -> None: ...

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None: ...

    def finalize(self, sync_id: str) -> str:
        """Run the post-load step once; return the digest of the weights now held."""
        ...

    def digest(self) -> str: ...

    def probe(self, probes: Sequence[Probe]) -> tuple[tuple[int, ...], ...]: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


def validate_bucket(
    spec: dict[str, ParamSpec], tensors: Sequence[tuple[str, torch.Tensor]], *, cast_ok: bool = False
) -> None:
    """Raise UNKNOWN_TENSOR / SHAPE_MISMATCH for the first tensor `spec` would refuse
    (messages.specs.spec_refusal: the daemon's rule too)."""
    for name, t in tensors:
        refused = spec_refusal(spec, name, dtype_name(t.dtype), tuple(t.shape), cast_ok)
        if refused is not None:
            code, why = refused
            raise make_error(code, f"this model: {why}", details={"tensor": name})


Parts = dict[str, bytes] | None  # per-tensor digest parts from `engines.verify`


@runtime_checkable
class LoadsBuckets(Protocol):
    def load_bucket(self, metas: Sequence[TensorMeta], buf: Buffer, parts: Parts = None) -> None: ...


@runtime_checkable
class LoadsRefs(Protocol):
    def load_ref(
        self, metas: Sequence[TensorMeta], ref: Ref, bucket_checksum: int, parts: Parts = None
    ) -> None: ...


@runtime_checkable
class ReceivesGroup(Protocol):
    def load_group(
        self,
        metas: Sequence[TensorMeta],
        group: JsonObject,  # the group's wire form (`GroupRef.to_wire()`)
        size: int,
        bucket_checksum: int,
        bind: str,
        seq: int | None = None,
        next_bucket: dict[str, int] | None = None,
        mac: tuple[str, int, str] | None = None,
    ) -> None: ...

    def close_group(self) -> None: ...


@runtime_checkable
class TakesSlices(Protocol):
    """Its ranks take slices (it declared `EngineInfo.slices` with each rank's map): every
    tensor of a bucket comes to `load_parts` with its part (`messages.slices`: WHOLE, whose
    view has the full shape, or a box, whose view has the box's); each rank takes what its
    map says of it (cutting its box from a whole tensor). After the post-load step it
    tells each rank's digest over the parts it holds (`messages.cuts.part_digest`) and the
    bytes each rank was handed since `begin`."""

    def load_parts(self, items: Sequence[tuple[str, Part, torch.Tensor]]) -> None: ...

    def rank_report(self) -> tuple[tuple[str, ...], tuple[int, ...]]: ...

    def expect_digest(self, digest: str | None) -> None:
        """The version's digest, as the daemon's `finalize` says it (None: not known), before
        `finalize`: an engine whose ranks hold only slices cannot compute it, and reports it."""
        ...


@runtime_checkable
class TakesDigestParts(Protocol):
    """Its digest is kept elsewhere (vLLM: the workers): the engine process hands each
    bucket's per-tensor digest parts along instead of the workers hashing again."""

    digest_parts: bool


@runtime_checkable
class RehashesWeights(Protocol):
    """Can tell the digest of the weights it holds now, read again from their storage (in
    checkpoint layout, whatever layout its post-load step left them in), not the digest
    its last finalize recorded: a check that what it serves is what it reported."""

    def fresh_digest(self) -> str: ...


@runtime_checkable
class ReportsPhases(Protocol):
    @property
    def last_phases(self) -> dict[str, float]: ...


@runtime_checkable
class LabelsOutputs(Protocol):
    """Labels every output with the weight version that generated it (vLLM's weight
    version: spans on each finished output). The daemon tells it the version at commit,
    once every participant finalized, so no output carries an uncommitted label."""

    def set_label(self, label: str) -> str:
        """Label what it generates from now on; return the label its outputs now carry."""
        ...


@runtime_checkable
class DropsWeights(Protocol):
    """Fault injection (`--failpoint drop_weights_after=N`): loses the weights it holds
    without knowing it, as a vLLM server does that slept at level 2 and woke without a
    reload (its recorded digest and version stay what they were)."""

    def drop_weights(self) -> None: ...


@runtime_checkable
class HandsToReaders(Protocol):
    """Hands the versions it holds to readers in its own process (verl's rollout side:
    `engines.holding`). The daemon tells it `served` once a version it finalized is the
    daemon's served version (READY written to the journal); it never hears of a version
    whose sync failed, and an abort withdraws what it was loading."""

    def serve(self, version: int, digest: str) -> bool:
        """`version` with `digest` is served now: offer it if that is what it holds;
        whether it did."""
        ...


@runtime_checkable
class ChecksHealth(Protocol):
    """Serves through a process of its own (a vLLM server it attached to): `health()`
    asks that process whether it answers, and the worker's heartbeats carry the answer, so
    the daemon sees a dead server between syncs. Called on a thread of its own (it may
    block up to its own bound), never on the worker's loop or the applier."""

    def health(self) -> str | None:
        """None when the server answers; else why not, in one line."""
        ...


@runtime_checkable
class DigestsBeforeFinalize(Protocol):
    """Can tell the digest of the weights it holds before its post-load step (the same
    digest `finalize` returns), so the daemon compares digests in phase one of the
    commit, before any engine finalizes."""

    def prepare_digest(self) -> str: ...
