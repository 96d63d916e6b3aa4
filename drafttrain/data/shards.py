"""The answers written in chunks: the same chunks for any number of processes, each chunk written
atomically by the rank it falls to, the whole merged by the main process.

Why chunks and not a split of the prompts: in floating point a row's answer (and its stored
log-probs) depends on the batch it is computed in, so the batches are fixed first - the prompts
longest first, cut every `chunk_size` - and only then dealt to the ranks, chunk j to share
j mod N. Each chunk is then computed exactly as one process computes it, and the merged dataset
is the same bytes. A chunk is one file, renamed into place when complete, so a killed run
resumes chunk by chunk; `plan.json` keeps the chunk size, so a resumed run cuts the same chunks.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..fileio import atomic_write_bytes, atomic_write_json
from .batching import longest_first
from .ranks import Ranks

PLAN = "plan.json"


def chunk_name(j: int) -> str:
    return f"chunk-{j:06d}.pt"


@dataclass
class Plan:
    chunk_size: int
    how: str                                   # how the size was chosen, for the log
    seconds: float = 0.0                       # what choosing it took (a measurement)
    chunks: list[list[int]] = field(default_factory=list)  # prompt indices of each chunk
    done: set[int] = field(default_factory=set)            # chunks already written (a resumed run)


class Shards:
    """The chunk files of one cache entry, in `folder` (`<cache key>.parts`)."""

    def __init__(self, folder: Path, prompts: list[list[int]], ranks: Ranks):
        self.folder, self.prompts, self.ranks = Path(folder), prompts, ranks
        self.plan: Plan | None = None

    def make_plan(self, choose) -> Plan:
        """Collective. The main process reads the stored plan or makes one (`choose()` -> (chunk size,
        how)) and lists the written chunks; every rank gets the same plan."""
        found = None
        if self.ranks.main:
            start = time.perf_counter()
            size, how = self._stored() or choose()
            atomic_write_json(self.folder / PLAN, {"chunk_size": size, "prompts": len(self.prompts)})
            found = (size, how, time.perf_counter() - start, sorted(self.written()))
        size, how, seconds, done = self.ranks.broadcast(found)
        order = longest_first(self.prompts)
        self.plan = Plan(size, how, seconds, [order[s:s + size] for s in range(0, len(order), size)], set(done))
        return self.plan

    def _stored(self) -> tuple[int, str] | None:
        path = self.folder / PLAN
        if not path.is_file():
            return None
        stored = json.loads(path.read_text())
        if stored.get("prompts") != len(self.prompts):
            return None
        return stored["chunk_size"], "kept from the interrupted run"

    def mine(self, main_only: bool = False) -> list[int]:
        """This process's chunks still to write (in lockstep: every chunk, on every rank)."""
        workers, share = (1, 0) if main_only else (self.ranks.workers, self.ranks.share)
        if main_only and not self.ranks.main:
            return []
        return [j for j in range(share, len(self.plan.chunks), workers) if j not in self.plan.done]

    def written(self) -> set[int]:
        return {int(p.name[6:12]) for p in self.folder.glob("chunk-*.pt")} if self.folder.is_dir() else set()

    def prompts_written(self) -> int:
        return sum(len(self.plan.chunks[j]) for j in self.written() if j < len(self.plan.chunks))

    def save(self, j: int, chunk: dict) -> None:
        if self.ranks.writes():
            buffer = io.BytesIO()
            torch.save(chunk, buffer)
            atomic_write_bytes(self.folder / chunk_name(j), buffer.getvalue())

    def columns(self) -> dict[str, list]:
        """Every chunk's rows as python lists, in prompt order (the main process, once all are written)."""
        columns: dict[str, list] = {}
        for j in range(len(self.plan.chunks)):
            chunk = torch.load(self.folder / chunk_name(j), weights_only=True)
            for row, i in enumerate(chunk.pop("index").tolist()):
                for name, rows in chunk.items():
                    columns.setdefault(name, [None] * len(self.prompts))[i] = rows[row].tolist()
        return columns

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


__all__ = ["PLAN", "Plan", "Shards", "chunk_name"]
