"""The vLLM worker extension (`worker_extension_cls`): runs inside every vLLM worker, on
every TP rank, via `collective_rpc`.

Rules:
- Every argument is a JSON string (so the same methods serve `LLM.collective_rpc`,
  multiprocessing workers, and the OpenAI server's `/collective_rpc`, which only passes
  strings). Tensor bytes never travel as arguments: a bucket lies in shared memory and
  the descriptor names the segment; each worker views it itself (no copy until
  `load_weights` copies into parameters).
- One reload per sync: `ws_begin` starts vLLM's layerwise reload, `ws_load` feeds buckets
  to `model.load_weights`, `ws_finalize` finalizes once (layerwise finalize where vLLM has
  it, `process_weights_after_loading` otherwise). A second `ws_finalize` for the same
  sync is refused here too, independently of the engine worker and the orchestrator.
- The digest is over the checkpoint-format tensors received and applied (vLLM repacks
  into its own layout); the canary probes prove the internal state.
- A sync that takes slices (`ws_begin` with `slices`, after `ws_slices` recorded this
  rank's map) loads only this rank's boxes (engines/vllm/loading.py), and the digest is
  this rank's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, Required, TypeAlias, TypedDict

import torch

from engines.vllm.loading import TensorWire, box_of, load_into
from messages import transports
from messages.buckets import Digester, hash_bucket
from messages.checksums import bucket_checksum
from messages.distgroup import Member
from messages.dtypes import DTYPES
from messages.schema import Ref, TensorMeta
from messages.segments import frombuffer
from messages.slices import Part

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from messages.distgroup import Posted
    from messages.replies import Json, JsonObject


# -- the rpc arguments (JSON strings, decoded here) and answers (JSON-like dicts) --------
class RefWire(TypedDict):
    """A reference (`Ref.to_wire()`; `via` left out when it is the first transport)."""

    name: str
    offset: int
    size: int
    via: NotRequired[str]


# With keys: [key hex, source, tag hex] (engines.vllm.base.load_group): a JSON array of a
# str, an int and a str, which no list type spells.
MacWire: TypeAlias = "list[Any]"


class SyncArg(TypedDict):
    sync_id: str


class BeginArg(SyncArg):
    version: int
    slices: NotRequired[bool]  # this sync takes slices (its buckets may hold boxes)


class LoadArg(SyncArg):
    """`ws_load`: the bucket by reference (`ref`) or as the engine's frame (`local`)."""

    tensors: list[TensorWire]
    ref: NotRequired[RefWire]
    local: NotRequired[str | None]
    checksum: NotRequired[int | None]  # null: the engine process verified the bytes
    parts: NotRequired[dict[str, str] | None]  # tensor -> digest part, hex


class NextBucket(TypedDict):
    seq: int
    size: int


class GroupLoadArg(SyncArg):
    """`ws_group_load`: a bucket this worker receives by broadcast."""

    group: JsonObject  # the group's wire form (`GroupRef.to_wire()`)
    size: int
    checksum: int
    tensors: list[TensorWire]
    bind: NotRequired[str]
    seq: NotRequired[int | None]
    next: NotRequired[NextBucket | None]
    mac: NotRequired[MacWire | None]


class UnsafeLoadArg(TypedDict):
    ref: RefWire
    tensors: list[TensorWire]


class WorkerInfo(TypedDict):
    """`ws_info` (and `ws_begin`, `ws_abort`): this worker's reload."""

    sync_id: str | None
    version: int | None
    reloading: bool
    finalize_count: int
    digest: str | None
    rank: int
    mode: str | None
    loaded: int
    kept: int
    received: int  # bytes of the entries this rank took in this sync


class FinalizeAnswer(WorkerInfo):
    duplicate: bool
    seconds: NotRequired[float]


class FailureWire(TypedDict):
    code: str  # an ErrorCode value
    message: str


class LoadAnswer(TypedDict, total=False):
    """A load rpc's answer (engines.vllm.base.WorkerLoad): what loaded, or the refusal."""

    loaded: int
    seconds: float
    phases: dict[str, float]
    error: FailureWire


class TransferInfo(TypedDict):
    """What the weight-transfer backend holds (engines.vllm.transfer)."""

    digest: str | None
    finalize_count: int
    loaded: int
    seconds: float
    backend: str


class NativeInfo(TypedDict, total=False):
    """`ws_native_info`: whether the weight-transfer backend runs, and then what it holds."""

    native: Required[bool]
    digest: str | None
    finalize_count: int
    loaded: int
    seconds: float
    backend: str


