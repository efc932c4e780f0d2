"""Quality of kept quantized weights: perplexity and greedy top-1 agreement against bf16.

    python bench/quality.py qwen2.5-coder-1.5b [--tokens 2000]

The benchmark's source text (repeated), teacher forced through the model loaded twice: with
``--weights auto`` (a GGUF's blocks kept, the quantized kernel) and ``--weights bf16`` (the
same file dequantized). Prints each perplexity and how often the two argmaxes agree.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from infer.bench.workloads import SOURCE_TEXT
from infer.models.loader import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a model name or path, as serve's --model")
    p.add_argument("--tokens", type=int, default=2000)
    args = p.parse_args()
    logits, targets = {}, None
    for mode in ("auto", "bf16"):
        loaded = load_model(args.model, torch.bfloat16, weights=mode)
        ids = loaded.tokenizer.encode(SOURCE_TEXT * 8, add_special_tokens=False)
        ids = ids[: args.tokens + 1]
        with torch.inference_mode():
            out = loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None])
        logits[mode] = out.logits[0, :-1].float()
        targets = torch.tensor(ids[1:])
        del loaded
    assert targets is not None
    for mode, lg in logits.items():
        print(f"{mode}: perplexity {math.exp(F.cross_entropy(lg, targets).item()):.4f}")
    agree = (logits["auto"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean().item()
    print(f"greedy top-1 agreement {agree:.2%} over {len(targets)} tokens")


if __name__ == "__main__":
    main()
