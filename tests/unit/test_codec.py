"""Codec: every message round-trips; every malformed input is a typed BAD_MESSAGE."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import torch

from messages import codec, schema
from messages.buckets import iter_buckets
from messages.errors import ErrorCode, MessageError
from messages.schema import PROTOCOL_VERSION, TensorMeta

META = TensorMeta("w", "float32", (2, 3), 0, 24)

SAMPLES: list[tuple[schema.Message, list]] = [
    (schema.Hello(id=1, client="t"), []),
    (
        schema.Begin(
            sync_id="s",
            version=3,
            id=2,
            sources=2,
            expected_buckets=5,
            probes=(schema.Probe((1, 2), 4, (5, 6, 7, 8)),),
        ),
        [],
    ),
    (schema.Bucket(sync_id="s", seq=0, tensors=(META,), checksum=2**64 - 1, id=3), [b"\0" * 24]),
    (
        schema.Bucket(
            sync_id="s",
            seq=1,
            tensors=(META,),
            checksum=7,
            ref=schema.Ref("weightsync.trainer.1.0123456789ab", 64, 24),
        ),
        [],
    ),
    (schema.Finish(sync_id="s", buckets=4, id=4, digest="ab"), []),
    (schema.Abort(sync_id="s", id=5, reason="r"), []),
    (schema.Status(id=6), []),
    (
        schema.Error(
            code="INVALID_STATE", message="m", id=7, state="READY", version=2, sync_id="s", details={"k": 1}
        ),
        [],
    ),
    (
        schema.Register(
            engine_id="e",
            backend="torch",
            id=8,
            version=2,
            digest="d",
            finalize_count=3,
            pid=9,
            spec=(schema.ParamSpec("w", "bfloat16", (4,)),),
        ),
        [],
    ),
    (schema.Heartbeat(engine_id="e", id=9), []),
    (schema.Goodbye(engine_id="e", id=10), []),
    (schema.Loaded(sync_id="s", seq=2, id=10, seconds=0.5), []),
    (
        schema.Finalized(sync_id="s", version=2, digest="d", id=11, finalize_count=1, probes=((1, 2), (3,))),
        [],
    ),
    (schema.Failed(sync_id="s", code="SHAPE_MISMATCH", message="m", id=12, seq=3, duplicate=True), []),
    (schema.Load(sync_id="s", version=1, seq=0, tensors=(META,), checksum=1), [b"\0" * 24]),
    (schema.Finalize(sync_id="s", version=1, probes=(schema.Probe((1,), 2),)), []),
    (
        schema.OpenStream(
            sync_id="s",
            version=1,
            group=schema.GroupRef(
                id="g1", host="127.0.0.1", port=1234, rank=1, world_size=3, backend="gloo", timeout=30.0
            ),
        ),
        [],
    ),
    (schema.Prepared(sync_id="s", buckets=3, nbytes=96, chain=2**64 - 1, digest="a" * 32, seconds=0.5), []),
    (schema.Commit(sync_id="s", version=7, id=3), []),
    (schema.Served(version=7, digest="d", sync_id="s"), []),
    (schema.Committed(sync_id="s", version=7, label="7", id=4), []),
    (schema.FanoutOpen(sync_id="s", version=7, frames=("e0", "e1"), refs=("e2",), report_interval=0.01), []),
]


@pytest.mark.parametrize("msg,payload", SAMPLES, ids=lambda x: getattr(x, "TYPE", ""))
def test_every_message_round_trips(msg, payload):
    out = codec.decode(codec.encode(msg, payload))
    assert out.msg == msg
    assert [bytes(p) for p in out.payload] == payload


def test_every_message_type_has_a_sample():
    assert {type(m).TYPE for m, _ in SAMPLES} == set(schema.MESSAGE_TYPES) - {"ok"}


def test_ok_body_round_trips_and_cannot_override_base_keys():
    out = codec.decode(codec.encode(schema.Ok(id=3, body={"state": "READY", "id": 99, "v": 5})))
    assert out.msg.id == 3 and out.msg.body == {"state": "READY"}


def test_unknown_fields_are_ignored():
    raw = {"v": PROTOCOL_VERSION, "type": "status", "id": 1, "future_field": [1, 2]}
    assert codec.decode([msgpack.packb(raw)]).msg == schema.Status(id=1)


def _raw(**fields):
    base = {
        "v": PROTOCOL_VERSION,
        "type": "bucket",
        "id": 1,
        "sync_id": "s",
        "seq": 0,
        "checksum": 1,
        "tensors": [META.to_wire()],
    }
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...})


def _code(frames) -> ErrorCode:
    with pytest.raises(MessageError) as ei:
        codec.decode(frames)
    return ei.value.code


@pytest.mark.parametrize(
    "frames,why",
    [
        ([], "empty"),
        ([b"\xc1\xc1garbage"], "not msgpack"),
        ([msgpack.packb([1, 2])], "not a map"),
        ([msgpack.packb({"type": "status"})], "no v"),
        ([msgpack.packb({"v": "1", "type": "status"})], "v not int"),
        ([msgpack.packb({"v": PROTOCOL_VERSION})], "no type"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "launch_missiles"})], "unknown type"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "status", "id": -1})], "negative id"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "status", "id": 1.5})], "float id"),
        ([_raw(sync_id=...), b"\0" * 24], "missing field"),
        ([_raw(seq="0"), b"\0" * 24], "mistyped field"),
        ([_raw(seq=True), b"\0" * 24], "bool is not int"),
        ([_raw(seq=-1), b"\0" * 24], "negative seq"),
        ([_raw()], "missing payload frame"),
        ([_raw(), b"\0" * 24, b"x"], "extra payload frame"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "status"}), b"x"], "payload on status"),
        ([_raw(tensors=[{**META.to_wire(), "offset": 8}]), b"\0" * 24], "offset outside frame"),
        ([_raw(tensors=[{**META.to_wire(), "nbytes": 20}]), b"\0" * 24], "nbytes != numel*itemsize"),
        ([_raw(tensors=[{**META.to_wire(), "dtype": "complex64"}]), b"\0" * 24], "unknown dtype"),
        ([_raw(tensors=[{**META.to_wire(), "shape": [-2, -3]}]), b"\0" * 24], "negative dims"),
        ([_raw(tensors=[META.to_wire(), META.to_wire()]), b"\0" * 48], "duplicate names"),
        ([_raw(tensors=[{**META.to_wire(), "name": ""}]), b"\0" * 24], "empty name"),
        ([_raw(tensors={"w": 1}), b"\0" * 24], "tensors not an array"),
        ([_raw(tensors=[[1, 2]]), b"\0" * 24], "tensor meta not a map"),
        (
            [_raw(shm={"name": "weightsync.trainer.1.0123456789ab", "offset": 0, "size": 24}), b"\0" * 24],
            "shm with payload",
        ),
        (
            [
                msgpack.packb(
                    {"v": PROTOCOL_VERSION, "type": "begin", "sync_id": "s", "version": 1, "sources": 0}
                )
            ],
            "zero sources",
        ),
        (
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "type": "begin",
                        "sync_id": "s",
                        "version": 1,
                        "probes": [{"prompt": [], "max_tokens": 1}],
                    }
                )
            ],
            "empty probe",
        ),
        (
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "type": "register",
                        "engine_id": "e",
                        "backend": "t",
                        "spec": [{"name": "w", "dtype": "nope", "shape": []}],
                    }
                )
            ],
            "unknown spec dtype",
        ),
    ],
)
def test_malformed_input_is_bad_message(frames, why):
    assert _code(frames) is ErrorCode.BAD_MESSAGE, why


def test_other_major_version_is_unsupported_protocol():
    assert (
        _code([msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "status"})])
        is ErrorCode.UNSUPPORTED_PROTOCOL
    )


def test_oversized_header_is_too_large():
    with pytest.raises(MessageError) as ei:
        codec.decode(
            [msgpack.packb({"v": PROTOCOL_VERSION, "type": "status", "pad": "x" * 1000})],
            max_header_bytes=100,
        )
    assert ei.value.code is ErrorCode.TOO_LARGE


def test_type_not_allowed_on_this_socket_is_refused():
    frames = codec.encode(schema.Register(engine_id="e", backend="torch"))
    assert _code_allowed(frames, ("status",)) is ErrorCode.BAD_MESSAGE


def _code_allowed(frames, allowed):
    with pytest.raises(MessageError) as ei:
        codec.decode(frames, allowed=allowed)
    return ei.value.code


def test_pickle_is_never_accepted():
    import pickle

    assert _code([pickle.dumps({"v": PROTOCOL_VERSION, "type": "status"})]) is ErrorCode.BAD_MESSAGE


def test_peek_id_recovers_id_of_a_bad_header_and_zero_for_garbage():
    assert codec.peek_id(msgpack.packb({"v": 1, "type": "nope", "id": 42})) == 42
    assert codec.peek_id(b"\xc1") == 0


def test_a_refused_header_larger_than_64k_is_answered_with_its_own_id():
    """A begin whose 200 KB sync_id is refused still names its request id (readable),
    so the source matches the refusal instead of waiting out its timeout."""
    raw = msgpack.packb(
        {"v": PROTOCOL_VERSION, "type": "begin", "id": 77, "sync_id": "s" * 200_000, "version": 1}
    )
    with pytest.raises(MessageError) as info:
        codec.decode([raw])
    assert info.value.code is ErrorCode.BAD_MESSAGE
    assert codec.peek_id(raw) == 77


def test_encoded_bucket_decodes_to_views_with_packed_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    (b,) = list(iter_buckets([("t", t)], 1 << 20))
    msg = schema.Bucket(sync_id="s", seq=0, tensors=b.tensors, checksum=b.checksum)
    out = codec.decode(codec.encode(msg, [b.frame()]))
    assert out.msg.tensors == b.tensors and out.msg.checksum == b.checksum
    assert msgspec.structs.asdict(out.msg)["tensors"][0].shape == (3, 4)


def test_every_message_type_has_a_direction_and_each_receiver_refuses_the_others():
    from messages.schema import FROM_ENGINE, FROM_TRAINER, MESSAGE_TYPES, PUBLISHED, TO_ENGINE, TO_TRAINER

    assert set(FROM_TRAINER + FROM_ENGINE + TO_ENGINE + TO_TRAINER + PUBLISHED) == set(MESSAGE_TYPES)
    frames = codec.encode(schema.Register(engine_id="e", backend="torch"))
    assert codec.decode(frames, allowed=FROM_ENGINE).msg.TYPE == "register"
    for allowed in (FROM_TRAINER, TO_ENGINE, TO_TRAINER, PUBLISHED):
        with pytest.raises(MessageError):
            codec.decode(frames, allowed=allowed)


def test_a_collective_failure_has_one_code_for_engines_and_trainers():
    from messages.distgroup import GroupError

    assert GroupError("deadline", timed_out=True).code is ErrorCode.TIMEOUT
    assert GroupError("peer closed").code is ErrorCode.ENGINE_FAILED
