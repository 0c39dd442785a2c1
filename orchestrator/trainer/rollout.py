"""Trainer-side helpers for token-in-token-out re-encoding of rollouts.

With `enable_thinking=False`, the chat template of a thinking model (Qwen3 style) puts a
non-thinking prefix (`<think>\\n\\n</think>\\n\\n`) at the start of the assistant turn given
to the rollout engine. The engine's forwarded sequence, and an MoE model's per-token
routed-experts record `[tokens, layers, topk]` (routing replay), include those tokens;
the generated `response_token_ids` do not. Re-encoding must put the prefix back, masked
out of the loss, or every later token is misaligned with the rollout.

Rules: pure functions over token id lists and tensors; every bad input is a `ValueError`
(or `TypeError`) naming what is wrong; nothing here mutates its arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

DEFAULT_NON_THINKING_PREFIX = "<think>\n\n</think>\n\n"
IGNORE_INDEX = -100
PADDING_SIDES = ("left", "right")


def non_thinking_prefix_ids(
    tokenizer: object, template_prefix: str | None, enable_thinking: bool
) -> list[int] | None:
    """Token ids of the non-thinking prefix the template injects, or None.

    None when thinking is on, when the template injects no prefix, or when anything
    needed is missing (no tokenizer, no `encode`, an encoding with no ids). Encoded
    without special tokens (no BOS), as the template emits it. An `encode` that raises is
    not hidden: a silently missing prefix is the misalignment this module prevents.
    Works with a transformers tokenizer and with a raw `tokenizers.Tokenizer`.
    """
    if enable_thinking or not template_prefix or not isinstance(template_prefix, str) or tokenizer is None:
        return None
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        return None
    ids = encode(template_prefix, add_special_tokens=False)
    ids = getattr(ids, "ids", ids)  # a `tokenizers.Tokenizer` returns an Encoding
    if not ids:
        return None
    return [int(i) for i in ids]


def template_injects_prefix(chat_template: str | None, prefix: str = DEFAULT_NON_THINKING_PREFIX) -> bool:
    """Whether a chat template string emits the non-thinking prefix when thinking is off."""
    if not chat_template:
        return False
    escaped = prefix.replace("\n", "\\n")
    return "enable_thinking" in chat_template and (prefix in chat_template or escaped in chat_template)


def _ids(name: str, seq: Sequence[int] | torch.Tensor | None) -> list[int]:
    if seq is None:
        return []
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of token ids, got shape {tuple(seq.shape)}")
        seq = seq.tolist()
    if isinstance(seq, (str, bytes)):
        raise TypeError(f"{name}: expected token ids, got {type(seq).__name__}")
    out = []
    for i, t in enumerate(seq):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{name}[{i}]: token ids are non-negative ints, got {t!r}")
        out.append(int(t))
    return out


def reencode_response(
    prompt_ids: Sequence[int],
    response_token_ids: Sequence[int],
    non_thinking_prefix_ids: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """(input_ids, loss_mask, labels) = prompt + prefix + response.

    Only response tokens count in the loss: mask 1 and label = token id there; prompt and
    prefix have mask 0 and label IGNORE_INDEX (-100).
    """
    prompt = _ids("prompt_ids", prompt_ids)
    prefix = _ids("non_thinking_prefix_ids", non_thinking_prefix_ids)
    response = _ids("response_token_ids", response_token_ids)
    input_ids = prompt + prefix + response
    n_ctx = len(prompt) + len(prefix)
    loss_mask = [0] * n_ctx + [1] * len(response)
    labels = [IGNORE_INDEX] * n_ctx + response
    return input_ids, loss_mask, labels


def replace_assistant_response_with_ids(
    messages: Sequence[Mapping[str, object]],
    response_token_ids: Sequence[int],
    non_thinking_prefix_ids: Sequence[int] | None = None,
) -> list[dict[str, object]]:
    """A copy of `messages` whose last assistant turn is carried as token ids.

    The assistant message gets `token_ids` (prefix + response), `loss_mask` (0 on the
    prefix, 1 on the response) and `content=None`, so a re-encoder emits exactly the tokens
    the engine produced instead of re-tokenizing text. If the conversation does not end
    with an assistant turn, one is appended.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError("messages must be a sequence of chat message dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}]: expected a dict with a 'role'")
        out.append(dict(m))
    prefix = _ids("non_thinking_prefix_ids", non_thinking_prefix_ids)
    response = _ids("response_token_ids", response_token_ids)
    turn = {
        "role": "assistant",
        "content": None,
        "token_ids": prefix + response,
        "loss_mask": [0] * len(prefix) + [1] * len(response),
    }
    if out and out[-1]["role"] == "assistant":
        extra = {k: v for k, v in out[-1].items() if k not in ("content", "token_ids", "loss_mask")}
        out[-1] = {**extra, **turn}
    else:
        out.append(turn)
    return out


