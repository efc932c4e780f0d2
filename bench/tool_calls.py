"""How often tool calls come back valid: many sampled requests against any OpenAI server.

Sends each question with two tools (weather, calculator) under ``auto``, ``required`` and a
named choice, at temperature 1.0 with EOS honoured, one request per case and seed, and counts
per choice mode: replies, calls, calls whose ``arguments`` are not JSON or do not fit the
tool's schema, and replies that should have held a call but did not (``required``/named).

    .venv/bin/python bench/tool_calls.py --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema

from infer.bench.tool_cases import QUESTIONS, SCHEMAS, TOOLS

CHOICES: dict[str, Any] = {
    "auto": "auto",
    "required": "required",
    "named": {"type": "function", "function": {"name": "calculator"}},
}


def _one(client: httpx.Client, model: str, question: str, choice: Any, seed: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "tools": TOOLS,
        "tool_choice": choice,
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 128,
    }
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return {"error": f"{r.status_code} {r.text[:200]}"}
    return r.json()["choices"][0]


def _verdicts(choice: dict[str, Any], must_call: bool) -> Counter[str]:
    count: Counter[str] = Counter(replies=1)
    if "error" in choice:
        count["errors"] += 1
        return count
    calls = choice["message"].get("tool_calls") or []
    if must_call and not calls and choice.get("finish_reason") != "length":
        count["missed"] += 1
    if choice.get("finish_reason") == "length":
        count["cut"] += 1
    for call in calls:
        count["calls"] += 1
        fn = call["function"]
        try:
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
        except (ValueError, KeyError, jsonschema.ValidationError):
            count["invalid"] += 1
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seeds", type=int, default=9, help="requests per question and mode")
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    jobs = [(mode, q, seed) for mode in CHOICES for q in QUESTIONS for seed in range(args.seeds)]
    totals: dict[str, Counter[str]] = {mode: Counter() for mode in CHOICES}
    with httpx.Client(base_url=args.url, timeout=600) as client:

        def run(job: tuple[str, str, int]) -> tuple[str, Counter[str]]:
            mode, q, seed = job
            return mode, _verdicts(_one(client, args.model, q, CHOICES[mode], seed), mode != "auto")

        with ThreadPoolExecutor(args.concurrency) as pool:
            for mode, count in pool.map(run, jobs):
                totals[mode] += count
    keys = ("replies", "calls", "invalid", "missed", "cut", "errors")
    print("| mode | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for mode, count in totals.items():
        print(f"| {mode} | " + " | ".join(str(count[k]) for k in keys) + " |")
    total = sum(totals.values(), Counter())
    print("| all | " + " | ".join(str(total[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
