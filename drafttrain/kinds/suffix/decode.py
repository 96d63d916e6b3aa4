"""Suffix lookup (SuffixDecoding, Oliaro et al. 2024; vLLM's `suffix` method, ArcticInference):
draft the most frequent continuation of the longest suffix of the text that occurred before.

No model. The prompt and the answer so far are kept in a suffix trie cut at `max_depth` tokens:
a node per distinct run of at most `max_depth` tokens, counting how often it occurred. Each new
token extends the runs that end where it lands (one node per depth: `max_depth` updates a token,
no rebuild). To draft, every suffix of the text up to `max_depth` tokens long is a node already
(the ones the last token extended), and from each one that has a continuation the lookup walks
down the most frequent child (ties: the most recent) while the walk's probability, the product
of child count / parent count, stays at least `min_token_prob`, and at most `spec_factor` times
the matched length. Of these chains it keeps the one with the largest expected number of
accepted tokens (the sum of the walk's probabilities; ties: the longer match).

Unlike n-gram lookup (the latest match of a suffix of at most 3 tokens), a long match is trusted
further and a frequent continuation wins over a recent one. The draft is deterministic, so the
chain rule keeps sampling exact (q one-hot); greedy, its chain may also be hung from a model
drafter's tree (`+suffix`, `hybrid.py`).
"""

from __future__ import annotations

import torch

from ...decoding.chain import Proposer
from ...decoding.engines import device_tensor


MAX_DEPTH = 24         # vLLM's suffix_decoding_max_tree_depth
SPEC_FACTOR = 1.0      # vLLM's suffix_decoding_max_spec_factor: drafts per matched token, at most
MIN_TOKEN_PROB = 0.1   # vLLM's suffix_decoding_min_token_prob


class _Node:
    """A run of tokens in the trie: how often it occurred, where it last ended, what followed."""

    __slots__ = ("count", "last", "children")

    def __init__(self):
        self.count, self.last, self.children = 0, -1, {}


class SuffixTrie:
    """Every run of at most `max_depth` consecutive tokens of one sequence, counted."""

    def __init__(self, max_depth: int = MAX_DEPTH):
        if max_depth < 1:
            raise ValueError(f"a suffix trie needs max_depth >= 1, got {max_depth}")
        self.max_depth, self.root, self.length = max_depth, _Node(), 0
        self.open: list[_Node] = []  # open[d]: the node of the last d + 1 tokens, d < max_depth

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """One more token: each run ending at the token before, one token longer (and the token alone)."""
        grown = []
        for node in [self.root, *self.open[:self.max_depth - 1]]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            child.last = self.length
            grown.append(child)
        self.open = grown
        self.length += 1

    def continuation(self, node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent walk below `node` (ties: the latest), at most `limit` tokens, while its
        probability stays at least `min_prob`; and its score, the sum of those probabilities."""
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < limit and node.children:
            token, child = max(node.children.items(), key=lambda item: (item[1].count, item[1].last))
            prob *= child.count / node.count
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return tokens, score

    def lookup(self, k: int, spec_factor: float = SPEC_FACTOR, min_prob: float = MIN_TOKEN_PROB) -> list[int]:
        """Up to `k` tokens after the text: the best continuation over every suffix match."""
        best, best_score = [], 0.0
        for matched, node in enumerate(self.open, start=1):  # the text's last `matched` tokens
            limit = min(k, int(matched * spec_factor + 1e-6))
            tokens, score = self.continuation(node, limit, min_prob) if limit > 0 else ([], 0.0)
            if score >= best_score and tokens:
                best, best_score = tokens, score
        return best


class SuffixProposer(Proposer):
    """Suffix lookup over the prompt and the answer so far, one trie per sequence, kept in step
    with the text it is asked about (tokens it has not seen are added; a new prompt starts anew)."""

    name = "suffix"

    def __init__(self, device, max_depth: int = MAX_DEPTH, spec_factor: float = SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB):
        self.device = torch.device(device)
        self.max_depth, self.spec_factor, self.min_token_prob = max_depth, spec_factor, min_token_prob
        self.trie = SuffixTrie(max_depth)

    def reset(self, prompt, hidden=None):
        self.trie = SuffixTrie(self.max_depth)
        self.trie.extend(list(prompt))

    def lookup(self, k: int, sequence: list[int]) -> list[int]:
        """The continuation on the host (what a hybrid hangs from a model's tree)."""
        if len(sequence) < self.trie.length:  # another sequence: start anew
            self.reset(sequence)
        self.trie.extend(sequence[self.trie.length:])
        return self.trie.lookup(k, self.spec_factor, self.min_token_prob) if k > 0 else []

    def propose(self, k, sequence):
        return device_tensor(self.lookup(k, sequence), self.device), None
