"""The wire: schemas, error codes, codec, bucketing and digests. No sockets, no asyncio."""

from messages.errors import ErrorCode, MessageError, WeightSyncError
from messages.schema import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "ErrorCode", "MessageError", "WeightSyncError"]
