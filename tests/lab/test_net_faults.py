"""The network's own faults, on the lab: a link that goes dark mid-sync (no FIN, no RST),
a link that flaps, a slow link. Each is judged on what the fleet ends with: one version,
the served digest on every READY engine, nothing stuck past its deadline, no process
restarted by hand. Each test prints how long the fleet took to settle."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.helpers import wait_for
from tests.lab.fleet import LabFleet
from tests.lab.net import Lab, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

ENGINE_TIMEOUT = 3.0
SLOW_MBIT = 4  # engine links: the tiny model (1.7 MB) takes ~3.4 s per copy over one


def _engines(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    e = st["engines"]
    return dict(e) if isinstance(e, dict) else {x["engine_id"]: x for x in e}


def _served_by(f: LabFleet) -> dict[str, tuple[int | None, str | None]]:
    """Each READY engine's (version, digest)."""
    return {
        e: (x.get("version"), x.get("digest"))
        for e, x in _engines(f.status()).items()
        if x.get("state") == "READY"
    }


def _syncing(f: LabFleet) -> bool:
    st = f.status()
    return st["state"] == "LOADING_BUCKETS" and st.get("sync") is not None


def _cut_e1_mid_push(
    f: LabFleet, version: int, transport: str, **push: Any
) -> tuple[dict[str, Any], float, float]:
    """Push `version` (`push`: more of the agent's push fields), and cut e1's link once the
    sync is loading: the push must fail (ENGINE_FAILED or TIMEOUT) within the engine
    timeout + 10 s. Returns its answer, the instant of the cut and how long the failure
    took after it."""
    rid = f.send({"op": "push", "version": version, "transport": transport, "timeout": 60, **push})
    wait_for(lambda: _syncing(f), 60, f"the sync of version {version} to be loading")
    cut = time.monotonic()
    f.host_of(1).cut()
    failed = f.answer(rid, timeout=120)
    noticed = time.monotonic() - cut
    assert not failed["ok"] and failed["code"] in ("ENGINE_FAILED", "TIMEOUT"), failed
    assert noticed <= ENGINE_TIMEOUT + 10, noticed
    return failed, cut, noticed


def _fleet(lab: Lab, tmp_path, model_dir, **kw: Any) -> LabFleet:
    args = ["--spool", str(tmp_path / "spool"), "--engine-timeout", str(ENGINE_TIMEOUT)]
    return LabFleet(lab, tmp_path / "fleet", model_dir, engines=2, min_engines=1, daemon_args=args, **kw)


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_an_engine_link_that_flaps_then_goes_dark_mid_sync(tmp_path, tiny_model_dir, transport):
    """One fleet, two faults on e1's link (engine links at 4 Mbit/s, --engine-timeout 3,
    --min-engines 1):
    - a flap of one second mid-sync, shorter than the engine timeout: TCP retransmits
      across the gap, nothing is declared lost, the sync commits on both engines;
    - a cut mid-sync: the sync fails within the engine timeout + 10 s naming e1, e0 is
      rolled back to the served version, the next push commits on e0 alone; healed, e1
      catches up by itself; the next push on both costs at most 1.2x a push before the
      faults (nothing queued for the dead connection drains through the healed link: the
      fan-out's heartbeats closed it; 0.99x over frames, 1.18x over a group, measured on
      the lab). Past 1.2x the test ends as an expected failure that says the ratio (the
      figure is printed either way).
    """
    with Lab(rate_mbit=200) as lab, _fleet(lab, tmp_path, tiny_model_dir) as f:
        for h in f.engine_hosts:
            h.rate(SLOW_MBIT)
        assert f.push(1, transport=transport)["ok"]
        before = f.push(2, transport=transport)
        assert before["ok"], before
        # the flap
        rid = f.send({"op": "push", "version": 3, "transport": transport, "timeout": 60})
        wait_for(lambda: _syncing(f), 60, "the third sync to be loading")
        f.host_of(1).cut()
        time.sleep(1.0)  # the fault itself is a duration: a one-second flap
        f.host_of(1).heal()
        v3 = f.answer(rid, timeout=120)
        assert v3["ok"] and v3["result"]["state"] == "READY", v3
        assert _served_by(f) == {e: (3, v3["result"]["digest"]) for e in ("e0", "e1")}
        # the cut
        failed, cut, noticed = _cut_e1_mid_push(f, 4, transport)
        assert "e1" in failed["message"], failed

        def rolled_back() -> bool:
            st = f.status()
            e0 = _served_by(f).get("e0")
            return st["state"] == "READY" and st["version"] == 3 and e0 == (3, v3["result"]["digest"])

        wait_for(rolled_back, 60, "e0 back at version 3")
        settled = time.monotonic() - cut
        v5 = f.push(5, transport=transport)  # --min-engines 1: commits on e0
        assert v5["ok"] and v5["result"]["state"] == "READY", v5
        f.host_of(1).heal()
        healed = time.monotonic()
        want = (5, v5["result"]["digest"])
        wait_for(
            lambda: _served_by(f) == {"e0": want, "e1": want}, 120, "e1 caught up to version 5 by itself"
        )
        caught_up = time.monotonic() - healed
        after = f.push(6, transport=transport)
        assert after["ok"] and _served_by(f) == {e: (6, after["result"]["digest"]) for e in ("e0", "e1")}
        ratio = after["result"]["seconds"] / before["result"]["seconds"]
        print(
            f"{transport}: failed {noticed:.1f}s after the cut, e0 back at v3 {settled:.1f}s after it; "
            f"e1 at v5 {caught_up:.1f}s after the heal; push after/before {after['result']['seconds']:.2f}s/"
            f"{before['result']['seconds']:.2f}s = {ratio:.2f}x"
        )
        if ratio > 1.2:  # 3.7x inline, 2.0x collective before the fan-out's heartbeats (docs/MULTINODE.md)
            pytest.xfail(
                f"{transport}: the push after the heal took {ratio:.2f}x the push before (target 1.2x)"
            )


