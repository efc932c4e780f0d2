"""Structured output at the HTTP edge: ``response_format`` -> a compiled grammar.

The compiler (one per served model; building it reads the whole vocabulary) is made on the
first structured request and kept in the app's extensions. Compiling runs in a thread.
"""

from __future__ import annotations

import trio
from quart import current_app

from infer.engine.engine import Engine
from infer.engine.grammar import Grammar, GrammarCompiler, GrammarError
from infer.server.errors import APIError
from infer.server.schemas import SamplingFields
from infer.server.state import ServerState

_KEY = "infer.grammar_compiler"


async def compile_format(state: ServerState, fields: SamplingFields) -> Grammar | None:
    """The grammar a request's ``response_format`` asks for; ``None`` for free text.

    Raises:
        APIError: 422 ``invalid_schema`` when the schema cannot be compiled (counted),
            503 while the model is not ready.
    """
    schema = fields.json_schema()
    if schema is None:
        return None
    engine, _ = state.require_ready()
    compiler: GrammarCompiler | None = current_app.extensions.get(_KEY)
    if compiler is None:
        compiler = await trio.to_thread.run_sync(_new_compiler, engine)
        current_app.extensions[_KEY] = compiler
    try:
        return await trio.to_thread.run_sync(compiler.json_schema, schema)
    except GrammarError as e:
        state.metrics.rejected["invalid_schema"] += 1
        raise APIError(422, f"response_format: {e}", "invalid_schema") from None


def _new_compiler(engine: Engine) -> GrammarCompiler:
    vocab = engine.model.config.vocab_size
    return GrammarCompiler(engine.tokenizer, vocab, sorted(engine.eos_token_ids))
