"""The target's features for EAGLE-3 training: kept in memory they equal the batched online forward."""

from __future__ import annotations

import random

import pytest
import torch

from drafttrain.data.collate import pack_example, collate
from drafttrain.features import TargetFeatures
from eagle3_helpers import VOCAB, target_hidden_states, tiny_target

AUX = (1, 3, 5)


def batch_of(rows):
    packed = [pack_example(p, r, 64) for p, r in rows]
    return collate(packed, pad_id=0, align_prompts=True)


@pytest.mark.parametrize("need_final", [False, True])
def test_kept_features_equal_the_batched_forward_of_each_example(need_final):
    target = tiny_target(seed=0, dtype=torch.float64)
    rng = random.Random(0)
    rows = [([rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))],
             [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 7))]) for _ in range(5)]
    online = TargetFeatures(target, AUX, need_final=need_final, keep_in_memory=False)
    kept = TargetFeatures(target, AUX, need_final=need_final, keep_in_memory=True)
    for order in ([0, 1, 2], [2, 3, 4, 0], [4, 1]):  # examples come back in other batches, other paddings
        batch = batch_of([rows[i] for i in order]) | {"example_index": torch.tensor(order)}
        f_kept, h_kept = kept(batch)
        f_online, h_online = online(batch)
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(f_kept[real], f_online[real], rtol=1e-10, atol=1e-10)
        assert (h_kept is None) == (not need_final)
        if need_final:
            torch.testing.assert_close(h_kept[real], h_online[real], rtol=1e-10, atol=1e-10)
        # the reference: the target alone on the example, its aux hidden states side by side
        for b, i in enumerate(order):
            ids = torch.tensor([rows[i][0] + rows[i][1]])
            hs = target_hidden_states(target, ids)
            torch.testing.assert_close(f_kept[b][real[b]], torch.cat([hs[a][0] for a in AUX], -1), rtol=0, atol=0)
    assert sorted(kept.memo) == [0, 1, 2, 3, 4]


def test_a_memo_that_disagrees_with_the_batch_is_an_error():
    target = tiny_target(seed=0, dtype=torch.float64)
    kept = TargetFeatures(target, AUX, need_final=False, keep_in_memory=True)
    kept(batch_of([([5, 6, 7], [8, 9])]) | {"example_index": torch.tensor([0])})
    with pytest.raises(ValueError, match="example 0"):
        kept(batch_of([([5, 6], [8])]) | {"example_index": torch.tensor([0])})
