"""Medusa decoding (batch size 1): the target drafts for itself through its Medusa heads.

Invariant (the same as `SpeculativeDecoder`'s): the target's KV cache holds the whole sequence
except its last token (`pending`), and we also hold the target's last hidden state at the last
cached position t. The heads read that state: head i guesses the token at t + 2 + i, i.e. the
token i + 1 places after `pending` (the target itself predicts the one right after `pending`
from pending's own hidden state, inside the verification pass).

Greedy (Medusa-1): the heads' top-k tokens fill a static candidate tree rooted at `pending`;
ONE target forward over all tree nodes (tree mask, per-depth positions) scores every path;
the longest path equal to the target's argmax is accepted, the cache keeps only that path
(`compact_cache`), and the target's argmax after it is the bonus token, the next `pending`.

Sampling: a chain of one token per head, d_i ~ q_i = head i's distribution, verified with the
standard rejection rule against the target's distributions at the chain positions (lossless;
q_i ignores the earlier drafts, which the rule allows). The cache keeps the accepted prefix.

Either way every emitted token comes out of a verification forward (prefill covers prompt[:-1]
and emits nothing): a step emits its accepted drafts plus one target token, so `Generation`'s
accepted_lengths count head tokens accepted per target forward, and tau = new tokens / steps.
`proposed_lengths` counts draft *positions* (the depth of the tree used), not tree nodes, so
acceptance_rate and per-position acceptance compare with chain drafters: position i is head
i - 1's token, so per-position acceptance is per-head acceptance. The tree's node count (what
the target verifies per step besides the root) is `num_tree_nodes - 1`.
"""

from __future__ import annotations

import time

import torch

from ..errors import UserError
from ..heads.model import MedusaHeads
from ..heads.tree import (
    Path,
    TreeBuffers,
    build_tree_buffers,
    chain_tree,
    compact_cache,
    default_tree,
    greedy_accept_tree,
    tree_attention_inputs,
    tree_candidates,
)
from .cache import CachedLM
from .sampling import probabilities, sample, verify_sampled
from .speculative import Generation, counted_proposals, trim_at_eos

MASKABLE_ATTENTION = ("sdpa", "eager")  # kernels that honour a custom 4-D mask


