"""A sink engine: preallocated tensors and nothing else, so benchmarks measure the data
plane (transport, validation, the copy into parameters, the digest) and not model code.

Rules: the model is a spec file (`sink.json`: `{"tensors": [{name, dtype, shape}]}`) in
the `--model` directory; every tensor is allocated once at startup and each bucket is
validated and copied in place, exactly like the torch engine. The per-tensor digest is
taken chunk by chunk right behind the copy (the bytes are still in cache); `finalize` only combines the
parts and counts itself, so the finalize-once guard is exercised like any other engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from engines.base import EngineInfo, EngineOptions, validate_bucket
from messages.buckets import Digester, as_bytes, copy_hashing
from messages.dtypes import ITEMSIZE, Dtype, torch_dtype
from messages.errors import ErrorCode, make_error
from messages.schema import ParamSpec, Probe

SPEC_FILE = "sink.json"


def synthetic_spec(
    model_bytes: int, tensor_bytes: int = 16 << 20, dtype: Dtype = "bfloat16"
) -> list[ParamSpec]:
    """Tensors of `tensor_bytes` (the last one smaller) adding up to `model_bytes`."""
    if model_bytes <= 0 or tensor_bytes <= 0:
        raise ValueError("model_bytes and tensor_bytes must be > 0")
    item = ITEMSIZE[dtype]
    cols = 1024
    row_bytes = cols * item
    rows_left = max(1, model_bytes // row_bytes)
    rows_per = max(1, tensor_bytes // row_bytes)
    out, i = [], 0
    while rows_left > 0:
        rows = min(rows_per, rows_left)
        out.append(ParamSpec(f"layers.{i}.weight", dtype, (rows, cols)))
        rows_left -= rows
        i += 1
    return out


def write_spec(directory: str | Path, spec: Sequence[ParamSpec]) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / SPEC_FILE).write_text(json.dumps({"tensors": [p.to_wire() for p in spec]}))
    return d


def read_spec(directory: str | Path) -> list[ParamSpec]:
    path = Path(directory) / SPEC_FILE
    try:
        raw = json.loads(path.read_text())
        return [
            ParamSpec(str(t["name"]), t["dtype"], tuple(int(x) for x in t["shape"])) for t in raw["tensors"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a sink spec ({exc})") from None


def random_weights(spec: Sequence[ParamSpec], seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Trainer-side tensors matching `spec` (random, so checksums and digests mean something)."""
    g = torch.Generator().manual_seed(seed)
    for p in spec:
        yield p.name, torch.randn(p.shape, generator=g, dtype=torch.float32).to(torch_dtype(p.dtype))


class SinkEngine:
    backend = "sink"

    def __init__(self, model_dir: str | Path, spec: Sequence[ParamSpec] | None = None) -> None:
        self.model_dir = str(model_dir)
        specs = read_spec(model_dir) if spec is None else list(spec)
        self.spec = {p.name: p for p in specs}
        self.params = {p.name: torch.zeros(p.shape, dtype=torch_dtype(p.dtype)) for p in specs}
        self.finalize_count = 0
        self._digester = Digester()
        self._digest: str | None = None
        for name, t in self.params.items():
            self._digester.update(name, t)
        self._digest = self._digester.hexdigest()

    def describe(self) -> EngineInfo:
        return EngineInfo(
            backend=self.backend,
            model=self.model_dir,
            spec=tuple(self.spec.values()),
            extra={"bytes": sum(t.numel() * t.element_size() for t in self.params.values())},
        )

    def begin(self, sync_id: str = "", version: int = 0) -> None:
        self._digest = None

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        validate_bucket(self.spec, tensors)
        for name, src in tensors:
            dst = self.params[name]
            h = self._digester.start(name, dst)
            copy_hashing(as_bytes(dst), as_bytes(src), h)  # the digest reads what was copied
            self._digester.finish(name, h)

    def finalize(self, sync_id: str = "") -> str:
        self.finalize_count += 1
        self._digest = self._digester.hexdigest()
        return self._digest

    def digest(self) -> str:
        if self._digest is None:
            raise make_error(ErrorCode.INVALID_STATE, "weights are changing: no digest until finalize")
        return self._digest

    def probe(self, probes: Sequence[Probe]) -> tuple[tuple[int, ...], ...]:
        raise make_error(ErrorCode.BAD_MESSAGE, "the sink engine has no model to probe")

    def abort(self) -> None:
        self._digest = None

    def close(self) -> None:
        self.params.clear()


def make_engine(options: EngineOptions) -> SinkEngine:
    return SinkEngine(options["model"])
