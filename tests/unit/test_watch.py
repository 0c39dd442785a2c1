"""The watcher's decisions with a recording client (pure: no daemon): which step
directories are complete (a marker, or shards whole and unchanged), their versions, and
the order they are pushed in."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from messages.errors import ErrorCode, make_error
from messages.replies import StatusReply
from orchestrator.trainer.watch import Watcher, version_in


class Recorder:
    def __init__(self) -> None:
        self.served: int | None = None
        self.pushes: list[int] = []
        self.delta_base = SimpleNamespace(version=None)
        self.lost_connections = 0

    def fleet(self, **kw):
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
    w.run_once(21.0)
    assert c.pushes == [1]  # unchanged but not a readable checkpoint: reported once
    (bad,) = [e for e in events if e["event"] == "incomplete"]
    assert bad["version"] == 2 and "model.safetensors: not a readable safetensors file" in bad["reason"]
    write(tmp_path / "step-0")  # completed after 1 was pushed: backwards
    w.run_once(22.0)
    w.run_once(30.0)
    assert [(e["event"], e["version"], e.get("code")) for e in events][-1] == ("refused", 0, "STALE_VERSION")
    assert c.pushes == [1]


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("step-120", 120),
        ("step_000120", 120),
        ("checkpoint-950", 950),
        ("global_step_40", 40),
        ("step=100", 100),
        ("megatron_gpt--val_loss=2.34-step=100-consumed_samples=3200.0", 100),  # NeMo
        ("epoch=1-step=300", 300),
        ("step-100-bf16", 100),
        ("iter_0000100", 100),
        ("120", 120),
        ("v7", 7),
        ("logs", None),
    ],
)
def test_a_step_name_gives_the_number_after_its_step_word(name, version):
    assert version_in(name) == version


def test_a_name_with_several_numbers_and_no_step_word_is_reported_once_not_pushed(tmp_path):
    assert isinstance(version_in("run-2024-06"), str)
    events = []
    c = Recorder()
    w = Watcher(tmp_path, c, events.append, settle=0.0)
    write(tmp_path / "run-2024-06")
    for t in (0.0, 1.0, 2.0):
        w.run_once(t)
    assert c.pushes == []
    assert [e["event"] for e in events] == ["ignored"] and "--version-from" in events[0]["reason"]


def test_a_temporary_directory_is_never_pushed_and_its_final_name_is(tmp_path):
    events = []
    c = Recorder()
    w = Watcher(tmp_path, c, events.append, settle=1.0)
    write(tmp_path / "tmp-checkpoint-950")
    for t in (0.0, 2.0, 4.0):
        w.run_once(t)
    assert c.pushes == []
    (tmp_path / "tmp-checkpoint-950").rename(tmp_path / "checkpoint-950")  # HF Trainer's rename
    for t in (5.0, 7.0):
        w.run_once(t)
    assert c.pushes == [950] and [e["event"] for e in events] == ["pushed"]


def test_shards_named_of_wait_for_their_index(tmp_path):
    events = []
    c = Recorder()
    w = Watcher(tmp_path, c, events.append, settle=1.0)
    d = tmp_path / "step-3"
    d.mkdir()
    save_file({"a": torch.ones(4)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(4)}, str(d / "model-00002-of-00002.safetensors"))
    for t in (0.0, 2.0, 4.0):
        w.run_once(t)
    assert c.pushes == []
    assert [e["event"] for e in events] == ["incomplete"] and "index" in events[0]["reason"]
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    for t in (5.0, 7.0):
        w.run_once(t)
    assert c.pushes == [3]


class Flaky(Recorder):
    """A client whose daemon answers nothing, or refuses pushes, as the test says."""

    def __init__(self) -> None:
        super().__init__()
        self.status_error: ErrorCode | None = None
        self.push_errors: list[ErrorCode] = []

    def fleet(self, **kw):
        if self.status_error is not None:
            raise make_error(self.status_error, "no daemon at ipc://x")
        return super().fleet()

    def push(self, named, version, **kw):
        if self.push_errors:
            raise make_error(self.push_errors.pop(0), "refused", state="READY")
        return super().push(named, version, **kw)


def test_no_daemon_and_no_engines_are_waits_that_never_use_up_a_step(tmp_path):
    events = []
    c = Flaky()
    w = Watcher(tmp_path, c, events.append, settle=0.0, retries=1)
    write(tmp_path / "step-1")
    c.status_error = ErrorCode.UNREACHABLE
    t = 0.0
    for _ in range(20):  # far more tries than `retries`
        w.run_once(t)
        t += 10.0
    # when it began (the second scan: the first only saw the files), then once a minute
    assert [(e["event"], e["waited_s"]) for e in events] == [("waiting", w) for w in (0, 60, 120, 180)]
    assert (events[0]["for"], events[0]["code"]) == ("daemon", "UNREACHABLE")
    c.status_error = None
    c.push_errors = [ErrorCode.NO_ENGINES] * 5
    for _ in range(20):
        w.run_once(t)
        t += 10.0
    assert c.pushes == [1]
    assert [(e["event"], e.get("for")) for e in events[4:]] == [
        ("resumed", "daemon"),
        ("waiting", "engines"),
        ("resumed", "engines"),
        ("pushed", None),
    ]


def test_a_wait_longer_than_wait_daemon_raises_its_error(tmp_path):
    c = Flaky()
    c.status_error = ErrorCode.UNREACHABLE
    w = Watcher(tmp_path, c, lambda e: None, settle=0.0, wait_daemon=30.0)
    write(tmp_path / "step-1")
    w.run_once(0.0)
    w.run_once(10.0)
    with pytest.raises(Exception) as ei:
        w.run_once(40.0)
    assert ei.value.code is ErrorCode.UNREACHABLE and "waited 30s for the daemon (limit 30s)" in str(ei.value)


def test_a_refusal_counts_and_is_retried_after_a_backoff(tmp_path):
    events = []
    c = Flaky()
    c.push_errors = [ErrorCode.SHAPE_MISMATCH] * 2
    w = Watcher(tmp_path, c, events.append, settle=0.0, retries=2)
    write(tmp_path / "step-1")
    w.run_once(0.0)
    w.run_once(0.1)  # within the backoff: not tried again
    w.run_once(5.0)
    assert [(e["event"], e.get("attempts")) for e in events] == [("failed", 1), ("gave_up", 2)]