class MedusaDecoder:
    name = "medusa"

    def __init__(self, target, heads: MedusaHeads, *, tree: list[Path] | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, eos_token_ids: set[int] = frozenset(),
                 generator: torch.Generator | None = None):
        """`tree`: Medusa paths (default: DEFAULT_TREE cut to the number of heads). With
        temperature > 0 only its depth is used: the heads draft a chain that deep."""
        self.target = CachedLM(target)
        self.heads = heads
        self.temperature, self.top_p = temperature, top_p
        self.eos = set(eos_token_ids)
        self.generator = generator
        self.device = next(target.parameters()).device
        self._check_heads(target, heads)

        num_heads = heads.config.num_heads
        paths = default_tree(num_heads) if tree is None else [tuple(p) for p in tree]
        self.buffers = build_tree_buffers(paths)  # validates the paths
        if self.buffers.max_depth > num_heads:
            raise UserError(f"the Medusa tree is {self.buffers.max_depth} deep but the heads have only "
                            f"{num_heads}; pass a tree of depth <= {num_heads}")
        if temperature > 0:
            self.buffers = build_tree_buffers(chain_tree(self.buffers.max_depth))
        self.is_chain = self.buffers.paths == chain_tree(self.buffers.max_depth)
        attn = getattr(target.config, "_attn_implementation", None) or "eager"
        if not self.is_chain and attn not in MASKABLE_ATTENTION:
            raise UserError(f"tree decoding needs an attention kernel that accepts custom masks, but the "
                            f"target uses {attn!r}; load it with attn_implementation='sdpa' or use a chain tree")
        self._trees: dict[int, TreeBuffers] = {}  # depth-limited trees (for the last steps), on device

    @staticmethod
    def _check_heads(target, heads: MedusaHeads) -> None:
        vocab = target.get_output_embeddings().weight.shape[0]
        hidden = target.get_output_embeddings().weight.shape[1]
        cfg = heads.config
        if (cfg.vocab_size, cfg.hidden_size) != (vocab, hidden):
            raise UserError(f"the Medusa heads are for vocab {cfg.vocab_size} x hidden {cfg.hidden_size} but the "
                            f"target has vocab {vocab} x hidden {hidden}; use heads trained on this target")

    @property
    def tree(self) -> list[Path]:
        return list(self.buffers.paths)

    @property
    def num_draft_tokens(self) -> int:
        """K for per-position (= per-head) acceptance: the deepest path a step can accept."""
        return self.buffers.max_depth

    @property
    def num_tree_nodes(self) -> int:
        """Tokens one full-depth verification forward processes (root included)."""
        return self.buffers.num_nodes

    def _tree(self, depth: int) -> TreeBuffers:
        """The tree cut to `depth` (prefix-closed), so no step drafts past max_new_tokens."""
        depth = min(depth, self.buffers.max_depth)
        if depth not in self._trees:
            paths = [p for p in self.buffers.paths if len(p) <= depth]
            self._trees[depth] = build_tree_buffers(paths).to(self.device)
        return self._trees[depth]

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _head_logits(self, hidden: torch.Tensor, num: int) -> torch.Tensor:
        """Logits [num, V] of the first `num` heads at one position."""
        weight = self.heads.lm_heads[0].weight
        hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        with torch.inference_mode():
            logits = torch.stack([self.heads.forward_head(i, hidden) for i in range(num)])
        return logits.to(self.device)

    def _greedy_step(self, pending: torch.Tensor, hidden: torch.Tensor, tree: TreeBuffers):
        """One tree verification. Returns (draft tokens accepted, bonus token, new hidden state)."""
        past = self.target.length
        topk = self._head_logits(hidden, tree.max_depth).topk(tree.topk, dim=-1).indices
        tokens = tree_candidates(pending, topk, tree)
        if self.is_chain:  # a chain is causal: the model's own mask and positions are right
            mask = positions = None
        else:
            mask, positions = tree_attention_inputs(tree, past, self.device, self.target.model.dtype)
        logits, states = self.target.forward(tokens, hidden_states=True, attention_mask=mask,
                                             position_ids=positions)
        nodes, accepted, bonus = greedy_accept_tree(tokens, logits.argmax(dim=-1), tree)
        compact_cache(self.target.cache, past, nodes)
        self.target.length = past + len(nodes)
        return accepted, bonus, states[nodes[-1]]

    def _sampled_step(self, pending: torch.Tensor, hidden: torch.Tensor, depth: int):
        q = probabilities(self._head_logits(hidden, depth), self.temperature, self.top_p)  # [k, V]
        draft = sample(q, self.generator)
        logits, states = self.target.forward(torch.cat([pending, draft]), hidden_states=True)
        p = probabilities(logits, self.temperature, self.top_p)
        verdict = verify_sampled(draft, q, p, self.generator).tolist()  # the step's host sync
        n = verdict[0]
        self.target.rollback(self.target.length - (depth - n))
        return verdict[1:n + 1], verdict[n + 1], states[n]

    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        out = Generation()
        start = time.perf_counter()
        self.target.reset()
        hidden = None  # the target's last hidden state at the last cached position
        if len(prompt) > 1:
            _, states = self.target.forward(torch.tensor(prompt[:-1], dtype=torch.long, device=self.device),
                                            hidden_states=True)
            hidden = states[-1]
        pending = torch.tensor(prompt[-1:], dtype=torch.long, device=self.device)
        self._sync()
        out.prefill_seconds = time.perf_counter() - start

        while len(out.tokens) < max_new_tokens:
            step_start = time.perf_counter()
            # At most `depth` drafts + 1 target token per step: never draft past the budget.
            depth = min(self.num_draft_tokens, max_new_tokens - len(out.tokens) - 1)
            if hidden is None:  # a one-token prompt: nothing for the heads to read yet
                depth = 0
            if depth == 0:
                logits, states = self.target.forward(pending, hidden_states=True)
                last = logits[-1]
                if self.temperature == 0:
                    token = last.argmax()
                else:
                    token = sample(probabilities(last, self.temperature, self.top_p), self.generator)
                accepted, bonus, hidden = [], int(token), states[-1]
            elif self.temperature == 0:
                accepted, bonus, hidden = self._greedy_step(pending, hidden, self._tree(depth))
            else:
                accepted, bonus, hidden = self._sampled_step(pending, hidden, depth)
            emitted = trim_at_eos(accepted + [bonus], self.eos)
            out.tokens.extend(emitted)
            out.accepted_lengths.append(min(len(accepted), len(emitted)))
            out.proposed_lengths.append(counted_proposals(depth, emitted, self.eos))
            out.step_tokens.append(len(emitted))
            out.step_seconds.append(time.perf_counter() - step_start)
            if emitted[-1] in self.eos:
                break
            pending = torch.tensor(emitted[-1:], dtype=torch.long, device=self.device)
        return out
