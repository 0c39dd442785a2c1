"""The sender's cuts (messages/cuts.py) and the wire's boxes: what is packed for a set
of layouts, each rank's digest on both sides, and the refusals of a bad box or layout."""

from __future__ import annotations

import pytest
import torch

from messages import codec, schema
from messages.buckets import Assembler, Digester, iter_buckets, unpack
from messages.checksums import combine
from messages.cuts import Cuts, cut, part_digest
from messages.errors import MessageError
from messages.slices import WHOLE, layout_key, layout_refusal, llama_tp_layout, rank_bytes, to_wire

STATE = {
    "model.embed_tokens.weight": torch.randn(32, 8),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
    "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8),
    "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16),
    "model.norm.weight": torch.randn(8),
}
SHAPES = {n: tuple(t.shape) for n, t in STATE.items()}


def _pack(cuts, bucket_bytes=1 << 20, split=False):
    d = Digester()
    buckets = list(iter_buckets(cuts.items(STATE.items(), d), bucket_bytes, digester=d, split=split))
    return buckets, d


def _held(layout, buckets):
    """What each rank of `layout` holds after taking its parts of every bucket, and its
    digest (the receiving side's definition)."""
    held = [{} for _ in layout]
    pieces = Assembler()
    for b in buckets:
        whole = [m for m in b.tensors if m.start is None]
        items = list(zip(whole, (t for _, t in unpack(whole, b.frame())), strict=True))
        for m in b.tensors:
            if m.start is not None:
                added = pieces.add(m, b.frame())
                if added.whole is not None:
                    meta, data, _ = added.whole
                    items += list(
                        zip([meta], (t for _, t in unpack([meta], memoryview(data.numpy()))), strict=True)
                    )
        for m, t in items:
            for r, rank_map in enumerate(layout):
                mine = rank_map.get(m.name)
                if mine is None:
                    continue
                if m.box is None:
                    held[r][m.name] = cut(t, mine).clone()
                elif tuple(m.box) == mine:
                    held[r][m.name] = t.clone()
    digests = [
        combine(part_digest(n, SHAPES[n], layout[r][n], t) for n, t in h.items()) for r, h in enumerate(held)
    ]
    return held, digests


@pytest.mark.parametrize("tp", [2, 4])
def test_each_distinct_box_is_packed_once_and_every_rank_gets_its_part(tp):
    layout = llama_tp_layout(SHAPES, tp)
    key = layout_key(layout)
    cuts = Cuts({key: layout})
    buckets, d = _pack(cuts)
    metas = [m for b in buckets for m in b.tensors]
    # the split tensors go as tp boxes each, the norm whole, once
    assert sum(1 for m in metas if m.name == "model.norm.weight") == 1
    assert all(sum(1 for m in metas if m.name == n) == tp for n in SHAPES if n != "model.norm.weight")
    sent = sum(m.nbytes for m in metas)
    whole = sum(t.numel() * 4 for t in STATE.values())
    assert sent == whole  # the boxes tile each tensor: the model's bytes, not tp copies
    held, digests = _held(layout, buckets)
    for r, rank_map in enumerate(layout):
        assert set(held[r]) == set(rank_map)
        for n, part in rank_map.items():
            assert torch.equal(held[r][n], cut(STATE[n], part))
    spec = {n: schema.ParamSpec(n, "float32", s) for n, s in SHAPES.items()}
    assert [sum(t.numel() * 4 for t in h.values()) for h in held] == rank_bytes(layout, spec)
    # the sender's rank digests equal what each rank computes over what it holds
    assert cuts.rank_digests(d) == {key: tuple(digests)}
    # and the version's digest stays the whole tensors'
    from messages.buckets import digest

    assert d.hexdigest() == digest(STATE.items())


def test_a_box_larger_than_a_bucket_travels_as_pieces_of_the_box():
    layout = llama_tp_layout(SHAPES, 2)
    cuts = Cuts({layout_key(layout): layout})
    buckets, d = _pack(cuts, bucket_bytes=128, split=True)
    assert any(m.start is not None and m.box is not None for b in buckets for m in b.tensors)
    assert all(b.nbytes <= 128 for b in buckets)
    for b in buckets:  # each passes the codec's checks
        codec.decode(
            [
                codec.encode(schema.Bucket(sync_id="s", seq=b.seq, tensors=b.tensors, checksum=b.checksum))[
                    0
                ],
                b.frame(),
            ]
        )
    held, digests = _held(layout, buckets)
    assert cuts.rank_digests(d)[layout_key(layout)] == tuple(digests)
    assert torch.equal(
        held[1]["model.layers.0.mlp.down_proj.weight"], STATE["model.layers.0.mlp.down_proj.weight"][:, 8:]
    )


def test_a_tensor_some_rank_loads_whole_is_sent_whole_and_the_others_cut_it():
    a = llama_tp_layout(SHAPES, 2)
    b = [{n: WHOLE for n in SHAPES}]  # an engine of one rank: every tensor whole
    cuts = Cuts({layout_key(a): a, layout_key(b): b})
    buckets, d = _pack(cuts)
    assert all(m.box is None for bk in buckets for m in bk.tensors)
    _, digests = _held(a, buckets)
    assert cuts.rank_digests(d)[layout_key(a)] == tuple(digests)


def test_the_codec_refuses_a_box_outside_its_tensor_or_of_the_wrong_size():
    t = torch.arange(16, dtype=torch.float32).reshape(4, 4)

    def bucket(box, nbytes):
        m = schema.TensorMeta("w", "float32", (4, 4), 0, nbytes, box=box)
        frame = t.numpy().tobytes()[:nbytes]
        header, *_ = codec.encode(schema.Bucket(sync_id="s", seq=0, tensors=(m,), checksum=0))
        return codec.decode([header, frame])

    bucket(((0, 2), (0, 4)), 32)  # a good one decodes
    with pytest.raises(MessageError, match="outside dimension 0"):
        bucket(((3, 2), (0, 4)), 32)
    with pytest.raises(MessageError, match="nbytes"):
        bucket(((0, 2), (0, 4)), 64)
    with pytest.raises(MessageError, match="dimensions"):
        bucket(((0, 2),), 32)


def test_a_declared_layout_that_does_not_fit_the_spec_is_refused():
    layout = llama_tp_layout(SHAPES, 2)
    spec = {n: schema.ParamSpec(n, "float32", s) for n, s in SHAPES.items()}
    good = schema.Slices(
        key=layout_key(layout), rank_bytes=tuple(rank_bytes(layout, spec)), ranks=to_wire(layout)
    )
    assert layout_refusal(good, spec) is None
    assert layout_refusal(schema.Slices(key="ab", rank_bytes=(1,)), spec) is None  # declared only
    bad = [dict(r) for r in layout]
    bad[1]["model.norm.weight"] = ((4, 8),)
    wrong = schema.Slices(key="ab", rank_bytes=good.rank_bytes, ranks=to_wire(bad))
    assert "outside its shape" in (layout_refusal(wrong, spec) or "")
    bad[1] = {"nope": WHOLE}
    assert "not in its spec" in (
        layout_refusal(schema.Slices(key="ab", rank_bytes=good.rank_bytes, ranks=to_wire(bad)), spec) or ""
    )
    lying = schema.Slices(key="ab", rank_bytes=(1, 1), ranks=good.ranks)
    assert "declared" in (layout_refusal(lying, spec) or "")
