"""What both vLLM backends share (`VllmBase`): validation against the checkpoint's own
tensor list, shared-memory staging, the rpc protocol of the worker extension
(`engines.vllm.extension`), and the finalize bookkeeping.

Rules: a bucket's bytes are copied once, from where they were received into the
parameters, by vLLM's own weight loaders. In-process workers (V1 multiprocessing off) get
the received frame itself (`engines.vllm.extension.LOCAL_BUFFERS`); a bucket sent by
reference is viewed by the workers straight from the trainer's slot. Only a frame for workers
in other processes (multiprocessing, the OpenAI server) is staged in shared memory first:
that is the one extra copy, and it is counted (`staged_bytes`). The engine process has
verified the checksum and computed every tensor's digest part (`engines.verify`) before a
worker sees the bucket; workers take the parts instead of hashing again. Names and shapes
are validated first (vLLM casts dtypes, so a dtype difference is allowed). After the
single finalize the prefix cache is reset before `finalized` is reported: cached KV
blocks were computed with old weights.

With `take_slices` (and a recorded layout with a box in it) the engine takes slices
(`engines.base.TakesSlices`): it declares each rank's map, so a sender cuts for it; each
worker takes only its boxes (engines/vllm/extension.py) and its digest is its rank's. The
workers then hold no whole tensor to digest: the engine reports the version's digest the
daemon sent with `finalize` (`expect_digest`), which the daemon accepts only with every
rank's digest equal to what the sender computed for that rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec
import structlog
import torch

from engines.base import EngineInfo, validate_bucket
from engines.vllm.slices import from_json
from messages.buckets import Sliced, iter_buckets
from messages.buckets import digest as weights_digest
from messages.checkpoint import checkpoint_spec, iter_safetensors
from messages.checksums import add_digests, bucket_checksum
from messages.dtypes import DTYPES
from messages.errors import ErrorCode, make_error
from messages.schema import Probe, Ref, Slices, TensorMeta
from messages.segments import VIA, Segment
from messages.slices import WHOLE, Layout, Part, layout_key, rank_bytes, to_wire

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from engines.vllm.extension import FinalizeAnswer
    from messages.replies import Json, JsonObject

log = structlog.get_logger()


class WorkerFailure(msgspec.Struct, frozen=True):
    code: str  # an ErrorCode value
    message: str


class WorkerLoad(msgspec.Struct, frozen=True):
    """One vLLM worker's answer to a load RPC (engines.vllm.extension): what it loaded and
    its phases, or its typed refusal."""

    loaded: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = {}
    error: WorkerFailure | None = None


EXTENSION = "engines.vllm.extension.WeightSyncExtension"


def _arg(**kw: object) -> str:
    """An rpc's argument: `kw` (JSON-able) as a JSON string."""
    return json.dumps(kw, separators=(",", ":"))


def _meta_tensor(m: TensorMeta) -> torch.Tensor:
    """A storage-free stand-in with the meta's dtype and shape, for validation only."""
    return torch.empty(m.shape, dtype=DTYPES[m.dtype], device="meta")


Parts = dict[str, bytes] | None  # per-tensor digest parts from `engines.verify`


def _hex(parts: Parts) -> dict[str, str] | None:
    return None if parts is None else {k: v.hex() for k, v in parts.items()}


