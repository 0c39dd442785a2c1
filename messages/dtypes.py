"""dtype names on the wire. Strings, never pickled torch objects.

Rules: the names and item sizes are plain data, so the daemon (which never touches a
tensor) validates headers without importing torch; the torch mapping is built on first
use by the code that has tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Dtype = Literal[
    "float32",
    "float64",
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
]

ITEMSIZE: dict[Dtype, int] = {
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
# The torch mapping, built on first use (`_torch_tables`).
_DTYPES: dict[str, torch.dtype] = {}
_NAMES: dict[torch.dtype, Dtype] = {}
if TYPE_CHECKING:  # what the module's `__getattr__` hands out
    DTYPES: dict[str, torch.dtype]  # name -> torch.dtype
    NAMES: dict[torch.dtype, Dtype]  # and back


def tensor_nbytes(dtype: Dtype, shape: tuple[int, ...] | list[int]) -> int:
    """The bytes of a whole tensor of `dtype` and `shape` (a scalar's shape is ())."""
    n = 1
    for d in shape:
        n *= d
    return n * ITEMSIZE[dtype]


def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, Dtype]]:
    if not _DTYPES:
        import torch  # noqa: PLC0415 (the daemon validates dtypes without torch)

        dtypes: dict[Dtype, torch.dtype] = {name: getattr(torch, name) for name in ITEMSIZE}
        _NAMES.update({v: k for k, v in dtypes.items()})
        _DTYPES.update(dtypes.items())
    return _DTYPES, _NAMES


def __getattr__(name: str) -> object:
    if name == "DTYPES":  # name -> torch.dtype and back, on first use
        return _torch_tables()[0]
    if name == "NAMES":
        return _torch_tables()[1]
    raise AttributeError(name)


def dtype_name(dtype: torch.dtype) -> Dtype:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported on the wire") from None


def torch_dtype(name: str) -> torch.dtype:
    return _torch_tables()[0][name]
