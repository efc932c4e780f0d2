"""Seeded, reproducible benchmark workloads cut from a fixed public-domain text.

Every prompt is a window of exact token length over the model's tokenization of
:data:`SOURCE_TEXT` (read cyclically, from a seeded random offset), so the same seed gives the
same token ids on every machine with no downloads. Every request is greedy with EOS ignored:
each system under test then generates exactly the same number of tokens for it.

Servers cache prompt prefixes (infer and vLLM both do by default), so no two prompts of a run
start at the same place in the text: a round (a workload, a sweep level) cannot reuse blocks
of an earlier round's prompts. The one deliberate exception is the ``prefix`` workload, whose
requests share one long system-style prefix: it measures what prefix caching saves.

Three loads are shaped as coding agents send them, as chat prompts rendered by the model's own
template: ``edit`` (a whole standard-library source file and an instruction to change it; the
file is what OpenAI's Predicted Outputs would send as the ``prediction``), ``agent`` (a long
system prompt of tool schemas and a repository map, then conversations of four turns, each
turn's prompt extending the one before) and ``prose`` (W1 again, where speculative decoding
has nothing to copy). Their prompts begin with a salt drawn from the seed, so that no two
requests share a first KV block unless they are turns of one conversation. ``long`` (one
request, an ~8k-token prompt of standard-library source, salted too) measures a long
prefill's TTFT.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# Public domain: Lincoln's Gettysburg Address (1863), the openings of Dickens' "A Tale of Two
# Cities" (1859), Austen's "Pride and Prejudice" (1813) and Melville's "Moby-Dick" (1851).
SOURCE_TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we \
are engaged in a great civil war, testing whether that nation, or any nation so conceived and \
so dedicated, can long endure. We are met on a great battle-field of that war. We have come to \
dedicate a portion of that field, as a final resting place for those who here gave their lives \
that that nation might live. It is altogether fitting and proper that we should do this. But, \
in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this \
ground. The brave men, living and dead, who struggled here, have consecrated it, far above our \
poor power to add or detract. The world will little note, nor long remember what we say here, \
but it can never forget what they did here. It is for us the living, rather, to be dedicated \
here to the unfinished work which they who fought here have thus far so nobly advanced. It is \
rather for us to be here dedicated to the great task remaining before us -- that from these \
honored dead we take increased devotion to that cause for which they gave the last full measure \
of devotion -- that we here highly resolve that these dead shall not have died in vain -- that \
this nation, under God, shall have a new birth of freedom -- and that government of the people, \
by the people, for the people, shall not perish from the earth.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age \
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season \
of Light, it was the season of Darkness, it was the spring of hope, it was the winter of \
despair, we had everything before us, we had nothing before us, we were all going direct to \
Heaven, we were all going direct the other way -- in short, the period was so far like the \
present period, that some of its noisiest authorities insisted on its being received, for good \
or for evil, in the superlative degree of comparison only. There were a king with a large jaw \
and a queen with a plain face, on the throne of England; there were a king with a large jaw \
and a queen with a fair face, on the throne of France. In both countries it was clearer than \
crystal to the lords of the State preserves of loaves and fishes, that things in general were \
settled for ever.

It is a truth universally acknowledged, that a single man in possession of a good fortune, must \
be in want of a wife. However little known the feelings or views of such a man may be on his \
first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding \
families, that he is considered the rightful property of some one or other of their daughters. \
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is \
let at last?" Mr. Bennet replied that he had not. "But it is," returned she; "for Mrs. Long \
has just been here, and she told me all about it." Mr. Bennet made no answer. "Do you not want \
to know who has taken it?" cried his wife impatiently. "You want to tell me, and I have no \
objection to hearing it." This was invitation enough.

Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no money \
in my purse, and nothing particular to interest me on shore, I thought I would sail about a \
little and see the watery part of the world. It is a way I have of driving off the spleen and \
regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it is \
a damp, drizzly November in my soul; whenever I find myself involuntarily pausing before coffin \
warehouses, and bringing up the rear of every funeral I meet; and especially whenever my hypos \
get such an upper hand of me, that it requires a strong moral principle to prevent me from \
deliberately stepping into the street, and methodically knocking people's hats off -- then, I \
account it high time to get to sea as soon as I can. This is my substitute for pistol and ball. \
With a philosophical flourish Cato throws himself upon his sword; I quietly take to the ship. \
There is nothing surprising in this. If they but knew it, almost all men in their degree, some \
time or other, cherish very nearly the same feelings towards the ocean with me.
"""