def pad_routed_experts(routed: torch.Tensor, target_len: int, padding_side: str) -> torch.Tensor:
    """Pad a `[tokens, layers, topk]` routed-experts record to exactly `target_len` tokens.

    Right padding repeats the last entry (the engine's last routing decision); left padding
    prepends zeros. A record longer than `target_len`, a rank other than 3, an unknown side
    or an empty record to right-pad are `ValueError`s.
    """
    if not isinstance(routed, torch.Tensor):
        raise TypeError(f"routed must be a torch.Tensor, got {type(routed).__name__}")
    if routed.dim() != 3:
        raise ValueError(f"routed must be [tokens, layers, topk], got shape {tuple(routed.shape)}")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if isinstance(target_len, bool) or not isinstance(target_len, int) or target_len < 0:
        raise ValueError(f"target_len must be a non-negative int, got {target_len!r}")
    n = routed.shape[0]
    if n > target_len:
        raise ValueError(f"routed has {n} tokens, more than target_len {target_len}")
    missing = target_len - n
    if missing == 0:
        return routed.clone()
    if padding_side == "right":
        if n == 0:
            raise ValueError("cannot right-pad an empty routed-experts record (no last entry)")
        pad = routed[-1:].expand(missing, *routed.shape[1:])
        return torch.cat([routed, pad], dim=0)
    pad = routed.new_zeros((missing, *routed.shape[1:]))
    return torch.cat([pad, routed], dim=0)


class AlignmentError(ValueError):
    """The routed-experts record does not line up with the re-encoded sequence."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


def check_alignment(input_ids: Sequence[int] | torch.Tensor, routed: torch.Tensor) -> None:
    """Raise `AlignmentError` (a ValueError) with the first misaligned position unless the
    record has exactly one entry per token of `input_ids` (pad it first with
    `pad_routed_experts`)."""
    ids = _ids("input_ids", input_ids)
    if not isinstance(routed, torch.Tensor) or routed.dim() != 3:
        shape = tuple(routed.shape) if isinstance(routed, torch.Tensor) else type(routed).__name__
        raise ValueError(f"routed must be a [tokens, layers, topk] tensor, got {shape}")
    n, need = routed.shape[0], len(ids)
    if n == need:
        return
    position = min(n, need)
    if n < need:
        raise AlignmentError(
            f"routed experts cover {n} tokens but input_ids has {need}: first "
            f"uncovered token at position {position} (id {ids[position]})",
            position,
        )
    raise AlignmentError(
        f"routed experts have {n} entries but input_ids has {need} tokens: "
        f"first extra entry at position {position}",
        position,
    )


# -- version labels: which policy version generated a rollout ------------------------------


def label_spans(output: object) -> list[tuple[int, int, int]]:
    """(version, start, end) spans of a rollout's output tokens, from the weight-version
    labels weightsync sets on vLLM at every commit: a vLLM `CompletionOutput`
    (`.weight_versions`) or a token-in-token-out response dict (`"weight_versions"`).
    A span covers tokens [start, end) generated by that version. ValueError when the
    output carries no labels, or a label that is not a weightsync version (vLLM's
    "default", before the first commit)."""
    spans = (
        output.get("weight_versions")
        if isinstance(output, dict)
        else getattr(output, "weight_versions", None)
    )
    if not spans:
        raise ValueError(
            "the output carries no weight-version labels (not generated by a labelled vLLM engine)"
        )
    out = []
    for s in spans:
        version, start, end = (
            (s["version"], s["start"], s["end"]) if isinstance(s, dict) else (s.version, s.start, s.end)
        )
        try:
            out.append((int(version), int(start), int(end)))
        except (TypeError, ValueError):
            raise ValueError(
                f"weight-version label {version!r} is not a committed weightsync version"
            ) from None
    return out


def oldest_version(output: object) -> int:
    """The oldest policy version that generated any token of `output`."""
    return min(v for v, _, _ in label_spans(output))


def too_stale(output: object, current: int, max_lag: int) -> bool:
    """True when some token of `output` comes from a policy more than `max_lag` versions
    older than `current` (an asynchronous loop drops such samples), or has no label."""
    if max_lag < 0:
        raise ValueError("max_lag must be >= 0")
    try:
        return oldest_version(output) < current - max_lag
    except ValueError:
        return True
