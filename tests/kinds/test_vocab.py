"""The draft vocabulary: hand-counted frequencies, deterministic ties, d2t / t2d round trips."""

from __future__ import annotations

import pytest
import torch

from drafttrain.kinds.vocab import DraftVocab, build_draft_vocab, token_counts

# Hand count over a vocabulary of 12: token 7 x4, 3 x3, 9 x3, 1 x2, 4 x1, 11 x1; 0,2,5,6,8,10 never.
ANSWERS = [[7, 3, 7, 9], [9, 1, 7, 3], [4, 3, 9, 7, 1, 11]]


def test_counts_match_a_hand_count():
    assert token_counts(ANSWERS, 12).tolist() == [0, 2, 0, 3, 1, 0, 0, 4, 0, 3, 0, 1]


def test_most_frequent_tokens_with_ties_to_the_lower_id():
    # Top 3: 7 (4), then the tie 3 / 9 (3 each): both fit.
    assert build_draft_vocab(ANSWERS, 12, 3).target_ids.tolist() == [3, 7, 9]
    # Top 5: ..., 1 (2), then the tie 4 / 11 (1 each) goes to 4.
    assert build_draft_vocab(ANSWERS, 12, 5).target_ids.tolist() == [1, 3, 4, 7, 9]
    # More slots than seen tokens: the unseen fill in by id (0, then 2).
    assert build_draft_vocab(ANSWERS, 12, 8).target_ids.tolist() == [0, 1, 2, 3, 4, 7, 9, 11]
    # The order of the data does not matter.
    assert build_draft_vocab(ANSWERS[::-1], 12, 5).target_ids.tolist() == [1, 3, 4, 7, 9]


def test_always_included_tokens_replace_the_least_frequent():
    vocab = build_draft_vocab(ANSWERS, 12, 4, always_include=[10])  # EOS never seen in the answers
    assert vocab.target_ids.tolist() == [3, 7, 9, 10]
    assert build_draft_vocab(ANSWERS, 12, 4, always_include=[7]).target_ids.tolist() == [1, 3, 7, 9]
    with pytest.raises(ValueError):
        build_draft_vocab(ANSWERS, 12, 1, always_include=[1, 2])
    with pytest.raises(ValueError):
        build_draft_vocab(ANSWERS, 12, 13)
    with pytest.raises(ValueError):
        build_draft_vocab([[12]], 12, 3)


def test_d2t_and_t2d_follow_the_serving_convention_and_round_trip():
    vocab = build_draft_vocab(ANSWERS, 12, 5)  # target ids [1, 3, 4, 7, 9]
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [1, 2, 2, 4, 5]  # target = draft + d2t
    assert vocab.t2d.dtype == torch.bool
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 3, 4, 7, 9]
    back = DraftVocab.from_d2t(vocab.d2t, 12)
    assert torch.equal(back.target_ids, vocab.target_ids) and torch.equal(back.t2d, vocab.t2d)
    full = build_draft_vocab(ANSWERS, 12, 12)  # no reduction: the identity map
    assert full.d2t.tolist() == [0] * 12 and bool(full.t2d.all())


def test_bad_maps_are_refused():
    with pytest.raises(ValueError):
        DraftVocab(torch.tensor([3, 3, 5]), 12)
    with pytest.raises(ValueError):
        DraftVocab(torch.tensor([5, 3]), 12)
    with pytest.raises(ValueError):
        DraftVocab(torch.tensor([3, 12]), 12)
