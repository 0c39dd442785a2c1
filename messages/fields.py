"""The wire's field types and bounds: every id, integer, string and list a peer can send
has its type, range, length or pattern here, and `messages.schema` builds its messages
from them (and re-exports them: readers import them from there).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

INT63 = 2**63 - 1
MAX_ID_LEN = 128
MAX_NAME_LEN = 1024
MAX_TEXT_LEN = 4096
MAX_TENSORS_PER_BUCKET = 65536
MAX_FLEET = 65536  # engines named in one message
MAX_SPEC = 1 << 20
MAX_RANK = 16
MAX_SOURCES = 1024
# a sharded push over the collective has a group per source, and every engine keeps each
# one open: past this many sources the daemon plans references or frames instead
MAX_COLLECTIVE_SOURCES = 64
MAX_PROBES = 64
MAX_PROBE_TOKENS = 4096

Id = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=MAX_ID_LEN,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*\Z",
        description="1-128 of [A-Za-z0-9._:@+-], not starting with a dot or dash",
    ),
]
Version = Annotated[int, Meta(ge=0, le=INT63, description="0..2**63-1")]
RequestId = Annotated[int, Meta(ge=0, le=INT63, description="0..2**63-1")]
Seq = Annotated[int, Meta(ge=0, le=2**31 - 1, description="0..2**31-1")]
SourceIndex = Annotated[int, Meta(ge=0, lt=MAX_SOURCES, description=f"0..{MAX_SOURCES - 1}")]
SourceCount = Annotated[int, Meta(ge=1, le=MAX_SOURCES, description=f"1..{MAX_SOURCES}")]
Size = Annotated[int, Meta(ge=0, le=2**62, description="0..2**62 bytes")]
# MessagePack carries at most 2**64-1, and msgspec bounds must fit an int64: ge=0 is the range.
Checksum = Annotated[int, Meta(ge=0, description="xxh3-64, 0..2**64-1")]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1, description="0..2**31-1")]
Dim = Annotated[int, Meta(ge=0, le=2**62, description="0..2**62")]
Shape = Annotated[tuple[Dim, ...], Meta(max_length=MAX_RANK, description=f"rank <= {MAX_RANK}")]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1, description="0..2**31-1")]
Tokens = Annotated[tuple[TokenId, ...], Meta(max_length=MAX_PROBE_TOKENS)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9, description="0..1e9")]
MAX_PHASES = 32
PhaseName = Annotated[str, Meta(max_length=32, pattern=r"^[a-z_]+$")]
TensorName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=MAX_NAME_LEN,
        pattern=r"^[^\x00-\x1f]+\Z",
        description=f"1-{MAX_NAME_LEN} chars, no control characters",
    ),
]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LEN, description=f"<= {MAX_TEXT_LEN} chars")]
LongText = Annotated[str, Meta(max_length=65536, description="<= 65536 chars")]
Host = Annotated[
    str,
    Meta(
        max_length=255, pattern=r"^[^\x00-\x1f/]*\Z", description="<= 255 chars, no control characters or '/'"
    ),
]
Digest = Annotated[
    str, Meta(min_length=1, max_length=128, pattern=r"^[0-9a-f]+\Z", description="lowercase hex, 1-128 chars")
]
# Where a bucket lies by reference (a "ref" transport, messages.transports): only names the
# segment code itself makes are accepted; never a path, never a dot-name.
SegmentName = Annotated[
    str,
    Meta(
        max_length=96,
        pattern=r"^weightsync\.[a-z]+\.[0-9]+\.[0-9a-f]{12}\Z",
        description="weightsync.KIND.PID.HEX12 (made by the transport's trainer side)",
    ),
]
# a transport's name (messages.transports; "auto": the daemon picks); one this daemon has
# not registered is refused at begin
FRAMES = "inline"  # the transport every end speaks: frames through the daemon
Transport = Annotated[
    str, Meta(max_length=32, pattern=r"^[a-z][a-z0-9_-]{0,31}\Z", description="a transport's name, or auto")
]
Backend = Literal["gloo", "nccl"]
Port = Annotated[int, Meta(ge=1, le=65535, description="1..65535")]
Mac = Annotated[bytes, Meta(min_length=16, max_length=16, description="16 bytes")]
Label = Annotated[
    str, Meta(max_length=64, pattern=r"^[^\x00-\x1f]*\Z", description="<= 64 chars, no control characters")
]
StoreToken = Annotated[
    str, Meta(max_length=64, pattern=r"^[0-9a-f]*\Z", description="<= 64 hex digits (the store's secret)")
]
CurveKey = Annotated[
    str, Meta(max_length=40, pattern=r"^[0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]*\Z", description="Z85, 40 chars")
]
MAX_GROUP = 4096
MAX_ALSO = 4096  # buckets one `loaded` may report beyond its cumulative seq
Rank = Annotated[int, Meta(ge=0, lt=MAX_GROUP, description=f"0..{MAX_GROUP - 1}")]
