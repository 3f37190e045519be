"""Model inputs: a sequence of chunks, concatenated by the server in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field

from tuneloop.types._base import StrictBase
from tuneloop.types.fields import Int64, NonNegativeInt64


class EncodedTextChunk(StrictBase):
    tokens: list[Int64]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ImageChunk(StrictBase):
    """An image; accepted on the wire, rejected with a 400 by text-only models."""

    data: str  # base64 in JSON, raw bytes in protobuf
    format: Literal["png", "jpeg"]
    expected_tokens: NonNegativeInt64 | None = None
    type: Literal["image"] = "image"

    @property
    def length(self) -> int:
        return self.expected_tokens or 0


ModelInputChunk = Annotated[EncodedTextChunk | ImageChunk, Field(discriminator="type")]


class ModelInput(StrictBase):
    chunks: list[ModelInputChunk]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        out: list[int] = []
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):
                raise ValueError("to_ints() needs a text-only ModelInput")
            out.extend(chunk.tokens)
        return out

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk | ImageChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        last = self.chunks[-1] if self.chunks else None
        if isinstance(last, EncodedTextChunk):
            merged = EncodedTextChunk(tokens=[*last.tokens, int(token)])
            return ModelInput(chunks=[*self.chunks[:-1], merged])
        return self.append(EncodedTextChunk(tokens=[int(token)]))
