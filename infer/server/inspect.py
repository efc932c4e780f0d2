"""``POST /v1/inspect/attention``: one layer's and head's full attention matrix for a prompt.

The forward runs in a worker thread (one at a time), never on the event loop; it reads the
weights the engine thread also reads, which is safe because neither writes them.
"""

from __future__ import annotations

import torch
import trio
from quart import Blueprint, Response, jsonify

from infer.engine.engine import Engine
from infer.models.layers import AttnCapture
from infer.server.errors import APIError
from infer.server.generation import check_model, encode_prompt, parse_body
from infer.server.schemas import InspectRequest
from infer.server.state import get_state

blueprint = Blueprint("inspect", __name__)

DECIMALS = 6  # float32 carries about 7 significant digits; this keeps the JSON small


@blueprint.post("/v1/inspect/attention")
async def attention() -> Response:
    """``{layer, head, tokens, attn}`` with ``attn[i][j]`` the weight query i gives key j."""
    state = get_state()
    body = await parse_body(InspectRequest)
    engine, _ = state.require_ready()
    check_model(state, body.model)
    _check_range(engine, body.layer, body.head)
    ids = await trio.to_thread.run_sync(
        encode_prompt, engine, body.prompt, body.messages, state.config.max_prompt_bytes)
    if len(ids) > state.config.max_inspect_tokens:
        raise APIError(422, f"the prompt is {len(ids)} tokens; attention inspection takes at "
                       f"most {state.config.max_inspect_tokens}", "context_length_exceeded")
    matrix = await trio.to_thread.run_sync(attention_matrix, engine, ids, body.layer,
                                           body.head, limiter=state.inspect_limiter)
    tokens = [str(engine.tokenizer.decode([i])) for i in ids]
    return jsonify({"layer": body.layer, "head": body.head, "tokens": tokens, "attn": matrix})


def _check_range(engine: Engine, layer: int, head: int) -> None:
    config = engine.model.config
    if layer >= config.num_hidden_layers:
        raise APIError(422, f"layer must be in [0, {config.num_hidden_layers - 1}], got "
                       f"{layer}", "invalid_value")
    if head >= config.num_attention_heads:
        raise APIError(422, f"head must be in [0, {config.num_attention_heads - 1}], got "
                       f"{head}", "invalid_value")


def attention_matrix(engine: Engine, ids: list[int], layer: int, head: int
                     ) -> list[list[float]]:
    """Attention probabilities of one head over a whole prompt (call it in a thread).

    Args:
        engine: Its model runs the forward (no KV cache is touched).
        ids: Prompt token ids.
        layer: Layer index.
        head: Query head index.

    Returns:
        ``t × t`` rows: row i is query token i's weights over keys ``0..t-1`` (zero above
        the diagonal).
    """
    model = engine.model
    with torch.inference_mode():
        input_ids = torch.tensor([ids], device=model.device)
        positions = torch.arange(len(ids), device=model.device).unsqueeze(0)  # [1, T]
        out = model(input_ids, positions, capture=AttnCapture(frozenset({layer})))
    assert out.attn is not None  # a capture was given
    probs = out.attn[layer][0, head].float().cpu()  # [T, T]
    return [[round(x, DECIMALS) for x in row] for row in probs.tolist()]
