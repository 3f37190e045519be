"""zstd request bodies (`Content-Encoding: zstd`, advertised as `proto_compress_fwdbwd`),
decompressed with a bound.

A zstd frame can expand ~30,000-fold, and one whose header declares its size makes
`ZstdDecompressor().decompress` allocate that size whatever `max_output_size` says: a 6 KB body
could ask for gigabytes. So bodies are stream-decompressed, at most `limit + 1` bytes, and one
that goes past the limit is refused as the plain body limit refuses (413) without ever holding
more than the limit.
"""

from __future__ import annotations

import io

import zstandard

__all__ = ["DecompressedTooLargeError", "decompress_bounded", "leading_bytes"]

_CHUNK = 1 << 20


class DecompressedTooLargeError(Exception):
    """The body decompresses to more than the limit."""


def decompress_bounded(data: bytes, limit: int) -> bytes:
    """`data` (one or more zstd frames) decompressed; DecompressedTooLargeError past `limit` bytes,
    zstandard.ZstdError if it is not zstd."""
    out = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    with reader:
        while True:
            chunk = reader.read(min(_CHUNK, limit + 1 - len(out)))
            if not chunk:
                break
            out += chunk
            if len(out) > limit:
                raise DecompressedTooLargeError(f"decompresses to more than {limit} bytes")
    if data and not out and not _is_empty_frame(data):
        raise zstandard.ZstdError("no zstd frame in the body")
    return bytes(out)


def _is_empty_frame(data: bytes) -> bool:
    try:
        return zstandard.frame_content_size(data) == 0
    except zstandard.ZstdError:
        return False


def leading_bytes(data: bytes, n: int) -> bytes:
    """At most the first `n` decompressed bytes of a zstd body (or of a cut one): enough to read
    the fields at its start without decompressing the rest."""
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
    with reader:
        return reader.read(n)
