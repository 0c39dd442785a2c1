"""The embedded engine: a transformers causal LM on CPU with a real, non-idempotent
post-load step.

Post-load step (documented contract, like vLLM's `process_weights_after_loading`): every
`nn.Linear` weight is repacked in place into the `[in, out]` kernel layout its forward
then multiplies by, and the checkpoint-format `[out, in]` contents are released (the
same storage now holds the kernel). `begin` restores the checkpoint layout so buckets can
be copied in by checkpoint name. Running `finalize` twice transposes the kernel again and
the model computes garbage, which is exactly the bug class this project exists to stop;
the worker's guard and the orchestrator's FSM keep it to once per sync.

With `tp` > 1 the engine holds `tp` tensor-parallel ranks of vLLM's Llama partition
(`messages.slices.llama_tp_layout`) and takes slices (`engines.base.TakesSlices`): rank r
holds a view of its box of each split tensor (so the model the canaries run is the union
of the ranks' slices, as a tensor-parallel forward computes it) and its own copy of each
replicated tensor (rank 0's is the model's). Each rank's digest is over what it holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from engines.base import EngineInfo, EngineOptions, validate_bucket
from messages.buckets import Digester
from messages.canary import greedy
from messages.checksums import combine
from messages.cuts import box_view, cut, part_digest
from messages.dtypes import dtype_name
from messages.errors import ErrorCode, make_error
from messages.schema import ParamSpec, Probe, Slices
from messages.slices import (
    WHOLE,
    Part,
    box_refusal,
    box_shape,
    layout_key,
    llama_tp_layout,
    rank_bytes,
    to_wire,
)

log = structlog.get_logger()


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32) -> nn.Module:
    """A transformers causal LM from a local directory, on CPU, in eval mode."""
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: untyped
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    model: nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.eval()
    return model


class _Kernel:
    """Forward of a repacked Linear: x @ K (+ b), K = the weight storage viewed [in, out]."""

    __slots__ = ("kernel", "bias")

    def __init__(self, kernel: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.kernel, self.bias = kernel, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.kernel)
        return y + self.bias if self.bias is not None else y


def _untied(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[int]]:
    """The model's tensors by checkpoint name, a tied weight once (under its first name, as
    `save_pretrained` writes it): a trainer sends it once, and the engine expects it once.
    Also the storages that more than one name refers to."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    names_per_storage: dict[int, int] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        ptr = t.untyped_storage().data_ptr()
        names_per_storage[ptr] = names_per_storage.get(ptr, 0) + 1
        if (ptr, t.storage_offset()) not in seen:
            seen.add((ptr, t.storage_offset()))
            out[name] = t
    return out, {p for p, n in names_per_storage.items() if n > 1}