def test_the_trainers_link_cut_mid_push_ends_the_sync_and_the_fleet_is_back_at_the_served_version(
    tmp_path, tiny_model_dir
):
    """The trainer's host goes dark mid-push (no FIN: the daemon never sees its connection
    close): the daemon ends the sync by itself at --sync-timeout and rolls the engines back;
    the trainer's call raises within its own deadline; healed, the next push commits."""
    with Lab(rate_mbit=200) as lab:
        args = [
            "--spool",
            str(tmp_path / "spool"),
            "--engine-timeout",
            str(ENGINE_TIMEOUT),
            "--sync-timeout",
            "5",
        ]
        with LabFleet(lab, tmp_path / "fleet", tiny_model_dir, engines=2, daemon_args=args) as f:
            f.trainer_host.rate(SLOW_MBIT)
            v1 = f.push(1, transport="inline")
            assert v1["ok"], v1
            rid = f.send({"op": "push", "version": 2, "transport": "inline", "timeout": 5, "retries": 0})
            wait_for(lambda: f.status()["state"] == "LOADING_BUCKETS", 60, "the second sync to be loading")
            cut = time.monotonic()
            f.trainer_host.cut()
            r = f.answer(rid, timeout=120)
            raised = time.monotonic() - cut
            assert not r["ok"], r
            f.trainer_host.heal()

            def back() -> bool:
                st = f.status()
                served = {(x.get("version"), x.get("digest")) for x in _engines(st).values()}
                return (
                    st["state"] == "READY" and st["version"] == 1 and served == {(1, v1["result"]["digest"])}
                )

            wait_for(back, 60, "the fleet back at version 1")
            settled = time.monotonic() - cut
            v3 = f.push(3, transport="inline")
            assert v3["ok"] and v3["result"]["state"] == "READY", v3
            print(
                f"trainer cut: its call raised {raised:.1f}s after the cut ({r['code']}); fleet at v1 {settled:.1f}s"
            )