class _ModelRunner(Protocol):
    """What the extension uses of vLLM's model runner."""

    def get_model(self) -> torch.nn.Module: ...


class _VllmConfig(Protocol):
    """What the extension uses of vLLM's config: handed back to vLLM's loaders."""

    model_config: object


class WorkerError(ValueError):
    """A typed refusal in a vLLM worker (`code`: an ErrorCode value). The load RPCs return it
    as data, `{"error": {"code", "message"}}` (engines.vllm.base.WorkerLoad), so the engine
    reads the code instead of searching the exception's text."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    def result(self) -> LoadAnswer:
        return {"error": {"code": self.code, "message": self.message}}


def _metas(wire: list[TensorWire]) -> list[TensorMeta]:
    return [
        TensorMeta(m["name"], m["dtype"], tuple(m["shape"]), m["offset"], m["nbytes"], box=box_of(m))
        for m in wire
    ]


def verify_received(buf: torch.Tensor, metas: list[TensorWire], expected: int) -> dict[str, bytes]:
    """Check a bucket received by broadcast against its checksum and return every tensor's
    digest part, in one pass over the bytes; a mismatch raises (nothing is loaded)."""
    host = buf if buf.device.type == "cpu" else buf.cpu()
    got, parts, _ = hash_bucket(
        host,
        _metas(metas),
        parts=True,
    )
    if got != expected:
        raise WorkerError("CHECKSUM_MISMATCH", "a group bucket arrived corrupted")
    return parts or {}


def verify_mac(buf: torch.Tensor, seq: int, mac: MacWire | None) -> None:
    """With keys (`mac` = [key hex, source, tag hex]): the trainer's tag over exactly the
    bytes this worker received, checked before anything is loaded."""
    if not mac:
        return
    from messages.errors import MessageError
    from messages.stream import check_load_mac

    key_hex, source, tag_hex = mac
    host = buf if buf.device.type == "cpu" else buf.cpu()
    try:
        check_load_mac(bytes.fromhex(key_hex), int(source), seq, host.numpy(), bytes.fromhex(tag_hex))
    except MessageError as exc:
        raise WorkerError("UNAUTHORIZED", exc.reason) from None


# In-process workers only: the engine puts a received frame here for the duration of one
# `ws_load` call, keyed by the token it passes, so the worker loads from the frame itself.
LOCAL_BUFFERS: dict[str, Buffer] = {}


@dataclass
class WorkerReload:
    """One vLLM worker's side of the syncs (this process only): the reload running, the
    finalize guard, what it loaded and holds, and its group member."""

    sync_id: str | None = None
    version: int | None = None
    reloading: bool = False
    finalized: set[str] = field(default_factory=set)  # the guard, in the worker itself
    finalize_count: int = 0
    digester: Digester = field(default_factory=Digester)  # a new one at each begin
    digest: str | None = None
    readers: dict[str, transports.Reader] = field(default_factory=dict)  # per reference transport
    loaded: int = 0
    mode: str | None = None  # layerwise, or process_weights_after_loading
    kept: int = 0
    member: Member | None = None  # this worker's group member
    # a receive posted ahead: (group id, seq, size) of its bucket, and the receive
    posted: tuple[tuple[Json, int | None, int], Posted] | None = None
    rank_map: dict[str, Part] | None = None  # what this rank loads (recorded by ws_slices)
    slices: bool = False  # this sync takes slices
    received: int = 0


def _view(st: WorkerReload, ref: RefWire) -> memoryview:
    """The bytes a reference names, read by its transport's reader (one per transport,
    kept by this worker)."""
    return transports.view(Ref(ref["name"], ref["offset"], ref["size"], ref.get("via", "")), st.readers)


class WeightSyncExtension:
    """Mixed into vLLM's Worker class; `self.model_runner` and `self.vllm_config` exist."""

    # set by vLLM's Worker, which this class is mixed into
    model_runner: _ModelRunner
    vllm_config: _VllmConfig
    device: torch.device

    def _ws(self) -> WorkerReload:
        st: WorkerReload | None = getattr(self, "_ws_state", None)
        if st is None:
            st = self._ws_state = WorkerReload()
        return st

    def _ws_model(self) -> torch.nn.Module:
        model: torch.nn.Module = self.model_runner.get_model()
        return model

    def ws_info(self, arg: str = "{}") -> WorkerInfo:
        st = self._ws()
        return {
            "sync_id": st.sync_id,
            "version": st.version,
            "reloading": st.reloading,
            "finalize_count": st.finalize_count,
            "digest": st.digest,
            "rank": getattr(self, "rank", 0),
            "mode": st.mode,
            "loaded": st.loaded,
            "kept": st.kept,
            "received": st.received,
        }

    def ws_begin(self, arg: str) -> WorkerInfo:
        a: BeginArg = json.loads(arg)
        st = self._ws()
        if st.reloading:
            if st.sync_id == a["sync_id"]:
                return self.ws_info()  # repeated begin of the same sync
            self._ws_end_reload()  # an abandoned sync: leave reload mode before the next
        if st.posted is not None:  # a receive left posted by an ended sync: leave that group
            self.ws_group_close()
        model = self._ws_model()
        try:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(model)
            st.mode = "layerwise"
        except ImportError:
            st.mode = "process_weights_after_loading"
        st.sync_id, st.version, st.reloading = a["sync_id"], a["version"], True
        st.digester, st.digest, st.loaded, st.kept, st.received = Digester(), None, 0, 0, 0
        st.slices = bool(a.get("slices")) and st.rank_map is not None
        return self.ws_info()

    def _ws_running(self, a: SyncArg, method: str) -> WorkerReload:
        """The worker's state, if `a`'s sync is the reload running here."""
        st = self._ws()
        if not st.reloading or st.sync_id != a["sync_id"]:
            raise RuntimeError(
                f"{method} for sync {a['sync_id']!r} but the running reload is "
                f"{st.sync_id!r} (reloading={st.reloading})"
            )
        return st

    def ws_load(self, arg: str) -> LoadAnswer:
        """arg: {sync_id, ref: {name, offset, size, via} | local: token, checksum | null, parts |
        null, tensors: [{name, dtype, shape, offset, nbytes}]}; returns {loaded, seconds,
        phases}. checksum null: the engine process verified these bytes (and sent `parts`)."""
        t0 = time.perf_counter()
        a: LoadArg = json.loads(arg)
        st = self._ws_running(a, "ws_load")
        local = a.get("local")
        if local is not None:
            mv = memoryview(LOCAL_BUFFERS[local])
            where = "the engine's frame"
        else:
            ref = a["ref"]
            mv = _view(st, ref)
            where = f"bucket {ref['name']} (by {transports.ref_name(ref.get('via', ''))})"
        phases: dict[str, float] = {}
        if a.get("checksum") is not None:
            if bucket_checksum(mv, _metas(a["tensors"])) != a["checksum"]:
                return WorkerError("CHECKSUM_MISMATCH", f"{where} is corrupted").result()
            phases["worker_checksum"] = time.perf_counter() - t0
        self._ws_apply(frombuffer(mv), a["tensors"], a.get("parts"), phases)
        return {"loaded": st.loaded, "seconds": time.perf_counter() - t0, "phases": phases}

    def ws_group_load(self, arg: str) -> LoadAnswer:
        """arg: {sync_id, group: GroupRef, seq, size, checksum, tensors, bind, next: {seq,
        size} | null}: this worker joins the group (rank = group rank + its vLLM rank) and
        receives the bucket by broadcast into its own buffer; no tensor crosses
        `collective_rpc`. With `next` (the engine already holds the following bucket's
        load) the receive of that bucket is posted before this one loads, so it crosses
        the network meanwhile; the next call finds it posted."""
        t0 = time.perf_counter()
        a: GroupLoadArg = json.loads(arg)
        st = self._ws_running(a, "ws_group_load")
        member = st.member
        if member is None:
            member = st.member = Member(a.get("bind", ""), rank_offset=getattr(self, "rank", 0), slots=2)
        key = (a["group"]["id"], a.get("seq"), a["size"])
        posted, st.posted = st.posted, None
        if posted is not None and posted[0] != key:
            member.close()  # a receive posted for another bucket would take this one's bytes
            raise RuntimeError(f"group bucket {key} arrived, but {posted[0]} was posted")
        buf = member.wait(
            posted[1] if posted is not None else member.post(a["group"], a["size"], sync=a.get("sync_id"))
        )
        t1 = time.perf_counter()
        nxt = a.get("next")
        if nxt:
            st.posted = (
                (a["group"]["id"], nxt["seq"], nxt["size"]),
                member.post(a["group"], nxt["size"], sync=a.get("sync_id")),
            )
        try:
            verify_mac(buf, a.get("seq") or 0, a.get("mac"))
            parts = verify_received(buf, a["tensors"], a["checksum"])
        except WorkerError as exc:  # refused before anything loaded: said as data
            return exc.result()
        phases = {"worker_receive": t1 - t0, "worker_checksum": time.perf_counter() - t1}
        self._ws_apply(buf, a["tensors"], parts, phases)
        return {"loaded": st.loaded, "seconds": time.perf_counter() - t0, "phases": phases}

    def ws_native_info(self, arg: str = "{}") -> NativeInfo:
        """What vLLM's weight-transfer engine (backend weightsync) holds: digest, count."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "info"):
            return {"native": False}
        return {"native": True, **engine.info()}

    def ws_slices(self, arg: str) -> JsonObject:
        """What this rank loads of each checkpoint tensor (`arg`: {"tensors": [[name, dtype,
        shape], ...]}), recorded from vLLM's own loaders (engines/vllm/slices.py)."""
        from engines.vllm.slices import record_rank_map, to_json

        tensors = [
            (str(n), str(d), tuple(int(x) for x in shape)) for n, d, shape in json.loads(arg)["tensors"]
        ]
        rank_map, whole_because = record_rank_map(self._ws_model(), tensors, self.device)
        self._ws().rank_map = rank_map
        return {
            "rank": getattr(self, "rank", 0),
            "map": to_json(rank_map),
            "whole_because": dict(whole_because),
        }

    def ws_group_close(self, arg: str = "{}") -> str:
        st = self._ws()
        member, st.posted, st.member = st.member, None, None  # the posted receive goes with the group
        if member is not None:
            member.close()
        return "ok"

    def _ws_apply(
        self,
        flat: torch.Tensor,
        metas: list[TensorWire],
        parts: Mapping[str, bytes | str] | None = None,
        phases: dict[str, float] | None = None,
    ) -> None:
        st = self._ws()
        kept, received = load_into(
            self._ws_model(),
            flat,
            metas,
            st.digester,
            layerwise=st.mode == "layerwise",
            parts=parts,
            phases=phases,
            rank_map=st.rank_map if st.slices else None,
        )
        st.kept += kept
        st.received += received
        st.loaded += len(metas)

    def ws_finalize(self, arg: str) -> FinalizeAnswer:
        a: SyncArg = json.loads(arg)
        st = self._ws()
        if a["sync_id"] in st.finalized:
            return {**self.ws_info(), "duplicate": True}
        if not st.reloading or st.sync_id != a["sync_id"]:
            raise RuntimeError(f"ws_finalize for sync {a['sync_id']!r} without its begin")
        t0 = time.perf_counter()
        self._ws_end_reload()
        st.finalized.add(a["sync_id"])
        st.finalize_count += 1
        if st.member is not None:  # the groups kept open: this sync's, one per source
            st.member.keep_used(a["sync_id"])
        st.digest = st.digester.hexdigest()
        return {**self.ws_info(), "duplicate": False, "seconds": time.perf_counter() - t0}

    def ws_abort(self, arg: str) -> WorkerInfo:
        a: SyncArg = json.loads(arg)
        st = self._ws()
        if st.reloading and st.sync_id == a["sync_id"]:
            self._ws_end_reload()  # mixed weights, but the model is runnable again
            st.digest, st.version = None, None
        return self.ws_info()

    def _ws_end_reload(self) -> None:
        st = self._ws()
        model = self._ws_model()
        model_config = self.vllm_config.model_config
        if st.mode == "layerwise":
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(model, model_config)
        else:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(model, model_config, self.device)
        st.reloading = False
        for r in st.readers.values():
            r.prune()  # drop mappings of slots the trainer unlinked; keep the rest

    # -- for tests: the hazard this project exists for ----------------------------------
    def ws_unsafe_process_after_loading(self, arg: str = "{}") -> str:
        """Run vLLM's post-load step again, as the buggy per-bucket pattern did."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(self._ws_model(), self.vllm_config.model_config, self.device)
        return "ok"

    def ws_unsafe_load_weights(self, arg: str) -> str:
        """Plain `load_weights` from a reference (`schema.Ref` wire form), outside any reload."""
        a: UnsafeLoadArg = json.loads(arg)
        flat = frombuffer(_view(self._ws(), a["ref"]))
        tensors = [
            (
                m["name"],
                flat[m["offset"] : m["offset"] + m["nbytes"]].view(DTYPES[m["dtype"]]).view(m["shape"]),
            )
            for m in a["tensors"]
        ]
        with torch.no_grad():
            self._ws_model().load_weights(iter(tensors))  # type: ignore[operator]
        return "ok"
