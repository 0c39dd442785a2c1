"""Trainer-side re-encoding: non-thinking prefix, loss masks, routed-experts padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.trainer.rollout import (
    DEFAULT_NON_THINKING_PREFIX,
    IGNORE_INDEX,
    AlignmentError,
    check_alignment,
    non_thinking_prefix_ids,
    pad_routed_experts,
    reencode_response,
    replace_assistant_response_with_ids,
    template_injects_prefix,
)

# The generation part of Qwen3's chat template (Qwen/Qwen3-* tokenizer_config.json),
# with its message loop simplified to plain turns.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog\n\n",
    "hello world\n",
    "user\nassistant\n",
    "What is two plus two?\n\nFour.\n\n",
    "thinking about it\n\nanswer\n",
] * 20


@pytest.fixture(scope="module")
def raw_tokenizer():
    """A real byte-level BPE built offline, with the thinking and chat tokens as added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizer(raw_tokenizer):
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    t.chat_template = QWEN3_CHAT_TEMPLATE
    return t


MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


def test_prefix_ids_are_the_thinking_tokens_and_newlines(tokenizer):
    ids = non_thinking_prefix_ids(tokenizer, DEFAULT_NON_THINKING_PREFIX, enable_thinking=False)
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert ids[0] == think and end_think in ids
    assert tokenizer.decode(ids) == DEFAULT_NON_THINKING_PREFIX
    assert tokenizer.bos_token_id is None or tokenizer.bos_token_id not in ids


def test_prefix_is_none_when_thinking_on_or_anything_is_missing(tokenizer):
    assert non_thinking_prefix_ids(tokenizer, DEFAULT_NON_THINKING_PREFIX, True) is None
    assert non_thinking_prefix_ids(tokenizer, None, False) is None
    assert non_thinking_prefix_ids(tokenizer, "", False) is None
    assert non_thinking_prefix_ids(None, DEFAULT_NON_THINKING_PREFIX, False) is None
    assert non_thinking_prefix_ids(object(), DEFAULT_NON_THINKING_PREFIX, False) is None


def test_raw_tokenizers_tokenizer_gives_the_same_ids(tokenizer, raw_tokenizer):
    assert non_thinking_prefix_ids(
        raw_tokenizer, DEFAULT_NON_THINKING_PREFIX, False
    ) == non_thinking_prefix_ids(tokenizer, DEFAULT_NON_THINKING_PREFIX, False)


def test_qwen3_template_injects_the_prefix_only_without_thinking(tokenizer):
    assert template_injects_prefix(QWEN3_CHAT_TEMPLATE)
    assert not template_injects_prefix("{{ messages[0].content }}")
    off = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    on = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert off == on + DEFAULT_NON_THINKING_PREFIX


def test_reencoded_sequence_equals_what_the_engine_was_given(tokenizer):
    """The engine saw template(enable_thinking=False) + response: re-encoding must match it."""
    engine_prompt = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    response = tokenizer.encode("Four.<|im_end|>", add_special_tokens=False)
    engine_seq = tokenizer.encode(engine_prompt, add_special_tokens=False) + response
    prompt_ids = tokenizer.encode(
        tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=True
        ),
        add_special_tokens=False,
    )
    prefix = non_thinking_prefix_ids(tokenizer, DEFAULT_NON_THINKING_PREFIX, False)
    input_ids, mask, labels = reencode_response(prompt_ids, response, prefix)
    assert input_ids == engine_seq
    assert sum(mask) == len(response) and mask[-len(response) :] == [1] * len(response)
    assert labels[-len(response) :] == response
    assert set(labels[: -len(response)]) == {IGNORE_INDEX}
    # without the prefix every response token would sit len(prefix) positions early
    wrong, _, _ = reencode_response(prompt_ids, response, None)
    assert wrong != engine_seq and len(engine_seq) - len(wrong) == len(prefix)


def test_replace_assistant_response_carries_ids_and_mask():
    msgs = MESSAGES + [{"role": "assistant", "content": "text that will be replaced", "name": "a"}]
    out = replace_assistant_response_with_ids(msgs, [7, 8, 9], [1, 2])
    assert out[-1] == {
        "role": "assistant",
        "name": "a",
        "content": None,
        "token_ids": [1, 2, 7, 8, 9],
        "loss_mask": [0, 0, 1, 1, 1],
    }
    assert msgs[-1]["content"] == "text that will be replaced"  # input not mutated
    appended = replace_assistant_response_with_ids(MESSAGES, [5], None)
    assert len(appended) == 2 and appended[-1]["token_ids"] == [5] and appended[-1]["loss_mask"] == [1]


@pytest.mark.parametrize("bad", [[1, -2], [1, 2.0], "abc", [True]])
def test_bad_token_ids_are_value_or_type_errors(bad):
    with pytest.raises((ValueError, TypeError)):
        reencode_response([1], bad, None)


# -- routed experts ---------------------------------------------------------------------


def routed(n, layers=2, topk=2, start=1):
    return torch.arange(start, start + n * layers * topk, dtype=torch.int32).reshape(n, layers, topk)


