"""Message <-> ZeroMQ multipart frames: `[msgpack header, *payload frames]`.

Rules: decoding is the trust boundary. `msgspec.msgpack` decodes the header straight into
the struct of `schema.py`, checking every field's type and constraint on the way; the few
checks that span fields or frames (tensor bytes inside the frame, nbytes = numel x
itemsize, one payload frame per bucket) run right after, here. Every violation raises
`MessageError(code, reason)` naming the field; nothing is asserted, nothing unpickled.
Payload frames are passed through untouched (zmq.Frame, bytes or memoryview): tensor
bytes never enter MessagePack. Limits are explicit arguments so the service can set them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Union

import msgspec
import zmq

from messages import schema
from messages.dtypes import ITEMSIZE, tensor_nbytes
from messages.errors import ErrorCode, MessageError
from messages.schema import INDEX32_MAX, MAX_TENSORS_PER_BUCKET, MESSAGE_TYPES, PROTOCOL_VERSION, Message, Ok
from messages.slices import box_refusal, box_shape

MAX_HEADER_BYTES = 16 * 1024 * 1024

_BASE_KEYS = ("v", "type", "id")
# A frame as ZeroMQ hands it over (`copy=False`: zmq.Frame) or as a caller builds it.
Frame = bytes | bytearray | memoryview | zmq.Frame
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class Decoded:
    msg: Message
    payload: list[Frame]


class _Envelope(msgspec.Struct):
    """What every header has, read when the full decode failed (to pick the right code)."""

    v: Any = None
    type: Any = None
    id: Any = 0


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


def _bad(reason: str) -> MessageError:
    return MessageError(ErrorCode.BAD_MESSAGE, reason)


@cache
def _decoder(allowed: tuple[str, ...]) -> msgspec.msgpack.Decoder[Message]:
    types = tuple(MESSAGE_TYPES[t] for t in allowed if t != "ok") or (Ok,)
    return msgspec.msgpack.Decoder(Union[types] if len(types) > 1 else types[0])


def _raw_bytes(raw: Frame) -> bytes | bytearray | memoryview:
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return raw
    return raw.buffer


def _envelope(buf: bytes | bytearray | memoryview, allowed: tuple[str, ...]) -> _Envelope:
    """`v`, `type` and `id`, checked before the message itself: protocol first."""
    try:
        env = _ENVELOPE.decode(buf)
    except msgspec.ValidationError:
        raise _bad("header is not a map") from None
    except msgspec.DecodeError:
        raise _bad("header is not MessagePack") from None
    if type(env.v) is not int:
        raise _bad("v: missing or not an int")
    if env.v != PROTOCOL_VERSION:
        raise MessageError(
            ErrorCode.UNSUPPORTED_PROTOCOL,
            f"protocol v{env.v} is not supported (this side speaks v{PROTOCOL_VERSION})",
        )
    if type(env.type) is not str:
        raise _bad("type: missing or not a string")
    if env.type not in allowed:
        raise _bad(f"type {env.type[:32]!r} is not accepted here")
    return env


def _refusal(mtype: str, exc: Exception) -> MessageError:
    text = str(exc)
    if "$.tensors" in text and "length <=" in text and "`$.tensors`" in text:
        return MessageError(
            ErrorCode.TOO_LARGE, f"{mtype}: more than {MAX_TENSORS_PER_BUCKET} tensors in one bucket"
        )
    return _bad(f"{mtype}: {text}")


# -- checks that span fields or frames --------------------------------------------------


def _check_tensors(tensors: Sequence[schema.TensorMeta], frame_len: int) -> None:
    seen: set[tuple[str, object]] = set()
    for i, t in enumerate(tensors):
        where = f"tensors[{i}] ({t.name[:64]!r})"
        if (t.name, t.box) in seen:
            raise _bad(f"{where}: duplicate tensor name in bucket")
        seen.add((t.name, t.box))
        itemsize = ITEMSIZE[t.dtype]
        full = tensor_nbytes(t.dtype, t.shape)
        if t.box is not None:
            full = _check_box(where, t, itemsize)
        numel = full // itemsize
        if t.start is not None:
            _check_piece(where, t, full, itemsize)
        elif t.patch is not None:
            _check_patch(where, t.patch, t.nbytes, numel, itemsize)
        elif t.nbytes != numel * itemsize:
            raise _bad(f"{where}: nbytes {t.nbytes} != numel {numel} * itemsize {itemsize}")
        if t.offset + t.nbytes > frame_len:
            raise _bad(
                f"{where}: bytes [{t.offset}, {t.offset + t.nbytes}) outside the {frame_len}-byte frame"
            )


def _check_box(where: str, t: schema.TensorMeta, itemsize: int) -> int:
    """A box of the tensor (an engine rank's slice): one in-bounds range per dimension;
    returns the box's bytes (a patch of a box is checked against them)."""
    box = t.box or ()
    refused = box_refusal(box, t.shape)
    if refused is not None:
        raise _bad(f"{where}: {refused}")
    return math.prod(box_shape(box)) * itemsize


def _check_piece(where: str, t: schema.TensorMeta, full: int, itemsize: int) -> None:
    """A piece of a tensor larger than a bucket: whole elements, inside the tensor, never
    the whole of it and never a patch."""
    start = t.start or 0
    if t.patch is not None:
        raise _bad(f"{where}: a piece cannot be a patch")
    if not 0 < t.nbytes < full or start + t.nbytes > full:
        raise _bad(f"{where}: piece [{start}, {start + t.nbytes}) of a {full}-byte tensor")
    if start % itemsize or t.nbytes % itemsize:
        raise _bad(f"{where}: piece [{start}, {start + t.nbytes}) cuts an element of {itemsize} bytes")


def _check_patch(where: str, p: schema.Patch, nbytes: int, numel: int, itemsize: int) -> None:
    """A patch's byte count follows from its kind (messages.delta lays them out)."""
    if p.kind == "same" and nbytes != 0:
        raise _bad(f"{where}: a 'same' patch carries {nbytes} bytes")
    if p.kind == "sparse":
        if p.count > numel:
            raise _bad(f"{where}: sparse patch of {p.count} elements, the tensor has {numel}")
        index = 4 if numel <= INDEX32_MAX else 8
        if nbytes != p.count * (index + itemsize):
            raise _bad(
                f"{where}: sparse patch of {p.count} elements is {nbytes} bytes, not {p.count * (index + itemsize)}"
            )
    if p.kind == "xor" and not 0 < nbytes < numel * itemsize:
        raise _bad(f"{where}: xor patch of {nbytes} bytes for a {numel * itemsize}-byte tensor")


def frame_len(frame: Frame) -> int:
    return memoryview(_raw_bytes(frame)).nbytes


def _validate(msg: Message, payload: list[Frame]) -> None:
    if isinstance(msg, (schema.Bucket, schema.Load)):
        ref, size = msg.ref, msg.size
        if ref is not None and size is not None:
            raise _bad(f"{msg.TYPE}: a bucket travels by reference or by broadcast, not both")
        if isinstance(msg, schema.Load) and msg.group is not None and size is None:
            raise _bad(f"{msg.TYPE}: a broadcast load needs its size")
        if size is not None:  # a broadcast: the bytes come by the group (a copy may ride along)
            if len(payload) > 1 or (payload and frame_len(payload[0]) != size):
                raise _bad(
                    f"{msg.TYPE}: a broadcast bucket carries at most one payload frame "
                    f"of exactly its size {size}"
                )
            _check_tensors(msg.tensors, size)
        elif ref is None:
            if len(payload) != 1:
                raise _bad(f"{msg.TYPE}: expected exactly 1 payload frame, got {len(payload)}")
            _check_tensors(msg.tensors, frame_len(payload[0]))
        else:
            if payload:
                raise _bad(f"{msg.TYPE}: a bucket by reference must carry no payload frame")
            _check_tensors(msg.tensors, ref.size)
    elif payload:
        raise _bad(f"{msg.TYPE}: expected no payload frames, got {len(payload)}")


# -- public API -------------------------------------------------------------------------


def encode_header(msg: Message) -> bytes:
    """The MessagePack header of `msg` (payload frames travel separately)."""
    if isinstance(msg, Ok):  # an ok's body fields sit at the top level of the header
        header = {k: v for k, v in msg.body.items() if k not in _BASE_KEYS}
        header.update(v=PROTOCOL_VERSION, type="ok", id=msg.id)
        return _ENCODER.encode(header)
    return _ENCODER.encode(msg)


def encode(msg: Message, payload: Sequence[Frame] = ()) -> list[Frame]:
    """Frames for `send_multipart(frames, copy=False)`: header then payload untouched."""
    return [encode_header(msg), *payload]


def decode(
    frames: Sequence[Frame], *, allowed: Sequence[str] | None = None, max_header_bytes: int = MAX_HEADER_BYTES
) -> Decoded:
    """`[header, *payload]` -> Decoded(msg, payload). Raises MessageError on anything wrong."""
    if not frames:
        raise _bad("empty message")
    names = tuple(allowed) if allowed is not None else tuple(MESSAGE_TYPES)
    buf = _raw_bytes(frames[0])
    n = memoryview(buf).nbytes
    if n > max_header_bytes:
        raise MessageError(ErrorCode.TOO_LARGE, f"header of {n} bytes exceeds {max_header_bytes}")
    payload = list(frames[1:])
    env = _envelope(buf, names)
    if env.type == "ok":  # an ok's body is free-form: its fields sit beside v, type and id
        if type(env.id) is not int or not 0 <= env.id < 2**63:
            raise _bad("ok: id must be an int in 0..2**63-1")
        raw = msgspec.msgpack.decode(buf)
        msg: Message = Ok(id=env.id, body={k: v for k, v in raw.items() if k not in _BASE_KEYS})
    else:
        try:
            msg = _decoder(names).decode(buf)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise _refusal(env.type, exc) from None
    _validate(msg, payload)
    return Decoded(msg, payload)


def peek_type(raw: Frame) -> str | None:
    """Best-effort message type of a header that failed to decode (None when unreadable),
    so a receiver can tell a type meant for its other socket from garbage."""
    try:
        buf = _raw_bytes(raw)
        if memoryview(buf).nbytes > MAX_HEADER_BYTES:
            return None
        mtype = _ENVELOPE.decode(buf).type
        return mtype if type(mtype) is str and mtype in MESSAGE_TYPES else None
    except (msgspec.ValidationError, msgspec.DecodeError):  # the caller has the real error
        return None


def peek_id(raw: Frame) -> int:
    """Best-effort request id of a header that failed to decode, so the error correlates."""
    try:
        buf = _raw_bytes(raw)
        if memoryview(buf).nbytes > MAX_HEADER_BYTES:  # never read: the refusal is TOO_LARGE
            return 0
        rid = _ENVELOPE.decode(buf).id
        return rid if type(rid) is int and 0 <= rid < 2**63 else 0
    except (msgspec.ValidationError, msgspec.DecodeError):  # the caller has the real error
        return 0
