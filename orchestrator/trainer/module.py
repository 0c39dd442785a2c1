"""Push a live training `nn.Module`: its parameters and buffers stream into buckets as the
push consumes them, so no second state dict is ever materialized.

Rules:
- Names are the HF checkpoint names vLLM's `load_weights` expects: wrapper prefixes that
  training adds (`_orig_mod.` from torch.compile, `_fsdp_wrapped_module.`, `module.` from
  DDP, `_checkpoint_wrapped_module.`) are dropped.
- Tied weights (one storage under two names, e.g. embeddings and `lm_head`) are sent once,
  under the first name, as `save_pretrained` writes them.
- `dtype` casts floating tensors on the fly (fp32 master -> bf16), straight into the
  bucket (`messages.buckets.Cast`): no cast copy of the model, not even one tensor's.
- Sharded parameters (FSDP2 / DTensor) are gathered one tensor at a time with
  `full_tensor()` (an all-gather): every rank must call `push_module` in lockstep; rank 0
  (the one holding a client) sends, the others only take part in the gathers. Chosen over
  each rank sending its shard as its own source: gathering keeps the engines' contract
  (whole tensors in checkpoint layout, which vLLM's loaders need to re-shard for their own
  TP), and costs rank 0 one full tensor of memory at a time (docs/TRAINER.md).
- `filter(name, tensor) -> bool` picks what to send (e.g. only the layers that train).
- `sharded=True` makes every rank a source of one sync: each still takes part in every
  gather, and sends only the tensors its plan assigns it (`shard.py`), so the bytes leave
  the trainer through every rank's connection at once (docs/TRAINER.md, "Sharded push").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Unpack, overload

import torch

from messages.buckets import Cast
from messages.dtypes import dtype_name
from orchestrator.trainer.shard import Meta

if TYPE_CHECKING:
    from orchestrator.trainer.options import ModulePushOptions, Pusher
    from orchestrator.trainer.results import SyncResult

WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def hf_name(name: str) -> str:
    """`name` without the path components training wrappers add (anywhere for compile,
    FSDP and checkpointing; DDP's `module` only in front). Whole components only: a
    module that is merely named like one (`vision_module`) keeps its name."""
    parts = [p for p in name.split(".") if p not in WRAPPERS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


# (storage address, offset in it, shape): one per tensor, tied weights share theirs
_StorageKey = tuple[int, int | torch.SymInt, tuple[int, ...]]


def _storage_key(t: torch.Tensor) -> _StorageKey:
    local = t.to_local() if hasattr(t, "to_local") else t
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))


def _entries(
    model: torch.nn.Module, filter: Callable[[str, torch.Tensor], bool] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor as the module holds it: a DTensor is not gathered) for every
    parameter and persistent buffer the push sends, tied weights once."""
    seen: set[_StorageKey] = set()
    for raw, t in model.state_dict(keep_vars=True).items():
        key = _storage_key(t)
        if key in seen:
            continue  # a tied weight: already sent under its first name
        seen.add(key)
        name = hf_name(raw)
        t = t.detach()
        # Before the gather (a DTensor's shape is the global one): no rank gathers what no
        # engine gets. The filter must decide the same on every rank.
        if filter is not None and not filter(name, t):
            continue
        yield name, t


def module_metas(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    filter: Callable[[str, torch.Tensor], bool] | None = None,
) -> list[Meta]:
    """(name, global shape, dtype as sent, bytes) of every tensor `module_tensors` yields,
    without gathering anything: what a sharded push's plan is computed from."""
    out: list[Meta] = []
    for name, t in _entries(model, filter):
        sent = dtype if dtype is not None and t.is_floating_point() else t.dtype
        numel = 1
        for d in t.shape:
            numel *= int(d)
        out.append((name, tuple(int(d) for d in t.shape), dtype_name(sent), numel * sent.itemsize))
    return out


def module_tensors(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    filter: Callable[[str, torch.Tensor], bool] | None = None,
    only: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | Cast]]:
    """(HF name, full tensor) for every parameter and persistent buffer, tied weights once,
    gathered lazily; with `dtype`, floating tensors come as `Cast` (cast while packed;
    `.materialize()` gives the tensor). Every rank of a sharded model must consume it in
    lockstep. `only(name)`: yield just those tensors (every DTensor is still gathered, on
    every rank takes part in the gather)."""
    for name, t in _entries(model, filter):
        if hasattr(t, "full_tensor"):  # DTensor (FSDP2): the whole tensor, on every rank
            t = t.full_tensor()
        if only is not None and not only(name):
            continue
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            yield name, Cast(t, dtype)  # cast as it is packed, into the bucket itself
            continue
        yield name, t


def _rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("sharded=True needs torch.distributed initialized, or source=(rank, world)")
    return dist.get_rank(), dist.get_world_size()


def _shared_sync_id() -> str:
    """One sync_id for every rank (rank 0's, broadcast over the training group as 16 bytes):
    a rank that comes late to a sync that already failed is then told how it ended, instead
    of opening a new one for the version."""
    dist = torch.distributed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    raw = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8).to(device)
    dist.broadcast(raw, src=0)
    return bytes(raw.cpu().tolist()).hex()


@overload
def push_module(
    client: Pusher,
    model: torch.nn.Module,
    version: int,
    *,
    dtype: torch.dtype | None = None,
    filter: Callable[[str, torch.Tensor], bool] | None = None,
    sharded: bool = False,
    source: tuple[int, int] | None = None,
    **push_kw: Unpack[ModulePushOptions],
) -> SyncResult: ...
@overload
def push_module(
    client: None,
    model: torch.nn.Module,
    version: int,
    *,
    dtype: torch.dtype | None = None,
    filter: Callable[[str, torch.Tensor], bool] | None = None,
    sharded: bool = False,
    source: tuple[int, int] | None = None,
    **push_kw: Unpack[ModulePushOptions],
) -> None: ...
def push_module(
    client: Pusher | None,
    model: torch.nn.Module,
    version: int,
    *,
    dtype: torch.dtype | None = None,
    filter: Callable[[str, torch.Tensor], bool] | None = None,
    sharded: bool = False,
    source: tuple[int, int] | None = None,
    **push_kw: Unpack[ModulePushOptions],
) -> SyncResult | None:
    """Push `model` as `version` through `client` (a TrainerClient); on ranks without a
    client (None), take part in the gathers of a sharded model and return None.

    sharded: every rank holds a client and sends only the tensors the plan assigns it
    (`orchestrator.trainer.shard`: bytes balanced, the same on every rank, computed once
    per layout), as source (rank, world) of one sync; `source` overrides the rank and world
    torch.distributed reports. With torch.distributed (and no `sync_id` given) the ranks agree
    on one sync_id first (rank 0's, broadcast), so a rank that comes late to a sync that
    failed hears how it ended at once."""
    if sharded:
        if client is None:
            raise ValueError("sharded=True: every rank sends its part, so every rank needs a client")
        rank, world = source or _rank_world()
        if source is None and "sync_id" not in push_kw:
            push_kw["sync_id"] = _shared_sync_id()
        plan = client.plans.get(module_metas(model, dtype=dtype, filter=filter), world)
        tensors = module_tensors(model, dtype=dtype, filter=filter, only=lambda n: plan.mine(rank, n))
        return client.push(tensors, version, source=(rank, world), plan=plan.key, **push_kw)
    tensors = module_tensors(model, dtype=dtype, filter=filter)
    if client is None:
        for _ in tensors:
            pass
        return None
    return client.push(tensors, version, **push_kw)