SCALES = ("full", "quick", "smoke")
# Command-line names, in the order they are built (and reported).
WORKLOAD_NAMES = (
    "w1",
    "w2",
    "w2serial",
    "chat64",
    "prefix",
    "sweep",
    "edit",
    "agent",
    "prose",
    "long",
)
# What `infer bench` runs when no workloads are named: the coding-agent loads are asked for.
DEFAULT_WORKLOADS = ("w1", "w2", "w2serial", "chat64", "prefix", "sweep")
# The prefix workload's system prompt, followed by source text up to the prefix length.
SYSTEM_PREAMBLE = (
    "You are a careful reading assistant. The user will ask short questions about the passage "
    "below. Answer in one or two plain sentences, quoting the passage where it helps.\n\n"
    "Passage:\n"
)
QUESTION_TOPICS = (
    "the nation",
    "the war",
    "the season of Light",
    "the king with a large jaw",
    "Mr. Bennet",
    "Netherfield Park",
    "Ishmael",
    "the ocean",
    "the dead",
    "freedom",
    "the throne of France",
    "a single man",
    "the watery part of the world",
    "November",
    "the ship",
    "the people",
)
QUESTION_FORMS = (
    "What does the passage say about {}?",
    "Who speaks of {}, and why?",
    "Sum up the mention of {} in five words.",
    "Is {} described kindly?",
)


# The edit load's files: standard-library modules of every supported Python (3.11-3.13),
# those whose source has EDIT_LINES lines on this one (counts move a little between versions).
EDIT_MODULES = (
    "colorsys",
    "fnmatch",
    "glob",
    "shlex",
    "sched",
    "queue",
    "netrc",
    "graphlib",
    "tabnanny",
    "reprlib",
    "getopt",
    "linecache",
    "codeop",
    "quopri",
    "hmac",
    "zipapp",
)
EDIT_LINES = (150, 400)
EDIT_SYSTEM = (
    "You are an expert Python programmer. Make exactly the change you are asked for and keep "
    "everything else in the file as it is."
)
EDIT_INSTRUCTIONS = (
    "Add type hints to every function.",
    "Rename `{old}` to `{new}` everywhere.",
    "Add a docstring to every function that lacks one.",
)
RENAME_SUFFIXES = ("impl", "v2", "legacy", "helper", "internal")
LONG_QUESTION = "Which of these modules would you refactor first, and why? Answer in two sentences."
# The agent load's repository maps come from these packages (each has a few hundred
# top-level definitions and methods), the chosen one first, the next ones after it as needed.
AGENT_PACKAGES = ("email", "http", "asyncio", "logging", "urllib", "importlib", "xml", "unittest")
AGENT_SYSTEM = (
    "You are a coding agent working in the Python repository mapped below. Use the tools to "
    "read, search, edit and test the code; keep changes small, explain each one in a sentence "
    "or two, and run the tests after every edit. Call a tool by answering with one JSON object "
    '{"name": ..., "arguments": {...}} and nothing else.'
)


Param = tuple[str, str]  # a tool parameter's JSON type and description


