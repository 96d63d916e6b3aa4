"""The processes that write the target's answers together, as the data side sees them.

A plain record of the rank, the number of processes and three collectives, so that the data
pipeline needs no accelerate: a recipe builds it from its Accelerator
(`training.distributed.answer_ranks`); a script or a test passes `SINGLE` (one process) or its own.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


def _same(obj: Any) -> Any:
    return obj


def _alone(obj: Any) -> list:
    return [obj]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    size: int = 1
    broadcast: Callable[[Any], Any] = field(default=_same, repr=False)      # the main process's obj, everywhere
    all_gather: Callable[[Any], list] = field(default=_alone, repr=False)   # every rank's obj, in rank order
    barrier: Callable[[], None] = field(default=_nothing, repr=False)
    # True when every rank must run every forward together (a target sharded across them): the
    # work is then not split, every rank computes everything and the main process writes it.
    lockstep: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def workers(self) -> int:
        """How many shares the work is split into."""
        return 1 if self.lockstep else self.size

    @property
    def share(self) -> int:
        """Which share is this process's."""
        return 0 if self.lockstep else self.rank

    def writes(self) -> bool:
        """Whether this process writes the files of its share (in lockstep only the main one does)."""
        return self.main or not self.lockstep

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """The main process runs the block first (filling a shared cache), then the others."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()


SINGLE = Ranks()

__all__ = ["Ranks", "SINGLE"]
