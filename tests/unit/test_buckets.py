"""Bucketing, zero-copy unpacking, checksums and the order-independent digest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.buckets import ALIGN, digest, iter_buckets, unpack
from messages.checksums import bucket_checksum
from messages.dtypes import DTYPES


def _sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 4
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return x.to(torch.int64).clamp(-100, 100).to(dtype) if dtype != torch.uint8 else x.abs().to(dtype)
    return x.to(dtype)


def _roundtrip(named, bucket_bytes=1 << 20):
    out = {}
    for b in iter_buckets(named, bucket_bytes):
        assert bucket_checksum(b.frame(), b.tensors) == b.checksum
        for name, t in unpack(b.tensors, bytes(b.frame())):
            out[name] = t
    return out


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exact(name):
    t = _sample(DTYPES[name])
    got = _roundtrip([("t", t)])["t"]
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_empty_scalar_and_non_contiguous_tensors_round_trip():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    named = [
        ("empty", torch.empty(0, 3)),
        ("scalar", torch.tensor(2.5)),
        ("transposed", base.t()),
        ("strided", base[:, ::2]),
    ]
    got = _roundtrip(named)
    for name, t in named:
        assert got[name].shape == t.shape
        assert torch.equal(got[name], t)


def test_buckets_respect_size_and_a_big_tensor_goes_alone():
    named = [(f"s{i}", torch.zeros(100)) for i in range(10)] + [("big", torch.zeros(10_000))]
    buckets = list(iter_buckets(named, 1024))
    assert [b.seq for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.nbytes <= 1024 or len(b.tensors) == 1
    assert [t.name for t in buckets[-1].tensors] == ["big"]
    assert all(t.offset % ALIGN == 0 for b in buckets for t in b.tensors)


def test_unpack_returns_views_into_the_received_buffer_without_copying():
    (b,) = list(iter_buckets([("a", torch.ones(16)), ("b", torch.zeros(8, 2))]))
    buf = bytearray(b.frame())
    views = dict(unpack(b.tensors, buf))
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    for meta in b.tensors:
        assert views[meta.name].data_ptr() == base + meta.offset
    buf[b.tensors[0].offset : b.tensors[0].offset + 4] = torch.tensor([7.0]).numpy().tobytes()
    assert views["a"][0].item() == 7.0  # a view: it sees the buffer change


def test_checksum_detects_one_flipped_bit():
    (b,) = list(iter_buckets([("a", torch.randn(256))]))
    raw = bytearray(b.frame())
    raw[100] ^= 0x01
    assert bucket_checksum(bytes(raw), b.tensors) != b.checksum


def test_unsupported_dtype_is_refused_before_packing():
    with pytest.raises(ValueError, match="not supported"):
        list(iter_buckets([("c", torch.zeros(2, dtype=torch.complex64))]))


def test_digest_changes_with_any_byte_name_or_shape():
    a = {"x": torch.arange(6, dtype=torch.float32), "y": torch.ones(2)}
    d0 = digest(a.items())
    b = {**a, "x": a["x"].clone()}
    b["x"][3] += 1
    assert digest(b.items()) != d0
    assert digest({"x2": a["x"], "y": a["y"]}.items()) != d0
    assert digest({"x": a["x"].reshape(2, 3), "y": a["y"]}.items()) != d0
    assert digest({"x": a["x"].to(torch.float64), "y": a["y"]}.items()) != d0


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    bucket_bytes=st.integers(64, 4096),
    seed=st.integers(0, 2**16),
)
def test_digest_is_independent_of_order_and_bucketing(sizes, bucket_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    named = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate(sizes)]
    perm = torch.randperm(len(named), generator=g).tolist()
    shuffled = [named[i] for i in perm]
    got = _roundtrip(shuffled, bucket_bytes)
    assert digest(named) == digest(shuffled) == digest(got.items())
    assert set(got) == {n for n, _ in named}


def test_one_pass_gives_the_checksum_and_every_digest_part(monkeypatch):
    """Packing hashes each tensor's bytes once: that hash is the tensor's digest part and
    a piece of the bucket's checksum, so an engine's single pass (hash_bucket) checks the
    bucket and yields the parts of the digest the trainer computed."""
    import messages.buckets as mb
    from messages.buckets import Digester, hash_bucket
    from messages.checksums import part_hasher

    fed = []

    class Counting:
        def __init__(self, *a):
            self.h = part_hasher(*a)

        def update(self, b):
            fed.append(memoryview(b).nbytes)
            self.h.update(b)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(mb, "part_hasher", Counting)
    named = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int32)), ("c", torch.randn(64))]
    d = Digester()
    (b,) = list(iter_buckets(named, 1 << 20, digester=d))
    assert sum(fed) == sum(m.nbytes for m in b.tensors)  # every byte hashed once, padding never
    got, parts, hashed = hash_bucket(b.frame(), b.tensors, parts=True)
    assert hashed == sum(m.nbytes for m in b.tensors)
    assert got == b.checksum
    assert d.hexdigest() == digest(named)
    ref = Digester()
    for name, p in parts.items():
        ref.add(name, p)
    assert ref.hexdigest() == digest(named)
    raw = bytearray(b.frame())
    last = b.tensors[-1]
    raw[last.offset + last.nbytes - 1] ^= 0x80  # the bucket's very last byte
    assert bucket_checksum(bytes(raw), b.tensors) != b.checksum


# -- tensors larger than a bucket: split by the source, assembled by the receiver ----------
from messages import codec, schema  # noqa: E402
from messages.buckets import Assembler, Cast, Digester  # noqa: E402
from messages.errors import MessageError  # noqa: E402


def _assemble(buckets):
    """What a receiver loads: whole tensors, and split ones once their last piece is in."""
    asm, out, parts = Assembler(), {}, {}
    for b in buckets:
        frame = bytes(b.frame())
        for m in b.tensors:
            if m.start is None:
                out[m.name] = next(t for n, t in unpack([m], frame) if n == m.name).clone()
                continue
            done = asm.add(m, frame).whole
            if done is not None:
                meta, data, part = done
                ((_, t),) = unpack([meta], data.numpy())
                out[meta.name], parts[meta.name] = t.clone(), part
    return out, parts, asm


@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    bucket=st.integers(8, 4096),
    cast=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_split_buckets_never_exceed_the_bucket_size_and_reassemble_to_the_same_digest(sizes, bucket, cast):
    g = torch.Generator().manual_seed(len(sizes) * 7919 + bucket)
    named = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate(sizes)]
    items = [(n, Cast(t, torch.bfloat16)) if cast else (n, t) for n, t in named]
    want = {n: (t.to(torch.bfloat16) if cast else t) for n, t in named}
    d = Digester()
    buckets = list(iter_buckets(items, bucket, split=True, digester=d))
    for b in buckets:
        assert b.nbytes <= max(bucket, 4)  # at least one element (4 bytes) per piece
        assert bucket_checksum(b.frame(), b.tensors) == b.checksum
        codec.decode(
            codec.encode(
                schema.Bucket(sync_id="s", seq=b.seq, tensors=b.tensors, checksum=b.checksum), [b.frame()]
            )
        )
    got, parts, asm = _assemble(buckets)
    assert not asm.incomplete()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert d.hexdigest() == digest(want.items())
    for name, part in parts.items():  # an assembled tensor's part is its whole digest part
        one = Digester()
        one.update(name, want[name])
        assert one._parts[name] == part


def test_a_piece_out_of_order_or_of_another_shape_is_refused_and_a_partial_tensor_is_incomplete():
    t = torch.arange(1000, dtype=torch.float32)
    b0, b1, b2, *_ = list(iter_buckets([("w", t)], 1024, split=True))
    asm = Assembler()
    with pytest.raises(MessageError, match="before its first"):
        asm.add(b1.tensors[0], bytes(b1.frame()))
    assert asm.add(b0.tensors[0], bytes(b0.frame())).whole is None
    with pytest.raises(MessageError, match="was due"):
        asm.add(b2.tensors[0], bytes(b2.frame()))
    assert asm.incomplete() == ["w (1024/4000 bytes)"]


@pytest.mark.parametrize(
    "start,nbytes,why",
    [(4, 4000, "piece"), (0, 4000, "piece"), (2, 8, "cuts an element"), (0, 0, "piece")],
)
def test_the_codec_bounds_a_piece_inside_its_tensor(start, nbytes, why):
    meta = schema.TensorMeta("w", "float32", (1000,), 0, nbytes, None, start)
    msg = schema.Bucket(sync_id="s", seq=0, tensors=(meta,), checksum=0)
    with pytest.raises(MessageError, match=why):
        codec.decode(codec.encode(msg, [b"\0" * max(nbytes, 1)]))


def test_a_delta_patch_larger_than_a_bucket_is_sent_as_its_dense_tensor_in_pieces():
    from messages.buckets import Patched

    dense = torch.randn(2000)
    patch = schema.Patch(kind="xor", base=b"\1" * 16, result=b"\0" * 16)
    big = Patched(patch, torch.zeros(6000, dtype=torch.uint8), torch.float32, (2000,), dense=dense)
    buckets = list(iter_buckets([("w", big)], 4096, split=True))
    assert all(m.patch is None and m.start is not None for b in buckets for m in b.tensors)
    got, _parts, _asm = _assemble(buckets)
    assert torch.equal(got["w"], dense)
