"""Sampler tests on small hand-made logits."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from infer import kernels
from infer.engine.params import SamplingParams
from infer.engine.sampler import (
    _sample_row,
    apply_repetition_penalty,
    make_generator,
    sample,
    sample_token,
    token_logprobs,
)
from support.reference import apply_top_k, apply_top_p, sampling_probs


@pytest.fixture(autouse=True, params=kernels.runnable_isas())
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here on each kernel target this CPU runs: its own, and the AVX2 builds
    laptops run (whose sampling kernel takes the portable path)."""
    monkeypatch.setattr(kernels, "ops", lambda: kernels.ops_for(request.param))
    return str(request.param)


GREEDY = SamplingParams(temperature=0.0)
V = 32


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    """Smooth-ish logits so that sampling has real choices to make."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen)


def draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """``n`` draws from one row with the request's own seeded generator."""
    gen = make_generator(params.seed)
    return [sample_token(logits, params, gen) for _ in range(n)]


def entropy(probs: torch.Tensor) -> float:
    nz = probs[probs > 0]
    return float(-(nz * nz.log()).sum())


# --- SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("temperature", -0.1),
        ("temperature", 100.5),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("stop", ["a"] * 9),
        ("stop", [""]),
        ("stop", "a"),
        ("stop", [3]),
        ("logprobs", -1),
        ("logprobs", 21),
        ("seed", 2**64),
    ],
)
def test_invalid_params_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.checked(**{field: value})


def test_valid_params_edges() -> None:
    p = SamplingParams.checked(
        max_new_tokens=1,
        temperature=100.0,
        top_p=1.0,
        top_k=0,
        stop=["a"] * 8,
        logprobs=20,
        seed=-1,
    )
    assert p.stop == ["a"] * 8
    assert SamplingParams().stop == [] and SamplingParams().stop is not SamplingParams().stop
    from_tuple = SamplingParams.checked(stop=("x", "y"))
    assert from_tuple.stop == ["x", "y"]


def test_make_generator() -> None:
    assert make_generator(None) is None
    gen = make_generator(1234)
    assert isinstance(gen, torch.Generator) and gen.initial_seed() == 1234


# --- greedy -----------------------------------------------------------------------------


def test_greedy_picks_argmax() -> None:
    logits = random_logits(6)
    expected = logits.argmax(dim=-1).tolist()
    assert sample(logits, [GREEDY] * 6, [None] * 6, [[]] * 6) == expected
    assert sample(logits.bfloat16(), [GREEDY] * 6, [None] * 6, [[]] * 6) == (
        logits.bfloat16().argmax(dim=-1).tolist()
    )
    assert sample_token(logits[2], GREEDY) == expected[2]


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(20, seed=3)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(20)]
    gens = [make_generator(p.seed) for p in params]
    assert sample(logits, params, gens, [[]] * 20) == logits.argmax(dim=-1).tolist()


# --- seeded sampling -------------------------------------------------------------------


def test_same_seed_same_sequence() -> None:
    logits = random_logits(1)[0]
    a = draw(logits, SamplingParams(seed=7), 50)
    b = draw(logits, SamplingParams(seed=7), 50)
    c = draw(logits, SamplingParams(seed=8), 50)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # it really sampled


def test_batch_invariance_of_a_seeded_row() -> None:
    """A seeded row gives the same tokens alone and next to greedy and sampled rows."""
    steps = 30
    step_logits = [random_logits(4, seed=100 + t) for t in range(steps)]
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=42)
    others = [
        GREEDY,
        SamplingParams(temperature=1.2, seed=5),
        SamplingParams(temperature=0.7, top_p=0.5),  # global RNG, unseeded
    ]

    gen = make_generator(target.seed)
    alone: list[int] = [1, 2, 3]  # a shared prompt
    for logits in step_logits:
        alone.append(sample(logits[2:3], [target], [gen], [alone])[0])

    params = [others[0], others[1], target, others[2]]
    gens = [make_generator(p.seed) for p in params]
    histories: list[list[int]] = [[9], [8, 8], [1, 2, 3], []]
    for logits in step_logits:
        for row, token in enumerate(sample(logits, params, gens, histories)):
            histories[row].append(token)
    assert histories[2] == alone
    assert len(set(alone[3:])) > 3


