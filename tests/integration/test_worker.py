"""The engine worker against a real ROUTER socket playing the orchestrator."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from engines.torch_engine import TorchEngine, greedy, load_model
from engines.worker import Worker
from examples.tiny import perturbed
from messages import codec, schema
from messages.buckets import digest, iter_buckets
from messages.schema import Probe

PROBE = Probe((1, 9, 33, 71), 6)


class CountingEngine(TorchEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.loads = 0
        self.finalizes = 0

    def load(self, tensors):
        self.loads += 1
        super().load(tensors)

    def finalize(self, sync_id=""):
        self.finalizes += 1
        return super().finalize(sync_id)


class FakeOrchestrator:
    def __init__(self, addr):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(addr)
        self.ident = None

    def recv(self, timeout=20.0, want=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            ident, *frames = self.sock.recv_multipart()
            self.ident = ident
            msg = codec.decode(frames).msg
            if want is None or msg.TYPE in want:
                return msg
        raise AssertionError(f"no {want} message within {timeout}s")

    def send(self, msg, payload=()):
        self.sock.send_multipart([self.ident, *codec.encode(msg, payload)])

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture()
def harness(tmp_path, tiny_model_dir):
    addr = f"ipc://{tmp_path}/engine.sock"
    orch = FakeOrchestrator(addr)
    eng = CountingEngine(tiny_model_dir, threads=1)
    worker = Worker(eng, addr, "e0", heartbeat_interval=0.2, ctx=zmq.Context())
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    reg = orch.recv(want=("register",))
    yield orch, worker, eng, reg
    worker.request_stop()
    t.join(10)
    orch.close()
    assert not t.is_alive()


def test_worker_registers_with_its_spec_and_digest(harness, tiny_state):
    _, _, _, reg = harness
    assert reg.engine_id == "e0" and reg.backend == "torch"
    assert {p.name for p in reg.spec} == set(tiny_state)
    assert reg.digest == digest(tiny_state.items()) and reg.finalize_count == 0


def test_duplicate_load_and_second_finalize_are_not_applied(harness, tiny_state, tiny_model_dir):
    orch, worker, eng, _ = harness
    new = dict(perturbed(tiny_state, 1))
    (b,) = list(iter_buckets(new.items(), 64 << 20))
    load = schema.Load(sync_id="s1", version=1, seq=0, tensors=b.tensors, checksum=b.checksum)
    for _ in range(2):  # the second is a duplicate: acked, not re-applied
        orch.send(load, [b.frame()])
        loaded = orch.recv(want=("loaded",))
        assert (loaded.sync_id, loaded.seq) == ("s1", 0)
    assert eng.loads == 1
    orch.send(schema.Finalize(sync_id="s1", version=1, probes=(PROBE,)))
    fin = orch.recv(want=("finalized",))
    assert fin.finalize_count == 1 and fin.digest == digest(new.items())
    orch.send(schema.Finalize(sync_id="s1", version=1, probes=(PROBE,)))
    refused = orch.recv(want=("failed",))
    assert refused.duplicate and refused.code == "INVALID_STATE"
    assert eng.finalizes == 1 and worker.duplicates_refused == 1
    ref = load_model(tiny_model_dir)
    ref.load_state_dict(new)
    assert fin.probes == (greedy(ref, PROBE.prompt, PROBE.max_tokens),)


def test_progress_is_cumulative_and_coalesced(harness, tiny_state):
    """Many small buckets sent at once: the engine reports `loaded` with increasing seqs,
    fewer reports than buckets, the last covering every bucket; failures are not delayed."""
    orch, worker, eng, _ = harness
    new = dict(perturbed(tiny_state, 2))
    buckets = list(iter_buckets(new.items(), 4 << 10))
    assert len(buckets) >= 10
    for i, b in enumerate(buckets):
        load = schema.Load(sync_id="s2", version=1, seq=i, tensors=b.tensors, checksum=b.checksum)
        orch.send(load, [b.frame()])
    seqs = []
    while not seqs or seqs[-1] < len(buckets) - 1:
        msg = orch.recv(want=("loaded", "failed"))
        assert msg.TYPE == "loaded", msg
        seqs.append(msg.seq)
    assert seqs == sorted(set(seqs)) and len(seqs) < len(buckets)
    assert eng.loads == len(buckets)
    b = buckets[0]  # a resend of an applied bucket is not re-applied: answered with the mark
    orch.send(
        schema.Load(sync_id="s2", version=1, seq=0, tensors=b.tensors, checksum=b.checksum), [b.frame()]
    )
    assert orch.recv(want=("loaded",)).seq == len(buckets) - 1


@pytest.mark.parametrize(
    "transport,bucket_bytes",
    [
        ("inline", 64 << 20),  # 1.7 MB: hashed on the verifier thread
        ("inline", 128 << 10),  # below THREAD_MIN_BYTES: hashed by the applier itself
        ("shm", 64 << 20),  # the trainer's slot, mapped and hashed by the verifier thread
    ],
)
def test_corrupted_frame_is_refused_by_the_engine(harness, tiny_state, transport, bucket_bytes):
    from engines.verify import THREAD_MIN_BYTES
    from messages.segments import Segment

    orch, _, eng, _ = harness
    b = next(iter(iter_buckets(dict(perturbed(tiny_state, 1)).items(), bucket_bytes)))
    assert (b.nbytes >= THREAD_MIN_BYTES) == (bucket_bytes > THREAD_MIN_BYTES)
    raw = bytearray(b.frame())
    raw[len(raw) // 2] ^= 0x01  # one bit, mid-bucket
    load = schema.Load(sync_id="s1", version=1, seq=0, tensors=b.tensors, checksum=b.checksum)
    with Segment(b.nbytes, kind="trainer") as seg:
        if transport == "shm":
            seg.write(bytes(raw))
            orch.send(msgspec.structs.replace(load, ref=schema.Ref(seg.name, 0, b.nbytes)))
        else:
            orch.send(load, [bytes(raw)])
        failed = orch.recv(want=("failed",))
    assert failed.code == "CHECKSUM_MISMATCH" and failed.seq == 0 and eng.loads == 0


def test_unknown_tensor_is_reported_with_code(harness):
    import torch

    orch, _, _, _ = harness
    (b,) = list(iter_buckets([("model.bogus.weight", torch.zeros(4))]))
    orch.send(
        schema.Load(sync_id="s1", version=1, seq=0, tensors=b.tensors, checksum=b.checksum), [b.frame()]
    )
    assert orch.recv(want=("failed",)).code == "UNKNOWN_TENSOR"


def test_worker_heartbeats_and_reregisters_when_unknown(harness):
    orch, _, _, _ = harness
    hb = orch.recv(want=("heartbeat",))
    orch.send(schema.Ok(id=hb.id, body={"known": False}))
    again = orch.recv(want=("register",))
    assert again.engine_id == "e0"


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_box_for_an_engine_that_takes_whole_tensors_is_refused_and_nothing_loads(
    harness, tiny_state, transport
):
    """An engine of one rank declared no slices: a bucket holding a box of a tensor (a
    sender that cut for a layout it did not declare) is BAD_MESSAGE before any path hands
    it on, by frame or by reference, and nothing is loaded."""
    from messages.buckets import Sliced
    from messages.cuts import cut
    from messages.segments import Segment

    orch, _, eng, reg = harness
    assert reg.slices is None
    name = "model.layers.0.self_attn.q_proj.weight"
    t = dict(perturbed(tiny_state, 1))[name]
    box = ((0, t.shape[0] // 2), (0, t.shape[1]))
    (b,) = list(iter_buckets([(name, Sliced(cut(t, box), box, tuple(t.shape)))]))
    assert b.tensors[0].box == box
    load = schema.Load(sync_id="s1", version=1, seq=0, tensors=b.tensors, checksum=b.checksum)
    with Segment(b.nbytes, kind="trainer") as seg:
        if transport == "shm":
            seg.write(bytes(b.frame()))
            orch.send(msgspec.structs.replace(load, ref=schema.Ref(seg.name, 0, b.nbytes)))
        else:
            orch.send(load, [b.frame()])
        failed = orch.recv(want=("failed",))
    assert failed.code == "BAD_MESSAGE" and "box" in failed.message and eng.loads == 0
