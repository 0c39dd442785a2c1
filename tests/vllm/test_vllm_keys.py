"""With keys, a vLLM engine's workers check each collective bucket's MAC themselves: the
bytes they received by broadcast must carry the trainer's BLAKE3 tag, keyed per sync
from the group's token (which reached them over the daemon's CURVE socket)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from examples.launch import Cluster
from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError


def test_vllm_workers_refuse_a_collective_bucket_with_a_forged_mac(
    tmp_path, tiny_model_dir, tiny_state, monkeypatch
):
    from orchestrator.trainer import stream as trainer_stream

    keys = tmp_path / "keys"
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator", "keys", "generate", str(keys)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    c = Cluster(
        Path(tmp_path / "c"),
        tiny_model_dir,
        engines=1,
        backend="vllm",
        keys=keys,
        daemon_args=["--engine-timeout", "30"],
    )
    try:
        with c, c.client(timeout=120.0) as client:
            w = dict(perturbed(tiny_state, 1))
            r1 = client.push(w.items(), 1, bucket_bytes=256 * 1024, transport="collective")
            assert r1.detail["transport"] == "collective" and not r1.detail.get("stream")
            assert {e["digest"] for e in r1.engines} == {digest(w.items())}
            real = trainer_stream.load_mac

            def forge(key, source, seq, data):
                return real(b"\x00" * 32, source, seq, data) if seq == 1 else real(key, source, seq, data)

            monkeypatch.setattr(trainer_stream, "load_mac", forge)
            with pytest.raises(WeightSyncError) as ei:
                client.push(
                    dict(perturbed(tiny_state, 2)).items(), 2, bucket_bytes=256 * 1024, transport="collective"
                )
            assert ei.value.code is ErrorCode.UNAUTHORIZED and "MAC" in ei.value.message, ei.value
            monkeypatch.setattr(trainer_stream, "load_mac", real)
            w = dict(perturbed(tiny_state, 3))
            r3 = client.push(w.items(), 3, bucket_bytes=256 * 1024, transport="collective")
            assert {e["digest"] for e in r3.engines} == {digest(w.items())}
    except BaseException:
        for p in c.procs:
            print(f"----- {p.name} -----\n{p.log_tail(60)}")
        raise
