"""The collective transport with real processes and real gloo: the daemon plans the group
and stays out of the byte path; engines receive by broadcast, verify, apply, ack."""

from __future__ import annotations

import os

import psutil
import pytest

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.buckets import digest
from messages.canary import make_probes
from tests.integration.helpers import running_daemon


def probes_for(model_dir, weights, n=6):
    """Greedy canaries computed by the trainer's own model: the engines must match them."""
    m = load_model(model_dir)
    m.load_state_dict(weights)
    return make_probes(m, [(1, 17, 42, 99, 7), (1, 250, 3, 64)], n)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    with running_daemon(tmp_path_factory.mktemp("collective"), tiny_model_dir) as c:
        yield c


def wait_for(client, ok, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = client.status()
        if ok(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def test_three_versions_reach_two_torch_engines_by_broadcast_with_exact_outputs(cluster, tiny_state):
    with cluster.client(timeout=30.0) as client:
        base = client.status()["last_ready_version"] or 0
        groups = set()
        for i in range(3):
            v = base + 1 + i
            w = dict(perturbed(tiny_state, v))
            probes = probes_for(cluster.model_dir, w)
            before = client.status()["daemon"]["bytes_received"]
            r = client.push(w.items(), v, bucket_bytes=128 * 1024, transport="collective", probes=probes)
            st = client.status()
            assert r.detail["transport"] == "collective"
            assert {e["digest"] for e in r.engines} == {digest(w.items())}
            assert st["version"] == v and st["state"] == "READY"
            # the daemon never received a weight byte (no spool: no copy either)
            assert st["daemon"]["bytes_received"] == before
            assert st["collective"]["world_size"] == 3 and st["collective"]["backend"] == "gloo"
            groups.add(st["collective"]["group"])
        assert len(groups) == 1, "the group is built once per membership and reused"


@pytest.mark.parametrize("engines", [2, 3])
def test_engine_killed_mid_broadcast_fails_typed_within_deadline_rolls_back_and_next_push_is_ready(
    tmp_path, tiny_model_dir, tiny_state, engines
):
    """The top complaint against NCCL weight sync: a dead member hangs everyone. Here the
    trainer gets ENGINE_FAILED naming the engine, the survivors are rolled back from the
    spool, and a new group carries the next push. The broadcast is relayed down the ranks
    (messages/relay.py): with 2 engines engine-1 is the chain's tail, with 3 its middle,
    whose neighbours' sends and receives fail first (`failed.peer`) and must not be named."""
    import time

    from messages.errors import ErrorCode, WeightSyncError

    bucket_timeout = 20.0
    args = [
        "--engine-timeout",
        "3",
        "--bucket-timeout",
        str(bucket_timeout),
        "--spool",
        str(tmp_path / "spool"),
    ]
    with running_daemon(tmp_path, tiny_model_dir, engines=engines, daemon_args=args, min_engines=1) as c:
        with c.client(timeout=30.0) as client:
            w1 = dict(perturbed(tiny_state, 1))
            r1 = client.push(w1.items(), 1, bucket_bytes=64 * 1024, transport="collective")
            st = client.status()
            assert r1.detail["transport"] == "collective"
            assert st["daemon"]["bytes_received"] == r1.bytes  # the spool's copy, nothing more
            g1 = st["collective"]["group"]
            next(
                p for p in c.procs if p.name == "engine-1"
            ).stop()  # back with a failpoint: dies in broadcast 3
            victim = c.start_engine("engine-1", ["--failpoint", "kill_in_broadcast=3"])
            wait_for(
                client,
                lambda st: any(
                    e["engine_id"] == "engine-1" and e["pid"] == victim.popen.pid and e["state"] == "READY"
                    for e in st["engines"]
                ),
            )
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as ei:
                client.push(
                    dict(perturbed(tiny_state, 2)).items(),
                    2,
                    bucket_bytes=64 * 1024,
                    transport="collective",
                    rollback_wait=0,
                )
            took = time.monotonic() - t0
            assert ei.value.code in (ErrorCode.ENGINE_FAILED, ErrorCode.TIMEOUT)
            assert "engine-1" in ei.value.message, ei.value.message
            assert "engine-0" not in ei.value.message and "engine-2" not in ei.value.message, ei.value.message
            assert took < bucket_timeout + 5, took
            assert victim.popen.wait(10) == -9
            # rollback from the spool puts version 1 back on the survivor
            st = wait_for(client, lambda st: st["state"] == "READY" and not st["dirty"])
            assert st["version"] == 1, st
            survivors = [e for e in st["engines"] if e["engine_id"] != "engine-1"]
            assert len(survivors) == engines - 1
            assert all(e["digest"] == digest(w1.items()) for e in survivors), survivors
            # the next push builds a new group without the dead member
            w3 = dict(perturbed(tiny_state, 3))
            r3 = client.push(w3.items(), 3, bucket_bytes=64 * 1024, transport="collective")
            st = client.status()
            assert r3.detail["transport"] == "collective" and st["version"] == 3
            assert st["collective"]["group"] != g1 and st["collective"]["world_size"] == engines
            assert {e["digest"] for e in r3.engines} == {digest(w3.items())}


@pytest.mark.parametrize("failpoint", ["kill_in_broadcast", "kill_in_receive"])
def test_an_engines_death_on_the_collective_fails_the_push_at_once_whatever_the_timeouts(
    tmp_path, tiny_model_dir, tiny_state, failpoint
):
    """With 30 s engine and bucket timeouts, an engine SIGKILLed (a) before it posts the
    receive of a bucket (its header read) or (b) with that receive posted fails the push
    with ENGINE_FAILED naming it within 3 s: its closed connection says so, not a timeout.
    The survivors take the next push."""
    import time

    from messages.errors import ErrorCode, WeightSyncError

    args = ["--engine-timeout", "30", "--bucket-timeout", "30", "--log-level", "info"]
    with running_daemon(tmp_path, tiny_model_dir, engines=1, daemon_args=args, min_engines=1) as c:
        victim = c.start_engine("engine-9", ["--failpoint", f"{failpoint}=3"])
        c.wait_engines(2, timeout=60)
        with c.client(timeout=30.0) as client:
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as ei:
                client.push(
                    dict(perturbed(tiny_state, 1)).items(),
                    1,
                    bucket_bytes=64 * 1024,
                    transport="collective",
                    rollback_wait=0,
                )
            took = time.monotonic() - t0
            assert victim.popen.wait(10) == -9
            err = ei.value
            assert err.code is ErrorCode.ENGINE_FAILED, (err.code, err.message)
            assert "engine-9" in err.message and "connection closed" in err.message, err.message
            assert took < 3.0, took
            w2 = dict(perturbed(tiny_state, 2))
            r = client.push(w2.items(), 2, bucket_bytes=64 * 1024, transport="collective")
            assert r.state == "READY" and r.detail["transport"] == "collective"
            assert [e["engine_id"] for e in r.engines] == ["engine-0"]
            assert {e["digest"] for e in r.engines} == {digest(w2.items())}


def test_daemon_trainer_and_engines_on_three_loopback_addresses(tmp_path, tiny_model_dir, tiny_state):
    """Nothing assumes one host: the daemon listens on 127.0.0.1, the trainer connects from
    127.0.0.2 and hosts the group's store there, the engines connect from 127.0.0.3 and
    bind their gloo sockets there."""
    import socket

    from examples.launch import Cluster

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    tport, eport = free_port(), free_port()
    c = Cluster(
        tmp_path,
        tiny_model_dir,
        engines=2,
        daemon_args=["--engine-timeout", "3", "--log-level", "debug"],
        engine_args=["--threads", "1", "--heartbeat-interval", "0.5", "--collective-host", "127.0.0.3"],
    )
    c.addr = f"tcp://127.0.0.1:{tport}"
    c.engine_addr = f"tcp://127.0.0.3:0;127.0.0.1:{eport}"  # connect from 127.0.0.3
    c.daemon_args += ["--bind", f"tcp://127.0.0.1:{tport}", "--engine-bind", f"tcp://127.0.0.1:{eport}"]
    with c:
        with c.client(timeout=30.0) as plain:
            st = plain.status()
        assert all(e["collective_ranks"] == 1 for e in st["engines"])
        from orchestrator.trainer.client import TrainerClient

        with TrainerClient(
            f"tcp://127.0.0.2:0;127.0.0.1:{tport}", timeout=30.0, collective_host="127.0.0.2"
        ) as client:
            for v in (1, 2):
                w = dict(perturbed(tiny_state, v))
                r = client.push(w.items(), v, bucket_bytes=128 * 1024, transport="collective")
                assert r.detail["transport"] == "collective"
                assert {e["digest"] for e in r.engines} == {digest(w.items())}
            st = client.status()
            assert st["collective"]["store"].startswith("127.0.0.2:")
            assert st["daemon"]["bytes_received"] == 0
            # Where everything listens, with the group up: the trainer (this process) on
            # 127.0.0.2 (its store and gloo), the engines on 127.0.0.3 (gloo), the daemon on
            # 127.0.0.1; nothing on every interface. What we connect (ZeroMQ to the daemon,
            # the store) leaves from the configured address; gloo's own outgoing
            # connections leave from the address the kernel routes them by.
            store_port = int(st["collective"]["store"].rsplit(":", 1)[1])
            mine = psutil.Process(os.getpid()).net_connections("tcp")  # other tests' too
            listen = {(x.laddr.ip, x.laddr.port) for x in mine if x.status == psutil.CONN_LISTEN}
            assert ("127.0.0.2", store_port) in listen, listen
            assert not {ip for ip, _ in listen} & {"::", "0.0.0.0"}, listen
            ours = [x for x in mine if x.raddr and x.raddr.port in (store_port, tport)]
            assert ours and {x.laddr.ip for x in ours} == {"127.0.0.2"}, ours
            for p in c.procs[1:]:
                conns = psutil.Process(p.popen.pid).net_connections("tcp")
                listen = {x.laddr.ip for x in conns if x.status == psutil.CONN_LISTEN}
                ours = [x for x in conns if x.raddr and x.raddr.port in (store_port, eport)]
                assert listen == {"127.0.0.3"}, (p.name, conns)
                assert len(ours) == 2 and {x.laddr.ip for x in ours} == {"127.0.0.3"}, (p.name, ours)
            daemon = psutil.Process(c.daemon.popen.pid).net_connections("tcp")
            assert {x.laddr.ip for x in daemon if x.status == psutil.CONN_LISTEN} == {"127.0.0.1"}
    logs = "".join((tmp_path / "logs" / f"engine-{i}.log").read_text() for i in range(2))
    assert '"group_joined"' in logs


DYING_TRAINER = r"""
import os, signal, sys
from examples.tiny import perturbed
from engines.torch_engine import load_model
from orchestrator.trainer.client import TrainerClient
from orchestrator.trainer.group import TrainerGroup
addr, model = sys.argv[1], sys.argv[2]
real = TrainerGroup.start
calls = []
def start(self, data, seq, give_up=None):
    calls.append(1)
    if len(calls) == 4:  # bucket 3 is announced: the engines wait in its broadcast
        print("DYING", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, data, seq, give_up)
TrainerGroup.start = start
state = load_model(model).state_dict()
TrainerClient(addr, timeout=30).push(perturbed(state, 2), 2, bucket_bytes=64 * 1024, transport="collective")
"""


def test_trainer_killed_mid_broadcast_frees_the_engines_rolls_back_and_next_push_is_ready(
    tmp_path, tiny_model_dir, tiny_state
):
    """The engines wait inside a broadcast whose root dies: they fail fast (the root's
    sockets close), the daemon rolls them back from the spool, and a new trainer pushes."""
    import subprocess
    import sys
    import time

    args = ["--engine-timeout", "3", "--bucket-timeout", "60", "--spool", str(tmp_path / "spool")]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, daemon_args=args) as c:
        with c.client(timeout=30.0) as client:
            w1 = dict(perturbed(tiny_state, 1))
            client.push(w1.items(), 1, bucket_bytes=64 * 1024, transport="collective")
        p = subprocess.Popen(
            [sys.executable, "-c", DYING_TRAINER, c.addr, str(tiny_model_dir)],
            stdout=subprocess.PIPE,
            text=True,
        )
        lines = []
        while (line := p.stdout.readline()) and line.strip() != "DYING":
            lines.append(line)  # the client's own log lines come first
        assert line.strip() == "DYING", lines
        assert p.wait(10) == -9
        t0 = time.monotonic()
        with c.client(timeout=30.0) as client:
            st = wait_for(
                client,
                lambda st: (
                    st["state"] == "READY"
                    and not st["dirty"]
                    and (st.get("last_sync") or {}).get("kind") == "rollback"
                ),
                timeout=30,
            )
            took = time.monotonic() - t0
            assert st["version"] == 1 and took < 20, (took, st)
            assert {e["digest"] for e in st["engines"]} == {digest(w1.items())}
            w3 = dict(perturbed(tiny_state, 3))
            r3 = client.push(w3.items(), 3, bucket_bytes=64 * 1024, transport="collective")
            assert r3.detail["transport"] == "collective"
            assert {e["digest"] for e in r3.engines} == {digest(w3.items())}


def test_a_byte_corrupted_on_the_collective_is_caught_by_the_engines(cluster, tiny_state, monkeypatch):
    """The checksum travels through the daemon, the bytes by broadcast: a byte flipped
    after packing fails the sync with CHECKSUM_MISMATCH, nothing finalized; the next push
    is READY."""
    from messages.errors import ErrorCode, WeightSyncError
    from orchestrator.trainer.group import TrainerGroup

    real = TrainerGroup.start
    seen = []

    def start(self, data, seq, give_up=None):
        seen.append(1)
        if len(seen) == 3:
            data = data.clone()
            data[len(data) // 2] ^= 0x40  # in flight, after the checksum was taken
        real(self, data, seq, give_up)

    with cluster.client(timeout=30.0) as client:
        st = client.status()
        v = (st["last_ready_version"] or 0) + 1
        counts = [e["finalize_count"] for e in st["engines"]]
        monkeypatch.setattr(TrainerGroup, "start", start)
        with pytest.raises(WeightSyncError) as ei:
            client.push(
                dict(perturbed(tiny_state, v)).items(), v, bucket_bytes=128 * 1024, transport="collective"
            )
        assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH, ei.value
        monkeypatch.setattr(TrainerGroup, "start", real)
        assert [e["finalize_count"] for e in client.status()["engines"]] == counts  # nothing finalized
        w = dict(perturbed(tiny_state, v + 1))
        r = client.push(w.items(), v + 1, bucket_bytes=128 * 1024, transport="collective")
        assert {e["digest"] for e in r.engines} == {digest(w.items())}


def test_hostile_collective_fields_get_typed_errors_and_the_daemon_serves_on(cluster, tiny_state):
    """A collective bucket in an inline sync, an inline frame in a collective sync, shm and
    size together, a copy frame of the wrong size: BAD_MESSAGE each, nothing applied."""
    import msgspec

    from messages import schema
    from messages.buckets import iter_buckets
    from messages.errors import ErrorCode, WeightSyncError

    with cluster.client(timeout=30.0) as client:
        v = (client.status()["last_ready_version"] or 0) + 1
        (b, *_) = list(iter_buckets(dict(perturbed(tiny_state, v)).items(), 128 * 1024))
        sid = client.begin(v, transport="inline").sync_id
        cases = [
            (
                lambda i: msgspec.structs.replace(client.stream.bucket_msg(sid, b, i), size=b.nbytes),
                [],
                "negotiate",
            ),
            (
                lambda i: msgspec.structs.replace(
                    client.stream.bucket_msg(
                        sid, b, i, ref=schema.Ref("weightsync.trainer.1.0123456789ab", 0, b.nbytes)
                    ),
                    size=b.nbytes,
                ),
                [],
                "not both",
            ),
            (
                lambda i: msgspec.structs.replace(client.stream.bucket_msg(sid, b, i), size=b.nbytes + 8),
                [b.frame()],
                "exactly its size",
            ),
        ]
        for make, payload, words in cases:
            with pytest.raises(WeightSyncError) as ei:
                client.conn.request(make, payload=payload, retries=0)
            assert ei.value.code is ErrorCode.BAD_MESSAGE and words in ei.value.message, ei.value
        client.abort(sid)
        offer = client._collective_offer()
        sid = client.begin(v, transport="collective", group_offer=offer).sync_id
        with pytest.raises(WeightSyncError) as ei:
            client.send_bucket(sid, b)  # bytes inline in a collective sync
        assert ei.value.code is ErrorCode.BAD_MESSAGE and "collective" in ei.value.message
        client.abort(sid)
        st = client.status()
        assert st["state"] in ("READY", "IDLE") and st["sync"] is None
        w = dict(perturbed(tiny_state, v))
        assert client.push(w.items(), v, bucket_bytes=128 * 1024, transport="collective").state == "READY"