def _tool(
    name: str, description: str, params: Mapping[str, Param], required: Sequence[str] = ()
) -> dict[str, Any]:
    """A function definition in OpenAI's tool shape."""
    properties = {p: {"type": kind, "description": text} for p, (kind, text) in params.items()}
    schema = {"type": "object", "properties": properties, "required": list(required)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


PATH: Param = ("string", "Path relative to the repository root.")
AGENT_TOOLS = (
    _tool(
        "read_file",
        "Read a file of the repository, whole or a range of its lines.",
        {
            "path": PATH,
            "start_line": ("integer", "First line to read (1-based; default 1)."),
            "end_line": ("integer", "Last line to read (default: the end of the file)."),
        },
        ["path"],
    ),
    _tool(
        "write_file",
        "Create a file, or replace the whole content of an existing one.",
        {"path": PATH, "content": ("string", "The new content.")},
        ["path", "content"],
    ),
    _tool(
        "apply_patch",
        "Apply a unified diff to the repository; fails without changing anything when a hunk "
        "does not apply.",
        {"patch": ("string", "The diff, with ---/+++ headers and @@ hunks.")},
        ["patch"],
    ),
    _tool(
        "run_tests",
        "Run the test suite, or some of it, with pytest; returns the summary and failures.",
        {
            "selector": ("string", "Test path or node id, e.g. tests/test_utils.py::test_quote."),
            "keyword": ("string", "A pytest -k expression."),
            "verbose": ("boolean", "Report every test, not only failures."),
        },
    ),
    _tool(
        "grep",
        "Search the repository's files for a regular expression; returns matching lines.",
        {
            "pattern": ("string", "A Python regular expression."),
            "path": ("string", "Folder or file to search (default: the whole repository)."),
            "glob": ("string", "Only files matching this glob, e.g. *.py."),
            "max_results": ("integer", "Most matches to return (default 50)."),
        },
        ["pattern"],
    ),
    _tool(
        "list_dir",
        "List a folder's files and subfolders.",
        {"path": PATH, "depth": ("integer", "How many levels down to list (default 1).")},
        ["path"],
    ),
    _tool(
        "find_symbol",
        "Find where a class, function or method is defined, and where it is used.",
        {
            "name": ("string", "The symbol, e.g. Parser.parse or quote."),
            "usages": ("boolean", "Also list the places that use it."),
        },
        ["name"],
    ),
    _tool(
        "run_command",
        "Run a shell command in the repository root; returns its exit status and output.",
        {
            "command": ("string", "The command line."),
            "timeout_s": ("integer", "Seconds before it is stopped (default 60)."),
        },
        ["command"],
    ),
    _tool(
        "git_diff",
        "Show the changes made so far, against the last commit.",
        {
            "path": ("string", "Only changes to this file or folder."),
            "staged": ("boolean", "Only the staged changes."),
        },
    ),
    _tool(
        "ask_user",
        "Ask the user a question when the task is ambiguous; returns their answer.",
        {"question": ("string", "One short question.")},
        ["question"],
    ),
)
# The agent's four questions, and the pre-written answers to the first three that the later
# turns' prompts carry. Placeholders are filled from the repository map.
AGENT_QUESTIONS = (
    "Where is `{func}` defined, and what uses it?",
    "Add a `timeout` parameter to `{func}`, None by default, and pass it on from its callers.",
    "Write a test for the new parameter.",
    "Now sum up what we changed, as a commit message.",
)
AGENT_ANSWERS = (
    "`{func}` is defined in `{path}`: `def {func}({args})`. I searched the repository with "
    "grep for its callers: it is used inside `{path}` itself and by `{other}`, and the tests "
    "reach it only through those. It does not change its arguments, so a new parameter with "
    "a default would not break any caller.",
    "I read `{path}` and applied this patch:\n\n```diff\n--- a/{path}\n+++ b/{path}\n@@\n"
    "-def {func}({args}):\n+def {func}({args_timeout}):\n```\n\nThe callers in `{other}` "
    "now pass `timeout=timeout` through. I ran the tests with run_tests: all of them pass, "
    "and none needed a change.",
    "I added `tests/test_{stem}.py::test_{func}_timeout`, which calls `{func}` once without "
    "a timeout and once with `timeout=0.5` and checks that both give the same result. "
    "run_tests reports it passing along with the rest of the suite.",
)


class Tokenizer(Protocol):
    """What the workloads need of a tokenizer: text to token ids."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer that may render chat messages with a template (Hugging Face's)."""

    chat_template: Any

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request: exact prompt token ids and exactly this many new tokens (EOS ignored).

    Args:
        prompt_ids: The prompt's token ids, sent as they are.
        max_new_tokens: Tokens to generate.
        prediction: Text the answer is expected to repeat (an edit's original file): sent as
            OpenAI's Predicted Outputs ``prediction`` only by a system that sends them.
        label: What the request is within its workload (``turn 2``), for metrics by label.
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    prediction: str | None = None
    label: str = ""


@dataclass(frozen=True)
class Workload:
    """A set of requests and how they are offered to the system under test.

    Args:
        name: Short id used in tables and file names (``W1``, ``W2``, ``sweep``).
        description: One line for the report.
        requests: The requests, in submission order.
        concurrency: Most requests in flight at once (a closed loop of this many streams).
        rate: Poisson arrivals at this many requests per second (``None``: each stream sends
            its next request as soon as its previous one ends).
        follow_ups: Labels of the requests whose prompt extends an earlier request's (a
            conversation's later turns): their TTFT is also summarized on its own.
    """

    name: str
    description: str
    requests: tuple[BenchRequest, ...]
    concurrency: int
    rate: float | None = None
    follow_ups: tuple[str, ...] = ()

    @property
    def output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)


@dataclass(frozen=True)
class Scale:
    """The sizes of the workloads at one scale (``full``: the specified sizes).

    ``chat_*`` size the chat-sized load (all requests in flight at once; prompts counted in
    words of the source text), ``prefix_*`` the shared-prefix load (``prefix_len`` tokens
    shared, then a short question; ``prefix_concurrency`` requests in flight), ``edit_*`` the
    file-editing load (``edit_new`` tokens of the answer, ``edit_concurrency`` in flight),
    ``agent_*`` the agent's conversations (a system prompt of about ``agent_system`` tokens,
    four turns of ``agent_new`` new tokens each, one request at a time) and ``long_*`` the
    long prompt's one request (about ``long_prompt`` tokens, ``long_new`` new ones).
    """

    w1_prompt: int
    w1_new: int
    w2_requests: int
    w2_prompt: tuple[int, int]
    w2_new: tuple[int, int]
    sweep_requests: int
    sweep_prompt: tuple[int, int]
    sweep_new: tuple[int, int]
    concurrency: tuple[int, ...]
    chat_requests: int = 64
    chat_words: tuple[int, int] = (20, 50)
    chat_new: int = 128
    prefix_requests: int = 16
    prefix_len: int = 500
    prefix_new: int = 32
    prefix_concurrency: int = 1
    edit_requests: int = 4
    edit_new: int = 1024
    edit_concurrency: int = 1
    agent_conversations: int = 2
    agent_system: int = 6000
    agent_new: int = 128
    long_prompt: int = 8000
    long_new: int = 16


# full: W1, W2, chat64 and prefix at their specified sizes; the sweep's 64
# requests are kept short so that its concurrency-1 pass stays within minutes. quick: a few
# minutes for everything on 2 busy cores, but the long load keeps its 8k-token prompt (one
# request, which is the point of it: ~1 min of prefill for infer on the 1.5B, 3-4 for
# llama.cpp). smoke: seconds; checks the pipeline (the test suite runs it), measures nothing.
SCALE_SIZES = {
    "full": Scale(256, 256, 16, (32, 1024), (64, 256), 64, (32, 512), (16, 64), (1, 4, 16, 64)),
    "quick": Scale(
        128,
        128,
        8,
        (32, 256),
        (16, 48),
        8,
        (32, 128),
        (16, 32),
        (1, 4, 8),
        16,
        (20, 50),
        32,
        8,
        500,
        16,
        edit_requests=2,
        edit_new=384,
        agent_conversations=1,
        agent_system=6000,
        agent_new=64,
    ),
    "smoke": Scale(
        16,
        4,
        2,
        (8, 32),
        (2, 4),
        2,
        (8, 16),
        (2, 3),
        (1, 2),
        4,
        (5, 10),
        4,
        3,
        48,
        4,
        edit_requests=2,
        edit_new=4,
        agent_conversations=1,
        agent_system=1200,
        agent_new=4,
        long_prompt=400,
        long_new=4,
    ),
}


class PromptSource:
    """Cuts prompts of exact token length out of the tokenized source text.

    Every prompt starts at an offset no earlier prompt of this source started at (token
    offsets for :meth:`prompt`, word offsets for :meth:`words`), so that no two share a
    cached prefix; offset 0 is kept for the warm-up. Words that begin a line are never a
    start either: tokenized alone they give the very tokens a token window starting there
    would (elsewhere the window's first token carries the leading space). Only when every
    offset has been used (a run larger than the text) do offsets repeat.
    """

    def __init__(self, tokenizer: Tokenizer, text: str = SOURCE_TEXT) -> None:
        self.tokenizer = tokenizer
        self.tokens = list(tokenizer.encode(text, add_special_tokens=False))
        words = list(re.finditer(r"\S+", text))
        self.word_list = [m.group() for m in words]
        if len(self.tokens) < 2:
            raise ValueError("the source text tokenizes to fewer than 2 tokens")
        self._used_tokens: set[int] = {0}
        self._line_starts = {i for i, m in enumerate(words) if text[: m.start()][-1:] in ("", "\n")}
        self._used_words = set(self._line_starts)

    def prompt(self, length: int, rng: random.Random) -> tuple[int, ...]:
        """``length`` consecutive tokens, starting at a fresh random offset, wrapping around."""
        if length < 1:
            raise ValueError(f"prompt length must be >= 1, got {length}")
        n = len(self.tokens)
        start = _fresh_offset(n, self._used_tokens, rng)
        return tuple(self.tokens[(start + i) % n] for i in range(length))

    def words(self, count: int, rng: random.Random) -> tuple[int, ...]:
        """The tokens of ``count`` consecutive words (joined by spaces) from a fresh offset."""
        if count < 1:
            raise ValueError(f"word count must be >= 1, got {count}")
        n = len(self.word_list)
        start = _fresh_offset(n, self._used_words, rng, self._line_starts)
        text = " ".join(self.word_list[(start + i) % n] for i in range(count))
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))


