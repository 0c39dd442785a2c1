"""What one engine rank loads of each checkpoint tensor: the whole tensor, a box of it, or
nothing; and the layout of a fleet of ranks as one hashable map.

A box is one contiguous range per dimension, `((start, length), ...)`, as many pairs as
the tensor has dimensions: what a chain of `narrow`s (and `chunk(n, dim)[i]`, and basic
`[a:b]` indexing) cuts from the full tensor. Those are the ops tensor-parallel loaders use
to take a rank's part (vLLM's column- and row-parallel layers, its vocab-parallel
embedding); vLLM's own recorder (`vllm.distributed.weight_transfer.sharded_rdt_fake`)
writes them as op chains `((op, args, kwargs), ...)`, and `box_of_chain` reads such a
chain. A chain with any other op (a view, a transpose) is not a box: the rank takes the
whole tensor and its loader cuts it, as today.

Rules:
- A layout is a list, one entry per rank, of `{name: Part}`; a name a rank does not
  list, it does not load. `layout_key` hashes it (xxhash over canonical MessagePack), so
  engines of one layout share one key and a sender cuts once per key.
- `llama_tp_layout` is the partition of vLLM's Llama layers at tensor-parallel size `tp`
  for checkpoint shapes that divide evenly: column-parallel q/k/v/gate/up (dim 0),
  row-parallel o/down (dim 1), vocab-parallel embedding and head (dim 0), everything else
  replicated (whole on every rank).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import msgspec
import xxhash

from messages.dtypes import Dtype, tensor_nbytes
from messages.schema import ParamSpec, Slices

Box: TypeAlias = tuple[tuple[int, int], ...]  # per dimension: (start, length)
WHOLE: Literal["whole"] = "whole"
Part: TypeAlias = "Box | Literal['whole']"
RankMap: TypeAlias = dict[str, Part]
Layout: TypeAlias = list[RankMap]


class NotABox(ValueError):
    """The chain does something other than cut one contiguous range per dimension."""


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_of_chain(
    shape: Sequence[int], chain: Sequence[tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]]]
) -> Box:
    """The box an op chain (vLLM's `OpChain` form) cuts from a tensor of `shape`; raises
    NotABox for an op outside narrow / chunk + index / basic slicing / contiguous."""
    box = list(full_box(shape))
    pending_chunks: tuple[int, int] | None = None  # chunk(n, dim) waiting for its [i]
    for op, args, kwargs in chain:
        kw = dict(kwargs)
        if pending_chunks is not None:
            if op != "__getitem__" or len(args) != 1 or not isinstance(args[0], int):
                raise NotABox(f"chunk not followed by an index: {op}{args}")
            n, dim = pending_chunks
            pending_chunks = None
            start, size = box[dim]
            step = -(-size // n)
            i = args[0] if args[0] >= 0 else n + args[0]
            lo = min(size, i * step)
            box[dim] = (start + lo, min(step, size - lo))
            continue
        if op == "contiguous":
            continue
        if op == "narrow":
            dim, start, length = (list(args) + [kw.get(k) for k in ("dim", "start", "length")[len(args) :]])[
                :3
            ]
            dim = _dim(int(dim), len(box))
            base, size = box[dim]
            start = int(start) if int(start) >= 0 else size + int(start)
            if start < 0 or int(length) < 0 or start + int(length) > size:
                raise NotABox(f"narrow({dim}, {start}, {length}) outside a dimension of {size}")
            box[dim] = (base + start, int(length))
        elif op == "chunk":
            n = int(args[0] if args else kw["chunks"])
            dim = int(args[1] if len(args) > 1 else kw.get("dim", 0))
            pending_chunks = (n, _dim(dim, len(box)))
        elif op == "__getitem__" and len(args) == 1:
            index = args[0] if isinstance(args[0], tuple) else (args[0],)
            if len(index) > len(box):
                raise NotABox(f"index {args[0]!r} has more dimensions than the tensor")
            for d, s in enumerate(index):
                if not isinstance(s, slice) or s.step not in (None, 1):
                    raise NotABox(f"index {args[0]!r} is not a range per dimension")
                base, size = box[d]
                lo, hi, _ = s.indices(size)
                box[d] = (base + lo, max(0, hi - lo))
        else:
            raise NotABox(f"op {op} is not a box")
    if pending_chunks is not None:
        raise NotABox("a chunk never indexed")
    return tuple(box)


def _dim(dim: int, ndim: int) -> int:
    d = dim if dim >= 0 else ndim + dim
    if not 0 <= d < ndim:
        raise NotABox(f"dimension {dim} of a {ndim}-d tensor")
    return d


def part_of(shape: Sequence[int], box: Box) -> Part:
    """`box`, or WHOLE when it covers the whole tensor."""
    return WHOLE if box == full_box(shape) else box


def box_shape(box: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The shape of what `box` cuts: its lengths."""
    return tuple(int(length) for _, length in box)


def box_refusal(box: Sequence[Sequence[int]], shape: Sequence[int]) -> str | None:
    """Why `box` is not a box of a tensor of `shape` (another number of dimensions, a
    range past a dimension's end), or None."""
    if len(box) != len(shape):
        return f"a box of {len(box)} dimensions for a tensor of {len(shape)}"
    for d, ((start, length), size) in enumerate(zip(box, shape, strict=True)):
        if start + length > size:
            return f"box [{start}, {start + length}) outside dimension {d} of {size}"
    return None


def part_bytes(shape: Sequence[int], part: Part, dtype: Dtype) -> int:
    """The bytes of a rank's part of a tensor of `dtype` and `shape`."""
    return tensor_nbytes(dtype, list(shape) if part == WHOLE else list(box_shape(part)))


def layout_key(layout: Layout) -> str:
    """One key per layout: the same parts for the same names give the same key."""
    canon = [sorted((n, p if p == WHOLE else [list(x) for x in p]) for n, p in r.items()) for r in layout]
    return xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(canon))


