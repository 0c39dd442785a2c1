"""Message <-> ZeroMQ multipart frames: `[msgpack header, *payload frames]`.

Rules: decoding validates every field of every header against the dataclass in
`schema.py` and raises `MessageError(code, reason)`; it never asserts and never unpickles.
Payload frames are passed through untouched (zmq.Frame, bytes or memoryview): tensor bytes
never enter MessagePack. Limits are explicit arguments so the service can set them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from messages import schema
from messages.dtypes import ITEMSIZE
from messages.errors import ErrorCode, MessageError
from messages.schema import PROTOCOL_VERSION, MESSAGE_TYPES, Message, Ok

MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSORS_PER_BUCKET = 65536
MAX_NAME_LEN = 1024
MAX_RANK = 16

_BASE_KEYS = ("v", "type", "id")


@dataclass(frozen=True, slots=True)
class Decoded:
    msg: Message
    payload: list[Any]


def _bad(reason: str) -> MessageError:
    return MessageError(ErrorCode.BAD_MESSAGE, reason)


# -- converters: wire value -> python value, raising on anything unexpected ------------

Conv = Callable[[Any, str], Any]


def _conv_int(v: Any, path: str) -> int:
    if type(v) is not int:
        raise _bad(f"{path}: expected int, got {type(v).__name__}")
    return v


def _conv_float(v: Any, path: str) -> float:
    if type(v) not in (int, float):
        raise _bad(f"{path}: expected number, got {type(v).__name__}")
    return float(v)


def _conv_str(v: Any, path: str) -> str:
    if type(v) is not str:
        raise _bad(f"{path}: expected str, got {type(v).__name__}")
    return v


def _conv_bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise _bad(f"{path}: expected bool, got {type(v).__name__}")
    return v


def _conv_dict(v: Any, path: str) -> dict:
    if type(v) is not dict:
        raise _bad(f"{path}: expected map, got {type(v).__name__}")
    return v


def _conv_any(v: Any, path: str) -> Any:
    return v


def _optional(inner: Conv) -> Conv:
    def conv(v: Any, path: str) -> Any:
        return None if v is None else inner(v, path)
    return conv


def _seq(inner: Conv) -> Conv:
    def conv(v: Any, path: str) -> tuple:
        if type(v) not in (list, tuple):
            raise _bad(f"{path}: expected array, got {type(v).__name__}")
        return tuple(inner(x, f"{path}[{i}]") for i, x in enumerate(v))
    return conv


def _struct(cls: type) -> Conv:
    fields = _field_table(cls)

    def conv(v: Any, path: str) -> Any:
        if type(v) is not dict:
            raise _bad(f"{path}: expected map, got {type(v).__name__}")
        return cls(**_convert_fields(fields, v, path))
    return conv


def _converter(tp: Any) -> Conv:
    if tp is int:
        return _conv_int
    if tp is float:
        return _conv_float
    if tp is str:
        return _conv_str
    if tp is bool:
        return _conv_bool
    if tp is Any:
        return _conv_any
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return _optional(_converter(rest[0]))
    if origin is tuple:
        return _seq(_converter(args[0]))
    if origin is dict or tp is dict:
        return _conv_dict
    if dataclasses.is_dataclass(tp):
        return _struct(tp)
    raise TypeError(f"no wire converter for {tp!r}")


_TABLES: dict[type, list[tuple[str, Conv, bool]]] = {}


def _field_table(cls: type) -> list[tuple[str, Conv, bool]]:
    table = _TABLES.get(cls)
    if table is None:
        hints = typing.get_type_hints(cls, vars(schema))
        table = []
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            table.append((f.name, _converter(hints[f.name]), required))
        _TABLES[cls] = table
    return table


def _convert_fields(table: list[tuple[str, Conv, bool]], raw: dict, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, conv, required in table:
        if name in raw:
            out[name] = conv(raw[name], f"{path}.{name}" if path else name)
        elif required:
            raise _bad(f"{path + '.' if path else ''}{name}: missing")
    return out


# -- semantic checks beyond types -------------------------------------------------------

def _check_nonneg(value: int | None, what: str) -> None:
    if value is not None and value < 0:
        raise _bad(f"{what}: must be >= 0, got {value}")


def _check_tensors(tensors: Sequence[schema.TensorMeta], frame_len: int | None) -> None:
    if len(tensors) > MAX_TENSORS_PER_BUCKET:
        raise MessageError(ErrorCode.TOO_LARGE, f"{len(tensors)} tensors in one bucket "
                                                f"(limit {MAX_TENSORS_PER_BUCKET})")
    seen: set[str] = set()
    for i, t in enumerate(tensors):
        where = f"tensors[{i}] ({t.name[:64]!r})"
        if not t.name or len(t.name) > MAX_NAME_LEN:
            raise _bad(f"{where}: name must be 1..{MAX_NAME_LEN} chars")
        if t.name in seen:
            raise _bad(f"{where}: duplicate tensor name in bucket")
        seen.add(t.name)
        itemsize = ITEMSIZE.get(t.dtype)
        if itemsize is None:
            raise _bad(f"{where}: unknown dtype {t.dtype!r}")
        if len(t.shape) > MAX_RANK:
            raise _bad(f"{where}: rank {len(t.shape)} exceeds {MAX_RANK}")
        numel = 1
        for d in t.shape:
            if d < 0:
                raise _bad(f"{where}: negative dimension in shape {list(t.shape)}")
            numel *= d
        if t.offset < 0 or t.nbytes < 0:
            raise _bad(f"{where}: offset and nbytes must be >= 0")
        if t.nbytes != numel * itemsize:
            raise _bad(f"{where}: nbytes {t.nbytes} != numel {numel} * itemsize {itemsize}")
        if frame_len is not None and t.offset + t.nbytes > frame_len:
            raise _bad(f"{where}: bytes [{t.offset}, {t.offset + t.nbytes}) outside the "
                       f"{frame_len}-byte frame")


def _frame_len(frame: Any) -> int:
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).nbytes


def _validate(msg: Message, payload: list[Any]) -> None:
    for name in ("seq", "version", "offset", "buckets", "sender", "finalize_count", "id"):
        if hasattr(msg, name):
            _check_nonneg(getattr(msg, name), name)
    if isinstance(msg, schema.Begin):
        if msg.transport not in ("inline", "shm", "auto"):
            raise _bad(f"transport: must be inline, shm or auto, got {msg.transport!r}")
        if msg.senders < 1:
            raise _bad("senders: must be >= 1")
        _check_nonneg(msg.expected_buckets, "expected_buckets")
        for i, p in enumerate(msg.probes):
            if not p.prompt or p.max_tokens < 1 or p.max_tokens > 4096:
                raise _bad(f"probes[{i}]: prompt must be non-empty and 1 <= max_tokens <= 4096")
            if any(t < 0 for t in p.prompt) or (p.expected and any(t < 0 for t in p.expected)):
                raise _bad(f"probes[{i}]: token ids must be >= 0")
    if msg.PAYLOAD == "bucket":
        shm = getattr(msg, "shm")
        if shm is None:
            if len(payload) != 1:
                raise _bad(f"{msg.TYPE}: expected exactly 1 payload frame, got {len(payload)}")
            _check_tensors(msg.tensors, _frame_len(payload[0]))  # type: ignore[attr-defined]
        else:
            if payload:
                raise _bad(f"{msg.TYPE}: shm bucket must carry no payload frame")
            if shm.offset < 0 or shm.size < 0 or not shm.name:
                raise _bad("shm: bad descriptor")
            _check_tensors(msg.tensors, shm.size)  # type: ignore[attr-defined]
    elif payload:
        raise _bad(f"{msg.TYPE}: expected no payload frames, got {len(payload)}")
    if isinstance(msg, (schema.Register,)):
        for i, s in enumerate(msg.spec):
            if s.dtype not in ITEMSIZE:
                raise _bad(f"spec[{i}]: unknown dtype {s.dtype!r}")


# -- public API -------------------------------------------------------------------------

def _to_wire(v: Any) -> Any:
    if hasattr(v, "to_wire"):
        return v.to_wire()
    if isinstance(v, tuple):
        return [_to_wire(x) for x in v]
    return v


def encode_header(msg: Message) -> bytes:
    """The MessagePack header of `msg` (payload frames travel separately)."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    if isinstance(msg, Ok):
        header["id"] = msg.id
        for k, v in msg.body.items():
            if k not in _BASE_KEYS:
                header[k] = v
    else:
        for f in dataclasses.fields(msg):  # type: ignore[arg-type]
            v = getattr(msg, f.name)
            if v is None and f.default is None:
                continue
            header[f.name] = _to_wire(v)
    return msgpack.packb(header, use_bin_type=True)


