"""The rule every side applies to a tensor an engine is sent: does its model take it."""

from __future__ import annotations

from messages.errors import ErrorCode
from messages.schema import ParamSpec


def spec_refusal(
    spec: dict[str, ParamSpec], name: str, dtype: str, shape: tuple[int, ...], cast_ok: bool
) -> tuple[ErrorCode, str] | None:
    """Why a model with `spec` refuses tensor `name` of `dtype` and `shape` (None: it takes
    it): the one rule the daemon checks before forwarding and each engine before loading.
    `cast_ok`: the engine casts dtypes, so only the shape must match."""
    want = spec.get(name)
    if want is None:
        return ErrorCode.UNKNOWN_TENSOR, f"no tensor {name!r}"
    if tuple(want.shape) != tuple(shape) or (not cast_ok and want.dtype != dtype):
        return (
            ErrorCode.SHAPE_MISMATCH,
            f"{name}: expects {want.dtype}{list(want.shape)}, got {dtype}{list(shape)}",
        )
    return None
