"""What a plan measured, kept under `$DRAFTTRAIN_HOME/plans/`, so that a second identical run plans
from it in seconds (`--num-draft-tokens auto`, `--tree-nodes auto`; `--replan` measures afresh).

The key, and where each thing is kept (one JSON file per key, its name the key's hash):
- `plans/costs/<hash>.json`: what forwards and steps cost, per machine, target, engine, dtype and
  device (`costs_key`). The machine is the CPU's model name (/proc/cpuinfo), the GPU's name where
  the run is on one, torch's thread count and torch's version: what a timing depends on that stays
  put from run to run. Its entries name what was timed: the target's forwards (a verification
  curve by hidden layers, sizes and context length; a plain step; the decode loop's overhead),
  shared by every drafter that verifies the same way, and each drafter's own share (its step, a
  tree's whole step), under the drafter's identity (`drafter_identity`).
- `plans/acceptance/<hash>.json`: what calibration found, per target, drafter identity (the kind,
  its weights' fingerprint, its own settings), calibration set (by content: the encoded prompts,
  so a renamed copy is the same set and an edited one is another), the decode settings that move
  acceptance, dtype and device (`acceptance_key`). The target's own greedy continuations of the
  calibration set are kept the same way, the target alone as their drafter.

A changed checkpoint, calibration file or target is another key, so another file, measured afresh;
nothing is ever looked up by path. A target or drafter given as a hub id has no fingerprint here:
what depends on it is measured every time. Each file is {"key": ..., "entries": {name: {"measured_at":
ISO time, "value": ...}}}, replaced whole after each new entry (`fileio.atomic_write_text`: a reader
never sees half a file; two runs writing at once keep the last one's). A damaged file is one
`warning:` line, and what it held is measured again and written over it. A cache that cannot be
written is one `warning:` line too: the plan is made, and not kept.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from ..fileio import atomic_write_text
from ..home import drafttrain_home
from .report import weights_fingerprint

PLAN_CACHE_VERSION = 1  # part of every key: a planner that measures differently reads none of an older one's


def plans_home() -> Path:
    return drafttrain_home() / "plans"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict:
    """What a timing depends on that stays put between runs on one machine."""
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return {"cpu": cpu_model(), "gpu": gpu, "threads": torch.get_num_threads(), "torch": torch.__version__}


def costs_key(target_fingerprint: str, engine: str, dtype: str, device: torch.device) -> dict:
    return {"version": PLAN_CACHE_VERSION, "machine": machine(device), "target": target_fingerprint, "engine": engine,
            "dtype": dtype, "device": torch.device(device).type}


def acceptance_key(target_fingerprint: str, drafter: str, calibration: str, settings: dict, dtype: str,
                   device: torch.device) -> dict:
    return {"version": PLAN_CACHE_VERSION, "target": target_fingerprint, "drafter": drafter,
            "calibration": calibration, "settings": settings, "dtype": dtype, "device": torch.device(device).type}


def content_hash(value) -> str:
    """A short hash of any JSON value (a key, a calibration set's token ids)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


def drafter_identity(kind: str, path: str | None, settings: dict) -> str | None:
    """The drafter's name in keys: its kind, its weights' fingerprint (an export directory's
    weights, config and recorded acceptance) and `settings` (its own flags, a lookup joined, the
    tree it drafts). None where the weights cannot be fingerprinted (a hub id)."""
    weights = weights_fingerprint(path, also=("drafttrain.json",)) if path else "none"
    return None if weights is None else content_hash({"kind": kind, "weights": weights, "settings": settings})


def now() -> datetime.datetime:
    """The time, UTC, to the microsecond: a run that starts within the second another measured is
    still told apart from it (`Measurer.cached`)."""
    return datetime.datetime.now(datetime.timezone.utc)


class Store:
    """One cache file's entries: read once, and written whole after each new one. `fresh` (`--replan`):
    what the file held is not read (what this run measures is, and replaces it)."""

    def __init__(self, path: Path | None, key: dict, fresh: bool, owner: PlanCache | None = None):
        self.path, self.key, self.owner = path, key, owner
        self.entries = {} if fresh or path is None else self._read(warn=True)

    def _read(self, warn: bool) -> dict:
        """The file's entries; none where there is no file, or (one `warning:` line) a damaged one."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            entries = data["entries"]
            if data.get("key") != self.key or not all("measured_at" in e and "value" in e for e in entries.values()):
                raise ValueError("its entries are not a plan cache's")
            for entry in entries.values():
                datetime.datetime.fromisoformat(entry["measured_at"])
            return dict(entries)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if warn:
                print(f"warning: the plan cache {self.path} is damaged ({type(e).__name__}: {e}); what it held is "
                      "measured again", file=sys.stderr)
            return {}

    def get(self, name: str) -> tuple[object, datetime.datetime] | None:
        """(the value, when it was measured), or None."""
        entry = self.entries.get(name)
        return None if entry is None else (entry["value"], datetime.datetime.fromisoformat(entry["measured_at"]))

    def put(self, name: str, value) -> datetime.datetime:
        """Keep `value` under `name`, for this run and in the file; returns its time."""
        when = now()
        self.entries[name] = {"measured_at": when.isoformat(), "value": value}
        if self.path is not None and (self.owner is None or self.owner.writable):
            self._write(name)
        return when

    def _write(self, name: str) -> None:
        """The file as it is now (another run may have added to it) with this run's `name`."""
        on_disk = self._read(warn=False)
        try:
            atomic_write_text(self.path, json.dumps({"key": self.key, "entries": {**on_disk, name: self.entries[name]}}))
        except OSError as e:
            if self.owner is not None:
                self.owner.unwritable(e)


class PlanCache:
    """The run's plan cache: one `Store` per key, shared by every drafter of the run (what one
    measured, the next reads). `root` None: nothing is read or kept. `replan`: nothing is read."""

    def __init__(self, root: Path | None, replan: bool = False):
        self.root, self.replan, self.writable = root, replan, True
        self._stores: dict[str, Store] = {}

    def unwritable(self, error: OSError) -> None:
        """One `warning:` line, the first time a write fails; nothing more is written this run."""
        if self.writable:
            self.writable = False
            print(f"warning: the plan cache {self.root} cannot be written ({error.strerror or error}); this run's "
                  "plans are not kept (set DRAFTTRAIN_HOME to a directory you can write to)", file=sys.stderr)

    def costs(self, key: dict) -> Store:
        return self._store("costs", key)

    def acceptance(self, key: dict) -> Store:
        return self._store("acceptance", key)

    def _store(self, kind: str, key: dict) -> Store:
        """The store of `key`; one holding a None (a hub id's fingerprint) is this run's only."""
        name = f"{kind}/{content_hash(key)}"
        if name not in self._stores:
            known = self.root is not None and None not in _values(key)
            self._stores[name] = Store(self.root / f"{name}.json" if known else None, key, self.replan, self)
        return self._stores[name]


class Measurer:
    """One drafter's plan, measurement by measurement: each read from its store or measured (and
    kept), the time of each (the report's `cached`: all of it older than this run; `measured_at`:
    the oldest), and its progress line (a tqdm bar, or None): what is measured now, and the units
    of work done, whose rate gives the bar its estimate of the time left."""

    def __init__(self, started: datetime.datetime, bar=None):
        self.started, self.bar = started, bar
        self.times: dict[tuple, datetime.datetime] = {}  # what the plan rests on -> when it was measured

    def measured(self, store: Store, name: str, measure, what: str, units: int = 1, fresh: bool = False):
        """`store`'s `name`, else `measure()` (`fresh`: measured whatever the store holds), and kept.
        The value is what JSON makes of it either way, so a plan from the cache is the plan the same
        measurements made. Kept as measured, a busy machine's too: its plan says so again each run
        (`plan.warn_noise`), until `--replan`. `units`: its share of the progress line, ticked off by
        `tick` as the work goes, the rest when it is done."""
        found = None if fresh else store.get(name)
        before = self.bar.n if self.bar is not None else 0
        if found is None:
            self.doing(what)
            value = json.loads(json.dumps(measure()))
            when = store.put(name, value)
        else:
            value, when = found
            self.doing(f"{what} (from the plan cache)")
        self.times[(id(store), name)] = when  # measured again (`fresh`): the earlier one no longer counts
        if self.bar is not None:
            self.tick(max(0, units - (self.bar.n - before)))
        return value

    def doing(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=True)

    def tick(self, units: int = 1) -> None:
        """`units` of work done (the line's total grows where the estimate fell short)."""
        if self.bar is not None and units:
            if self.bar.total is not None and self.bar.n + units > self.bar.total:
                self.bar.total = self.bar.n + units
            self.bar.update(units)

    @property
    def cached(self) -> bool:
        """Whether everything the plan rests on was measured before this run."""
        return bool(self.times) and all(t < self.started for t in self.times.values())

    @property
    def measured_at(self) -> str | None:
        """When the oldest measurement the plan rests on was made (ISO 8601, UTC, to the second)."""
        return min(self.times.values()).replace(microsecond=0).isoformat() if self.times else None


def _values(value):
    """Every leaf of a JSON value."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _values(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _values(v)]
    return [value]


__all__ = ["PLAN_CACHE_VERSION", "Measurer", "PlanCache", "Store", "acceptance_key", "content_hash", "costs_key",
           "drafter_identity", "machine", "now", "plans_home"]