class VllmBase:
    """What both vLLM backends share: validation, shared-memory staging, the rpc protocol
    of the extension, and the finalize bookkeeping. Subclasses provide `rpc`,
    `_after_finalize` and `probe`."""

    backend = "vllm"
    digest_parts = True  # the engine process hashes each bucket once, for checksum and digest

    def _setup(self, model_dir: str | Path, staging_bytes: int, take_slices: bool = False) -> None:
        self.model_dir = str(model_dir)
        self.spec = checkpoint_spec(model_dir)
        self.staging = Segment(staging_bytes, kind="vllm")
        self.finalize_count = 0
        self.staged_bytes = 0  # frame bytes copied into staging (workers in other processes)
        self._phases: dict[str, float] = {}
        self.sync_id: str | None = None
        self._digest: str | None = weights_digest(iter_safetensors(model_dir))
        self._slices: tuple[Slices | None, Layout] | None = None  # recorded once (`slices`)
        self.whole_because: dict[str, str] = {}  # names loaded whole for lack of a box, and why
        self.take_slices = take_slices  # asked for: it takes slices once its layout has a box
        self._expected: str | None = None  # the version's digest, from `finalize` (slices)
        self._rank_report: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())

    def rpc(self, method: str, arg: str = "{}") -> list[Json]:
        """Call `method` of the extension on every vLLM worker: their answers, JSON-like
        (engines.vllm.extension says each method's shape)."""
        raise NotImplementedError

    def _extra(self) -> JsonObject:
        return {}

    def describe(self) -> EngineInfo:
        return EngineInfo(
            backend=self.backend,
            model=self.model_dir,
            spec=tuple(self.spec.values()),
            cast_ok=True,
            extra=self._extra(),
            collective_ranks=self._workers(),
            slices=self.slices()[0],
        )

    def slices(self) -> tuple[Slices | None, Layout]:
        """What each worker (rank) loads of the checkpoint, recorded once from vLLM's own
        loaders (engines/vllm/slices.py): the declaration and the layout (one map per
        rank, in rank order). None and [] when recording is not possible here."""
        if self._slices is not None:
            return self._slices
        tensors = [[p.name, p.dtype, list(p.shape)] for p in self.spec.values()]
        try:
            answers = self.rpc("ws_slices", json.dumps({"tensors": tensors}))
        except Exception as exc:
            log.warning("slices_not_recorded", error=f"{type(exc).__name__}: {exc}"[:300])
            self._slices = (None, [])
            return self._slices
        ranked = sorted((cast("JsonObject", a) for a in answers), key=lambda a: int(cast(int, a["rank"])))
        layout: Layout = [from_json(cast("dict[str, Json]", a["map"])) for a in ranked]
        self.whole_because = {
            n: w for a in ranked for n, w in cast("dict[str, str]", a["whole_because"]).items()
        }
        whole = sorted(self.whole_because)
        sizes = rank_bytes(layout, self.spec)
        if whole:
            log.info("slices_whole_names", names=whole[:20], count=len(whole))
        sliced = self.take_slices and any(p != WHOLE for r in layout for p in r.values())
        decl = Slices(
            key=layout_key(layout), rank_bytes=tuple(sizes), ranks=to_wire(layout) if sliced else ()
        )
        self._slices = (decl, layout)
        return self._slices

    @property
    def sliced(self) -> bool:
        """It takes slices: it declared each rank's map."""
        decl = self.slices()[0]
        return decl is not None and bool(decl.ranks)

    def load_parts(self, items: Sequence[tuple[str, Part, torch.Tensor]]) -> None:
        """Tensors with their parts (a box's contents, or whole), as one bucket with boxes."""
        for b in iter_buckets(
            [(n, t if p == WHOLE else Sliced(t, p, self.spec[n].shape)) for n, p, t in items], 1 << 62
        ):
            self.load_bucket(b.tensors, b.frame())

    def expect_digest(self, digest: str | None) -> None:
        """The version's digest (the daemon's `finalize`), reported when it takes slices."""
        self._expected = digest

    def rank_report(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        return self._rank_report

    def _workers(self) -> int:
        """Group members this engine brings: one per vLLM worker (TP x PP)."""
        return 1

    def begin(self, sync_id: str, version: int) -> None:
        self.rpc("ws_begin", _arg(sync_id=sync_id, version=version, slices=self.sliced))
        self._expected, self._rank_report = None, ((), ())
        self.sync_id = sync_id
        self._digest = None
        self._phases = {}

    @property
    def last_phases(self) -> dict[str, float]:
        """The workers' split of this sync's load time, and staging / prefix reset."""
        return dict(self._phases)

    def _check(self, metas: Sequence[TensorMeta]) -> None:
        """Names and shapes against the checkpoint's, before any worker sees the bucket."""
        validate_bucket(self.spec, [(m.name, _meta_tensor(m)) for m in metas], cast_ok=True)

    def load_bucket(self, metas: Sequence[TensorMeta], buf: Buffer, parts: Parts = None) -> None:
        self._check(metas)
        self._send_bucket(metas, buf, parts)

    def _local(self) -> bool:
        """Do the workers run in this process (and can take a buffer by reference)?"""
        return False

    def _send_bucket(self, metas: Sequence[TensorMeta], buf: Buffer, parts: Parts) -> None:
        wire = [m.to_wire() for m in metas]
        if self._local():
            from engines.vllm.extension import LOCAL_BUFFERS

            token = f"{self.sync_id}/{id(buf)}"
            LOCAL_BUFFERS[token] = buf
            try:
                self._timed("ws_load", sync_id=self.sync_id, local=token, tensors=wire, parts=_hex(parts))
            finally:
                LOCAL_BUFFERS.pop(token, None)
            return
        t0 = time.perf_counter()
        n = self.staging.write(buf)
        self.staged_bytes += n
        self._add("staging", time.perf_counter() - t0)
        self._timed(
            "ws_load",
            sync_id=self.sync_id,
            tensors=wire,
            parts=_hex(parts),
            checksum=None if parts is not None else bucket_checksum(self.staging.view(0, n), metas),
            ref=Ref(self.staging.name, 0, n, via=VIA).to_wire(),
        )

    def load_ref(
        self, metas: Sequence[TensorMeta], ref: Ref, bucket_checksum: int, parts: Parts = None
    ) -> None:
        """A reference transport: hand the trainer's slot straight to the vLLM workers (no staging
        copy); they copy into parameters (and verify the checksum themselves unless the
        engine process has: `parts` given)."""
        self._check(metas)
        self._send_ref(metas, ref, bucket_checksum, parts)

    def _send_ref(self, metas: Sequence[TensorMeta], ref: Ref, bucket_checksum: int, parts: Parts) -> None:
        self._timed(
            "ws_load",
            sync_id=self.sync_id,
            ref=ref.to_wire(),
            parts=_hex(parts),
            checksum=None if parts is not None else bucket_checksum,
            tensors=[m.to_wire() for m in metas],
        )

    def _timed(self, method: str, **kw: object) -> list[Json]:
        """Run a load rpc (one `WorkerLoad` per worker); raise the first worker's typed
        refusal; add the workers' own split of its time to this sync's phases."""
        results = self.rpc(method, _arg(**kw))
        loads = [msgspec.convert(r, WorkerLoad) for r in results]
        for w in loads:
            if w.error is not None:
                code = (
                    w.error.code if w.error.code in ErrorCode.__members__ else ErrorCode.ENGINE_FAILED.value
                )
                raise make_error(ErrorCode(code), w.error.message[-500:])
        for phase, seconds in (loads[0].phases if loads else {}).items():
            self._add(phase, seconds)
        return results

    def _add(self, phase: str, seconds: float) -> None:
        self._phases[phase] = self._phases.get(phase, 0.0) + seconds

    def load_group(
        self,
        metas: Sequence[TensorMeta],
        group: JsonObject,
        size: int,
        bucket_checksum: int,
        bind: str,
        seq: int | None = None,
        next_bucket: dict[str, int] | None = None,
        mac: tuple[str, int, str] | None = None,
    ) -> None:
        """A group transport: every vLLM worker joins the group and receives the bucket
        itself (rank = group rank + worker rank), verifies it (with keys: `mac` = (key hex,
        source, tag hex), checked by each worker on the bytes it received) and loads it;
        with `next_bucket` ({seq, size} of the load queued behind this one) the workers
        post its receive before loading this one."""
        self._check(metas)
        self._timed(
            "ws_group_load",
            sync_id=self.sync_id,
            group=group,
            size=size,
            checksum=bucket_checksum,
            bind=bind,
            tensors=[m.to_wire() for m in metas],
            seq=seq,
            next=next_bucket,
            mac=list(mac) if mac is not None else None,
        )

    def close_group(self) -> None:
        self.rpc("ws_group_close")

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        validate_bucket(self.spec, tensors, cast_ok=True)
        for b in iter_buckets(tensors, 1 << 62):
            self.load_bucket(b.tensors, b.frame())

    def finalize(self, sync_id: str) -> str:
        results = cast("list[FinalizeAnswer]", self.rpc("ws_finalize", _arg(sync_id=sync_id)))
        if any(r.get("duplicate") for r in results):
            raise make_error(ErrorCode.INVALID_STATE, f"vLLM workers refused a second finalize of {sync_id}")
        digests = {r["digest"] for r in results}
        digest = next(iter(digests)) if len(digests) == 1 else None
        if self.sliced:  # each worker's digest is its rank's; the version's is the daemon's
            ranked = sorted(results, key=lambda r: r["rank"])
            self._rank_report = (
                tuple(str(r["digest"]) for r in ranked),
                tuple(int(r["received"]) for r in ranked),
            )
            digest = self._expected or add_digests(self._rank_report[0])
        if digest is None:  # they disagree (a finalize that ran always reports its digest)
            raise make_error(ErrorCode.ENGINE_FAILED, f"vLLM workers disagree on the digest: {digests}")
        t0 = time.perf_counter()
        self._after_finalize()
        self._add("prefix_reset", time.perf_counter() - t0)
        self.finalize_count = min(r["finalize_count"] for r in results)
        self._digest = digest
        return digest

    def _after_finalize(self) -> None:
        raise NotImplementedError

    def digest(self) -> str:
        if self._digest is None:
            raise make_error(ErrorCode.INVALID_STATE, "no digest: a sync is in progress or was aborted")
        return self._digest

    def probe(self, probes: Sequence[Probe]) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[int, ...]]:
        return list(self.probe([Probe(tuple(p), max_tokens) for p in prompts]))

    def abort(self) -> None:
        if self.sync_id is not None:
            self.rpc("ws_abort", _arg(sync_id=self.sync_id))
        self._digest = None

    def close(self) -> None:
        self.staging.close()