def test_the_daemons_link_cut_mid_sync_and_healed_the_engines_keep_serving_and_the_next_push_commits(
    tmp_path, tiny_model_dir
):
    """The daemon's host goes dark mid-sync: the trainer's call raises; the engines keep
    the served version meanwhile (the sync never finalized); healed, the engines register
    again by themselves and the next push commits on both, no process restarted."""
    with Lab(rate_mbit=200) as lab, _fleet(lab, tmp_path, tiny_model_dir) as f:
        f.daemon_host.rate(SLOW_MBIT)
        v1 = f.push(1, transport="inline")
        assert v1["ok"], v1
        pids = {name: p.pid for name, p in f.procs.items()}
        rid = f.send({"op": "push", "version": 2, "transport": "inline", "timeout": 5, "retries": 0})
        wait_for(lambda: _syncing(f), 60, "the second sync to be loading")
        cut = time.monotonic()
        f.daemon_host.cut()
        r = f.answer(rid, timeout=120)
        raised = time.monotonic() - cut
        assert not r["ok"], r
        f.daemon_host.heal()
        healed = time.monotonic()
        # the engines were lost to the daemon while the link was dark: they register again by
        # themselves once it is back, and the push waits for them
        v3 = f.push(3, transport="inline", rollback_wait=120, engines_wait=60)
        assert v3["ok"] and v3["result"]["state"] == "READY", v3
        want = {e: (3, v3["result"]["digest"]) for e in ("e0", "e1")}
        # --min-engines 1: v3 may commit on the first engine back; the other catches up
        wait_for(lambda: _served_by(f) == want, 60, "both engines at version 3")
        assert {name: p.pid for name, p in f.procs.items()} == pids
        assert all(p.poll() is None for p in f.procs.values())
        print(
            f"daemon cut: the trainer raised {raised:.1f}s after it; v3 committed {time.monotonic() - healed:.1f}s after the heal"
        )


def test_one_engine_five_times_slower_still_commits(tmp_path, tiny_model_dir):
    """e1's link carries a fifth of the others' rate: the push waits for it and commits
    (no deadline counts a slow link as a dead one)."""
    with Lab(rate_mbit=40) as lab, _fleet(lab, tmp_path, tiny_model_dir) as f:
        f.host_of(1).rate(8)
        for v, transport in ((1, "inline"), (2, "collective")):
            r = f.push(v, transport=transport)
            assert r["ok"] and r["result"]["state"] == "READY", r
            engines = _engines(f.status())
            assert {x.get("version") for x in engines.values()} == {v}, engines


def test_the_middle_of_the_relay_chain_goes_dark_mid_sync(tmp_path, tiny_model_dir):
    """Three engines over the collective: the trainer's bytes pass e0 -> e1 -> e2
    (messages/relay.py). e1's link goes dark mid-sync (no FIN, no RST): e0's sends and
    e2's receives stall, not fail. The sync fails within the engine timeout + 10 s naming
    e1 (its heartbeats stop) and no other engine; e0 and e2 are rolled back to the served
    version; with --min-engines 1 the next push commits on them (a new chain without e1);
    healed, e1 catches up by itself, and the next push commits on all three."""
    args = ["--spool", str(tmp_path / "spool"), "--engine-timeout", str(ENGINE_TIMEOUT)]
    with (
        Lab(rate_mbit=200) as lab,
        LabFleet(lab, tmp_path / "fleet", tiny_model_dir, engines=3, min_engines=1, daemon_args=args) as f,
    ):
        for h in f.engine_hosts:
            h.rate(SLOW_MBIT)
        v1 = f.push(1, transport="collective")
        assert v1["ok"], v1
        failed, cut, noticed = _cut_e1_mid_push(f, 2, "collective")
        assert "e1" in failed["message"] and "e0" not in failed["message"], failed
        assert "e2" not in failed["message"], failed
        others = {e: (1, v1["result"]["digest"]) for e in ("e0", "e2")}
        wait_for(
            lambda: f.status()["state"] == "READY" and _served_by(f) == others, 60, "e0 and e2 back at v1"
        )
        settled = time.monotonic() - cut
        v3 = f.push(3, transport="collective")
        assert v3["ok"] and v3["result"]["state"] == "READY", v3
        f.host_of(1).heal()
        healed = time.monotonic()
        want = (3, v3["result"]["digest"])
        wait_for(lambda: _served_by(f) == {e: want for e in ("e0", "e1", "e2")}, 120, "e1 caught up to v3")
        caught_up = time.monotonic() - healed
        v4 = f.push(4, transport="collective")
        assert v4["ok"] and _served_by(f) == {e: (4, v4["result"]["digest"]) for e in ("e0", "e1", "e2")}
        print(
            f"middle of the chain cut: failed {noticed:.1f}s after the cut, e0 and e2 at v1 {settled:.1f}s "
            f"after it; e1 at v3 {caught_up:.1f}s after the heal"
        )


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_sliced_pushes_to_two_rank_engines_over_a_slow_link_and_a_cut_one(
    tmp_path, tiny_model_dir, transport
):
    """Two engines of two ranks each (`--tp 2`: every push is cut into slices), each on its
    own host. e1's link is five times slower than e0's: the push waits for it and commits,
    each rank handed only its slices. Then e1's link goes dark mid-sync: the sync fails
    within the engine timeout + 10 s naming e1; e0 is rolled back to the served version by
    slices from the spool; the next push commits on e0; healed, e1 catches up by itself,
    and the next push commits on both."""
    with Lab(rate_mbit=40) as lab, _fleet(lab, tmp_path, tiny_model_dir, engine_args=["--tp", "2"]) as f:
        f.host_of(1).rate(8)
        v1 = f.push(1, transport=transport)
        assert v1["ok"] and v1["result"]["state"] == "READY", v1
        received = {e: x["slices"]["received"] for e, x in _engines(f.status()).items()}
        whole = v1["result"]["bytes"]
        for e, got in received.items():  # each rank: about half the model, not all of it
            assert len(got) == 2 and max(got) <= 0.6 * whole, (e, got, whole)
        failed, cut, noticed = _cut_e1_mid_push(f, 2, transport)
        assert "e1" in failed["message"], failed
        wait_for(
            lambda: f.status()["state"] == "READY" and _served_by(f).get("e0") == (1, v1["result"]["digest"]),
            60,
            "e0 back at v1",
        )
        settled = time.monotonic() - cut
        assert _engines(f.status())["e0"]["slices"]["received"] == received["e0"]  # replayed by slices
        v3 = f.push(3, transport=transport)
        assert v3["ok"] and v3["result"]["state"] == "READY", v3
        f.host_of(1).heal()
        healed = time.monotonic()
        want = (3, v3["result"]["digest"])
        wait_for(lambda: _served_by(f) == {"e0": want, "e1": want}, 120, "e1 caught up to v3")
        caught_up = time.monotonic() - healed
        v4 = f.push(4, transport=transport)
        assert v4["ok"] and _served_by(f) == {e: (4, v4["result"]["digest"]) for e in ("e0", "e1")}
        for e, x in _engines(f.status()).items():
            assert x["slices"]["received"] == received[e], (e, x["slices"])
        print(
            f"tp 2, {transport}: failed {noticed:.1f}s after the cut, e0 at v1 {settled:.1f}s after it; "
            f"e1 at v3 {caught_up:.1f}s after the heal"
        )


