"""`python -m bench.vllm`: the same weights into real vLLM, through weightsync vs direct.

Direct: in this process, one `collective_rpc` with a function that runs vLLM's layerwise
reload over the same buckets (`initialize_layerwise_reload`, `model.load_weights` per
bucket, `finalize_layerwise_reload`), the tensors handed over by reference: the cheapest
way the same weights can get into vLLM. Through weightsync: a daemon and a vLLM engine
process, `TrainerClient.push` (digest, checksums, two hops, shared-memory staging,
finalize and prefix-cache reset included). Median of `--repeats` syncs each; prints the
ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def direct_seconds(model_dir: Path, weights: dict, bucket_bytes: int, repeats: int) -> list[float]:
    from orchestrator.config import set_process_env, vllm_process_env

    set_process_env(vllm_process_env(False))
    from vllm import LLM

    from messages.buckets import iter_buckets, unpack

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    buckets = [list(unpack(b.tensors, bytes(b.frame()))) for b in iter_buckets(weights.items(), bucket_bytes)]

    def reload(worker):
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                              initialize_layerwise_reload)
        model = worker.model_runner.get_model()
        initialize_layerwise_reload(model)
        for tensors in buckets:
            model.load_weights(iter(tensors))
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        return True

    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.collective_rpc(reload)
        llm.reset_prefix_cache()
        out.append(time.perf_counter() - t0)
    return out


def weightsync_seconds(workdir: Path, model_dir: Path, weights: dict, bucket_bytes: int,
                       repeats: int) -> list[float]:
    from examples.launch import Cluster

    out = []
    with Cluster(workdir, model_dir, engines=1, backend="vllm") as cluster, \
            cluster.client(timeout=300.0) as client:
        for v in range(1, repeats + 1):
            r = client.push(weights.items(), v, bucket_bytes=bucket_bytes)
            out.append(r.seconds)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", help="tiny | small | medium")
    ap.add_argument("--bucket-bytes", type=int, default=4 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from examples.tiny import build_tiny_llama, perturbed
    from engines.torch_engine import load_model

    with tempfile.TemporaryDirectory(prefix="weightsync-bench-vllm-") as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_llama(tmp / "model", size=args.size)
        weights = dict(perturbed(load_model(model_dir).state_dict(), 1))
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        ws = weightsync_seconds(tmp, model_dir, weights, args.bucket_bytes, args.repeats)
        direct = direct_seconds(model_dir, weights, args.bucket_bytes, args.repeats)
    d, w = statistics.median(direct), statistics.median(ws)
    result = {"model_bytes": nbytes, "bucket_bytes": args.bucket_bytes, "repeats": args.repeats,
              "direct_s": d, "weightsync_s": w, "ratio": w / d,
              "direct_all": direct, "weightsync_all": ws}
    print(f"model {nbytes / 1e6:.1f} MB, buckets of {args.bucket_bytes / 1e6:.1f} MB, "
          f"median of {args.repeats}")
    print(f"  direct in-process load_weights : {d * 1e3:8.1f} ms  ({nbytes / d / 1e9:.2f} GB/s)")
    print(f"  through weightsync (1 engine)  : {w * 1e3:8.1f} ms  ({nbytes / w / 1e9:.2f} GB/s)")
    print(f"  ratio weightsync / direct      : {w / d:8.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