def _fresh_offset(
    n: int, used: set[int], rng: random.Random, keep: frozenset[int] | set[int] = frozenset()
) -> int:
    """A random offset in ``range(n)`` not in ``used`` (which it joins); when it holds them
    all, ``used`` first goes back to ``keep`` (or to nothing when that is everything)."""
    if len(used) >= n:
        used.clear()
        if len(keep) < n:
            used.update(keep)
    start = rng.randrange(n)
    while start in used:
        start = (start + 1) % n
    used.add(start)
    return start


def single(source: PromptSource, prompt_len: int, new_tokens: int, seed: int) -> Workload:
    """W1: one request alone; the serving overhead against a direct ``generate()``."""
    rng = random.Random(f"W1/{seed}")
    request = BenchRequest(source.prompt(prompt_len, rng), new_tokens)
    return Workload(
        "W1", f"1 request, {prompt_len}-token prompt, {new_tokens} new tokens", (request,), 1
    )


def mixed_requests(
    source: PromptSource,
    n: int,
    prompt_range: tuple[int, int],
    new_range: tuple[int, int],
    seed: int | str,
) -> tuple[BenchRequest, ...]:
    """``n`` requests with prompt and output lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt_len = rng.randint(*prompt_range)
        new_tokens = rng.randint(*new_range)
        requests.append(BenchRequest(source.prompt(prompt_len, rng), new_tokens))
    return tuple(requests)


def mixed(
    source: PromptSource,
    n: int,
    prompt_range: tuple[int, int],
    new_range: tuple[int, int],
    seed: int,
    rate: float | None = None,
) -> Workload:
    """W2: ``n`` mixed requests, all ``n`` in flight at once (or arriving at ``rate``)."""
    requests = mixed_requests(source, n, prompt_range, new_range, f"W2/{seed}")
    arrivals = f", Poisson arrivals at {rate:g} req/s" if rate else ""
    description = (
        f"{n} concurrent requests, prompts {prompt_range[0]}-{prompt_range[1]} tokens, "
        f"{new_range[0]}-{new_range[1]} new tokens{arrivals}"
    )
    return Workload("W2", description, requests, n, rate)


def serial(
    source: PromptSource,
    n: int,
    prompt_range: tuple[int, int],
    new_range: tuple[int, int],
    seed: int,
) -> Workload:
    """W2-serial: W2's prompt and output lengths (fresh text), one request at a time."""
    requests = mixed_requests(source, n, prompt_range, new_range, f"W2/{seed}")
    description = (
        f"W2's {n} prompt and output lengths ({prompt_range[0]}-{prompt_range[1]} tokens, "
        f"{new_range[0]}-{new_range[1]} new), one request at a time"
    )
    return Workload("W2-serial", description, requests, 1)


