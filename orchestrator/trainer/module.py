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
  each rank sending its shard as its own sender: gathering keeps the engines' contract
  (whole tensors in checkpoint layout, which vLLM's loaders need to re-shard for their own
  TP), and costs rank 0 one full tensor of memory at a time (docs/TRAINER.md).
- `filter(name, tensor) -> bool` picks what to send (e.g. only the layers that train).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from messages.buckets import Cast

WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def hf_name(name: str) -> str:
    """`name` without the path components training wrappers add (anywhere for compile,
    FSDP and checkpointing; DDP's `module` only in front). Whole components only: a
    module that is merely named like one (`vision_module`) keeps its name."""
    parts = [p for p in name.split(".") if p not in WRAPPERS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))


def module_tensors(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    filter: Callable[[str, torch.Tensor], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | Cast]]:
    """(HF name, full tensor) for every parameter and persistent buffer, tied weights once,
    gathered lazily; with `dtype`, floating tensors come as `Cast` (cast while packed;
    `.materialize()` gives the tensor). Every rank of a sharded model must consume it in
    lockstep."""
    seen: set[tuple[Any, ...]] = set()
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
        if hasattr(t, "full_tensor"):  # DTensor (FSDP2): the whole tensor, on every rank
            t = t.full_tensor()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            yield name, Cast(t, dtype)  # cast as it is packed, into the bucket itself
            continue
        yield name, t


def push_module(
    client: Any,
    model: torch.nn.Module,
    version: int,
    *,
    dtype: torch.dtype | None = None,
    filter: Callable[[str, torch.Tensor], bool] | None = None,
    **push_kw: Any,
) -> Any:
    """Push `model` as `version` through `client` (a TrainerClient); on ranks without a
    client (None), take part in the gathers of a sharded model and return None."""
    tensors = module_tensors(model, dtype=dtype, filter=filter)
    if client is None:
        for _ in tensors:
            pass
        return None
    return client.push(tensors, version, **push_kw)