def encode(msg: Message, payload: Sequence[Any] = ()) -> list[Any]:
    """Frames for `send_multipart(frames, copy=False)`: header then payload untouched."""
    return [encode_header(msg), *payload]


def parse_header(raw: Any, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """MessagePack header -> dict, checking size, shape and protocol version."""
    buf = getattr(raw, "bytes", raw) if not isinstance(raw, (bytes, bytearray, memoryview)) else raw
    n = memoryview(buf).nbytes
    if n > max_header_bytes:
        raise MessageError(ErrorCode.TOO_LARGE, f"header of {n} bytes exceeds {max_header_bytes}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types; all mean the same to a peer
        raise _bad(f"header is not MessagePack ({type(exc).__name__})") from None
    if type(header) is not dict:
        raise _bad(f"header is not a map (got {type(header).__name__})")
    v = header.get("v")
    if type(v) is not int:
        raise _bad("v: missing or not an int")
    if v != PROTOCOL_VERSION:
        raise MessageError(ErrorCode.UNSUPPORTED_PROTOCOL,
                           f"protocol v{v} is not supported (this side speaks v{PROTOCOL_VERSION})")
    return header


def decode(frames: Sequence[Any], *, allowed: Sequence[str] | None = None,
           max_header_bytes: int = MAX_HEADER_BYTES) -> Decoded:
    """`[header, *payload]` -> Decoded(msg, payload). Raises MessageError on anything wrong."""
    if not frames:
        raise _bad("empty message")
    header = parse_header(frames[0], max_header_bytes)
    mtype = header.get("type")
    if type(mtype) is not str:
        raise _bad("type: missing or not a string")
    cls = MESSAGE_TYPES.get(mtype)
    if cls is None or (allowed is not None and mtype not in allowed):
        raise _bad(f"type {mtype!r} is not accepted here")
    if "id" in header and (type(header["id"]) is not int or header["id"] < 0):
        raise _bad("id: must be a non-negative int")
    if cls is Ok:
        body = {k: v for k, v in header.items() if k not in _BASE_KEYS}
        msg: Message = Ok(id=header.get("id", 0), body=body)
    else:
        try:
            msg = cls(**_convert_fields(_field_table(cls), header, ""))
        except TypeError as exc:  # a field the dataclass cannot take: treat as malformed
            raise _bad(str(exc)) from None
    payload = list(frames[1:])
    _validate(msg, payload)
    return Decoded(msg, payload)


def peek_id(raw: Any) -> int:
    """Best-effort request id of a header that failed to decode, so the error correlates."""
    try:
        buf = getattr(raw, "bytes", raw)
        if memoryview(buf).nbytes > 4096:
            return 0
        header = msgpack.unpackb(buf, raw=False)
        rid = header.get("id", 0) if type(header) is dict else 0
        return rid if type(rid) is int and rid >= 0 else 0
    except Exception:  # best effort by contract: the caller already has the real error
        return 0
