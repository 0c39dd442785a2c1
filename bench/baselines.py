"""Baselines measured in the same run as the weightsync syncs, over the same bytes: the
model's own tensors, read from where the trainer holds them (memory, not cache).

- raw ZeroMQ: PUSH -> PULL of the tensors as zero-copy frames, one multipart message per
  `bucket_bytes`, from this process to a receiver subprocess over ipc (what the inline
  transport rides on).
- memcpy: `copy_` of every tensor into one preallocated, already-faulted destination
  (the floor for any same-host transport: the shm transport is one of these per engine,
  plus the trainer's copy into its slot).

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

from messages.buckets import as_bytes

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


def _messages(weights: list, bucket_bytes: int) -> list[list[memoryview]]:
    out: list[list[memoryview]] = [[]]
    size = 0
    for _, t in weights:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(memoryview(as_bytes(t).numpy()))
        size += n
    return out


class ZmqBaseline:
    """Raw zero-copy PUSH/PULL of the model's tensors to a receiver process, one round per
    `once()`, so rounds can alternate with the candidate they are compared with."""

    def __init__(self, workdir: Path, weights: list, bucket_bytes: int) -> None:
        data_addr = f"ipc://{workdir}/bench-data.sock"
        done_addr = f"ipc://{workdir}/bench-done.sock"
        self.ctx = zmq.Context()
        self.done = self.ctx.socket(zmq.PULL)
        self.done.bind(done_addr)
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.baselines", "recv", data_addr, done_addr])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 4)
        if not self.done.poll(60_000):
            self.close()
            raise RuntimeError("zmq baseline receiver did not start")
        self.done.recv()
        self.push.connect(data_addr)
        self.messages = _messages(weights, bucket_bytes)
        self.total = sum(mv.nbytes for m in self.messages for mv in m)

    def once(self) -> float:
        t0 = time.perf_counter()
        for frames in self.messages:
            self.push.send_multipart(frames, copy=False)
        self.push.send(END)
        got = int(self.done.recv())
        if got != self.total:
            raise RuntimeError(f"zmq baseline lost bytes: {got} of {self.total}")
        return got / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        try:
            if self.proc.poll() is None and hasattr(self, "messages"):
                self.push.send(END)  # a zero-byte round stops the receiver
                self.done.recv()
                self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.push.close(0)
            self.done.close(0)
            self.ctx.term()


def zmq_gbps(workdir: Path, weights: list, bucket_bytes: int, repeats: int = 3) -> float:
    """Median GB/s of raw zero-copy PUSH/PULL of the model's tensors, bucket by bucket."""
    b = ZmqBaseline(workdir, weights, bucket_bytes)
    try:
        return statistics.median(b.once() for _ in range(repeats))
    finally:
        b.close()


class MemcpyBaseline:
    """`copy_` of every tensor into one preallocated, already-faulted destination."""

    def __init__(self, weights: list) -> None:
        self.srcs = [as_bytes(t) for _, t in weights]
        self.total = sum(s.numel() for s in self.srcs)
        self.dst = torch.empty(self.total, dtype=torch.uint8)
        self.dst.fill_(1)  # fault the pages in: engines copy into resident parameters

    def once(self) -> float:
        t0 = time.perf_counter()
        off = 0
        for s in self.srcs:
            self.dst[off : off + s.numel()].copy_(s)
            off += s.numel()
        return self.total / (time.perf_counter() - t0) / 1e9


def memcpy_gbps(weights: list, repeats: int = 3) -> float:
    """Median GB/s of copying every tensor of the model into preallocated memory."""
    b = MemcpyBaseline(weights)
    return statistics.median(b.once() for _ in range(repeats))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "recv":
        receiver(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m bench.baselines recv DATA_ADDR DONE_ADDR")
