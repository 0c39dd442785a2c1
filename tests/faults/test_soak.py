"""A short soak in the default suite (the long one is `python -m tests.faults.soak`)."""

from __future__ import annotations

import pytest

from tests.faults.soak import run

pytestmark = pytest.mark.slow


def test_short_soak_with_faults_never_double_finalizes_or_serves_wrong_weights():
    r = run(24, seed=3, fault_rate=0.5, progress=False)
    assert sum(r["faults"].values()) == 24 and r["faults"].get("none", 0) < 24
    assert set(r["transports"]) == {"inline", "shm", "collective", "sharded"}  # faults drawn on each
    assert r["ok"] > 0 and r["failed"] > 0 and r["failed_touching"] > 0
    # every failure that touched engines was rolled back, and nothing else was
    assert r["rolled_back"] == r["failed_touching"], r["failures"]
    assert (
        r["double_finalizes"],
        r["ready_with_wrong_digest"],
        r["leaked_processes"],
        r["leaked_shm_segments"],
        r["unsettled"],
        r["unexplained_failures"],
    ) == (0, 0, 0, 0, 0, 0)
    assert len(r["failures"]) == r["failed"] and all(
        f["code"] and f["message"] and f["explained"] for f in r["failures"]
    )