class TorchEngine:
    """`Engine` over a transformers model. Not thread-safe: the worker calls it from one thread."""

    backend = "torch"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        threads: int | None = None,
        lora_rank: int = 0,
        lora_targets: Sequence[str] = (),
        tp: int = 1,
    ) -> None:
        if tp > 1 and lora_rank:
            raise ValueError("--tp with LoRA slots is not supported")
        if threads:
            torch.set_num_threads(threads)
        self.model_dir = str(model_dir)
        self.model = load_model(model_dir, dtype="auto")  # the checkpoint's own dtype
        # A linear whose weight is tied (the LM head sharing the embedding table) keeps its
        # layout: repacking it would scramble the embedding lookups that read the same storage.
        self.params, tied_ptrs = _untied(self.model)
        self.lora = self._lora_slots(lora_rank, tuple(lora_targets))
        self.linears = [
            m
            for name, m in self.model.named_modules()
            if isinstance(m, nn.Linear)
            and m.weight.untyped_storage().data_ptr() not in tied_ptrs
            and name not in self.lora
        ]
        for name, (_m, a, b) in self.lora.items():
            self.params[f"{name}.lora_A.weight"], self.params[f"{name}.lora_B.weight"] = a, b
        self.spec = {n: ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self.params.items()}
        self.packed = False
        self.finalize_count = 0  # post-load steps run by syncs (the startup one is not counted)
        self.version: int | None = None
        self._digest: str | None = self._checkpoint_digest()
        self._prepared: str | None = None  # the digest taken at prepare, for finalize
        self.layout = llama_tp_layout({n: p.shape for n, p in self.spec.items()}, tp) if tp > 1 else None
        # rank -> name -> (its part, what it holds of it: a view of the model's box, or a copy)
        self.ranks = [] if self.layout is None else [self._rank(r, m) for r, m in enumerate(self.layout)]
        self.received = [0] * len(self.ranks)  # bytes handed to each rank since begin
        self._rank_digests: tuple[str, ...] = ()
        self._pack()  # the model as loaded from disk is served, so it is post-processed once

    # -- Engine protocol ----------------------------------------------------------------
    def describe(self) -> EngineInfo:
        return EngineInfo(
            backend=self.backend,
            model=self.model_dir,
            spec=tuple(self.spec.values()),
            extra={"parameters": sum(t.numel() for t in self.params.values()), "linears": len(self.linears)},
            slices=None
            if self.layout is None
            else Slices(
                key=layout_key(self.layout),
                rank_bytes=tuple(rank_bytes(self.layout, self.spec)),
                ranks=to_wire(self.layout),
            ),
        )

    def begin(self, sync_id: str = "", version: int = 0) -> None:
        if self.packed:
            self._unpack()
        self.version = None
        self._digest = None
        self._prepared = None
        self.received = [0] * len(self.ranks)
        self._rank_digests = ()

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.ranks:
            self.load_parts([(n, WHOLE, t) for n, t in tensors])
            return
        if self.packed:
            raise make_error(ErrorCode.INVALID_STATE, "load while weights are packed; begin first")
        validate_bucket(self.spec, tensors)
        self._prepared = None
        with torch.no_grad():
            for name, src in tensors:
                self.params[name].copy_(src)

    def load_parts(self, items: Sequence[tuple[str, Part, torch.Tensor]]) -> None:
        """Each rank takes its part of each item: its box of a whole tensor, or the box sent
        for it (a box for no rank of this layout is for another engine's, and skipped)."""
        if not self.ranks:  # one rank (no --tp): it declared no slices, and takes whole tensors
            if any(p != WHOLE for _, p, _ in items):
                raise make_error(ErrorCode.BAD_MESSAGE, "a box of a tensor for an engine of one rank")
            self.load([(n, t) for n, _, t in items])
            return
        if self.packed:
            raise make_error(ErrorCode.INVALID_STATE, "load while weights are packed; begin first")
        validate_bucket(self.spec, [(n, t) for n, p, t in items if p == WHOLE])
        for name, part, t in items:
            want = self.spec.get(name)
            if part == WHOLE:
                continue
            if want is None:
                raise make_error(ErrorCode.UNKNOWN_TENSOR, f"this model has no tensor {name!r}")
            if (
                dtype_name(t.dtype) != want.dtype
                or box_refusal(part, want.shape) is not None
                or tuple(t.shape) != box_shape(part)
            ):
                raise make_error(
                    ErrorCode.SHAPE_MISMATCH,
                    f"{name}: box {list(part)} as {dtype_name(t.dtype)}{list(t.shape)} of "
                    f"{want.dtype}{list(want.shape)}",
                )
        self._prepared = None
        with torch.no_grad():
            for name, part, t in items:
                for r, rank in enumerate(self.ranks):
                    held = rank.get(name)
                    if held is None:
                        continue
                    mine, dst = held
                    if part == WHOLE:
                        dst.copy_(cut(t, mine))
                    elif part == mine:
                        dst.copy_(t)
                    else:
                        continue
                    self.received[r] += t.numel() * t.element_size()

    def expect_digest(self, digest: str | None) -> None:
        """Nothing to keep: the model holds every rank's slices, so it computes the digest."""

    def rank_report(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Each rank's digest (taken at finalize, before the post-load step) and bytes."""
        return self._rank_digests, tuple(self.received)

    def _rank(self, r: int, rank_map: dict[str, Part]) -> dict[str, tuple[Part, torch.Tensor]]:
        out: dict[str, tuple[Part, torch.Tensor]] = {}
        for name, part in rank_map.items():
            p = self.params[name].data
            if part == WHOLE:
                out[name] = (part, p if r == 0 else p.clone())
                continue
            out[name] = (part, box_view(p, part))
        return out

    def _take_rank_digests(self) -> None:
        self._rank_digests = tuple(
            combine(part_digest(n, self.spec[n].shape, part, held) for n, (part, held) in rank.items())
            for rank in self.ranks
        )

    def prepare_digest(self) -> str:
        """The digest `finalize` will return (phase one of the commit); kept for it."""
        if self.packed:
            raise make_error(ErrorCode.INVALID_STATE, "prepare while weights are packed; begin first")
        self._prepared = self._checkpoint_digest()
        if self.ranks:
            self._take_rank_digests()
        return self._prepared

    def finalize(self, sync_id: str = "") -> str:
        # before the checkpoint layout is released (taken at prepare when nothing changed since)
        if self.ranks and not self._prepared:
            self._take_rank_digests()
        digest = self._prepared or self._checkpoint_digest()
        self._prepared = None
        self._pack()
        self.finalize_count += 1
        self._digest = digest
        return digest

    def digest(self) -> str:
        if self._digest is None:
            if self.packed:
                raise make_error(ErrorCode.INTERNAL, "packed weights without a recorded digest")
            self._digest = self._checkpoint_digest()
        return self._digest

    @torch.no_grad()
    def fresh_digest(self) -> str:
        """The digest of what the parameters' storage holds now, each tensor read back in
        checkpoint layout (a repacked kernel `[in, out]` transposed back to `[out, in]`),
        computed again: never the digest recorded at finalize."""
        kernels = {m.weight.data_ptr() for m in self.linears} if self.packed else set()
        d = Digester()
        for name, t in self.params.items():
            w = t.detach()
            if w.data_ptr() in kernels:
                out_f, in_f = w.shape
                w = w.view(in_f, out_f).t()
            d.update(name, w)
        return d.hexdigest()

    def probe(self, probes: Sequence[Probe]) -> tuple[tuple[int, ...], ...]:
        if not self.packed:
            raise make_error(ErrorCode.INVALID_STATE, "probe before finalize: weights not served")
        return tuple(greedy(self.model, p.prompt, p.max_tokens) for p in probes)

    def abort(self) -> None:
        """Drop the sync: weights may be mixed, so nothing is served until the next one."""
        self.version = None
        self._digest = None
        self._prepared = None

    def close(self) -> None:
        self.params.clear()
        self.linears.clear()

    # -- the post-load step -------------------------------------------------------------
    def _checkpoint_digest(self) -> str:
        d = Digester()
        for name, t in self.params.items():
            d.update(name, t.detach())
        return d.hexdigest()

    def _lora_slots(
        self, rank: int, targets: tuple[str, ...]
    ) -> dict[str, tuple[nn.Linear, torch.Tensor, torch.Tensor]]:
        """Zero A [rank, in] / B [out, rank] for every linear whose name ends in a target
        (vLLM's `enable_lora` + `max_lora_rank`): an adapter push fills them."""
        if rank <= 0 or not targets:
            return {}
        out = {}
        for name, m in self.model.named_modules():
            if isinstance(m, nn.Linear) and name.split(".")[-1] in targets:
                w = m.weight
                out[name] = (
                    m,
                    torch.zeros((rank, w.shape[1]), dtype=w.dtype),
                    torch.zeros((w.shape[0], rank), dtype=w.dtype),
                )
        if not out:
            raise ValueError(f"no linear layer named {targets} for LoRA")
        return out

    @torch.no_grad()
    def _pack(self) -> None:
        t0 = time.perf_counter()
        for m, a, b in self.lora.values():
            # The base weight keeps its checkpoint layout (the next adapter merges into the
            # same base); the served kernel is base + B @ A, in its own storage.
            kernel = (m.weight + b @ a).t().contiguous()
            m.forward = _Kernel(kernel, m.bias)  # type: ignore[method-assign,assignment]
        for m in self.linears:
            w = m.weight.data
            out_f, in_f = w.shape
            kernel = w.t().contiguous()  # [in, out]
            w.view(-1).copy_(kernel.view(-1))  # same storage, now the kernel layout
            m.forward = _Kernel(w.view(in_f, out_f), m.bias)  # type: ignore[method-assign,assignment]
        self.packed = True
        log.debug("weights_packed", linears=len(self.linears), seconds=time.perf_counter() - t0)

    @torch.no_grad()
    def _unpack(self) -> None:
        for m, _a, _b in self.lora.values():
            if "forward" in m.__dict__:
                del m.forward
        for m in self.linears:
            w = m.weight.data
            out_f, in_f = w.shape
            restored = w.view(in_f, out_f).t().contiguous()  # back to [out, in]
            w.view(-1).copy_(restored.view(-1))
            if "forward" in m.__dict__:
                del m.forward
        self.packed = False

    @torch.no_grad()
    def drop_weights(self) -> None:
        """Fault injection (`DropsWeights`): every weight zeroed in place, in whatever layout
        it is in; the recorded digest and version stay, as a server's would that lost them."""
        for t in self.params.values():
            t.zero_()

    def weight_ptrs(self) -> dict[str, int]:
        """data_ptr of every checkpoint tensor (tests check loads are in place)."""
        return {n: t.data_ptr() for n, t in self.params.items()}


def make_engine(options: EngineOptions) -> TorchEngine:
    return TorchEngine(
        options["model"],
        threads=options.get("threads"),
        lora_rank=int(options.get("lora_rank") or 0),
        lora_targets=tuple(options.get("lora_targets") or ()),
        tp=int(options.get("tp") or 1),
    )
