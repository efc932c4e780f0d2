"""lm-eval's ``local-completions`` model against a real server, on a handmade task.

lm-eval scores each answer of a multiple-choice question by the log-likelihood of its tokens
after the question: it sends the question and the answer's tokens as one prompt with
``echo``, ``logprobs: 1`` and ``max_tokens: 1`` and sums the prompt logprobs of the answer's
tokens. The task and its data are written to ``tmp_path`` (nothing is downloaded); the
tokenizer is the default model's own local directory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from infer.models.default import ensure_default_model
from support.server import running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TASK = "infer_easy_facts"
# Questions whose right answer the model finds far likelier than the wrong one.
DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " banana"], "answer": 0},
    {"question": "One, two, three, four,", "choices": [" purple", " five"], "answer": 1},
    {"question": "The sun rises in the", "choices": [" east", " spoon"], "answer": 0},
    {"question": "Monday, Tuesday,", "choices": [" seventeen", " Wednesday"], "answer": 1},
]


def _write_task(folder: Path) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )


def _evaluate(url: str, folder: Path) -> tuple[dict[str, Any], Any]:
    """Run lm-eval on the task (in a thread: the server runs on the test's event loop)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        model=MODEL,
        tokenizer=str(ensure_default_model()),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        num_concurrent=1,
        max_retries=1,
    )
    results = simple_evaluate(
        model=lm,
        tasks=[TASK],
        # only the task written here: indexing lm-eval's thousands of own tasks takes ~10 s
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None
    return results, lm


async def _score(client: httpx.AsyncClient, context: list[int], continuation: list[int]) -> float:
    """The log-likelihood of ``continuation`` after ``context`` from infer's prompt logprobs."""
    r = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": context + continuation, "echo": True, "logprobs": 0}
        | {"max_tokens": 0},
    )
    assert r.status_code == 200, r.text
    return float(sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(context) :]))


async def test_lm_eval_local_completions_scores_a_task(
    real_app, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    _write_task(tmp_path)
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=300) as client,
    ):
        results, lm = await trio.to_thread.run_sync(_evaluate, server.url, tmp_path)
        samples = results["samples"][TASK]
        assert len(samples) == len(DOCS)
        for sample in samples:
            for (context, continuation), (loglikelihood, _) in zip(
                sample["arguments"], sample["filtered_resps"], strict=True
            ):
                assert math.isfinite(loglikelihood) and loglikelihood < 0
                ours = await _score(client, *lm._encode_pair(context, continuation))
                assert loglikelihood == pytest.approx(ours, abs=1e-4)
    assert results["results"][TASK]["acc,none"] == 1.0
