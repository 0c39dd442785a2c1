"""LoRA adapter sync: push only the adapter when only the adapter trains.

Wire format (what engines started with LoRA slots expect, `--lora-rank R --lora-targets`):
for each target module `M` (its checkpoint name, e.g. `model.layers.0.self_attn.q_proj`),
`M.lora_A.weight` [R, in] and `M.lora_B.weight` [out, R], with the adapter's scaling
(`alpha / r`) folded into B and zero rows/columns padding a rank r < R up to R (both
leave B @ A, the update, exactly as the adapter defines it). The push is a partial push
(the base weights stay), so versions, digests, finalize-once, the spool and rollback
apply to adapters as to full weights. Merged-weight sync stays `push` / `push_module`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Unpack

import torch

if TYPE_CHECKING:
    from orchestrator.trainer.options import AdapterPushOptions, Pusher
    from orchestrator.trainer.results import SyncResult

_PEFT_PREFIX = "base_model.model."


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA A/B tensors of a PEFT-wrapped model, by module name (`.default` and the
    `base_model.model.` prefix dropped)."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            name = name.removeprefix(_PEFT_PREFIX)
            name = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", name)
            out[name] = t
    return out


def lora_tensors(
    adapter: Mapping[str, torch.Tensor],
    *,
    alpha: float,
    rank: int | None = None,
    engine_rank: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Wire tensors for `adapter` ({M.lora_A.weight: [r, in], M.lora_B.weight: [out, r]}):
    B scaled by alpha / r, both padded with zeros to `engine_rank`."""
    for name, t in sorted(adapter.items()):
        r = rank or (t.shape[0] if ".lora_A." in name else t.shape[1])
        R = engine_rank or r
        if r > R:
            raise ValueError(f"{name}: adapter rank {r} exceeds the engines' LoRA rank {R}")
        t = t.detach()
        if ".lora_A." in name:
            out = torch.zeros((R, t.shape[1]), dtype=t.dtype)
            out[:r] = t
        elif ".lora_B." in name:
            out = torch.zeros((t.shape[0], R), dtype=t.dtype)
            out[:, :r] = t * (alpha / r)
        else:
            raise ValueError(f"{name} is not a LoRA A or B matrix")
        yield name, out


def push_adapter(
    client: Pusher,
    adapter: Mapping[str, torch.Tensor],
    version: int,
    *,
    alpha: float,
    rank: int | None = None,
    engine_rank: int | None = None,
    **push_kw: Unpack[AdapterPushOptions],
) -> SyncResult:
    """Push `adapter` as `version` (a partial push: the engines keep their base weights)."""
    return client.push(
        lora_tensors(adapter, alpha=alpha, rank=rank, engine_rank=engine_rank),
        version,
        partial=True,
        **push_kw,
    )
