"""Version labels on rollouts (pure logic over vLLM's span shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from orchestrator.trainer.rollout import label_spans, oldest_version, too_stale


@dataclass
class Span:  # the shape of vllm.outputs.WeightVersionSpan
    version: str
    start: int
    end: int


@dataclass
class Output:  # the shape of vllm.outputs.CompletionOutput (what matters here)
    weight_versions: list[Span] | None


def test_spans_from_vllm_outputs_and_from_token_in_token_out_json():
    out = Output([Span("7", 0, 3), Span("8", 3, 8)])
    assert label_spans(out) == [(7, 0, 3), (8, 3, 8)]
    as_json = {
        "weight_versions": [{"version": "7", "start": 0, "end": 3}, {"version": "8", "start": 3, "end": 8}]
    }
    assert label_spans(as_json) == [(7, 0, 3), (8, 3, 8)]
    assert oldest_version(out) == 7


def test_an_async_loop_drops_samples_older_than_its_lag():
    mixed = Output([Span("7", 0, 3), Span("9", 3, 8)])  # weights changed mid-generation
    assert not too_stale(mixed, current=9, max_lag=2)
    assert too_stale(mixed, current=10, max_lag=2)  # its first tokens are 3 versions old
    assert not too_stale(Output([Span("10", 0, 8)]), current=10, max_lag=0)


def test_unlabelled_or_foreign_labels_are_refused_and_count_as_stale():
    for bad in (Output(None), Output([]), Output([Span("default", 0, 8)]), {"weight_versions": None}):
        with pytest.raises(ValueError):
            label_spans(bad)
        assert too_stale(bad, current=1, max_lag=5)
    with pytest.raises(ValueError):
        too_stale(Output([Span("1", 0, 1)]), current=1, max_lag=-1)