# --- the per-row pieces ---------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([0.1, 3.0, -1.0, 2.0, 2.5, 0.0])
    masked = apply_top_k(logits, 3)
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [1, 3, 4]
    assert torch.equal(masked[[1, 3, 4]], logits[[1, 3, 4]])
    assert torch.equal(apply_top_k(logits, 0), logits)
    assert torch.equal(apply_top_k(logits, 6), logits)
    # Ties at the k-th value still keep exactly k.
    assert int(torch.isfinite(apply_top_k(torch.zeros(8), 3)).sum()) == 3


def test_top_k_draws_never_leave_the_top_k() -> None:
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    counts = Counter(draw(logits, SamplingParams(temperature=2.0, top_k=3, seed=0), 600))
    assert set(counts) == {0, 1, 2}


@pytest.mark.parametrize(
    ("p", "kept"),
    [(0.3, {0}), (0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_p(p: float, kept: set[int]) -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05 in scrambled order; ids 0..3 after unscrambling.
    order = [2, 0, 3, 1]
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    masked = apply_top_p(probs.log(), p)
    kept_ids = {order[i] for i in torch.isfinite(masked).nonzero().flatten().tolist()}
    assert kept_ids == kept
    finite = torch.isfinite(masked)
    assert torch.allclose(masked[finite], probs.log()[finite])


def test_top_p_one_is_a_no_op() -> None:
    logits = random_logits(1)[0]
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def reference_top_p(logits: torch.Tensor, p: float) -> set[int]:
    """Plain-Python top-p: walk the sorted distribution until the mass reaches p."""
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])  # flat (nucleus > 256 tokens) to peaked
@pytest.mark.parametrize("p", [0.2, 0.6, 0.9])
def test_top_p_matches_reference_on_a_large_vocab(scale: float, p: float) -> None:
    logits = random_logits(1, vocab=2000, seed=int(scale * 100))[0] * scale
    masked = apply_top_p(logits, p)
    assert set(torch.isfinite(masked).nonzero().flatten().tolist()) == reference_top_p(logits, p)


def test_sampling_probs_equals_composed_pieces() -> None:
    logits = random_logits(1, vocab=500, seed=4)[0] * 3
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, repetition_penalty=1.2)
    history = [3, 7, 7, 400]
    composed = apply_repetition_penalty(logits, history, 1.2) / 0.7
    composed = torch.softmax(apply_top_p(apply_top_k(composed, 40), 0.8), dim=-1)
    assert torch.allclose(sampling_probs(logits, params, history), composed, atol=1e-6)


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    counts = Counter(draw(probs.log(), SamplingParams(seed=3), 4000))
    assert 3 not in counts
    for token, expected in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] / 4000 - expected) < 0.03


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits, [0, 1, 0, 99], 2.0)  # 99: past V, ignored
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # input untouched
    before, after = logits.softmax(-1), out.softmax(-1)
    assert after[0] < before[0] and after[1] < before[1]
    assert torch.equal(apply_repetition_penalty(logits, [0, 1], 1.0), logits)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = random_logits(1, seed=9)
    history = [1, 5, 5, 17, 31, 0]
    reference = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits.clone())
    assert torch.equal(apply_repetition_penalty(logits[0], history, penalty), reference[0])


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert sample(logits, params, [None], [[]]) == [0]
    assert sample(logits, params, [None], [[0]]) == [1]


def test_temperature_scales_entropy() -> None:
    logits = random_logits(1, seed=11)[0]
    entropies = [
        entropy(sampling_probs(logits, SamplingParams(temperature=t), [])) for t in (0.3, 1, 3)
    ]
    assert entropies[0] < entropies[1] < entropies[2]
    # The draws follow: a cold sampler repeats its favourite far more often.
    cold = Counter(draw(logits, SamplingParams(temperature=0.3, seed=1), 400))
    hot = Counter(draw(logits, SamplingParams(temperature=3.0, seed=1), 400))
    assert len(cold) < len(hot)
    assert cold.most_common(1)[0][1] > hot.most_common(1)[0][1]


def test_sampling_probs_order_and_greedy_rejected() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    # Penalty first: token 0 drops to 1.5 so top_k=2 keeps tokens 0 and 1.
    params = SamplingParams(temperature=1.0, top_k=2, repetition_penalty=2.0)
    probs = sampling_probs(logits, params, [0])
    assert (probs > 0).nonzero().flatten().tolist() == [0, 1]
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(logits, GREEDY, [])


def test_sample_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError):
        sample(random_logits(2), [GREEDY], [None], [[]])
    with pytest.raises(ValueError):
        sample(torch.zeros(V), [GREEDY], [None], [[]])
    with pytest.raises(ValueError):
        sample_token(random_logits(2), GREEDY)


