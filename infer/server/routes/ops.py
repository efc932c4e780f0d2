"""What operators and gateways ask of a server: readiness, Prometheus metrics, and the model
and limits in SGLang's shape (SGLang Model Gateway names its workers' model from them)."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, jsonify
from typing_extensions import TypedDict

from infer import __version__
from infer.api.openai.models import MAX_CHOICES
from infer.engine.params import MAX_LOGPROBS
from infer.server.edge.openapi import documented
from infer.server.host.admission import generating
from infer.server.host.metrics import CONTENT_TYPE, Live, exposition
from infer.server.host.registry import ModelSlot
from infer.server.host.state import ServerState, Status, get_state

blueprint = Blueprint("ops", __name__)


class Health(TypedDict):
    status: str
    model: str
    running: int
    waiting: int


@blueprint.get("/health")
@documented("operations", response=Health)
async def _health() -> tuple[Response, int]:
    """Readiness: 200 once the model is loaded and the engine loop runs, else 503."""
    state = get_state()
    worker = state.worker
    body = Health(
        status=state.status.value,
        model=state.model_name,
        running=worker.running if worker else 0,
        waiting=worker.waiting if worker else 0,
    )
    return jsonify(body), 200 if state.ready else 503


@blueprint.get("/metrics")
@documented("operations")
async def _metrics() -> Response:
    """Prometheus text exposition; every series labelled with its model."""
    state = get_state()
    text = exposition(
        [(slot.name, slot.metrics, _live(state, slot)) for slot in state.models.slots]
    )
    return Response(text, status=200, content_type=CONTENT_TYPE)


def _live(state: ServerState, slot: ModelSlot) -> Live:
    """A model's gauges now."""
    if slot.embedder is not None:
        ready = state.status == Status.READY and slot.embedder.ready
        return Live(0, slot.embedder.pending, ready)
    worker, engine = slot.worker, slot.engine
    if worker is None or engine is None:
        return Live()
    ready = state.status == Status.READY and worker.ready
    return Live(worker.running, worker.waiting, ready, engine.cache_stats())


@blueprint.get("/model_info")
@blueprint.get("/get_model_info")
@documented("operations")
async def _model_info() -> Response:
    """The default model, in SGLang's shape (the gateway names its workers' model from it)."""
    state = get_state()
    async with generating(state, None) as (_, engine, _):
        config = engine.model.config
        return jsonify(
            {
                **_names(state),
                "is_generation": True,
                "supports_vision": False,
                "model_type": config.architecture,
                "architectures": [config.architecture],
                "max_context_length": engine.max_seq_len,
                "max_req_input_len": engine.max_seq_len - 1,
                "vocab_size": config.vocab_size,
                "num_hidden_layers": config.num_hidden_layers,
                "num_attention_heads": config.num_attention_heads,
                "eos_token_ids": sorted(engine.eos_token_ids),
                "weight_version": "default",
            }
        )


@blueprint.get("/server_info")
@blueprint.get("/get_server_info")
@documented("operations")
async def _server_info() -> Response:
    """The server's limits and version, in SGLang's shape (its default model's)."""
    state = get_state()
    async with generating(state, None) as (_, engine, _):
        return jsonify(
            {
                **_names(state),
                "served_model_names": list(state.model_names),
                "context_length": engine.max_seq_len,
                "max_running_requests": engine.config.max_batch_size,
                "max_total_num_tokens": engine.blocks.num_blocks * engine.config.block_size,
                "page_size": engine.config.block_size,
                "dtype": engine.config.dtype,
                "max_inspect_tokens": state.config.max_inspect_tokens,
                "max_logprobs": MAX_LOGPROBS,
                "max_choices": MAX_CHOICES,
                "version": __version__,
                "backend": "infer",
            }
        )


def _names(state: ServerState) -> dict[str, Any]:
    """The default model's path and served name, as both of SGLang's answers start."""
    path = state.models.default.spec.source
    return {"model_path": path, "tokenizer_path": path, "served_model_name": state.model_name}
