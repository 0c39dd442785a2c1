"""weightsync across hosts: the daemon, the trainer and two engines each on a lab host of
its own, every byte over a 200 Mbit/s link: pushes by frames and by a group commit with
every engine serving the trainer's digest, and nothing listens beyond the addresses
configured."""

from __future__ import annotations

import pytest

from tests.lab.fleet import ENGINE_PORT, TRAINER_PORT, LabFleet
from tests.lab.net import Lab, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    with Lab(rate_mbit=200) as lab, LabFleet(lab, tmp_path, tiny_model_dir, engines=2) as f:
        yield f


def _served(f: LabFleet) -> dict[str, tuple[int, str]]:
    st = f.status()
    engines = st["engines"]
    items = engines.items() if isinstance(engines, dict) else ((e["engine_id"], e) for e in engines)
    return {eid: (e.get("version"), e.get("digest")) for eid, e in items}


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_pushes_commit_across_hosts(fleet, transport):
    for version in (1, 2):
        r = fleet.push(version, transport=transport)
        assert r["ok"], r
        res = r["result"]
        assert res["state"] == "READY" and res["detail"]["transport"] == transport, res
        served = _served(fleet)
        assert served == {"e0": (version, res["digest"]), "e1": (version, res["digest"])}, served


def test_nothing_listens_beyond_the_addresses_configured(fleet):
    """The daemon's host listens on its configured address only (the trainer and engine
    sockets, the fan-out beside them); engines listen on nothing but their own address
    (a group's sockets, while one is open); the trainer host's store is bound to its own
    address, never to every interface."""
    assert fleet.push(1, transport="collective")["ok"]
    d = fleet.daemon_host
    listening = d.listening()
    assert f"{d.addr}:{TRAINER_PORT}" in listening and f"{d.addr}:{ENGINE_PORT}" in listening
    for h in (fleet.daemon_host, fleet.trainer_host, *fleet.engine_hosts):
        for a in h.listening():
            assert a.rsplit(":", 1)[0] in (h.addr, "127.0.0.1"), (h.name, a, h.listening())


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_a_sharded_push_from_two_source_hosts_commits_across_hosts(tmp_path, tiny_model_dir, transport):
    """Two trainer hosts, each one source of a sharded push (the version's tensors split
    between them), into two engines on hosts of their own: one sync, both sources told
    READY with the version's digest, every engine serving it."""
    with (
        Lab(rate_mbit=200) as lab,
        LabFleet(lab, tmp_path, tiny_model_dir, engines=2, sources=2) as f,
    ):
        for version in (1, 2):
            answers = f.push_sharded(version, transport=transport)
            assert all(a["ok"] for a in answers), answers
            results = [a["result"] for a in answers]
            assert {r["state"] for r in results} == {"READY"}, results
            assert {r["detail"]["transport"] for r in results} == {transport}, results
            (digest,) = {r["digest"] for r in results}
            assert _served(f) == {"e0": (version, digest), "e1": (version, digest)}