def test_right_padding_repeats_the_last_entry_left_padding_prepends_zeros():
    r = routed(3)
    right = pad_routed_experts(r, 5, "right")
    assert right.shape == (5, 2, 2) and torch.equal(right[:3], r)
    assert torch.equal(right[3], r[-1]) and torch.equal(right[4], r[-1])
    left = pad_routed_experts(r, 5, "left")
    assert left.shape == (5, 2, 2) and torch.equal(left[2:], r) and not left[:2].any()


@pytest.mark.parametrize(
    "args,match",
    [
        ((routed(4), 3, "right"), "more than target_len"),
        ((torch.zeros(3, 2), 5, "right"), "layers, topk"),
        ((routed(2), 4, "middle"), "padding_side"),
        ((routed(2), -1, "left"), "non-negative"),
        ((routed(0), 3, "right"), "empty"),
    ],
)
def test_bad_padding_requests_are_clear_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        pad_routed_experts(*args)


def test_check_alignment_names_the_first_uncovered_position():
    ids = list(range(10, 16))
    check_alignment(ids, routed(6))
    with pytest.raises(AlignmentError) as ei:
        check_alignment(ids, routed(4))
    assert ei.value.position == 4 and "position 4" in str(ei.value)
    with pytest.raises(AlignmentError) as ei:
        check_alignment(ids, routed(8))
    assert ei.value.position == 6


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 999), max_size=20),
    prefix=st.one_of(st.none(), st.lists(st.integers(0, 999), min_size=1, max_size=6)),
    response=st.lists(st.integers(0, 999), max_size=20),
    extra=st.integers(0, 10),
    side=st.sampled_from(["left", "right"]),
)
def test_reencode_and_pad_properties(prompt, prefix, response, extra, side):
    ids, mask, labels = reencode_response(prompt, response, prefix)
    n_prefix = len(prefix or [])
    assert len(ids) == len(mask) == len(labels) == len(prompt) + n_prefix + len(response)
    assert sum(mask) == len(response)
    assert [t for t, m in zip(ids, mask) if m] == response == [lab for lab in labels if lab != IGNORE_INDEX]
    assert ids[len(prompt) : len(prompt) + n_prefix] == (prefix or [])
    # the engine recorded routing for the forwarded tokens; pad to the re-encoded length
    have = max(1, len(ids) - extra) if side == "right" else max(0, len(ids) - extra)
    rec = routed(min(have, len(ids))) if ids else routed(0)
    if side == "right" and rec.shape[0] == 0:
        return
    padded = pad_routed_experts(rec, len(ids), side)
    assert padded.shape[0] == len(ids)
    check_alignment(ids, padded)
    kept = padded[: rec.shape[0]] if side == "right" else padded[len(ids) - rec.shape[0] :]
    assert torch.equal(kept, rec)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 30), extra=st.integers(0, 30), side=st.sampled_from(["left", "right"]))
def test_padding_length_is_exact_on_both_sides(n, extra, side):
    if side == "right" and n == 0 and extra > 0:
        with pytest.raises(ValueError):
            pad_routed_experts(routed(0), extra, side)
        return
    out = pad_routed_experts(routed(n), n + extra, side)
    assert out.shape == (n + extra, 2, 2)
    if extra == 0:
        assert torch.equal(out, routed(n))


# -- regression tests for the three review findings ---------------------------------------


def _prefix_contract(fn, tokenizer):
    enc = tokenizer.encode(DEFAULT_NON_THINKING_PREFIX, add_special_tokens=False)
    expected = list(getattr(enc, "ids", enc))
    assert len(expected) >= 3
    assert fn(tokenizer, DEFAULT_NON_THINKING_PREFIX, False) == expected
    assert fn(tokenizer, DEFAULT_NON_THINKING_PREFIX, True) is None


def test_regression_undefined_variable(tokenizer):
    """Review finding 1: the prefix helper referenced a name that did not exist."""

    def buggy(tok, template_prefix, enable_thinking):
        if enable_thinking or not template_prefix:
            return None
        return tok.encode(prefix_text, add_special_tokens=False)  # noqa: F821  (the bug)

    with pytest.raises(NameError):
        _prefix_contract(buggy, tokenizer)
    _prefix_contract(non_thinking_prefix_ids, tokenizer)


def test_regression_unsupported_keyword_call(raw_tokenizer):
    """Review finding 2: encode was called with a keyword the tokenizer does not take."""

    def buggy(tok, template_prefix, enable_thinking):
        if enable_thinking or not template_prefix:
            return None
        return tok.encode(template_prefix, add_bos=False).ids  # the bug: no such keyword

    with pytest.raises(TypeError):
        _prefix_contract(buggy, raw_tokenizer)
    _prefix_contract(non_thinking_prefix_ids, raw_tokenizer)


def _padding_contract(fn):
    for side in ("left", "right"):
        for n, target in ((3, 7), (5, 5), (1, 2)):
            out = fn(routed(n), target, side)
            assert out.shape[0] == target, (side, n, target, out.shape[0])


def test_regression_wrong_length_padding():
    """Review finding 3: the pad length was the target, not the missing count."""

    def buggy(r, target_len, padding_side):
        pad_len = target_len  # the bug: should be target_len - len(r)
        if padding_side == "right":
            return torch.cat([r, r[-1:].expand(pad_len, *r.shape[1:])])
        return torch.cat([r.new_zeros((pad_len, *r.shape[1:])), r])

    with pytest.raises(AssertionError):
        _padding_contract(buggy)
    _padding_contract(pad_routed_experts)
