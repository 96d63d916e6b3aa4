"""Exact references for the sampling tests: the target's distribution of its first two sampled
tokens (enumerated over a tiny vocabulary) and a chi-square test of samples against it."""

import numpy as np
import torch
from scipy.stats import chisquare

from drafttrain.decoding.verify import probabilities

V = 6  # the sampling tests' vocabulary: small enough to enumerate every two-token continuation


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Chi-square goodness of fit; cells with small expectation are pooled into one."""
    keys = sorted(probs, key=lambda key: -probs[key])
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for key in keys:
        e = probs[key] * n
        if e >= 5:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            rest_o += counts.get(key, 0)
            rest_e += e
    obs.append(rest_o + sum(c for key, c in counts.items() if key not in probs))
    exp.append(rest_e)
    obs, exp = np.array(obs, float), np.array(exp, float)
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # a sample fell on an outcome of probability zero
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def exact_two_token_distribution(target, prompt, temperature, top_p, vocab_size):
    with torch.no_grad():
        p1 = probabilities(target(torch.tensor([prompt])).logits[0, -1], temperature, top_p)
        out = {}
        for x in range(vocab_size):
            if p1[x] == 0:
                continue
            p2 = probabilities(target(torch.tensor([prompt + [x]])).logits[0, -1], temperature, top_p)
            for y in range(vocab_size):
                if p2[y] > 0:
                    out[(x, y)] = float(p1[x] * p2[y])
    return out


def sample_first_two(decoder, prompt, n: int) -> tuple[dict, int]:
    """`n` decodes of `prompt` (3 tokens each): the counts of their first two tokens, and the drafts
    accepted in all (a test checks some were, so the rule was exercised)."""
    counts, accepted = {}, 0
    for _ in range(n):  # one seeded generator: repeated prompts must give independent samples
        gen = decoder.generate(prompt, 3)
        counts[tuple(gen.tokens[:2])] = counts.get(tuple(gen.tokens[:2]), 0) + 1
        accepted += sum(gen.accepted_lengths)
    return counts, accepted
