"""What a request used: :class:`Counts` from its stream, and the ``usage`` object OpenAI's
routes and the native ``done`` event carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, NotRequired

from pydantic import Field
from typing_extensions import TypedDict


@dataclass(frozen=True)
class Counts:
    """What a request used, as every protocol's usage reports it.

    Args:
        prompt_tokens: Each distinct prompt once.
        completion_tokens: Every choice's generated tokens.
        cached_tokens: Prompt tokens the prefix cache served.
        prediction: For a request with a prediction: its tokens the answers kept, and those
            tried and not kept; ``None`` without one.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prediction: tuple[int, int] | None = None


class PromptTokensDetails(TypedDict):
    cached_tokens: Annotated[int, Field(description="prompt tokens served from the prefix cache")]


class CompletionTokensDetails(TypedDict):
    accepted_prediction_tokens: Annotated[
        int, Field(description="tokens of the prediction the answer kept")
    ]
    rejected_prediction_tokens: Annotated[
        int, Field(description="tokens of the prediction that were tried and not kept")
    ]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: NotRequired[
        Annotated[
            CompletionTokensDetails,
            Field(description="with a `prediction`: how much of it the answer used"),
        ]
    ]


def usage(counts: Counts) -> Usage:
    """OpenAI's token counts: each prompt once, every choice, how many prompt tokens the
    prefix cache served and, for a request with a prediction, how much of it was used."""
    total = counts.prompt_tokens + counts.completion_tokens
    result: Usage = {
        "prompt_tokens": counts.prompt_tokens,
        "completion_tokens": counts.completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": counts.cached_tokens},
    }
    if counts.prediction is not None:
        accepted, rejected = counts.prediction
        result["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": rejected,
        }
    return result
