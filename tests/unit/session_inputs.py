"""The engine session's inputs, as the daemon and the applier send them (for the session's
tests)."""

from __future__ import annotations

from messages import schema

GROUP = schema.GroupRef(
    id="g", host="127.0.0.1", port=2000, rank=1, world_size=2, backend="gloo", timeout=5.0
)


def load(sync_id: str, seq: int, version: int = 1) -> schema.Load:
    return schema.Load(sync_id=sync_id, version=version, seq=seq, tensors=(), checksum=0)


def finalized(sync_id: str, version: int = 1) -> schema.Finalized:
    return schema.Finalized(sync_id=sync_id, version=version, digest="d", finalize_count=1)


def failed(sync_id: str) -> schema.Failed:
    return schema.Failed(sync_id=sync_id, code="ENGINE_FAILED", message="boom")
