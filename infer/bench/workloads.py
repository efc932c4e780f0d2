"""Seeded, reproducible benchmark workloads cut from a fixed public-domain text.

Every prompt is a window of exact token length over the model's tokenization of
:data:`SOURCE_TEXT` (read cyclically, from a seeded random offset), so the same seed gives the
same token ids on every machine with no downloads. Every request is greedy with EOS ignored:
each system under test then generates exactly the same number of tokens for it.

Servers cache prompt prefixes (infer and vLLM both do by default), so no two prompts of a run
start at the same place in the text: a round (a workload, a sweep level) cannot reuse blocks
of an earlier round's prompts. The one deliberate exception is the ``prefix`` workload, whose
requests share one long system-style prefix: it measures what prefix caching saves.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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
WORKLOAD_NAMES = ("w1", "w2", "w2serial", "chat64", "prefix", "sweep")
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


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request: exact prompt token ids and exactly this many new tokens (EOS ignored)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int


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
    """

    name: str
    description: str
    requests: tuple[BenchRequest, ...]
    concurrency: int
    rate: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)


@dataclass(frozen=True)
class Scale:
    """The sizes of the workloads at one scale (``full``: the specified sizes).

    ``chat_*`` size the chat-sized load (all requests in flight at once; prompts counted in
    words of the source text), ``prefix_*`` the shared-prefix load (``prefix_len`` tokens
    shared, then a short question; ``prefix_concurrency`` requests in flight).
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


# full: W1, W2, chat64 and prefix at their specified sizes; the sweep's 64
# requests are kept short so that its concurrency-1 pass stays within minutes. quick: a few
# minutes for everything on 2 busy cores. smoke: seconds; checks the pipeline (the test suite
# runs it), measures nothing.
SCALE_SIZES = {
    "full": Scale(256, 256, 16, (32, 1024), (64, 256), 64, (32, 512), (16, 64), (1, 4, 16, 64)),
    "quick": Scale(
        128,
        32,
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
    ),
    "smoke": Scale(16, 4, 2, (8, 32), (2, 4), 2, (8, 16), (2, 3), (1, 2), 4, (5, 10), 4, 3, 48, 4),
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
    built: dict[str, list[Workload]] = {
        "w1": [single(source, s.w1_prompt, s.w1_new, seed)],
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
    }
    return [w for name in WORKLOAD_NAMES if name in names for w in built[name]]