def chat(
    source: PromptSource, n: int, words: tuple[int, int], new_tokens: int, seed: int
) -> Workload:
    """chat64: ``n`` chat-sized prompts (``words`` words of the text), all in flight at once."""
    rng = random.Random(f"chat/{seed}")
    requests = tuple(
        BenchRequest(source.words(rng.randint(*words), rng), new_tokens) for _ in range(n)
    )
    description = (
        f"{n} concurrent requests, prompts of {words[0]}-{words[1]} words, {new_tokens} new tokens"
    )
    return Workload("chat64", description, requests, n)


def shared_prefix(
    source: PromptSource,
    tokenizer: Tokenizer,
    n: int,
    prefix_len: int,
    new_tokens: int,
    concurrency: int,
    seed: int,
) -> Workload:
    """prefix: ``n`` requests = one ``prefix_len``-token system-style prefix + a short
    question each (no two alike); TTFT shows what a prefix cache saves."""
    rng = random.Random(f"prefix/{seed}")
    preamble = tuple(tokenizer.encode(SYSTEM_PREAMBLE, add_special_tokens=False))
    passage = source.prompt(max(prefix_len - len(preamble), 1), rng)
    prefix = (preamble + passage)[:prefix_len]
    requests = []
    for i in range(n):
        form = QUESTION_FORMS[rng.randrange(len(QUESTION_FORMS))]
        topic = QUESTION_TOPICS[rng.randrange(len(QUESTION_TOPICS))]
        question = f"\n\nQuestion {i + 1}: " + form.format(topic) + "\nAnswer:"
        ids = tuple(tokenizer.encode(question, add_special_tokens=False))
        requests.append(BenchRequest(prefix + ids, new_tokens))
    description = (
        f"{n} requests, {concurrency} at a time: one shared {prefix_len}-token prefix + a short "
        f"question each, {new_tokens} new tokens"
    )
    return Workload("prefix", description, tuple(requests), concurrency)


