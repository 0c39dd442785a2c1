"""GPU paths, run by bench/gpu_check.sh on a CUDA machine (skipped, with the reason, on CPU):
NCCL broadcast through the collective group, and CUDA IPC between two processes on one GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

RANK = r"""
import json, sys, time, torch
from messages.distgroup import Group, GroupSpec
from messages.rendezvous import StoreServer
spec = json.loads(sys.argv[1]); n = int(sys.argv[2]); reps = int(sys.argv[3])
torch.cuda.set_device(spec["rank"] % torch.cuda.device_count())
server = StoreServer(spec["host"]) if spec["rank"] == 0 else None
if server is not None:
    print(json.dumps({"port": server.port, "token": server.token}), flush=True)
    spec["port"], spec["token"] = server.port, server.token
else:
    got = json.loads(sys.stdin.readline())
    spec["port"], spec["token"] = got["port"], got["token"]
g = Group(GroupSpec(**spec))
buf = torch.full((n,), spec["rank"] == 0 and 7 or 0, dtype=torch.uint8, device=g.device)
g.broadcast(buf); torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(reps):
    g.broadcast(buf)
torch.cuda.synchronize()
dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"rank": spec["rank"], "ok": int(buf[n // 2]) == 7,
                              "gbps": n * reps / dt / 1e9}), flush=True)
g.close()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank (2+ GPUs)")
def test_nccl_broadcast_through_the_collective_group():
    n, reps = 256 << 20, 10
    spec = {
        "id": "gpu-nccl",
        "host": "127.0.0.1",
        "port": 0,
        "world_size": 2,
        "backend": "nccl",
        "timeout": 120.0,
        "bind": "127.0.0.1",
    }
    root = subprocess.Popen(
        [sys.executable, "-c", RANK, json.dumps({**spec, "rank": 0}), str(n), str(reps)],
        stdout=subprocess.PIPE,
        text=True,
    )
    where = root.stdout.readline()  # {"port", "token"}: the root's rendezvous store
    peer = subprocess.Popen(
        [sys.executable, "-c", RANK, json.dumps({**spec, "rank": 1}), str(n), str(reps)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = peer.communicate(where, timeout=240)
    root_out, _ = root.communicate(timeout=60)
    res = [json.loads(ln[7:]) for ln in (out + root_out).splitlines() if ln.startswith("RESULT ")]
    assert len(res) == 2 and all(r["ok"] for r in res)
    print(f"NCCL broadcast {n >> 20} MiB x{reps}: {min(r['gbps'] for r in res):.1f} GB/s")


OPENER = r"""
import json, sys, time, torch
from messages.cuda_ipc import open_handle
ref = json.loads(sys.stdin.readline())
ref["handle"] = bytes.fromhex(ref["handle"]); ref["ref_counter_handle"] = bytes.fromhex(ref["ref_counter_handle"])
ref["event_handle"] = bytes.fromhex(ref["event_handle"]) if ref["event_handle"] else ref["event_handle"]
src = open_handle(ref)
dst = torch.empty_like(src)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(10):
    dst.copy_(src)
torch.cuda.synchronize(); dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"sum": int(src[:4096].sum()), "gbps": src.numel() * 10 / dt / 1e9}), flush=True)
"""


def test_cuda_ipc_colocated_engine_reads_the_trainers_bucket_without_a_host_copy():
    from messages.cuda_ipc import export

    buf = torch.arange(256 << 20, dtype=torch.int64, device="cuda").to(torch.uint8)
    ref = export(buf)
    wire = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in ref.items()}
    p = subprocess.Popen(
        [sys.executable, "-c", OPENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    out, _ = p.communicate(json.dumps(wire) + "\n", timeout=240)
    (res,) = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert res["sum"] == int(buf[:4096].sum())
    print(f"CUDA IPC device copy {buf.numel() >> 20} MiB x10: {res['gbps']:.1f} GB/s")
    time.sleep(0.1)
