"""The watcher's decisions with a recording client (pure: no daemon): which step
directories are complete (a marker, or shards whole and unchanged), their versions, and
the order they are pushed in."""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from messages.replies import StatusReply
from orchestrator.trainer.watch import Watcher


class Recorder:
    def __init__(self) -> None:
        self.served: int | None = None
        self.pushes: list[int] = []
        self.delta_base = SimpleNamespace(version=None)

    def fleet(self):
        return StatusReply(state="READY", last_ready_version=self.served)

    def push(self, named, version, **kw):
        assert list(named)  # the checkpoint reads
        self.pushes.append(version)
        self.served = version
        return SimpleNamespace(
            state="READY", sync_id=f"s{version}", buckets=1, bytes=1, seconds=0.1, digest="d", detail={}
        )


def write(d, value=1.0):
    d.mkdir()
    save_file({"w": torch.full((4,), value)}, str(d / "model.safetensors"))


def test_with_a_marker_only_marked_directories_count_and_the_regex_gives_versions(tmp_path):
    events = []
    c = Recorder()
    w = Watcher(tmp_path, c, events.append, marker="STABLE", version_from=re.compile(r"ckpt_(\d+)_final"))
    write(tmp_path / "ckpt_7_final")
    write(tmp_path / "ckpt_3_final")
    write(tmp_path / "ckpt_9_draft")  # no version by the regex: ignored
    (tmp_path / "ckpt_9_draft" / "STABLE").touch()
    w.run_once(0.0)
    assert c.pushes == []  # nothing marked yet
    (tmp_path / "ckpt_7_final" / "STABLE").touch()
    (tmp_path / "ckpt_3_final" / "STABLE").touch()
    w.run_once(1.0)
    assert c.pushes == [3, 7]  # in version order, whatever the names sort to
    assert [(e["event"], e["version"]) for e in events] == [("pushed", 3), ("pushed", 7)]


def test_without_a_marker_a_directory_counts_once_its_files_stopped_changing(tmp_path):
    events = []
    c = Recorder()
    w = Watcher(tmp_path, c, events.append, settle=5.0)
    write(tmp_path / "step-1")
    w.run_once(0.0)
    w.run_once(4.0)
    assert c.pushes == []  # unchanged for 4 s only
    w.run_once(5.5)
    assert c.pushes == [1]
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "model.safetensors").write_bytes(b"\x00" * 10)  # truncated
    w.run_once(10.0)
    w.run_once(20.0)
    assert c.pushes == [1]  # unchanged but not a readable checkpoint
    write(tmp_path / "step-0")  # completed after 1 was pushed: backwards
    w.run_once(21.0)
    w.run_once(30.0)
    assert [(e["event"], e["version"], e.get("code")) for e in events][-1] == ("refused", 0, "STALE_VERSION")
    assert c.pushes == [1]
