"""OpenAI's embeddings (:mod:`infer.api.embeddings`): parse, embed on the model's thread
(:func:`~infer.server.host.embedding.embed`), answer."""

from __future__ import annotations

from quart import Blueprint, Response, jsonify

from infer.api.embeddings.bodies import EmbeddingList, embedding_list
from infer.api.embeddings.models import EmbeddingRequest
from infer.server.edge.exchange import parse_body
from infer.server.edge.openapi import documented
from infer.server.host.embedding import embed
from infer.server.host.state import get_state

blueprint = Blueprint("embeddings", __name__)


@blueprint.post("/v1/embeddings")
@documented("OpenAI", EmbeddingRequest, EmbeddingList)
async def embeddings() -> Response:
    """One vector per input (a text or token ids), from an embedding model."""
    body = await parse_body(EmbeddingRequest)
    done = await embed(get_state(), body.model, body.inputs(), dimensions=body.dimensions)
    result = done.embeddings
    return jsonify(
        embedding_list(done.model, result.vectors, result.total_tokens, body.encoding_format)
    )
