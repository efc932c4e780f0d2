"""The body of OpenAI's ``POST /v1/embeddings``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictStr

from infer.api.fields import Body
from infer.engine.params import TokenId

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(Body):
    """`POST /v1/embeddings`: one vector per input, in input order.

    An input is a text or a list of token ids (the text's tokens, without the model's
    special tokens); one longer than the model takes is refused (400
    ``context_length_exceeded``), as OpenAI refuses it.
    """

    input: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list (a single text or token list is one input)."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(t, int) for t in given):
            return [given]  # type: ignore[list-item]  # one input of token ids
        return list(given)  # type: ignore[arg-type]