_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def llama_tp_layout(shapes: Mapping[str, Sequence[int]], tp: int) -> Layout:
    """vLLM's Llama partition at tensor-parallel size `tp` (see the module's rules).
    Raises ValueError where a split dimension does not divide by `tp`."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, not {tp}")
    layout: Layout = [{} for _ in range(tp)]
    for name, shape in shapes.items():
        dim = 0 if (_COLUMN.search(name) or _VOCAB.search(name)) else 1 if _ROW.search(name) else None
        if dim is None or tp == 1:
            for r in range(tp):
                layout[r][name] = WHOLE
            continue
        size = int(shape[dim])
        if size % tp:
            raise ValueError(f"{name}: dimension {dim} ({size}) does not divide by tp={tp}")
        step = size // tp
        for r in range(tp):
            box = list(full_box(shape))
            box[dim] = (r * step, step)
            layout[r][name] = tuple(box)
    return layout


def rank_bytes(layout: Layout, spec: Mapping[str, ParamSpec]) -> list[int]:
    """Bytes each rank of `layout` loads of the checkpoint tensors `spec` describes."""
    return [sum(part_bytes(spec[n].shape, p, spec[n].dtype) for n, p in r.items()) for r in layout]


def layout_of(ranks: Sequence[Mapping[str, Any]]) -> Layout:
    """Rank maps in wire form (`Slices.ranks`: "whole" or [[start, length], ...]) as a layout."""
    return [
        {n: WHOLE if p == WHOLE else tuple((int(a), int(b)) for a, b in p) for n, p in r.items()}
        for r in ranks
    ]


def to_wire(layout: Layout) -> tuple[dict[str, Any], ...]:
    """A layout as `Slices.ranks`."""
    return tuple({n: p if p == WHOLE else tuple(tuple(x) for x in p) for n, p in r.items()} for r in layout)


def layout_refusal(slices: Slices, spec: Mapping[str, ParamSpec]) -> str | None:
    """Why a declared layout cannot be cut for (a name the engine does not expect, a box
    outside its tensor, bytes that differ from the declared), or None."""
    if not slices.ranks:
        return None
    if len(slices.ranks) != len(slices.rank_bytes):
        return f"{len(slices.ranks)} rank maps for {len(slices.rank_bytes)} ranks"
    layout = layout_of(slices.ranks)
    for r, rank_map in enumerate(layout):
        for name, part in rank_map.items():
            p = spec.get(name)
            if p is None:
                return f"rank {r} loads {name!r}, which is not in its spec"
            bad = None if part == WHOLE else box_refusal(part, p.shape)
            if bad is not None:
                return (
                    f"rank {r}: box {list(part)} of {name!r} lies outside its shape {list(p.shape)} ({bad})"
                )
    got = rank_bytes(layout, spec)
    if list(got) != list(slices.rank_bytes):
        return f"rank maps hold {got} bytes per rank, declared {list(slices.rank_bytes)}"
    return None
