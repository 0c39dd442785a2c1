"""`python -m bench.push_module`: the trainer's extra memory while `push_module` streams a
model several times the bucket window, against the model's size.

A model of `--model-bytes` (fp32 linears) is built in this process (the trainer), then
pushed with `push_module` (and once with a bf16 cast) to sink engines through a real
daemon. The trainer's peak RSS (VmHWM, reset before each push) minus its RSS before the
push is the extra memory; the target is window x bucket plus one tensor, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

MiB = 1 << 20


def build(model_bytes: int, tensor_bytes: int) -> Any:
    import torch

    n = max(1, model_bytes // tensor_bytes)
    side = int((tensor_bytes // 4) ** 0.5)
    layers = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(n)])
    with torch.no_grad():
        for p in layers.parameters():
            p.normal_()
    return layers


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.push_module", description=__doc__.split("\n")[0])
    ap.add_argument("--model-bytes", default="512MiB")
    ap.add_argument("--tensor-bytes", default="16MiB")
    ap.add_argument("--bucket-bytes", default="16MiB")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    from bench.common import parse_size, peak_rss_mib, reset_peak, rss_mib
    from engines.sink import write_spec
    from examples.launch import Cluster
    from messages.dtypes import dtype_name
    from messages.schema import ParamSpec
    from orchestrator.trainer import module_tensors

    torch.set_num_threads(1)
    model = build(parse_size(args.model_bytes), parse_size(args.tensor_bytes))
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
    bucket = parse_size(args.bucket_bytes)
    out: dict[str, Any] = {
        "model_mib": round(model_mib, 1),
        "bucket_mib": bucket / MiB,
        "window": args.window,
        "runs": [],
    }
    me = os.getpid()
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-module-") as tmp:
        for dtype in (None, torch.bfloat16):
            spec = [
                ParamSpec(n, dtype_name(dtype or t.dtype), tuple(t.shape)) for n, t in module_tensors(model)
            ]
            spec_dir = write_spec(Path(tmp) / f"spec-{dtype}", spec)
            with (
                Cluster(
                    Path(tmp) / f"run-{dtype}",
                    spec_dir,
                    engines=1,
                    backend="sink",
                    daemon_args=["--log-level", "warning"],
                    engine_args=["--log-level", "warning"],
                ) as cluster,
                cluster.client(timeout=120.0) as client,
            ):
                before = rss_mib(me)
                reset_peak(me)
                r = client.push_module(
                    model, 1, dtype=dtype, bucket_bytes=bucket, window=args.window, transport="inline"
                )
                extra = peak_rss_mib(me) - before
            largest = max(p.numel() for p in model.parameters()) * (2 if dtype else 4) / MiB
            bound = args.window * bucket / MiB + largest
            run = {
                "dtype": str(dtype or "float32"),
                "state": r.state,
                "seconds": round(r.seconds, 3),
                "trainer_extra_mib": round(extra, 1),
                "bound_mib": round(bound, 1),
                "within_bound": extra <= bound * 1.25 + 16,
            }
            out["runs"].append(run)
            print(
                f"push_module {model_mib:.0f} MiB model, dtype {run['dtype']}: trainer +{extra:.0f} MiB "
                f"(window x bucket + one tensor = {bound:.0f} MiB; model {model_mib:.0f} MiB), "
                f"{r.seconds:.2f}s, {r.state}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
