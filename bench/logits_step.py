"""Cost of the logits step (infer/engine/logit_processors.py) at batch 16 on SmolLM2's vocabulary.

    python bench/logits_step.py

Prints the median time per step of ``process_logits`` for a batch of 16 rows with 0, 1, 8
and 16 of them constrained by a JSON schema (each matcher advanced by the token it is given,
as in decoding), with logit bias and penalties on all rows, and with nothing to do.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from infer.engine.grammar import GrammarCompiler
from infer.engine.logit_processors import process_logits
from infer.engine.params import SamplingParams
from infer.engine.request import Request
from infer.models.default import ensure_default_model

BATCH, VOCAB, STEPS = 16, 49152, 60
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}


def _requests(constrained: int, compiler: GrammarCompiler, **extra: object) -> list[Request]:
    grammar = compiler.json_schema(SCHEMA)
    return [
        Request(f"r{i}", [1], SamplingParams(grammar=grammar if i < constrained else None, **extra))  # type: ignore[arg-type]
        for i in range(BATCH)
    ]


def _median_ms(requests: list[Request]) -> float:
    torch.manual_seed(0)
    times = []
    for _ in range(STEPS):
        logits = torch.randn(BATCH, VOCAB)
        start = time.perf_counter()
        out = process_logits(logits, requests)
        times.append(time.perf_counter() - start)
        for req, token in zip(requests, out.argmax(dim=-1).tolist(), strict=True):
            if req.grammar_state is None or req.grammar_state.active:
                req.output_ids.append(token)
    return statistics.median(times[5:]) * 1000


def main() -> None:
    path = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(Path(path))
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    print(f"process_logits, batch {BATCH}, V={VOCAB}: median ms per step over {STEPS - 5}")
    print(f"  nothing to do:            {_median_ms(_requests(0, compiler)):.4f}")
    for n in (1, 8, 16):
        print(f"  {n:2d} rows constrained:      {_median_ms(_requests(n, compiler)):.3f}")
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {42: -100.0}}
    print(f"  bias + penalties, 16 rows: {_median_ms(_requests(0, compiler, **penalties)):.3f}")


if __name__ == "__main__":
    main()
