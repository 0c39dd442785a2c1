"""messages/slices.py: the box an op chain cuts, the rank's part, the Llama partition."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.cuts import cut
from messages.schema import ParamSpec
from messages.slices import (
    WHOLE,
    NotABox,
    box_of_chain,
    layout_key,
    llama_tp_layout,
    part_bytes,
    part_of,
    rank_bytes,
)


def _replay(t: torch.Tensor, chain) -> torch.Tensor:
    """What vLLM's sharded_rdt does with a chain: run each op on the real tensor."""
    out = t
    for op, args, kwargs in chain:
        out = getattr(out, op)(*args, **dict(kwargs))
    return out


@st.composite
def tensors_and_chains(draw):
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 9)) for _ in range(ndim)]
    cur = list(shape)
    chain = []
    for _ in range(draw(st.integers(0, 4))):
        dim = draw(st.integers(-ndim, ndim - 1))
        d = dim % ndim
        kind = draw(st.sampled_from(["narrow", "chunk", "slice", "contiguous"]))
        if kind == "narrow":
            start = draw(st.integers(0, cur[d]))
            length = draw(st.integers(0, cur[d] - start))
            chain.append(("narrow", (dim, start, length), ()))
            cur[d] = length
        elif kind == "chunk" and cur[d] > 0:
            n = draw(st.integers(1, 4))
            step = -(-cur[d] // n)
            pieces = len(range(0, cur[d], step))
            i = draw(st.integers(0, pieces - 1))
            chain.append(("chunk", (n, dim), ()))
            chain.append(("__getitem__", (i,), ()))
            cur[d] = min(step, cur[d] - i * step)
        elif kind == "slice":
            lo = draw(st.integers(0, cur[0]))
            hi = draw(st.integers(lo, cur[0]))
            chain.append(("__getitem__", (slice(lo, hi),), ()))
            cur[0] = hi - lo
        else:
            chain.append(("contiguous", (), ()))
    return shape, chain


@settings(max_examples=300, deadline=None)
@given(tensors_and_chains())
def test_the_box_of_a_chain_cuts_what_replaying_the_chain_gives(case):
    shape, chain = case
    t = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
    box = box_of_chain(shape, chain)
    want = _replay(t, chain)
    got = cut(t, part_of(shape, box))
    assert got.shape == want.shape and torch.equal(got, want.contiguous())
    assert part_bytes(shape, part_of(shape, box), "float32") == want.numel() * 4


def test_ops_that_are_not_a_box_are_refused():
    for chain in (
        [("transpose", (0, 1), ())],
        [("view", (-1,), ())],
        [("chunk", (2, 0), ())],  # never indexed
        [("__getitem__", ((slice(0, 4, 2),),), ())],
    ):
        with pytest.raises(NotABox):
            box_of_chain((4, 4), chain)


SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.k_proj.weight": (32, 64),
    "model.layers.0.self_attn.v_proj.weight": (32, 64),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.gate_proj.weight": (128, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.post_attention_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (256, 64),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_llama_partition_tiles_every_split_tensor_and_replicates_the_rest(tp):
    layout = llama_tp_layout(SHAPES, tp)
    assert len(layout) == tp and all(set(r) == set(SHAPES) for r in layout)
    for name, shape in SHAPES.items():
        t = torch.randn(shape)
        parts = [r[name] for r in layout]
        if tp == 1 or "norm" in name:
            assert parts == [WHOLE] * tp
            continue
        dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
        assert torch.equal(torch.cat([cut(t, p) for p in parts], dim=dim), t), name
    sizes = rank_bytes(layout, {n: ParamSpec(n, "float32", s) for n, s in SHAPES.items()})
    whole = sum(4 * math.prod(s) for s in SHAPES.values())
    norms = sum(4 * math.prod(s) for n, s in SHAPES.items() if "norm" in n)
    assert all(b == (whole - norms) // tp + norms for b in sizes), (sizes, whole)


def test_one_layout_one_key():
    a, b = llama_tp_layout(SHAPES, 2), llama_tp_layout(dict(reversed(list(SHAPES.items()))), 2)
    assert layout_key(a) == layout_key(b)
    assert layout_key(a) != layout_key(llama_tp_layout(SHAPES, 4))
    assert layout_key(a) != layout_key(list(reversed(a)))  # rank order matters


def test_a_split_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        llama_tp_layout({"model.layers.0.mlp.up_proj.weight": (10, 4)}, 4)
