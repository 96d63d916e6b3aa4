"""Teacher-forced acceptance must replay real greedy speculative decoding step for step."""

import pytest
import torch
from tiny import greedy_reference, noisy_copy, tiny_lm

from drafttrain.decoding import DraftModelProposer, SpeculativeDecoder
from drafttrain.evaluation.replay import chain_accepted_lengths, tau, teacher_forced_accepted_lengths

PROMPTS = [[5, 9, 13, 7, 5, 9], [40], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]


def test_chain_rule_by_hand():
    T, F = True, False
    # K=2: step 1 accepts 2 (t=0,1) and emits 3; step 2 at t=3 rejects; step 3 at t=4 accepts 1, emits 2.
    assert chain_accepted_lengths([T, T, F, F, T, F], 2, 100) == [2, 0, 1]
    # At the length limit a step drafts at most tokens-left - 1 tokens.
    assert chain_accepted_lengths([T, T, T, T], 4, 4) == [3]
    # The target stopped (EOS last): a draft matching through the EOS emits nothing past it.
    assert chain_accepted_lengths([T, T, T], 4, 10) == [3]
    assert tau(6, [2, 0, 1]) == pytest.approx(6 / 3)
    assert tau(3, [3]) == 3.0  # matched through the EOS: 3 tokens in one step, not accepted + 1


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("scale", [0.05, 0.2])
def test_equals_the_decoders_accepted_lengths(k, scale):
    target = tiny_lm(0)
    draft = noisy_copy(target, scale=scale)
    steps = 0
    for prompt in PROMPTS:
        for max_new, eos in ((25, set()), (30, None)):
            output = greedy_reference(target, prompt, max_new)
            if eos is None:  # an EOS inside the output: the target stops there
                eos = {output[13]}
                output = greedy_reference(target, prompt, max_new, eos=output[13])
            decoder = SpeculativeDecoder(target, DraftModelProposer(draft, 64, 0.0, 1.0, None),
                                         num_draft_tokens=k, eos_token_ids=eos)
            real = decoder.generate(prompt, max_new)
            assert real.tokens == output
            replay = teacher_forced_accepted_lengths(draft, prompt, output, num_draft_tokens=k,
                                                     max_new_tokens=max_new)
            assert replay == real.accepted_lengths
            steps += len(replay)
            assert any(replay) or scale > 0.1
    assert steps > 0