def sweep(
    source: PromptSource,
    n: int,
    prompt_range: tuple[int, int],
    new_range: tuple[int, int],
    levels: Sequence[int],
    seed: int,
    rate: float | None = None,
) -> list[Workload]:
    """``n`` requests of the same lengths at each concurrency level in ``levels`` (fresh text
    at each level, so a prefix cache cannot replay the previous level)."""
    arrivals = f", Poisson arrivals at {rate:g} req/s" if rate else ""
    description = (
        f"{n} requests, prompts {prompt_range[0]}-{prompt_range[1]} tokens, "
        f"{new_range[0]}-{new_range[1]} new tokens{arrivals}"
    )
    return [
        Workload(
            "sweep",
            description,
            mixed_requests(source, n, prompt_range, new_range, f"sweep/{seed}"),
            c,
            rate,
        )
        for c in levels
    ]


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
    """The token ids of ``messages`` rendered for the assistant's reply: the tokenizer's chat
    template with its generation prompt, or, for a tokenizer without one, ``Role: content``
    paragraphs ending in ``Assistant:``."""
    if isinstance(tokenizer, ChatTokenizer) and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
    else:
        paragraphs = [f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages]
        text = "".join(paragraphs) + "Assistant:"
    return tuple(tokenizer.encode(str(text), add_special_tokens=False))


def _salt(rng: random.Random) -> str:
    """``Session 1f2e3d4c.``: the start that makes a prompt's first tokens its own."""
    return f"Session {rng.getrandbits(32):08x}."


@functools.cache
def edit_sources(lines: tuple[int, int] = EDIT_LINES) -> tuple[tuple[str, str], ...]:
    """``(file name, source)`` of each :data:`EDIT_MODULES` module whose source has between
    ``lines[0]`` and ``lines[1]`` lines here, in that order.

    Raises:
        RuntimeError: None of them has (a Python whose standard library moved on).
    """
    found = []
    for name in EDIT_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(".py"):
            continue
        try:
            text = Path(origin).read_text(encoding="utf-8")
        except OSError:
            continue
        if lines[0] <= len(text.splitlines()) <= lines[1]:
            found.append((Path(origin).name, text))
    if not found:
        raise RuntimeError(f"no module of {EDIT_MODULES} has {lines[0]}-{lines[1]} lines here")
    return tuple(found)


def defined_names(source: str) -> list[str]:
    """The functions, classes and methods a module defines (dunders left out), sorted."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    tree = ast.parse(source)
    names = {n.name for n in ast.walk(tree) if isinstance(n, kinds)}
    return sorted(name for name in names if not name.startswith("__"))


def edit(tokenizer: Tokenizer, n: int, new_tokens: int, concurrency: int, seed: int) -> Workload:
    """edit: ``n`` requests to change a standard-library file (type hints, a rename, the
    missing docstrings) and return it whole; each carries the file as its ``prediction``."""
    rng = random.Random(f"edit/{seed}")
    sources = edit_sources()
    requests = []
    for _ in range(n):
        path, text = sources[rng.randrange(len(sources))]
        instruction = EDIT_INSTRUCTIONS[rng.randrange(len(EDIT_INSTRUCTIONS))]
        if "{old}" in instruction:
            old = rng.choice(defined_names(text))
            instruction = instruction.format(old=old, new=f"{old}_{rng.choice(RENAME_SUFFIXES)}")
        user = (
            f"Here is `{path}`:\n\n```python\n{text}```\n\n{instruction} "
            "Return the whole file in one ```python block."
        )
        messages = [
            {"role": "system", "content": f"{_salt(rng)} {EDIT_SYSTEM}"},
            {"role": "user", "content": user},
        ]
        requests.append(BenchRequest(chat_prompt(tokenizer, messages), new_tokens, text))
    low, high = EDIT_LINES
    description = (
        f"{n} requests, {concurrency} at a time: a {low}-{high}-line standard-library file "
        f"and an edit to make to it, {new_tokens} new tokens; the file is the prediction"
    )
    return Workload("edit", description, tuple(requests), concurrency)


@dataclass(frozen=True)
class MappedModule:
    """One file of a repository map.

    Args:
        path: ``package/module.py``.
        lines: Its lines in the map: the path, then its classes, functions and methods.
        functions: ``(name, parameters)`` of its public top-level functions that take no
            ``*args``, ``**kwargs`` or keyword-only parameters.
    """

    path: str
    lines: tuple[str, ...]
    functions: tuple[tuple[str, str], ...]


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{keyword} {node.name}({ast.unparse(node.args)})"


@functools.cache
def package_map(package: str) -> tuple[MappedModule, ...]:
    """The repository map of a standard-library package: each module (sorted by path) with
    its class and function signatures, read with :mod:`ast`."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return ()
    root = Path(spec.origin).parent
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    modules = []
    for file in sorted(root.rglob("*.py")):
        path = f"{package}/{file.relative_to(root).as_posix()}"
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        lines, public = [path], []
        for node in tree.body:
            if isinstance(node, functions):
                lines.append("    " + _signature(node))
                a = node.args
                if not (node.name.startswith("_") or a.vararg or a.kwarg or a.kwonlyargs):
                    public.append((node.name, ast.unparse(a)))
            elif isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                lines.append(f"    class {node.name}" + (f"({bases})" if bases else ""))
                lines += ["        " + _signature(m) for m in node.body if isinstance(m, functions)]
        if len(lines) > 1:
            modules.append(MappedModule(path, tuple(lines), tuple(public)))
    return tuple(modules)


