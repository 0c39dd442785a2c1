"""Everything a trainer imports, in one place.

- `TrainerClient` / `SyncResult`: push named tensors (or a checkpoint directory through
  `iter_safetensors`) to every engine, version by version; `make_probes` builds the greedy
  canaries a push can carry.
- `push_module` / `TrainerClient.push_module`: a live (possibly FSDP2-sharded) module,
  streamed; `TrainerClient.wait_ready(min_version)` bounds an off-policy trainer's staleness.
- `rollout`: token-in-token-out re-encoding helpers (the non-thinking prefix, routed
  experts padding and alignment).
"""

from messages.canary import make_probes
from messages.checkpoint import iter_safetensors
from orchestrator.trainer.client import SyncResult, TrainerClient
from orchestrator.trainer.module import module_tensors, push_module
from orchestrator.trainer.rollout import (
    check_alignment,
    non_thinking_prefix_ids,
    pad_routed_experts,
    reencode_response,
    replace_assistant_response_with_ids,
    template_injects_prefix,
)

__all__ = [
    "TrainerClient",
    "SyncResult",
    "make_probes",
    "module_tensors",
    "push_module",
    "iter_safetensors",
    "check_alignment",
    "non_thinking_prefix_ids",
    "pad_routed_experts",
    "reencode_response",
    "replace_assistant_response_with_ids",
    "template_injects_prefix",
]
