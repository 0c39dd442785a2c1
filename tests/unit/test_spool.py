"""The spool on real files: a committed version survives a restart with its canaries."""

from __future__ import annotations

import json

from messages.checksums import DIGEST_SCHEME, LEGACY_DIGEST_SCHEME
from messages.schema import Probe
from orchestrator.daemon.spool import MANIFEST, Spool


def test_a_committed_version_keeps_its_probes_across_a_restart(tmp_path):
    probes = (Probe(prompt=(1, 17, 42), max_tokens=3, expected=(4, 5, 6)), Probe(prompt=(9,), max_tokens=1))
    s = Spool(tmp_path)
    s.begin("s1", 7)
    s.add(
        "s1", 0, 0, [{"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}], 1, b"x" * 8
    )
    info = s.commit("s1", 7, "digest-7", probes)
    assert info is not None and info.probes == probes
    manifest = json.loads((tmp_path / "current" / MANIFEST).read_text())
    assert manifest["probes"][0] == {"prompt": [1, 17, 42], "max_tokens": 3, "expected": [4, 5, 6]}
    again = Spool(tmp_path)  # a restarted daemon reads what the last one committed
    assert again.info is not None and (again.info.version, again.info.probes) == (7, probes)


def test_a_manifest_with_malformed_probes_is_unreadable_not_trusted(tmp_path):
    s = Spool(tmp_path)
    s.begin("s1", 1)
    s.add("s1", 0, 0, [], 1, b"y" * 4)
    s.commit("s1", 1, "d", ())
    path = tmp_path / "current" / MANIFEST
    raw = json.loads(path.read_text())
    raw["probes"] = [{"prompt": "not tokens"}]
    path.write_text(json.dumps(raw))
    again = Spool(tmp_path)
    assert again.info is None and "unreadable" in (again.error or "")


def test_the_manifest_records_the_digest_scheme_and_an_unrecorded_one_reads_as_v5s(tmp_path):
    s = Spool(tmp_path)
    s.begin("s1", 1)
    s.add("s1", 0, 0, [], 1, b"z" * 4)
    s.commit("s1", 1, "d", ())
    path = tmp_path / "current" / MANIFEST
    raw = json.loads(path.read_text())
    assert raw["digest_scheme"] == DIGEST_SCHEME and Spool(tmp_path).info.scheme == DIGEST_SCHEME
    del raw["digest_scheme"]  # as a v5 daemon wrote it
    path.write_text(json.dumps(raw))
    again = Spool(tmp_path)
    assert again.info is not None and again.info.scheme == LEGACY_DIGEST_SCHEME
    assert again.view()["digest_scheme"] == LEGACY_DIGEST_SCHEME
    raw["digest_scheme"] = 128  # not a name: unreadable, not trusted
    path.write_text(json.dumps(raw))
    assert Spool(tmp_path).info is None


def test_a_version_cut_into_slices_keeps_each_ranks_digest_across_a_restart(tmp_path):
    box = {"name": "w", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 8, "box": [[0, 2]]}
    s = Spool(tmp_path)
    s.begin("s1", 3)
    s.add("s1", 0, 0, [box], 1, b"x" * 8)
    info = s.commit("s1", 3, "digest-3", (), {"abc": ("r0", "r1")})
    assert info is not None and info.slice_digests == {"abc": ("r0", "r1")}
    again = Spool(tmp_path)
    assert again.info is not None and again.info.slice_digests == {"abc": ("r0", "r1")}
    assert again.entries()[0].tensors == [box]  # the boxes are replayed as they were sent
