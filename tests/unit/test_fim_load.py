"""The fim load's parts without a server: the typing session (llama.vim's bodies, from
real files), what counts as the ghost text being typed next, the summary and its table."""

from __future__ import annotations

from infer.bench.fim import Completion, sampling, summary, table
from infer.bench.typing import N_SUFFIX, Keystroke, matches, ring, session


def test_a_session_asks_as_llama_vim_at_several_points_of_each_line() -> None:
    keystrokes = session(2, points=3, seed=0)
    assert keystrokes == session(2, points=3, seed=0)  # the same requests every run
    lines = {k.where.rsplit(":", 1)[0] for k in keystrokes}
    assert len(keystrokes) > len(lines) > 8
    for k in keystrokes:
        assert k.prefix.endswith("\n") and k.suffix.startswith("\n")
        assert k.suffix.count("\n") <= N_SUFFIX + 1 and "\n" not in k.middle
        assert k.typed_next.strip()
        if k.middle:  # mid-line: the line's indentation, as llama.vim counts it
            assert k.indent == len(k.middle) - len(k.middle.lstrip())
        else:  # a blank line: llama.vim sends no indentation and no prompt
            assert k.indent == 0
    body = keystrokes[1].body(ring(), sampling(0.0, 0.9))
    assert body["input_prefix"] == keystrokes[1].prefix and body["prompt"] == keystrokes[1].middle
    assert body["temperature"] == 0.0 and len(body["input_extra"]) == 4
    assert body["response_fields"][0] == "content"


def test_the_first_line_of_ghost_text_is_judged_against_what_was_typed() -> None:
    mid = Keystroke("", "    x = comp", "\n", 4, "ute(1)", "f.py:1:12")
    assert matches(mid, "ute(1)\n    y = 2") and not matches(mid, "ute(2)")
    blank = Keystroke("", "", "\n", 0, "return x", "f.py:2:4")
    assert matches(blank, "    return x\n") and not matches(blank, "")


def test_summary_and_table() -> None:
    done = [Completion(f"f:{i}", 100.0 * (i + 1), 10, 900, 5, i % 2 == 0, "x") for i in range(20)]
    s = summary(done)
    assert s["requests"] == 20 and s["p50_ms"] == 1050.0 and s["p95_ms"] == 2000.0
    assert s["first_line_typed"] == 0.5 and s["prompt_read_mean"] == 10.0
    report = {
        "model": "m",
        "sampling": sampling(0.0, 0.9),
        "systems": {"infer-continuous": {"summary": s}, "llama.cpp": {"summary": s}},
    }
    assert s["p95_in_file_ms"] == 2000.0  # one file: every request after its first
    assert "| infer-continuous | 20 | 1050 | 2000 | 2000 | 1.00x | 50.0% |" in table(report)
