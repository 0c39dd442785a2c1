"""The rendezvous store: gloo groups form through it, it listens on one address only, and
without the group's token (or, with CURVE, the server's key) nothing gets in."""

from __future__ import annotations

import datetime
import threading

import psutil
import pytest
import torch
import torch.distributed as dist
import zmq

from messages.rendezvous import StoreClient, StoreError, StoreServer


def _pg(store, rank, world):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=20)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("g/", store), rank, world, opts)


@pytest.mark.parametrize("curve", [False, True])
def test_a_gloo_group_forms_through_the_store_and_broadcasts(curve):
    server = StoreServer("127.0.0.1", curve=curve)
    assert bool(server.public_key) is curve
    out: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def member(rank):
        store = StoreClient("127.0.0.1", server.port, server.token, server.public_key, timeout=20)
        try:
            pg = _pg(store, rank, 3)
            t = torch.arange(5, dtype=torch.float32) if rank == 0 else torch.zeros(5)
            pg.broadcast([t], dist.BroadcastOptions()).wait()
            out[rank] = t.tolist()
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            store.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.close()
    assert not errors, errors
    assert out == {r: [0.0, 1.0, 2.0, 3.0, 4.0] for r in range(3)}


def test_it_listens_on_the_given_address_only():
    server = StoreServer("127.0.0.1")
    try:
        listening = [
            c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
        ]
        mine = [a for a in listening if a.port == server.port]
        assert [a.ip for a in mine] == ["127.0.0.1"], listening
    finally:
        server.close()


def test_a_wrong_token_is_refused_and_changes_nothing():
    server = StoreServer("127.0.0.1")
    good = StoreClient("127.0.0.1", server.port, server.token, timeout=2)
    bad = StoreClient("127.0.0.1", server.port, "0" * 64, timeout=2)
    try:
        good.set("k", b"v1")
        with pytest.raises(StoreError, match="refused"):
            bad.set("k", b"evil")
        with pytest.raises(StoreError, match="refused"):
            bad.get("k")
        assert good.get("k") == b"v1"
        assert good.add("n", 2) == 2 and good.add("n", 3) == 5
        assert good.check(["k", "n"]) and not good.check(["k", "missing"])
        assert good.compare_set("c", b"", b"x") == b"x" and good.compare_set("c", b"y", b"z") == b"x"
        assert good.num_keys() == 3 and good.delete_key("c") and good.num_keys() == 2
        with pytest.raises(StoreError, match="timed out"):
            good.wait(["never"], datetime.timedelta(seconds=0.3))
    finally:
        good.close()
        bad.close()
        server.close()


def test_with_curve_a_client_without_the_servers_key_gets_nothing():
    server = StoreServer("127.0.0.1", curve=True)
    wrong_key = zmq.curve_keypair()[0].decode()
    plain = StoreClient("127.0.0.1", server.port, server.token, "", timeout=0.5)
    forged = StoreClient("127.0.0.1", server.port, server.token, wrong_key, timeout=0.5)
    try:
        for client in (plain, forged):  # no handshake: no answer, whatever the token
            with pytest.raises(StoreError, match="no answer"):
                client.set("k", b"evil")
        good = StoreClient("127.0.0.1", server.port, server.token, server.public_key, timeout=2)
        assert not good.check(["k"])
        good.close()
    finally:
        plain.close()
        forged.close()
        server.close()


def test_a_per_bucket_mac_binds_the_key_the_sender_the_seq_and_the_bytes():
    from messages.errors import MessageError
    from messages.stream import check_load_mac, load_mac, mac_key

    key = mac_key("ab" * 32, "sync-1")
    assert key != mac_key("ab" * 32, "sync-2") and key != mac_key("cd" * 32, "sync-1")
    data = bytes(range(200))
    tag = load_mac(key, 0, 5, data)
    check_load_mac(key, 0, 5, data, tag)  # the right tag passes
    check_load_mac(None, 0, 5, data, None)  # no keys: nothing due
    for args in (
        (key, 1, 5, data, tag),
        (key, 0, 6, data, tag),
        (key, 0, 5, data[:-1] + b"x", tag),
        (key, 0, 5, data, None),
    ):
        with pytest.raises(MessageError) as ei:
            check_load_mac(*args)
        assert ei.value.code.value == "UNAUTHORIZED"


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), -1.0, "soon", True])
def test_a_bad_timeout_is_answered_with_an_error_and_the_store_keeps_serving(timeout):
    """An infinite or NaN wait used to kill the store's thread (its deadline did not
    convert to milliseconds); now it is refused and the next request is served."""
    import msgspec

    server = StoreServer("127.0.0.1")
    good = StoreClient("127.0.0.1", server.port, server.token, timeout=2)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        raw.send(msgspec.msgpack.encode([server.token, "wait", ["never"], None, timeout]))
        assert raw.poll(5000), "no answer: the store's thread died"
        status, value = msgspec.msgpack.decode(raw.recv())
        assert status == "error" and "bad timeout" in value
        good.set("k", b"v")
        assert good.get("k") == b"v"
    finally:
        raw.close()
        good.close()
        server.close()