def agent_system_prompt(
    tokenizer: Tokenizer, tokens: int, package: int, salt: str
) -> tuple[str, list[MappedModule]]:
    """The agent's system prompt, and the modules its map shows (whole or in part).

    The prompt is ``salt``, instructions, :data:`AGENT_TOOLS` (one JSON object a line) and
    the repository map of ``AGENT_PACKAGES[package]`` (then of the packages after it), ending
    at the first whole line that brings it to ``tokens`` tokens (at least one line of map).
    """
    tools = "\n".join(json.dumps(tool) for tool in AGENT_TOOLS)
    head = f"{salt} {AGENT_SYSTEM}\n\n# Tools\n\n{tools}\n\n# Repository map\n\n"

    def text() -> str:
        return head + "".join(line + "\n" for line in lines)

    lines: list[str] = []
    shown: list[MappedModule] = []
    estimate = len(tokenizer.encode(head, add_special_tokens=False))
    order = AGENT_PACKAGES[package:] + AGENT_PACKAGES[:package]
    for module in (m for name in order for m in package_map(name)):
        shown.append(module)
        for line in module.lines:
            if estimate >= tokens and lines:
                # Lines counted alone overestimate a little: count the whole text, go on if short.
                estimate = len(tokenizer.encode(text(), add_special_tokens=False))
                if estimate >= tokens:
                    return text(), shown
            lines.append(line)
            estimate += len(tokenizer.encode(line + "\n", add_special_tokens=False))
    return text(), shown


def agent(
    tokenizer: Tokenizer, conversations: int, system_tokens: int, new_tokens: int, seed: int
) -> Workload:
    """agent: ``conversations`` of four turns, one request at a time. A turn's prompt is the
    system prompt (:func:`agent_system_prompt`), the earlier turns' questions and pre-written
    answers, and its own question: turns 2-4 extend the turn before."""
    rng = random.Random(f"agent/{seed}")
    requests = []
    for _ in range(conversations):
        package = rng.randrange(len(AGENT_PACKAGES))
        system, shown = agent_system_prompt(tokenizer, system_tokens, package, _salt(rng))
        # The turns are about a function of the package, one the map shows if it shows any.
        modules = package_map(AGENT_PACKAGES[package])
        mapped = [m for m in modules if m.functions and m in shown]
        home = rng.choice(mapped or [m for m in modules if m.functions])
        func, args = rng.choice(home.functions)
        fill = {
            "func": func,
            "args": args,
            "args_timeout": f"{args}, timeout=None" if args else "timeout=None",
            "path": home.path,
            "other": rng.choice([m for m in modules if m is not home] or [home]).path,
            "stem": Path(home.path).stem.strip("_") or "module",
        }
        messages = [{"role": "system", "content": system}]
        for turn, question in enumerate(AGENT_QUESTIONS):
            messages.append({"role": "user", "content": question.format(**fill)})
            ids = chat_prompt(tokenizer, messages)
            requests.append(BenchRequest(ids, new_tokens, label=f"turn {turn + 1}"))
            if turn < len(AGENT_ANSWERS):
                messages.append(
                    {"role": "assistant", "content": AGENT_ANSWERS[turn].format(**fill)}
                )
    turns = len(AGENT_QUESTIONS)
    description = (
        f"{conversations} conversation{'s' if conversations > 1 else ''} of {turns} turns, "
        "one request at a time: a "
        f"~{system_tokens}-token system prompt ({len(AGENT_TOOLS)} tool schemas, a repository "
        f"map), the turns before and a short question, {new_tokens} new tokens; turns 2-{turns} "
        "extend the turn before (their TTFT p50 is reported alone)"
    )
    labels = tuple(f"turn {t}" for t in range(2, turns + 1))
    return Workload("agent", description, tuple(requests), 1, follow_ups=labels)


