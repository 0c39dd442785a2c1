"""Fuzzing a live daemon: hypothesis-generated multipart messages on both sockets.

Invariants, checked after every case: the daemon answers each trainer request with a
typed `error` (a known code) or an `ok`, never crashes, and never changes state on input
it refused. A few hundred cases by default; `--fuzz-cases 10000` is the slow mode
(`make fuzz`). The daemon has no engines (min_engines=1), so even a well-formed `begin`
is refused (NO_ENGINES) and nothing the fuzzer sends may move it out of IDLE.
"""

from __future__ import annotations

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.launch import Cluster
from messages import codec, schema
from messages.errors import ErrorCode

pytestmark = pytest.mark.slow
CODES = {c.value for c in ErrorCode}

BASE = {
    "hello": schema.Hello(id=1),
    "status": schema.Status(id=1),
    "begin": schema.Begin(sync_id="s", version=1, id=1),
    "finish": schema.Finish(sync_id="s", buckets=1, id=1),
    "abort": schema.Abort(sync_id="s", reason="r", id=1),
    "bucket": schema.Bucket(
        sync_id="s", seq=0, checksum=0, id=1, tensors=(schema.TensorMeta("w", "float32", (2, 2), 0, 16),)
    ),
    "register": schema.Register(engine_id="e", backend="torch", id=1),
    "loaded": schema.Loaded(sync_id="s", seq=0, id=1),
    "finalized": schema.Finalized(sync_id="s", version=1, digest="d", id=1),
}

packable = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what MessagePack can carry
wild = st.one_of(
    st.none(),
    st.booleans(),
    packable,
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(packable, max_size=4),
    st.dictionaries(st.text(max_size=5), packable, max_size=3),
)


def header_of(name: str) -> dict:
    return msgpack.unpackb(codec.encode_header(BASE[name]), raw=False)


@st.composite
def mutated(draw, names):
    """A real header of one type with one to three fields dropped, retyped or added."""
    h = header_of(draw(st.sampled_from(names)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "retype", "add", "tensor"]))
        key = draw(st.sampled_from(sorted(h)))
        if op == "drop":
            h.pop(key, None)
        elif op == "retype":
            h[key] = draw(wild)
        elif op == "add":
            h[draw(st.text(max_size=8))] = draw(wild)
        elif (
            op == "tensor"
            and isinstance(h.get("tensors"), list)
            and h["tensors"]
            and isinstance(h["tensors"][0], dict)
        ):  # an earlier retype may have made it an int
            t = h["tensors"][0]
            field = draw(st.sampled_from(["offset", "nbytes", "shape", "dtype", "name"]))
            t[field] = draw(
                st.one_of(wild, st.just([2**40, 2**40]), st.just(2**62), st.just(-1), st.just("complex128"))
            )
    return h


def frames_of(draw_header, payload):
    raw = msgpack.packb(draw_header, use_bin_type=True)
    return [raw, *payload]


payloads = st.lists(st.binary(max_size=64), max_size=3)
trainer_cases = st.one_of(
    st.lists(st.binary(max_size=256), min_size=1, max_size=4),  # random frames
    st.builds(frames_of, mutated(["hello", "status", "begin", "finish", "abort", "bucket"]), payloads),
    st.builds(lambda p: [codec.encode_header(BASE["bucket"]), *p], payloads),  # wrong frame sizes
)


def must_be_invalid(h: dict) -> dict:
    """Engine-socket cases are made invalid for sure (a valid `register` would add an engine)."""
    h["v"] = "not-an-int"
    return h


engine_cases = st.one_of(
    st.lists(st.binary(max_size=256), min_size=1, max_size=3),
    st.builds(frames_of, mutated(["register", "loaded", "finalized"]).map(must_be_invalid), payloads),
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    with Cluster(
        tmp_path_factory.mktemp("fuzz"), None, engines=0, min_engines=1, daemon_args=["--log-level", "error"]
    ) as cluster:
        yield cluster


def snapshot(cluster):
    st_ = cluster.status()
    return (st_["state"], st_["version"], st_["dirty"], st_["sync"], len(st_["engines"]))


def dealer(addr: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def fuzz_settings(request):
    return settings(
        max_examples=request.config.getoption("--fuzz-cases"),
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


# `make fuzz` runs 10,000 cases: an idle daemon reads engine messages in 50 ms batches,
# so the slow mode outlives pytest's default 300 s; the default mode takes seconds.
@pytest.mark.timeout(3600)
def test_trainer_socket_answers_every_case_with_a_typed_reply(target, request):
    before = snapshot(target)
    sock = dealer(target.addr)
    seen: dict[str, int] = {}

    @fuzz_settings(request)
    @given(case=trainer_cases)
    def one(case):
        sock.send_multipart(case)
        assert sock.poll(5000), f"no answer to {case!r:.200}"
        reply = codec.decode(sock.recv_multipart(), allowed=("ok", "error")).msg
        if isinstance(reply, schema.Error):
            assert reply.code in CODES
            seen[reply.code] = seen.get(reply.code, 0) + 1
        assert snapshot(target) == before

    try:
        one()
    finally:
        sock.close()
    assert seen.get("BAD_MESSAGE", 0) > 0  # the fuzzer did reach the validator
    assert "INTERNAL" not in seen  # a crash caught and reported is still our bug


# `make fuzz` runs 10,000 cases: an idle daemon reads engine messages in 50 ms batches,
# so the slow mode outlives pytest's default 300 s; the default mode takes seconds.
@pytest.mark.timeout(3600)
def test_engine_socket_refuses_every_invalid_case_and_keeps_serving(target, request):
    before = snapshot(target)
    sock = dealer(target.engine_addr)

    @fuzz_settings(request)
    @given(case=engine_cases)
    def one(case):
        sock.send_multipart(case)
        assert sock.poll(5000), f"no answer to {case!r:.200}"
        reply = codec.decode(sock.recv_multipart(), allowed=("ok", "error")).msg
        assert isinstance(reply, schema.Error) and reply.code in CODES - {"INTERNAL"}
        assert snapshot(target) == before

    try:
        one()
    finally:
        sock.close()
