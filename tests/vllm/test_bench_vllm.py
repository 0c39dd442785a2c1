"""`python -m bench.vllm` runs end to end: every path alternates with direct, the profile
splits each sync into phases per process and accounts for each pass over the model's
bytes (the bytes the trainer's and the engine's loops counted as they copied and hashed),
and --check names what it misses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_vllm_alternates_paths_and_profiles_each_sync(tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.vllm",
            "--size",
            "tiny",
            "--repeats",
            "2",
            "--bucket-bytes",
            str(256 * 1024),
            "--transports",
            "shm,inline",
            "--profile",
            "--check",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    data = json.loads(out.read_text())
    assert r.returncode == (1 if data["missed"] else 0), r.stderr[-3000:]
    assert [ln[len("MISSED: ") :] for ln in r.stdout.splitlines() if ln.startswith("MISSED: ")] == data[
        "missed"
    ]
    (res,) = data["results"]
    assert set(res["all_s"]) == {"direct", "shm", "inline", "disk"}
    assert all(len(v) == 2 for v in res["all_s"].values())  # the warm-up round is not counted
    for k, v in res["median_s"].items():
        assert res["min_s"][k] <= v <= res["max_s"][k]
        assert res["ratio_vs_direct"][k] == pytest.approx(v / res["median_s"]["direct"])
    for t in ("shm", "inline"):
        for row in res["profiles"][t]:
            assert {"pack", "send", "wait_acks", "begin", "finish"} <= set(row["trainer"])
            (phases,) = row["engines"].values()
            assert {"load", "finalize", "vllm_load_weights", "prefix_reset"} <= set(phases)
            assert set(row["cpu"]) == {"trainer", "daemon", "engine-0"}
    assert "checksum" in res["profiles"]["shm"][0]["engines"]["engine-0"]
    assert "profile, shm" in r.stdout and "CPU per sync" in r.stdout
    n = res["model_bytes"]
    for t in ("shm", "inline"):
        # the counts the trainer and the engine made as they copied and hashed, each sync
        for row in res["profiles"][t]:
            assert row["trainer_bytes"] == {"pack_copy": n, "pack_hash": n}
            assert list(row["engine_bytes"].values()) == [{"checksum": n}]
        rows = {p["pass"]: p for p in data["passes"][f"tiny/{t}"]}
        # each of the model's bytes is copied and hashed once by the trainer and hashed once
        # by the engine, as those loops counted it
        for name in ("trainer: pack", "trainer: hash", "engine: hash"):
            assert rows[name]["counted"] and rows[name]["bytes"] == n and rows[name]["seconds"] > 0, rows[
                name
            ]
        assert rows["vLLM: keep pending"]["counted"] and 0 <= rows["vLLM: keep pending"]["bytes"] <= n
        # vLLM's loaders count nothing: their two passes are the code's, marked as not counted
        assert not rows["vLLM: load"]["counted"] and not rows["direct: load"]["counted"]
        assert f"passes over the bytes, {t}" in r.stdout and f"CPU floor, {t}" in r.stdout
    assert ("daemon: forward" in {p["pass"] for p in data["passes"]["tiny/inline"]}) and (
        "daemon: control" in {p["pass"] for p in data["passes"]["tiny/shm"]}
    )
    assert data["machine"]["cpus"] >= 1
