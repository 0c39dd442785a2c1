"""dtype names on the wire. Strings, never pickled torch objects.

Rules: the names and item sizes are plain data, so the daemon (which never touches a
tensor) validates headers without importing torch; the torch mapping is built on first
use by the code that has tensors.
"""

from __future__ import annotations

from typing import Any, Literal, cast

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
_TORCH: dict[str, Any] = {}


def tensor_nbytes(dtype: Dtype, shape: tuple[int, ...] | list[int]) -> int:
    """The bytes of a whole tensor of `dtype` and `shape` (a scalar's shape is ())."""
    n = 1
    for d in shape:
        n *= d
    return n * ITEMSIZE[dtype]


def _torch_tables() -> dict[str, Any]:
    if not _TORCH:
        import torch  # noqa: PLC0415 (the daemon validates dtypes without torch)

        dtypes = {name: getattr(torch, name) for name in ITEMSIZE}
        _TORCH["DTYPES"] = dtypes
        _TORCH["NAMES"] = {v: k for k, v in dtypes.items()}
    return _TORCH


def __getattr__(name: str) -> Any:
    if name in ("DTYPES", "NAMES"):  # name -> torch.dtype and back, on first use
        return _torch_tables()[name]
    raise AttributeError(name)


def dtype_name(dtype: Any) -> Dtype:
    try:
        return cast(Dtype, _torch_tables()["NAMES"][dtype])
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported on the wire") from None


def torch_dtype(name: str) -> Any:
    return _torch_tables()["DTYPES"][name]
