"""examples/rl_loop.py, run small: a real optimizer on a toy reward, every step pushed
through weightsync into a real vLLM engine that samples the next batch."""

from __future__ import annotations

import json
import subprocess
import sys

from orchestrator.daemon.config import child_env


def test_rl_loop_reward_rises_and_engine_greedy_equals_the_trainers_after_every_push():
    r = subprocess.run(
        [sys.executable, "-m", "examples.rl_loop", "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=280,
        env=child_env(),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    steps = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith('{"step"')]
    (res,) = [json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["greedy_matches"] for s in steps) and res["all_greedy_match"] is True
    assert res["reward_last"] > res["reward_first"] + 0.2, steps
    # every step's samples carry the label of the version pushed the step before
    assert [s["sample_versions"] for s in steps] == [[], [1], [2], [3]], steps