# --- the CPU kernel against the torch rows ----------------------------------------------


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])  # flat (the cut beyond 8 nats) to peaked
def test_kernel_draws_the_torch_rows_tokens(scale: float) -> None:
    """On the CPU, sample() draws every non-greedy row in the kernel; the per-row torch code
    is the reference: with the same generators both draw the same tokens, step after step."""
    params = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),
        SamplingParams(temperature=0.8, top_k=40, seed=3),
        SamplingParams(temperature=1.3, top_k=200, top_p=0.8, repetition_penalty=1.3, seed=4),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=2.0, top_p=0.5, seed=5),
        SamplingParams(temperature=0.5, top_k=1, seed=6),
        SamplingParams(temperature=1.0, top_p=0.999, repetition_penalty=0.8, seed=7),
    ]
    kernel_gens = [make_generator(p.seed) for p in params]
    torch_gens = [make_generator(p.seed) for p in params]
    histories: list[list[int]] = [[5, 9, 9, 2999, 3000, -1] for _ in params]  # ids past V: ignored
    drawn = []
    for step in range(25):
        logits = random_logits(len(params), vocab=3000, seed=step) * scale
        got = sample(logits, params, kernel_gens, histories)
        want = [
            _sample_row(logits[i], p, torch_gens[i], histories[i]) for i, p in enumerate(params)
        ]
        assert got == want, f"step {step}"
        for history, token in zip(histories, got, strict=True):
            history.append(token)
        drawn.append(got)
    assert len({row[0] for row in drawn}) > 5  # it really sampled


def test_kernel_never_draws_a_banned_token() -> None:
    """-inf logits (a grammar's mask, a -100 bias after processing) are never drawn, even at
    the very top of the CDF, with or without a cut."""
    logits = random_logits(1, vocab=500, seed=2)[0]
    banned = torch.arange(0, 500, 3)
    logits[banned] = -math.inf
    for params in (
        SamplingParams(temperature=5.0),
        SamplingParams(temperature=5.0, top_p=0.999),
        SamplingParams(temperature=5.0, top_k=400),
    ):
        rows = logits.expand(64, -1).contiguous()
        uniforms = torch.linspace(0, 1 - 1e-16, 64, dtype=torch.float64)
        picked = kernels.ops().sample_rows(
            rows,
            torch.arange(64),
            torch.full((64,), params.temperature),
            torch.full((64,), params.top_k),
            torch.full((64,), params.top_p, dtype=torch.float64),
            torch.ones(64),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(65, dtype=torch.long),
            uniforms,
        )
        assert not set(picked.tolist()) & set(banned.tolist())
        assert len(set(picked.tolist())) > 20


def test_kernel_tiny_temperature_is_greedy() -> None:
    """A temperature so small that logit / t overflows to inf still picks the argmax."""
    logits = random_logits(4, vocab=1000, seed=8) * 3
    logits[3] -= 20  # all negative: logit / t overflows to -inf everywhere
    params = [SamplingParams(temperature=1e-40, seed=i) for i in range(4)]
    gens = [make_generator(p.seed) for p in params]
    assert sample(logits, params, gens, [[]] * 4) == logits.argmax(dim=-1).tolist()
    # The per-row torch code (other devices) agrees.
    assert [_sample_row(logits[i], p, gens[i], []) for i, p in enumerate(params)] == (
        logits.argmax(dim=-1).tolist()
    )


# --- logprobs --------------------------------------------------------------------------


def test_token_logprobs() -> None:
    logits = random_logits(3, seed=5).bfloat16()
    tokens = [4, 0, 31]
    out = token_logprobs(logits, tokens, 5)
    logp = torch.log_softmax(logits.float(), dim=-1)
    assert len(out) == 3
    for row, (chosen, top) in enumerate(out):
        assert math.isclose(chosen, float(logp[row, tokens[row]]), rel_tol=1e-6)
        values = [lp for _, lp in top]
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert top[0][0] == int(logp[row].argmax())
        assert all(lp <= 0 for lp in values) and sum(math.exp(lp) for lp in values) <= 1 + 1e-6
    full = token_logprobs(logits[:1], [0], V)[0][1]
    assert math.isclose(sum(math.exp(lp) for _, lp in full), 1.0, rel_tol=1e-5)
    assert token_logprobs(logits, tokens, 0) == [(c, []) for c, _ in out]
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens[:2], 1)
    with pytest.raises(ValueError):
        token_logprobs(logits, tokens, V + 1)
