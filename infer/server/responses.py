"""Response bodies as pydantic models: what ``/openapi.json`` documents for each route.

The routes build their bodies as plain dicts (see :mod:`infer.server.openai_format`); these
models describe the same shapes, and the schemathesis test checks responses against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str


class ErrorResponse(BaseModel):
    """Every error before a stream starts (4xx, 5xx)."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` with ``stream: false``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` with ``stream: false``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: str
    model: str
    running: int
    waiting: int


class AttentionResponse(BaseModel):
    """``POST /v1/inspect/attention``."""

    layer: int
    head: int
    tokens: list[str]
    attn: list[list[float]]
