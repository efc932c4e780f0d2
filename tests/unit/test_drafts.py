"""Draft sources and the plan of how many draft tokens a step verifies."""

from __future__ import annotations

from infer.engine.block_manager import BlockManager
from infer.engine.speculative import Corpus, DraftState, Speculator


def test_a_prediction_is_copied_from_where_the_answer_matches_it() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    corpus = Corpus(prediction)
    assert corpus.propose([1, 2, 11, 12], 3) == [13, 14, 15]
    # The copy goes on from where it stopped once the answer kept it...
    assert corpus.propose([1, 2, 11, 12, 13, 14], 8) == [15, 16, 17]
    # ...and a sequence that matches nothing gets no draft.
    assert corpus.propose([1, 2, 3, 4], 4) == []


def test_the_request_own_tokens_draft_where_their_end_was_seen_before() -> None:
    corpus = Corpus()
    sequence = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert corpus.propose(sequence, 2) == [8, 9]
    sequence += [8, 9, 3]
    assert corpus.propose(sequence, 2) == []  # (9, 3) and (8, 9, 3) were never followed
    sequence += [5, 6]
    # (3, 5, 6) is new; (5, 6) was followed by 7
    assert corpus.propose(sequence, 4) == [7, 8, 9, 1]


def test_the_prediction_drafts_first_then_the_request_own_tokens() -> None:
    state = DraftState(prediction=[20, 21, 22, 23])
    assert state.propose([1, 20, 21], 2) == [22, 23]
    assert state.source == "prediction"
    state.record(drafted=2, kept=1)
    assert state.propose([7, 8, 9, 7, 8], 1) == [9]
    assert state.source == "prompt"
    state.record(drafted=1, kept=1)
    assert (state.accepted_prediction, state.rejected_prediction) == (1, 1)


def test_acceptance_follows_what_a_request_keeps() -> None:
    state = DraftState()
    state.source = "prompt"
    start = state.acceptance
    for _ in range(5):
        state.record(drafted=8, kept=8)
    assert state.acceptance > 0.9 > start
    for _ in range(10):
        state.record(drafted=4, kept=0)
    assert state.acceptance < 0.2
    assert state.model.rate == 0.7  # a draft model's drafts are counted apart


def test_drafts_run_where_they_pay_and_not_in_a_full_batch() -> None:
    spec = Speculator(max_tokens=16, row_cost=0.13)
    alone_copying = spec.plan([(0.95, 16, 1.0)], rows=1)
    alone_unsure = spec.plan([(0.3, 16, 1.0)], rows=1)
    assert alone_copying[0] >= 8
    assert 0 < alone_unsure[0] <= 2
    assert spec.plan([(0.5, 16, 1.0)] * 64, rows=64) == [0] * 64
    # A request whose draft is short gets no more rows than its draft has.
    assert spec.plan([(0.95, 3, 1.0)], rows=1) == [3]
    assert Speculator(max_tokens=0, row_cost=0.13).plan([(0.99, 16, 1.0)], rows=1) == [0]


def test_a_costly_draft_model_drafts_less_than_copied_text() -> None:
    spec = Speculator(max_tokens=16, row_cost=0.18)
    copied, modelled = spec.plan([(0.9, 16, 1.0)], rows=1), spec.plan([(0.9, 16, 4.0)], rows=1)
    assert 0 < modelled[0] < copied[0]
    assert spec.plan([(0.9, 16, 1.0), (0.9, 16, 4.0)] * 8, rows=16)[1::2] == [0] * 8


def test_trim_gives_back_the_blocks_past_the_kept_tokens() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.match_prefix("r", [1, 2, 3])
    assert blocks.ensure("r", 13)  # 4 blocks: 3 of them for a draft
    assert blocks.num_free == 4
    blocks.trim("r", 5)
    assert len(blocks.table("r")) == 2 and blocks.num_free == 6
