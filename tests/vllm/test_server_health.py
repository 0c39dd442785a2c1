"""A `--backend vllm-server` engine whose vLLM server dies between syncs: its heartbeats
carry the server's health (GET /health, probed off the engine's loop), so `status` shows
the engine unhealthy and the version served by no engine, without waiting for a push
(issue 44, item 6). A real vLLM OpenAI server, killed with its whole process group."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from examples.tiny import perturbed
from tests.integration.helpers import wait_for, ws
from tests.vllm.conftest import server_cluster, vllm_server_process


def test_a_dead_vllm_server_shows_in_status_between_syncs(tmp_path, tiny_model_dir, tiny_state):
    with vllm_server_process(tiny_model_dir, Path(tmp_path) / "server.log") as (url, proc):
        with server_cluster(Path(tmp_path) / "cluster", tiny_model_dir, url) as c:
            with c.client(timeout=120.0) as client:
                client.push(perturbed(tiny_state, 1), 1)
            st = c.status()
            assert st["state"] == "READY" and st["served_by"] == 1, st
            assert st["engines"][0]["server_error"] is None, st

            os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine core, at once
            proc.wait(30)

            def unhealthy():
                s = c.status()
                return s if s["engines"][0]["server_error"] else None

            st = wait_for(unhealthy, 15, "the engine's heartbeat says its server is down")
            e = st["engines"][0]
            assert e["state"] == "READY" and url in e["server_error"], st  # its process is live
            assert st["state"] == "READY" and st["version"] == 1 and st["served_by"] == 0, st
            r = ws("status", "--addr", c.addr, timeout=30)
            assert r.returncode == 0, r.stderr
            assert "engine server-0 is unhealthy" in r.stdout, r.stdout
            assert "READY, server down" in r.stdout, r.stdout
            assert "version 1 is not served by any engine" in r.stdout, r.stdout
