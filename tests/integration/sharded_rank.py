"""One trainer rank of a sharded push (run by torchrun, or as a plain process with RANK and
WORLD_SIZE set): tests/integration/test_sharded_push.py starts four.

argv: MODE MODEL_DIR ADDR OUT_DIR [SYNC_ID]. Writes OUT_DIR/rank<R>.json: each push's result, or the
error that ended it.
- fsdp: the model is sharded with FSDP2 (gloo); push_module(sharded=True) pushes version 1
  inline, after a step version 2 by shared memory (auto), after another version 3 by the
  collective (each rank broadcasting from its own group), with canaries from the unsharded
  model.
- kill-TRANSPORT: no process group; each rank pushes its part of `perturbed(state, 2)`
  with `push(source=(rank, world))` over TRANSPORT; rank 2 SIGKILLs itself after sending
  half its tensors.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.canary import make_probes
from messages.errors import WeightSyncError
from orchestrator.trainer import TrainerClient
from orchestrator.trainer.module import module_metas
from orchestrator.trainer.shard import plan_shards

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


def step(model: torch.nn.Module, seed: int) -> None:
    """What a training step does to the weights (deterministic; sharded or not alike)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = 0.02 * torch.randn(p.shape, generator=g).to(p.dtype)
            if hasattr(p, "device_mesh"):  # a DTensor: its own shard of the same noise
                from torch.distributed.tensor import distribute_tensor

                noise = distribute_tensor(noise, p.device_mesh, p.placements)
            p.add_(noise)


def fsdp(model_dir: str, addr: str, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = load_model(model_dir)
    step(model, 41)
    probes1 = make_probes(model, PROMPTS, 6)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    out["dtensor"] = type(next(iter(model.parameters()))).__name__ == "DTensor"
    with TrainerClient(addr, timeout=60) as client:
        for version, transport in ((1, "inline"), (2, "auto"), (3, "collective")):
            if version > 1:
                step(model, 40 + version)
                full = load_model(model_dir)  # canaries of the unsharded step-2 model
                full.load_state_dict({n: t.full_tensor() for n, t in model.state_dict().items()})
                probes = make_probes(full, PROMPTS, 6)  # (the full_tensor gathers: every rank)
            else:
                probes = probes1
            r = client.push_module(
                model, version, sharded=True, bucket_bytes=64 * 1024, transport=transport, probes=probes
            )
            out[str(version)] = {
                "state": r.state,
                "sync_id": r.sync_id,
                "digest": r.digest,
                "engines": [e["digest"] for e in r.engines],
                "transport": r.detail["transport"],
                "bytes": r.bytes,
                "source_digest": r.detail["source_digest"],
                "plans_computed": client.plans.computed,
            }
    dist.barrier()
    dist.destroy_process_group()


def kill(model_dir: str, addr: str, out: dict, rank: int, world: int, transport: str, sync_id: str) -> None:
    model = load_model(model_dir)
    state = dict(perturbed(model.state_dict(), 2))
    plan = plan_shards(module_metas(model), world)
    mine = [(n, t) for n, t in state.items() if plan.mine(rank, n)]

    def tensors():
        for i, item in enumerate(mine):
            if rank == 2 and i == len(mine) // 2:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-push: half of its part is sent
            yield item

    with TrainerClient(addr, timeout=60) as client:
        try:
            r = client.push(
                tensors(),
                2,
                source=(rank, world),
                plan=plan.key,
                bucket_bytes=16 * 1024,
                transport=transport,
                sync_id=sync_id,  # the same on every rank: a late rank hears how the sync ended
            )
            out["2"] = {"state": r.state}
        except WeightSyncError as err:
            out["error"] = {"code": err.code.value, "message": err.message, "state": err.state}


def main() -> None:
    mode, model_dir, addr, out_dir = sys.argv[1:5]
    sync_id = sys.argv[5] if len(sys.argv) > 5 else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict = {"rank": rank}
    try:
        if mode == "fsdp":
            fsdp(model_dir, addr, out)
        else:  # kill-TRANSPORT
            kill(model_dir, addr, out, rank, world, mode.split("-", 1)[1], sync_id or "")
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    # Leave without C++ static destructors (torch's gloo teardown has aborted a rank at exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
