"""Canary probes: the trainer's own greedy answer for a few prompts, which every engine
must reproduce after finalize (else CANARY_MISMATCH, and READY is not reached).

Rules: greedy decoding without a KV cache over any transformers causal LM (deterministic
and model-agnostic); prompts are token ids, never text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from messages.schema import Probe


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """Greedy-decode `max_tokens` tokens after `prompt` (EOS is not a stop: engines use ignore_eos)."""
    device = next(model.parameters()).device  # a trainer's model may live on its GPU
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[0, -1]
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], dtype=torch.long, device=device)], dim=1)
    return tuple(out)


def make_probes(model: torch.nn.Module, prompts: Iterable[Sequence[int]], max_tokens: int = 8) -> list[Probe]:
    """Probes with `expected` = this model's greedy tokens (run on the weights being pushed)."""
    was_training = model.training
    model.eval()
    try:
        return [Probe(tuple(p), max_tokens, greedy(model, p, max_tokens)) for p in prompts]
    finally:
        model.train(was_training)
