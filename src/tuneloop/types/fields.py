"""Field types every wire request shares: bounded integers, ids, stored metadata and tags.

Integers on the wire are 64-bit signed (protobuf int64, database BIGINT, NumPy int64): a value
outside that range would overflow where it is stored or converted (an OverflowError, a 500),
so the type refuses it where it is parsed, naming the field. Servers parse bodies with
`parse_json`, which is strict (a string "1" is not the integer 1, a float is not an id); the
SDK builds the same models in Python, where NumPy integers keep working for its users.

Metadata and tags are stored in the registry and returned on every listing: their size is
bounded so one tenant cannot grow the database, or each listing's answer, without limit.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Model and sampler ids embed these ("<session>:train:<n>") in 128-character columns.
MAX_SEQ_ID = INT64_MAX
# user_metadata: its JSON form (UTF-8) at most this many bytes. 16 KiB holds hundreds of
# ordinary key/value pairs (experiment names, hyperparameters, git hashes).
MAX_METADATA_BYTES = 16 * 1024
# Tags of a session: at most this many, each at most this many characters.
MAX_TAGS = 64
MAX_TAG_LENGTH = 128

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
# A position in a model's (or a session's) ordered stream of requests.
SeqId = Annotated[int, Field(ge=0, le=MAX_SEQ_ID)]


def _bounded_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"{size} bytes as JSON, at most {MAX_METADATA_BYTES}")
    return value


UserMetadata = Annotated[dict[str, Any] | None, AfterValidator(_bounded_metadata)]
StringMetadata = Annotated[dict[str, str] | None, AfterValidator(_bounded_metadata)]
Tag = Annotated[str, Field(max_length=MAX_TAG_LENGTH)]
Tags = Annotated[list[Tag], Field(max_length=MAX_TAGS)]

M = TypeVar("M", bound=BaseModel)


def parse_json(model: type[M], body: bytes) -> M:
    """A wire body as `model`, strictly: JSON types must match the field types (no coercion)."""
    return model.model_validate_json(body, strict=True)


__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_METADATA_BYTES",
    "MAX_SEQ_ID",
    "MAX_TAGS",
    "MAX_TAG_LENGTH",
    "Int64",
    "NonNegativeInt64",
    "SeqId",
    "StringMetadata",
    "Tag",
    "Tags",
    "UserMetadata",
    "parse_json",
]
