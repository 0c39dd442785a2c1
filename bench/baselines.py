"""Baselines measured in the same run as the weightsync syncs, over the same bytes.

- raw ZeroMQ: PUSH -> PULL of `bucket_bytes` frames, zero-copy on both sides, from this
  process to a receiver subprocess over ipc (what the inline transport rides on).
- memcpy: `copy_` of the same bytes, bucket by bucket, into a preallocated destination
  (the floor for any same-host transport: the shm transport is one of these per engine).

`python -m bench.baselines recv DATA_ADDR DONE_ADDR` is the receiver process.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import zmq

END = b"end"


def receiver(data_addr: str, done_addr: str) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 4)
    pull.bind(data_addr)
    done = ctx.socket(zmq.PUSH)
    done.connect(done_addr)
    done.send(b"ready")
    while True:
        total = 0
        while True:
            frame = pull.recv(copy=False)
            if len(frame) == len(END) and frame.bytes == END:
                break
            total += len(frame)
        done.send(str(total).encode())
        if total == 0:
            break
    pull.close(0)
    done.close(0)
    ctx.term()


def zmq_gbps(workdir: Path, model_bytes: int, bucket_bytes: int, repeats: int = 3) -> float:
    """Median GB/s of raw zero-copy PUSH/PULL for `model_bytes` in `bucket_bytes` frames."""
    data_addr = f"ipc://{workdir}/bench-data.sock"
    done_addr = f"ipc://{workdir}/bench-done.sock"
    ctx = zmq.Context()
    done = ctx.socket(zmq.PULL)
    done.bind(done_addr)
    proc = subprocess.Popen([sys.executable, "-m", "bench.baselines", "recv", data_addr, done_addr])
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 4)
    try:
        if not done.poll(60_000):
            raise RuntimeError("zmq baseline receiver did not start")
        done.recv()
        push.connect(data_addr)
        src = torch.randint(0, 255, (bucket_bytes,), dtype=torch.uint8)
        frames = max(1, model_bytes // bucket_bytes)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(frames):
                push.send(memoryview(src.numpy()), copy=False)
            push.send(END)
            got = int(done.recv())
            runs.append(got / (time.perf_counter() - t0) / 1e9)
            if got != frames * bucket_bytes:
                raise RuntimeError(f"zmq baseline lost bytes: {got} of {frames * bucket_bytes}")
        push.send(END)  # a zero-byte round stops the receiver
        done.recv()
        proc.wait(30)
        return statistics.median(runs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        push.close(0)
        done.close(0)
        ctx.term()


def memcpy_gbps(model_bytes: int, bucket_bytes: int, repeats: int = 3) -> float:
    """Median GB/s of copying `model_bytes` bucket by bucket into preallocated memory."""
    bucket_bytes = min(bucket_bytes, model_bytes)
    frames = max(1, model_bytes // bucket_bytes)
    src = torch.randint(0, 255, (bucket_bytes,), dtype=torch.uint8)
    dst = torch.empty(frames * bucket_bytes, dtype=torch.uint8)
    dst.fill_(1)  # fault the pages in: engines copy into resident parameters
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(frames):
            dst[i * bucket_bytes:(i + 1) * bucket_bytes].copy_(src)
        runs.append(frames * bucket_bytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(runs)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "recv":
        receiver(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m bench.baselines recv DATA_ADDR DONE_ADDR")