def test_delta_pushes_by_slices_over_a_slow_link_and_a_cut_one(tmp_path, tiny_model_dir):
    """Two engines of two ranks each keeping a base (`--tp 2 --delta-base`), e1's link five
    times slower. Small steps pushed as deltas are patches of each rank's box and commit on
    both. A delta push whose sync loses e1's link fails naming e1; e0 is rolled back to the
    served version (the spool replays the boxes, then the box patches); healed, e1 catches
    up the same way, and the next delta, against the served version, commits on both."""
    engine_args = ["--tp", "2", "--delta-base"]
    with Lab(rate_mbit=40) as lab, _fleet(lab, tmp_path, tiny_model_dir, engine_args=engine_args) as f:
        f.host_of(1).rate(8)
        delta = {"client": "delta", "delta": True}
        v1 = f.push(1, transport="inline", **delta)  # the first: dense (cut), the trainer's copy
        assert v1["ok"] and v1["result"]["detail"]["delta"]["chose"] == "dense", v1
        v2 = f.push(2, transport="inline", change="sparse", **delta)
        assert v2["ok"], v2
        sent = v2["result"]["detail"]["delta"]
        assert sent["chose"] == "delta" and sent["bytes"] < sent["dense_bytes"] / 50, sent
        assert _served_by(f) == {e: (2, v2["result"]["digest"]) for e in ("e0", "e1")}
        # a step that changes every element (its delta entries go dense: long enough to cut)
        failed, cut, noticed = _cut_e1_mid_push(f, 3, "inline", **delta)
        assert "e1" in failed["message"], failed
        wait_for(
            lambda: f.status()["state"] == "READY" and _served_by(f).get("e0") == (2, v2["result"]["digest"]),
            60,
            "e0 back at v2 (boxes, then box patches)",
        )
        f.host_of(1).heal()
        want = (2, v2["result"]["digest"])
        wait_for(lambda: _served_by(f) == {"e0": want, "e1": want}, 120, "e1 caught up to v2")
        v4 = f.push(4, transport="inline", change="sparse", **delta)
        assert v4["ok"] and v4["result"]["detail"]["delta"]["chose"] == "delta", v4
        assert _served_by(f) == {e: (4, v4["result"]["digest"]) for e in ("e0", "e1")}
        print(f"delta by slices, tp 2: failed {noticed:.1f}s after the cut")
