"""How a vLLM worker loads one bucket (engines/vllm/extension.py): views of the received
bytes handed to vLLM's own `load_weights`, the weights vLLM's layerwise reload keeps past
the call copied out before the buffer is reused, and the digest fed.

Rules: the views are never cloned before the loaders copy them into the parameters. In a
sync that takes slices, a bucket entry with a box is this rank's only if the box is its
part: it reaches the loader inside a full-shaped placeholder whose box holds the slice
(the loader narrows to exactly that box, as recorded from it), and the digest is the
rank's, over the parts its map lists (`messages.cuts.part_digest`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import NotRequired, TypedDict

import torch

from messages.buckets import Digester
from messages.cuts import box_view, cut, part_digest
from messages.dtypes import DTYPES, Dtype
from messages.slices import WHOLE, Box, Part, box_shape


class TensorWire(TypedDict):
    """A tensor of a load rpc (`TensorMeta.to_wire()`): the fields a worker reads."""

    name: str
    dtype: Dtype
    shape: list[int]
    offset: int
    nbytes: int
    box: NotRequired[list[list[int]]]  # a box of the tensor (a rank's slice)


def box_of(m: TensorWire) -> Box | None:
    b = m.get("box")
    return None if b is None else tuple((int(s), int(n)) for s, n in b)


def pending_weights(flat: torch.Tensor) -> Iterator[tuple[dict[str, object], str, torch.Tensor]]:
    """The weights vLLM's layerwise reload still holds as views of `flat`: (the loader
    call's bound arguments, the argument's name, the view).

    vLLM's layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py,
    `make_online_process_loader`) does not load a weight when it arrives: it appends the
    loader call's bound arguments, the weight tensor included, to
    `LAYERWISE_INFO[layer].loaded_weights` and replays them in `_layerwise_process` once
    the layer's last weight has arrived. Weights of a layer split across buckets therefore
    outlive the bucket's `load_weights` call; everything else was consumed by the layer's
    processing."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    ptr = flat.untyped_storage().data_ptr()
    for info in list(LAYERWISE_INFO.values()):
        for _name, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == ptr:
                    yield bound.arguments, key, value


def keep_pending_weights(flat: torch.Tensor) -> int:
    """Copy out the weights vLLM still holds from `flat` when a bucket's load returns
    (`pending_weights`): `flat` (a receive buffer or a reference transport's slot) is about to
    be reused. Those, and only those, are cloned; returns how many."""
    kept = 0
    for args, key, value in list(pending_weights(flat)):
        args[key] = value.clone()
        kept += 1
    return kept


def load_into(
    model: torch.nn.Module,
    flat: torch.Tensor,
    metas: list[TensorWire],
    digester: Digester,
    *,
    layerwise: bool,
    parts: Mapping[str, bytes | str] | None = None,
    phases: dict[str, float] | None = None,
    rank_map: Mapping[str, Part] | None = None,
) -> tuple[int, int]:
    """Load one bucket from views of `flat` (the received bytes): vLLM's weight loaders
    make the one copy into the parameters; the views are not cloned first. Feeds the
    digest (from `parts`, the engine process's hashes of the same bytes, when given);
    returns how many weights had to be kept past the call (layerwise reload), and the
    bytes of the entries taken. With `rank_map` (a sync that takes slices): only this
    rank's boxes are taken, each in a full-shaped placeholder, and the digest is over the
    parts the map lists."""
    t0 = time.perf_counter()
    tensors = []
    rank_parts: dict[str, bytes] = {}
    received = 0
    for m in metas:
        t = flat[m["offset"] : m["offset"] + m["nbytes"]].view(DTYPES[m["dtype"]])
        box = box_of(m)
        if box is not None and rank_map is None:
            raise ValueError(f"{m['name']}: a box of a tensor, in a sync that takes no slices")
        if rank_map is None or box is None:
            tensors.append((m["name"], t.view(m["shape"]) if m["shape"] else t.reshape(())))
            received += m["nbytes"]
            continue
        if rank_map.get(m["name"]) != box:
            continue  # another rank's box
        held = t.view(box_shape(box))
        full = torch.empty(m["shape"], dtype=held.dtype)  # only the box is ever read
        box_view(full, box).copy_(held)
        tensors.append((m["name"], full))
        rank_parts[m["name"]] = part_digest(m["name"], m["shape"], box, held)
        received += m["nbytes"]
    with torch.no_grad():
        model.load_weights(iter(tensors))  # type: ignore[operator]  # vLLM models define it
    t1 = time.perf_counter()
    kept = keep_pending_weights(flat) if layerwise else 0
    t2 = time.perf_counter()
    if rank_map is not None:  # this rank's digest: the parts of what its map lists
        for name, t in tensors:
            mine = rank_map.get(name)
            if name in rank_parts:
                digester.add(name, rank_parts[name])
            elif mine == WHOLE and parts is not None:
                p = parts[name]
                digester.add(name, p if isinstance(p, bytes) else bytes.fromhex(p))
            elif mine is not None:
                digester.add(name, part_digest(name, t.shape, mine, cut(t, mine)))
    elif parts is not None:  # hex from the engine process, bytes from this worker's own pass
        for name, _t in tensors:
            p = parts[name]
            digester.add(name, p if isinstance(p, bytes) else bytes.fromhex(p))
    else:
        for name, t in tensors:
            digester.update(name, t)
    if phases is not None:
        for phase, s in (
            ("vllm_load_weights", t1 - t0),
            ("vllm_keep_pending", t2 - t1),
            ("worker_digest", time.perf_counter() - t2),
        ):
            phases[phase] = phases.get(phase, 0.0) + s
    return kept, received
