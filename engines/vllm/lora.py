"""LoRA adapter slots for the in-process vLLM engine (`--lora-rank R --lora-targets ...`,
which also turns on vLLM's `enable_lora` with `max_lora_rank >= R`).

Rules: the engine's spec gains `M.lora_A.weight` [R, in] and `M.lora_B.weight` [out, R]
for every target module `M` (orchestrator/trainer/lora.py writes that format: scaling
folded into B, zero-padded to R). Adapter tensors never reach vLLM's `load_weights`: they
are kept here while a sync loads, and at its single finalize written as a PEFT adapter
directory (`adapter_config.json` with `lora_alpha = r`, so the scaling is the folded one)
and added to vLLM under a new id (`LLMEngine.add_lora`); the previous one is removed and
new requests (probes included) use the new adapter. A sync without adapter tensors leaves
the adapter as it is. The adapter's digest is over the tensors as received.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from messages.buckets import Digester
from messages.schema import ParamSpec, TensorMeta

if TYPE_CHECKING:  # vLLM is untyped here (mypy skips it): these are Any to the type checker
    from vllm import LLM
    from vllm.lora.request import LoRARequest

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    return next(r for r in VLLM_RANKS if r >= rank)


def is_lora(name: str) -> bool:
    return name.endswith(".lora_A.weight") or name.endswith(".lora_B.weight")


class LoraSlots:
    def __init__(
        self, model_dir: str, base_spec: dict[str, ParamSpec], rank: int, targets: Sequence[str]
    ) -> None:
        self.model_dir, self.rank, self.targets = model_dir, rank, tuple(targets)
        self.spec: dict[str, ParamSpec] = {}
        for name, p in base_spec.items():
            parts = name.split(".")
            if len(p.shape) == 2 and len(parts) > 2 and parts[-1] == "weight" and parts[-2] in self.targets:
                mod = name.removesuffix(".weight")
                out_f, in_f = p.shape
                self.spec[f"{mod}.lora_A.weight"] = ParamSpec(f"{mod}.lora_A.weight", p.dtype, (rank, in_f))
                self.spec[f"{mod}.lora_B.weight"] = ParamSpec(f"{mod}.lora_B.weight", p.dtype, (out_f, rank))
        if not self.spec:
            raise ValueError(f"no 2-D weight of a module named {self.targets} for LoRA")
        self.pending: dict[str, torch.Tensor] = {}
        self.dir = tempfile.TemporaryDirectory(prefix="weightsync-lora-")
        self.current_id = 0
        self.digest: str | None = None

    def take(self, metas: Sequence[TensorMeta], flat: torch.Tensor) -> list[TensorMeta]:
        """Keep this bucket's adapter tensors (copied: the buffer is reused); return the
        metas of the base tensors, for vLLM's own loader."""
        from messages.dtypes import DTYPES

        base = []
        for m in metas:
            if m.name in self.spec:
                t = flat[m.offset : m.offset + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
                self.pending[m.name] = t.clone()
            else:
                base.append(m)
        return base

    def activate(self, llm: LLM, version: int) -> LoRARequest:
        """Write the adapter received in this sync and make it the one requests use."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = Path(self.dir.name) / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {f"base_model.model.{n}": t.contiguous() for n, t in self.pending.items()},
            str(path / "adapter_model.safetensors"),
        )
        (path / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "task_type": "CAUSAL_LM",
                    "r": self.rank,
                    "lora_alpha": self.rank,
                    "target_modules": list(self.targets),
                    "bias": "none",
                    "lora_dropout": 0.0,
                    "base_model_name_or_path": self.model_dir,
                }
            )
        )
        d = Digester()
        for n in sorted(self.pending):
            d.update(n, self.pending[n])
        old, self.current_id = self.current_id, self.current_id + 1
        request = LoRARequest(f"weightsync-v{version}", self.current_id, str(path))
        llm.llm_engine.add_lora(request)
        if old:
            llm.llm_engine.remove_lora(old)
        self.pending.clear()
        self.digest = d.hexdigest()
        return request

    def close(self) -> None:
        self.dir.cleanup()
