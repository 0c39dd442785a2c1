"""Everything a trainer imports, in one place.

- `TrainerClient` / `SyncResult`: push named tensors (or a checkpoint directory through
  `iter_safetensors`) to every engine, version by version; `make_probes` builds the greedy
  canaries a push can carry.
- `rollout`: token-in-token-out re-encoding helpers (the non-thinking prefix, routed
  experts padding and alignment).
"""

from messages.canary import make_probes
from messages.checkpoint import iter_safetensors
from orchestrator.client import SyncResult, TrainerClient
from orchestrator.trainer.rollout import (check_alignment, non_thinking_prefix_ids, pad_routed_experts,
                                          reencode_response, replace_assistant_response_with_ids,
                                          template_injects_prefix)

__all__ = ["TrainerClient", "SyncResult", "make_probes", "iter_safetensors", "check_alignment",
           "non_thinking_prefix_ids", "pad_routed_experts", "reencode_response",
           "replace_assistant_response_with_ids", "template_injects_prefix"]
