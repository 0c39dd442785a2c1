"""`python -m bench --check` and `python -m bench.fleet --check` judge every documented
target: fed figures that miss each one, they name each one; fed figures that meet them,
nothing."""

from __future__ import annotations

from bench.fleet import fit
from bench.fleet import missed_targets as fleet_missed
from bench.throughput import missed_targets

MiB, GiB = 1 << 20, 1 << 30


def run(
    transport, engines, gbps, seconds, model=GiB, trainer=32.0, daemon=80.0, ratio_zmq=0.9, ratio_memcpy=0.6
):
    return {
        "transport": transport,
        "chosen_transport": transport,
        "engines": engines,
        "bucket_bytes": 16 * MiB,
        "model_bytes": model,
        "window": 2,
        "seconds": seconds,
        "gbps": gbps,
        "ratio_zmq": ratio_zmq,
        "ratio_memcpy": ratio_memcpy,
        "orchestrator_rss_mib": daemon,
        "trainer_rss_mib": trainer,
    }


def result(runs, control=6000.0, coll_ratio=0.95, four=1.1):
    return {
        "window": 2,
        "runs": runs,
        "control": {"points": [{"engines": 1, "buckets_per_s": control}]},
        "collective": {
            "points": [{"engines": 1, "ratio_vs_raw": coll_ratio, "daemon_bytes_received": 0}],
            "wall_vs_one_engine": {4: four},
        },
    }


def test_the_data_plane_check_names_every_missed_target():
    runs = [
        run("inline", 1, 1.0, 1.0, ratio_zmq=0.5),
        run("shm", 1, 1.5, 0.7, ratio_memcpy=0.3),  # < 2x inline, < 0.5x memcpy
        run("shm", 4, 1.0, 2.0),  # > 1.5x the 1-engine time
        run("inline", 1, 1.0, 4.0, model=4 * GiB, trainer=200.0, daemon=500.0),  # RSS grew
    ]
    missed = "\n".join(missed_targets(result(runs, control=1000.0, coll_ratio=0.5, four=3.0)))
    for target in (
        "inline >= 0.8x raw ZeroMQ",
        "shm >= 0.5x memcpy",
        "shm >= 2x inline",
        "shm 4 engines <= 1.5x",
        "trainer RSS flat",
        "daemon RSS <=",
        ">= 5,000 control buckets/s",
        "collective >= 0.9x raw broadcast",
        "collective 4 engines <= 1.2x",
    ):
        assert target in missed, target


def test_the_data_plane_check_passes_figures_that_meet_every_target():
    runs = [
        run("inline", 1, 1.0, 1.0),
        run("shm", 1, 2.5, 0.4),
        run("shm", 4, 2.4, 0.5),
        run("inline", 1, 1.0, 4.0, model=4 * GiB, trainer=40.0),
    ]
    assert missed_targets(result(runs)) == []


def fleet_run(transport, engines, cpu, msgs, wall, buckets=2000):
    return {
        "transport": transport,
        "engines": engines,
        "buckets": buckets,
        "daemon_cpu_s": cpu,
        "daemon_msgs": msgs,
        "wall_s": wall,
        "daemon_rss_mib": 60.0,
    }


def test_the_fleet_check_names_every_missed_target():
    runs = [
        fleet_run("collective", 1, 0.2, 10, 0.3),
        fleet_run("collective", 256, 12.0, 600_000, 14.0),
        fleet_run("inline", 1, 0.2, 4000, 0.3),
        fleet_run("inline", 256, 13.0, 600_000, 14.0),
    ]
    fits = fit(runs)
    assert fits["inline"]["per_engine_bucket_us"] > 5
    wide = {"engines": 256, "register_s": 2.0, "idle_cpu_pct": 9.0, "status_ms": 300.0}
    missed = "\n".join(fleet_missed(runs, fits, wide))
    for target in (
        "daemon CPU",
        "daemon messages",
        "sync wall",
        "per extra engine",
        "registered",
        "idle",
        "status",
    ):
        assert target in missed, target
    good = [
        fleet_run("collective", 1, 0.2, 10, 0.3),
        fleet_run("collective", 256, 0.5, 900, 0.5),
        fleet_run("inline", 1, 0.2, 4000, 0.3),
        fleet_run("inline", 256, 0.4, 9000, 0.5),
    ]
    ok = {"engines": 256, "register_s": 0.3, "idle_cpu_pct": 2.0, "status_ms": 10.0}
    assert fleet_missed(good, fit(good), ok) == []


def test_fleet_check_fails_a_target_whose_point_was_not_run():
    """`bench.fleet --check` used to skip the 256-engine targets silently when that point
    was not run; now each unmeasured target is named as not run."""
    only_small = [
        fleet_run("collective", 1, 0.2, 10, 0.3),
        fleet_run("inline", 1, 0.2, 4000, 0.3),
    ]
    missed = fleet_missed(only_small, fit(only_small), None)
    assert any("collective 256 engines: not run" in m for m in missed), missed
    assert any("inline: not run at two fleet sizes" in m for m in missed), missed
    assert any("fleet-wide at 256 engines: not run" in m for m in missed), missed
    no_one = [fleet_run("collective", 256, 0.5, 900, 0.5)]
    assert any("collective 1 engine: not run" in m for m in fleet_missed(no_one, fit(no_one), None))
