"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` counts what the generation routes would feed the model (a chat renders through
the template first), with the same prompt-size limit.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint, Response, jsonify

from infer.engine.engine import Engine
from infer.server.errors import APIError
from infer.server.generation import check_model, parse_body, render_chat
from infer.server.limits import check_prompt_size
from infer.server.openai import max_model_len
from infer.server.schemas import DetokenizeRequest, TokenizeRequest
from infer.server.state import get_state

blueprint = Blueprint("tokenize", __name__)


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    """``{tokens, count, max_model_len}`` (and ``token_strs`` when asked)."""
    body = await parse_body(TokenizeRequest)
    state = get_state()
    engine, _ = state.require_ready()
    check_model(state, body.model)
    max_bytes = state.config.max_prompt_bytes
    ids = await trio.to_thread.run_sync(_encode, engine, body, max_bytes)
    answer: dict[str, Any] = {"tokens": ids, "count": len(ids),
                              "max_model_len": max_model_len(state)}
    if body.return_token_strs:
        answer["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return jsonify(answer)


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    """``{prompt}``: the text of ``tokens``."""
    body = await parse_body(DetokenizeRequest)
    state = get_state()
    engine, _ = state.require_ready()
    check_model(state, body.model)
    vocab = engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(422, f"tokens: ids must be in [0, {vocab})", "invalid_value")
    text = await trio.to_thread.run_sync(engine.tokenizer.decode, body.tokens)
    return jsonify({"prompt": str(text)})


def _encode(engine: Engine, body: TokenizeRequest, max_bytes: int) -> list[int]:
    """Token ids of the body's prompt or conversation (runs in a thread)."""
    if body.messages is not None:
        text = render_chat(engine, body.messages) if body.add_generation_prompt else str(
            engine.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages],
                tokenize=False))
    else:
        text = body.prompt or ""
    check_prompt_size(text, max_bytes)
    ids = engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return [int(i) for i in ids]
