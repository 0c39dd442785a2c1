"""Reading a trainer checkpoint directory as a stream of (name, tensor).

Rules: tensors are read lazily one at a time (memory stays at one tensor plus the
bucket being packed), in a deterministic order (files sorted, keys in file order).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily yields every tensor of every *.safetensors file under `path` (validated now)."""
    from safetensors import safe_open

    files = safetensors_files(path)

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if name in seen:
                        raise ValueError(f"tensor {name!r} appears in more than one file")
                    seen.add(name)
                    yield name, st.get_tensor(name)

    return gen()
