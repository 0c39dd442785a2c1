"""Reading a trainer checkpoint directory as a stream of (name, tensor).

Rules: tensors are read lazily one at a time (memory stays at one tensor plus the
bucket being packed), in a deterministic order (files sorted, keys in file order).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from messages.dtypes import Dtype
from messages.schema import ParamSpec


class CheckpointError(ValueError):
    """A checkpoint directory cannot be pushed as it is (missing, corrupt, ambiguous)."""


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def _index(files: list[Path]) -> None:
    """Open every file's header now: corrupt, truncated or overlapping files are refused
    before a sync begins, never halfway through one."""
    owner: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                keys = list(st.keys())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f.name}: not a readable safetensors file ({exc})") from None
        for name in keys:
            if name in owner:
                raise CheckpointError(f"tensor {name!r} appears in both {owner[name]} and {f.name}")
            owner[name] = f.name


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily yields every tensor of every *.safetensors file under `path` (validated now)."""
    files = safetensors_files(path)
    _index(files)

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():
                        yield name, st.get_tensor(name)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{f.name}: read failed ({exc})") from None

    return gen()


def checkpoint_spec(path: str | Path) -> dict[str, ParamSpec]:
    """Name -> ParamSpec of every tensor in the checkpoint, from the headers only."""
    spec: dict[str, ParamSpec] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ValueError(f"{f.name}: {name} has unsupported dtype {sl.get_dtype()}")
                spec[name] = ParamSpec(name, dtype, tuple(sl.get_shape()))
    return spec


_ST_DTYPES: dict[str, Dtype] = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I8": "int8",
    "U8": "uint8",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
}


class Checkpoint:
    """A checkpoint directory's tensors, read again from disk on each iteration (a push
    that goes dense after a refused delta iterates twice)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(iter_safetensors(self.path))
