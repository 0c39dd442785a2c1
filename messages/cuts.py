"""The sender's planning step for a push to engines that take slices
(messages/slices.py): what to pack, before any transport carries it.

Rules:
- Given the participants' layouts, a tensor every rank of every layout loads a box of
  travels as those boxes, each distinct box once (`messages.buckets.Sliced`); any other
  tensor travels whole, and a rank that loads a box of it cuts its box on arrival.
- The version's digest stays the whole tensors' (a sliced tensor's own part is hashed
  here too), and `rank_digests` gives each rank's digest over the parts it was sent,
  which the daemon checks each rank's report against (`part_digest` is the one
  definition of a part a rank holds, on both sides).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from messages.buckets import Cast, Digester, Item, Sliced, as_bytes, tensor_view
from messages.checksums import combine, part_hasher
from messages.dtypes import dtype_name
from messages.slices import WHOLE, Box, Layout, Part, layout_of


def box_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of `t` that `box` cuts (no copy: writing it writes `t`)."""
    if len(box) != t.dim():
        raise ValueError(f"a box of {len(box)} dimensions for a tensor of {t.dim()}")
    out = t
    for d, (start, length) in enumerate(box):
        if (start, length) != (0, t.shape[d]):
            out = out.narrow(d, start, length)
    return out


def cut(t: torch.Tensor, part: Part) -> torch.Tensor:
    """The rank's part of `t`, contiguous (a copy unless it already is one)."""
    return t if part == WHOLE else box_view(t, part).contiguous()


class Cuts:
    """The sender's cuts for one push to the participants' layouts (module rules)."""

    def __init__(self, layouts: Mapping[str, Layout]) -> None:
        self.layouts = dict(layouts)

    @classmethod
    def of(cls, wire: Mapping[str, Sequence[Mapping[str, Any]]]) -> Cuts | None:
        """The cuts for a begin reply's layouts (`BeginReply.layouts`); None without any."""
        return cls({k: layout_of(v) for k, v in wire.items()}) if wire else None

    def _parts(self, name: str) -> list[Part]:
        return [r[name] for layout in self.layouts.values() for r in layout if name in r]

    def boxes(self, name: str) -> list[Box]:
        """The distinct boxes `name` travels as; empty where it travels whole (no rank
        loads a box of it, or some rank loads the whole)."""
        parts = self._parts(name)
        return [] if WHOLE in parts else _distinct_boxes(parts)

    def items(self, named: Iterable[tuple[str, Item]], digester: Digester) -> Iterator[tuple[str, Item]]:
        """`named` as the items to pack: each tensor whole, or as its distinct boxes."""
        for name, t in named:
            if not isinstance(t, (torch.Tensor, Cast)):  # a patch, a piece: as it is
                yield name, t
                continue
            parts = self._parts(name)
            boxes = _distinct_boxes(parts)
            if not boxes or WHOLE in parts:
                yield name, t
                # ranks that cut their box from the whole on arrival: their parts, hashed here
                if boxes:
                    whole = _tensor(t)
                    for box in boxes:
                        digester.add(name, part_digest(name, whole.shape, box, cut(whole, box)), box)
                continue
            src = _tensor(t)
            digester.update(name, src)  # the tensor's own part: the version's digest is the whole's
            for box in boxes:
                yield name, Sliced(cut(src, box), box, tuple(src.shape))

    def rank_digests(self, digester: Digester) -> dict[str, tuple[str, ...]]:
        """Per layout key, each rank's digest over the parts of the tensors it loads that
        this push sent (the whole's part, or its box's)."""
        out: dict[str, tuple[str, ...]] = {}
        for key, layout in self.layouts.items():
            ranks = []
            for r in layout:
                parts = []
                for name, p in r.items():
                    got = digester.part(name) if p == WHOLE else digester.slices.get((name, p))
                    if got is not None:
                        parts.append(got)
                ranks.append(combine(parts))
            out[key] = tuple(ranks)
        return out


class Planned:
    """What a push learns at its begin, for an encoder that runs as the push streams (a
    delta push patches each rank's box, not the whole): the cuts (None: every tensor
    travels whole) and the push's digester. The push fills it before reading a tensor."""

    __slots__ = ("cuts", "digester")

    def __init__(self) -> None:
        self.cuts: Cuts | None = None
        self.digester: Digester | None = None


def _distinct_boxes(parts: Iterable[Part]) -> list[Box]:
    return sorted({p for p in parts if isinstance(p, tuple)})


def _tensor(t: torch.Tensor | Cast) -> torch.Tensor:
    return (t.materialize() if isinstance(t, Cast) else t).detach()


def part_digest(name: str, full_shape: Sequence[int], part: Part, held: torch.Tensor) -> bytes:
    """The digest part of what a rank holds of tensor `name`: `held` is its part (the
    whole tensor, or the box's contents)."""
    box = None if part == WHOLE else part
    h = part_hasher(name, dtype_name(held.dtype), tuple(int(n) for n in full_shape), box=box)
    b = as_bytes(held)
    if b.numel():
        h.update(tensor_view(b))
    return h.digest()
