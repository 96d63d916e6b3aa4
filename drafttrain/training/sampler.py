"""Data order as a pure function of (seed, epoch, position), so resumes and process counts agree.

Each epoch is a seeded permutation cut into micro-batches, dealt to the ranks in turn. So 2
processes x micro-batch 2 see the same global batches as 1 process x micro-batch 2 x 2
accumulation steps, and a resumed run skips exactly the micro-batches already consumed.
"""

from __future__ import annotations

import torch

from ..errors import UserError


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def check_enough_examples(n: int, micro_batch_size: int, world_size: int, gradient_accumulation_steps: int) -> None:
    """At least one global batch of examples (a recipe checks it before its first evaluation writes)."""
    global_batch = micro_batch_size * world_size * gradient_accumulation_steps
    if n < global_batch:
        raise UserError(f"the training set has {n} examples, fewer than one global batch of {global_batch} "
                        f"({world_size} process(es) x micro_batch_size {micro_batch_size} x "
                        f"gradient_accumulation_steps {gradient_accumulation_steps}); add prompts or make "
                        "the batch smaller")


class MicroBatches(torch.utils.data.Sampler):
    """This rank's micro-batches (lists of example indices), from its micro-batch `start` on, forever.

    An epoch is a seeded permutation of the examples, cut into whole global batches of
    world_size x gradient_accumulation_steps x micro_batch_size examples (the remainder is
    dropped, so every process count that gives the same global batch drops the same examples).
    Rank r's j-th micro-batch of an epoch holds positions [g*b, (g+1)*b) of the permutation,
    with g = j * world_size + r: with 2 processes the two ranks' j-th micro-batches are the
    1-process run's micro-batches 2j and 2j+1.
    """

    def __init__(self, n: int, micro_batch_size: int, world_size: int, rank: int, seed: int,
                 gradient_accumulation_steps: int = 1, start: int = 0):
        self.n, self.b, self.world, self.rank, self.seed, self.start = n, micro_batch_size, world_size, rank, seed, start
        check_enough_examples(n, micro_batch_size, world_size, gradient_accumulation_steps)
        global_batch = micro_batch_size * world_size * gradient_accumulation_steps
        self.per_epoch = (n // global_batch) * gradient_accumulation_steps  # this rank's micro-batches

    def __iter__(self):
        u = self.start
        while True:
            epoch, j = divmod(u, self.per_epoch)
            perm = epoch_permutation(self.n, self.seed, epoch)
            for j in range(j, self.per_epoch):
                lo = (j * self.world + self.rank) * self.b
                yield perm[lo:lo + self.b]
            u = (epoch + 1) * self.per_epoch

    def __len__(self):  # endless; the loop stops at max_steps
        return 2**62


__all__ = ["MicroBatches", "epoch_permutation"]
