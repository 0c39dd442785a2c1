"""A transport defined here, in this test file alone, plugs into the seam
(messages.transports) and carries a model end to end: the trainer writes each bucket to a
file, the bucket message carries a reference to it, the daemon vouches for it (and reads it
into its spool), each engine reads it. No other file knows it: the daemon and the engines
load this module by the setting every weightsync process reads (WEIGHTSYNC_TRANSPORT_MODULES).

It also fails like a transport should: a bucket whose file changed after the trainer hashed
it fails the sync (CHECKSUM_MISMATCH) and the fleet is rolled back to the served version.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from examples.launch import Cluster
from examples.tiny import perturbed
from messages import schema, transports
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError, make_error
from tests.integration.helpers import FAST_DAEMON, wait_for

NAME = "filecopy"
DIR_VAR = "WS_TEST_FILECOPY_DIR"  # where this transport's files lie (the test sets it)
ROOT = Path(__file__).resolve().parents[2]
CORRUPT: set[int] = set()  # bucket seqs whose file the trainer side spoils after hashing


def _dir() -> Path:
    return Path(os.environ[DIR_VAR])


class FileSlots:
    """The trainer's side for one push: slot `seq % n` is packed in memory; its reference
    writes it to a file of its own (the file is what the engines read)."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.bufs = [torch.empty(max(slot_bytes, 1), dtype=torch.uint8) for _ in range(slots)]
        self.names = [f"weightsync.{NAME}.{os.getpid()}.{uuid.uuid4().hex[:12]}" for _ in range(slots)]

    @property
    def slots(self) -> int:
        return len(self.bufs)

    def slot(self, seq: int, nbytes: int) -> torch.Tensor:
        i = seq % len(self.bufs)
        if self.bufs[i].numel() < nbytes:
            self.bufs[i] = torch.empty(nbytes, dtype=torch.uint8)
        return self.bufs[i][:nbytes]

    def ref(self, seq: int, nbytes: int) -> schema.Ref:
        i = seq % len(self.bufs)
        data = bytearray(self.bufs[i][:nbytes].numpy().tobytes())
        if seq in CORRUPT and data:
            data[len(data) // 2] ^= 0x40  # after the checksum was taken: the file lies
        (_dir() / self.names[i]).write_bytes(bytes(data))
        return schema.Ref(self.names[i], 0, nbytes, via=NAME)

    def close(self) -> None:
        for name in self.names:
            (_dir() / name).unlink(missing_ok=True)


class FileRings:
    def __init__(self) -> None:
        self.ring: FileSlots | None = None

    def get(self, window: int, bucket_bytes: int) -> FileSlots | None:
        if self.ring is None or self.ring.slots < window:
            self.drop()
            self.ring = FileSlots(window, bucket_bytes)
        return self.ring

    def drop(self) -> None:
        if self.ring is not None:
            self.ring.close()
        self.ring = None


class FileReader:
    """The daemon's and the engines' side: read a referenced file, after the checks a
    reference from a peer needs (a name of ours, a regular file holding the bytes). Each
    read is counted in a file per process, so the test sees who read."""

    def _path(self, name: str, offset: int, size: int) -> Path:
        path = _dir() / name
        if not name.startswith(f"weightsync.{NAME}.") or "/" in name or not path.is_file():
            raise make_error(ErrorCode.BAD_MESSAGE, f"{name!r} is not a {NAME} file of ours")
        if path.stat().st_size < offset + size:
            raise make_error(ErrorCode.BAD_MESSAGE, f"{name!r} holds fewer than {offset + size} bytes")
        return path

    def view(self, name: str, offset: int, size: int) -> memoryview:
        data = self._path(name, offset, size).read_bytes()[offset : offset + size]
        with open(_dir() / f"reads.{os.getpid()}", "a") as f:
            f.write(f"{name}\n")
        return memoryview(bytearray(data))

    def check(self, name: str, offset: int, size: int) -> None:
        self._path(name, offset, size)

    def prune(self) -> None:
        pass

    def close(self) -> None:
        pass


# usable where the test said where its files lie: in another test of the same process the
# registry still lists it, but no end offers it
transports.register(
    transports.Transport(
        NAME,
        "ref",
        same_host=True,
        preference=-1,
        rings=FileRings,
        reader=FileReader,
        available=lambda: DIR_VAR in os.environ,
    )
)


@pytest.fixture
def filecopy(tmp_path, tiny_model_dir, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    monkeypatch.setenv(DIR_VAR, str(files))
    env = {
        DIR_VAR: str(files),
        "WEIGHTSYNC_TRANSPORT_MODULES": __name__,
        "PYTHONPATH": str(ROOT),
    }
    cluster = Cluster(
        tmp_path,
        tiny_model_dir,
        engines=2,
        daemon_args=[*FAST_DAEMON, "--spool", str(tmp_path / "spool")],
        engine_args=["--threads", "1", "--heartbeat-interval", "0.5"],
        env=env,
    )
    try:
        with cluster:
            yield cluster, files
    except BaseException:
        for p in cluster.procs:
            print(f"----- {p.name} log -----\n{p.log_tail(60)}")
        raise


def _readers(files: Path) -> dict[int, int]:
    """pid -> how many buckets that process read through this transport."""
    return {int(p.name.split(".")[1]): len(p.read_text().splitlines()) for p in files.glob("reads.*")}


def test_a_transport_defined_in_a_test_file_carries_a_model_and_rolls_back(filecopy, tiny_state):
    cluster, files = filecopy
    engine_pids = {p.popen.pid for p in cluster.procs if p.name.startswith("engine")}
    with cluster.client(timeout=30.0) as client:
        w1 = dict(perturbed(tiny_state, 1))
        r1 = client.push(w1.items(), 1, transport=NAME, bucket_bytes=64 * 1024)
        assert r1.state == "READY" and r1.detail["transport"] == NAME
        st = client.status()
        assert {(e["state"], e["version"], e["digest"]) for e in st["engines"]} == {("READY", 1, r1.digest)}
        assert r1.digest == digest(w1.items())
        # every engine read every bucket through the reader defined above; the daemon
        # read each one into its spool
        reads = _readers(files)
        assert all(reads.get(pid) == r1.buckets for pid in engine_pids), (reads, engine_pids, r1.buckets)
        assert reads.get(cluster.daemon.popen.pid) == r1.buckets
        assert st["spool"]["version"] == 1

        # a bucket file spoiled after hashing: refused, nothing committed, rolled back
        CORRUPT.add(1)
        try:
            with pytest.raises(WeightSyncError) as ei:
                client.push(dict(perturbed(tiny_state, 2)).items(), 2, transport=NAME, bucket_bytes=64 * 1024)
        finally:
            CORRUPT.clear()
        assert ei.value.code is ErrorCode.CHECKSUM_MISMATCH, ei.value
        st = wait_for(
            lambda: (s := client.status())["state"] == "READY" and s["last_sync"]["kind"] == "rollback" and s,
            60,
            "the rollback to version 1",
        )
        assert (st["version"], st["digest"]) == (1, r1.digest)
        assert st["last_sync"]["status"] == "ROLLED_BACK"
        for e in st["engines"]:
            assert (e["state"], e["version"], e["digest"]) == ("READY", 1, r1.digest)

        # and the next version goes through it again
        w3 = dict(perturbed(tiny_state, 3))
        r3 = client.push(w3.items(), 3, transport=NAME, bucket_bytes=64 * 1024)
        assert (r3.state, r3.detail["transport"], r3.digest) == ("READY", NAME, digest(w3.items()))
