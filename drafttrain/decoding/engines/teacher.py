"""A target that answers from a sequence it already decoded: greedy decoding without the target.

A greedy decode's verdicts are fixed by the target's own greedy continuation: a drafted node is
accepted exactly when its path spells the continuation, and the target's argmax there is the
continuation's next token. So once the target's greedy continuation of a prompt is known (one real
decode) and its hidden states along it (ONE teacher-forced forward over prompt + continuation), any
greedy drafter decodes that prompt again at the cost of its own work alone: `TeacherForcedLM`
answers every forward from them. A planner's acceptance recordings do this (`evaluation.plan`):
EAGLE-3's plan on Gemma-3 (2 CPU cores) verified 64-node trees through the 270M target step after
step, once per top-k weighed, and that was most of its 607 s.

What a verified row gets: at position p (the cache's length plus the row's depth), the
sequence's token at p + 1 as its argmax, and the target's hidden states at p. That is the
target's own answer where the row's path follows the sequence; a row off the sequence is never
accepted whatever its argmax (its path was rejected at the row that left the sequence, and so
every row below it), so its answer is never read. Past the sequence's end (a step that accepted
the EOS it ended with: the decode stops there) the argmax is the sequence's last token: any token
would do, but it must be one, since the drafter is fed the step's bonus token before the loop
stops. Its logits carry their argmax only (`ArgmaxLogits`): greedy verdicts read nothing else, and a
262k-token vocabulary's rows would cost what the replay saves. Greedy only: sampling reads the
target's distributions. The hidden states come from one forward over the whole sequence rather than
step by step: equal up to rounding.
"""

from __future__ import annotations

import torch

from .base import CachedLM, select_hidden


class ArgmaxLogits:
    """Logits of which only the argmax is known: what `verify.GreedyVerdict` and `Greedy.tree` read."""

    def __init__(self, argmax: torch.Tensor):
        self._argmax = argmax

    def argmax(self, dim: int = -1) -> torch.Tensor:
        if dim not in (-1, 1):
            raise ValueError("teacher-forced logits know their argmax over the vocabulary only")
        return self._argmax


class TeacherForcedLM(CachedLM):
    """The target along one known sequence (prompt + its greedy continuation, EOS included):
    `hidden` [len(sequence), ...] holds its `layers` at every position (None: no layers)."""

    engine = "teacher-forced"

    def __init__(self, model, sequence: list[int], hidden: torch.Tensor | None = None, layers: tuple[int, ...] = ()):
        self.model = model
        self.device = next(model.parameters()).device
        self.sequence = torch.tensor(list(sequence) + list(sequence[-1:]), dtype=torch.long, device=self.device)
        self.hidden, self.layers = hidden, tuple(layers)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def forward(self, tokens: torch.Tensor, *, tree=None, hidden_layers: tuple[int, ...] = ()):
        if tuple(hidden_layers) not in ((), self.layers):
            raise ValueError(f"a teacher-forced target built with layers {self.layers} was asked for {hidden_layers}")
        n = tokens.numel()
        depths = torch.arange(n, device=self.device) if tree is None else tree.depths  # a chain, a prefill: in a row
        last = self.sequence.numel() - 1
        positions = (self.length + depths).clamp(max=last)
        argmax = self.sequence[(positions + 1).clamp(max=last)]
        self.length += n
        hidden = None
        if hidden_layers:
            hidden = self.hidden.index_select(0, positions.clamp(max=self.hidden.shape[0] - 1))
        return ArgmaxLogits(argmax), hidden

    def rollback(self, length: int) -> None:
        self._check_rollback(length)
        self.length = length

    def known_continuation(self, past: int, n: int) -> list[int]:
        real = self.sequence.numel() - 1  # the last token is repeated past the end
        return self.sequence[past + 1:min(past + 1 + n, real)].tolist()

    def compact(self, past_len: int, nodes, path=None) -> None:
        """The kept path is the sequence's own tokens at the next positions: only the length moves."""
        self.length = past_len + len(nodes)


@torch.inference_mode()
def teacher_forced(model, sequence: list[int], layers: tuple[int, ...] = ()) -> TeacherForcedLM:
    """`TeacherForcedLM` of `sequence`, its hidden `layers` (transformers' `output_hidden_states`
    indexing) from one forward of `model` over it, logits for the last position only."""
    hidden = None
    if layers:
        device = next(model.parameters()).device
        out = model(input_ids=torch.tensor([sequence], device=device), output_hidden_states=True, logits_to_keep=1)
        hidden = select_hidden([h[0] for h in out.hidden_states], tuple(layers))
    return TeacherForcedLM(model, sequence, hidden, layers)


__all__ = ["ArgmaxLogits", "TeacherForcedLM", "teacher_forced"]