def prose(w1: Workload) -> Workload:
    """prose: W1's request again (the same prompt and length), where speculative decoding
    has hardly anything to copy: what speculation costs where it cannot help."""
    description = (
        f"W1's request again ({w1.description}); its prompt is cached when W1 ran before it "
        "on the same server"
    )
    return Workload("prose", description, w1.requests, 1)


def long(tokenizer: Tokenizer, tokens: int, new_tokens: int, seed: int) -> Workload:
    """long: one request of about ``tokens`` prompt tokens (the edit load's standard-library
    files in a seeded order, cut at a whole line, then a short question) and ``new_tokens``
    new ones: the TTFT of a long prefill."""
    rng = random.Random(f"long/{seed}")
    files = list(edit_sources())
    rng.shuffle(files)
    salt = _salt(rng)

    def prompt(body: str) -> tuple[int, ...]:
        user = f"Here are some Python modules.\n\n{body}\n{LONG_QUESTION}"
        messages = [{"role": "system", "content": f"{salt} {EDIT_SYSTEM}"}]
        return chat_prompt(tokenizer, [*messages, {"role": "user", "content": user}])

    lines = [line for path, text in files for line in (f"# {path}", *text.splitlines(), "")]

    def size(n: int) -> int:
        return len(prompt("".join(line + "\n" for line in lines[:n])))

    # The most lines that keep the prompt within `tokens` (its size grows with every line).
    low, high = 0, len(lines)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if size(mid) <= tokens else (low, mid - 1)
    lines = lines[:low]
    ids = prompt("".join(line + "\n" for line in lines))
    description = (
        f"1 request, a {len(ids)}-token prompt (standard-library modules and a question), "
        f"{new_tokens} new tokens: its TTFT is the long prefill's"
    )
    return Workload("long", description, (BenchRequest(ids, new_tokens),), 1)


def build_workloads(
    tokenizer: Tokenizer,
    names: Sequence[str],
    scale: str = "full",
    seed: int = 0,
    concurrency: Sequence[int] | None = None,
    rate: float | None = None,
) -> list[Workload]:
    """The named workloads (from :data:`WORKLOAD_NAMES`) at a scale, in that order.

    Every workload is built, in a fixed order, and the named ones are returned: a workload's
    prompts are then the same whichever others run with it.

    Raises:
        ValueError: An unknown workload or scale name.
    """
    if scale not in SCALE_SIZES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    unknown = set(names) - set(WORKLOAD_NAMES)
    if unknown:
        raise ValueError(
            f"unknown workloads: {', '.join(sorted(unknown))} (use {', '.join(WORKLOAD_NAMES)})"
        )
    s = SCALE_SIZES[scale]
    source = PromptSource(tokenizer)
    levels = tuple(concurrency) if concurrency else s.concurrency
    w1 = single(source, s.w1_prompt, s.w1_new, seed)
    built: dict[str, list[Workload]] = {
        "w1": [w1],
        "w2": [mixed(source, s.w2_requests, s.w2_prompt, s.w2_new, seed, rate)],
        "w2serial": [serial(source, s.w2_requests, s.w2_prompt, s.w2_new, seed)],
        "chat64": [chat(source, s.chat_requests, s.chat_words, s.chat_new, seed)],
        "prefix": [
            shared_prefix(
                source,
                tokenizer,
                s.prefix_requests,
                s.prefix_len,
                s.prefix_new,
                s.prefix_concurrency,
                seed,
            )
        ],
        "sweep": sweep(source, s.sweep_requests, s.sweep_prompt, s.sweep_new, levels, seed, rate),
        "edit": [edit(tokenizer, s.edit_requests, s.edit_new, s.edit_concurrency, seed)],
        "agent": [agent(tokenizer, s.agent_conversations, s.agent_system, s.agent_new, seed)],
        "prose": [prose(w1)],
        "long": [long(tokenizer, s.long_prompt, s.long_new, seed)],
    }
    return [w for name in WORKLOAD_NAMES if name in names for w in built[name]]
