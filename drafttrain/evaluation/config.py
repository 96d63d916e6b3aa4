"""Settings of `eval`, `compare` and `replay`: documented dataclasses from which the command-line
flags, their defaults and their `--help` text are generated, so a default lives in one place.

A field is declared with `option(default, doc, ...)`; `add_flags(parser, cls)` turns every field
into `--field-name` (type from the annotation, `(default: ...)` appended to the doc), and
`from_args(cls, args)` builds the dataclass back from the parsed namespace.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from ..decoding.defaults import NUM_DRAFT_TOKENS
from ..errors import UserError
from ..heads.tree import check_paths

TREE_CHOICES = ("auto", "default", "chain", "dynamic")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")
ENGINE_CHOICES = ("auto", "eager", "static")


def option(default=MISSING, doc: str = "", *, choices: tuple | None = None, metavar: str | None = None,
           drafter: bool = False):
    """A settings field: `doc` becomes its --help text, `choices` are checked by argparse and by
    `validate_choices`; `drafter` marks the fields that pick the drafter (`eval` only: `compare`
    takes `--drafter NAME=...` instead)."""
    if not doc:
        raise ValueError("every option needs a doc")
    return dataclasses.field(default=default, metadata={"doc": doc, "choices": choices, "metavar": metavar,
                                                       "drafter": drafter})


@dataclass(kw_only=True)
class EvalConfig:
    """One drafter against the target on held-out prompts (SPEC §2); `compare` runs several that
    differ only in the drafter and the output directory."""

    target: str = option(doc="Target model: a local directory or a hub id.", metavar="T")
    prompts: list[str] = option(doc="JSONL prompt file (SPEC §1); repeat the flag for several files.",
                                metavar="FILE")
    out: str = option(doc="Report directory. One that exists and is not empty is refused unless --overwrite.",
                      metavar="DIR")
    draft: str | None = option(None, "Draft model: a directory or hub id with the target's tokenizer.",
                               metavar="DIR", drafter=True)
    heads: str | None = option(None, "Medusa heads directory (vLLM's format) trained on this target.",
                               metavar="DIR", drafter=True)
    eagle3: str | None = option(None, "EAGLE-3 draft directory (SGLang's / vLLM's layout) trained on this target.",
                                metavar="DIR", drafter=True)
    method: str | None = option(None, "A drafter without weights: ngram (prompt lookup) or none (the target "
                                "alone).", choices=("ngram", "none"), drafter=True)
    name: str | None = option(None, "The drafter's name in titles and tables (unset: the draft or heads "
                              "directory's name, else the method).", drafter=True)
    limit: int | None = option(None, "At most N prompts from each prompt file (unset: all).", metavar="N")
    num_draft_tokens: int = option(NUM_DRAFT_TOKENS, "K: draft tokens per verification step (Medusa heads: the "
                                   "tree's depth cap).", metavar="K")
    temperature: float = option(0.0, "Sampling temperature; 0 is greedy decoding.")
    top_p: float = option(1.0, "Nucleus sampling: keep the smallest set of tokens with this much probability.")
    max_new_tokens: int = option(128, "New tokens per prompt, at most (a prompt also ends at EOS).", metavar="N")
    seed: int = option(0, "Seeds the run once: repeated prompts get independent samples, and the same command "
                       "gives the same outputs.")
    dtype: str = option("auto", "Weights and compute dtype; auto is bfloat16 on CUDA, float32 on CPU.",
                        choices=DTYPE_CHOICES)
    device: str = option("auto", "auto, cpu, cuda or cuda:N; auto is cuda when available.")
    baseline: str = option("ours", "ours: also decode and time every prompt with the target alone on the same "
                           "engine (speedups, output matching); none: skip it.", choices=("ours", "none"))
    engine: str = option("auto", "Decoding engine: eager is the model's own forward on a dynamic cache; static "
                         "a preallocated KV cache with compiled fixed-shape steps (CUDA graphs on CUDA; Llama, "
                         "Mistral, Qwen2, Qwen3); auto is static on CUDA where supported, else eager.",
                         choices=ENGINE_CHOICES)
    ngram_max: int = option(3, "Longest suffix n-gram that n-gram lookup matches.", metavar="N")
    tree: str = option("auto", "Candidate tree of Medusa heads and EAGLE-3 drafts (greedy): auto (heads: the tree "
                       "calibrated when they were trained, else default; EAGLE-3: dynamic), default (a static "
                       "22-node tree), chain, dynamic (EAGLE-3 only: EAGLE-2's tree grown by draft confidence, "
                       "--tree-nodes nodes, K deep), or a JSON file of paths like [[0], [1], [0, 0]].")
    tree_nodes: int = option(32, "EAGLE-3 dynamic tree: nodes verified per step, the pending token included.",
                             metavar="N")
    tree_topk: int = option(4, "EAGLE-3 dynamic tree: nodes expanded per depth, and children drafted per node.",
                            metavar="N")
    overwrite: bool = option(False, "Replace an earlier report in --out whole (nothing of it remains).")
    quiet: bool = option(False, "No progress bar.")

    def validate(self) -> None:
        validate_choices(self)
        chosen = [x for x in (self.draft and "--draft", self.heads and "--heads", self.eagle3 and "--eagle3",
                              self.method and f"--method {self.method}") if x]
        if len(chosen) != 1:
            raise UserError("choose exactly one drafter: --draft DIR, --heads DIR, --eagle3 DIR, --method ngram or "
                            "--method none" + (f" (got {' and '.join(chosen)})" if chosen else ""))
        if not self.prompts:
            raise UserError("no prompt file given; pass --prompts FILE")
        if self.num_draft_tokens < 1:
            raise UserError(f"--num-draft-tokens must be at least 1, got {self.num_draft_tokens}")
        if not 0 <= self.temperature < math.inf:  # also rejects nan
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1, got {self.limit}")
        if self.ngram_max < 1:
            raise UserError(f"--ngram-max must be at least 1, got {self.ngram_max}")
        if self.tree not in TREE_CHOICES:
            read_tree_file(self.tree)
        if self.tree == "dynamic" and self.heads:
            raise UserError("--tree dynamic grows a tree with an EAGLE-3 draft; Medusa heads use auto, default, chain "
                            "or a tree file")
        if self.tree_nodes < 2:
            raise UserError(f"--tree-nodes must be at least 2 (the pending token and one draft), got {self.tree_nodes}")
        if self.tree_topk < 1:
            raise UserError(f"--tree-topk must be at least 1, got {self.tree_topk}")

    @property
    def proposer_name(self) -> str:
        """draft | heads | eagle3 | ngram | none: which kind of drafter runs."""
        return "draft" if self.draft else "heads" if self.heads else "eagle3" if self.eagle3 else self.method

    @property
    def drafter_name(self) -> str:
        """What titles and tables call the drafter."""
        if self.name:
            return self.name
        path = self.draft or self.heads or self.eagle3
        if path:
            return Path(path.rstrip("/")).name or path
        return str(self.method)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Settings that may differ between the drafters of one `compare` run.
PER_DRAFTER = ("draft", "heads", "eagle3", "method", "name", "out")


def shared_settings(cfg: EvalConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_DRAFTER}


def validate_choices(cfg) -> None:
    """The same choices argparse enforces, for settings built in code."""
    for f in fields(cfg):
        choices, value = f.metadata.get("choices"), getattr(cfg, f.name)
        if choices and value is not None and value not in choices:
            raise UserError(f"unknown {flag_name(f.name)} {value!r}; use one of {', '.join(choices)}")


def read_tree_file(path: str) -> list:
    """A tree as JSON: a list of paths, each a list of top-k choice indices, e.g. [[0], [1], [0, 0]]."""
    try:
        paths = check_paths(tuple(p) for p in json.loads(Path(path).read_text()))
    except OSError as e:
        raise UserError(f"--tree {path}: cannot read it ({e.strerror}); use auto, default, chain or a JSON file of "
                        "paths like [[0], [1], [0, 0]]") from e
    except (TypeError, ValueError) as e:
        raise UserError(f"--tree {path}: not a valid tree ({e}); write a JSON list of paths like [[0], [1], [0, 0]]"
                        ) from e
    if not paths:  # an empty tree would verify no draft at all: plain decoding under a drafter's name
        raise UserError(f"--tree {path}: the tree is empty; write at least one path, like [[0], [1], [0, 0]]")
    return paths


# ----------------------------------------------------------------------------- flags from fields


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_flags(parser, cls, *, drafter: bool = True, docs: dict[str, str] | None = None) -> None:
    """One flag per field of `cls` (`drafter=False` leaves out the drafter fields); `docs`
    replaces a field's help text for this command."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("drafter") and not drafter:
            continue
        doc = (docs or {}).get(f.name, f.metadata["doc"]).replace("%", "%%")
        kind, repeated = _scalar_type(hints[f.name])
        kwargs: dict = {"dest": f.name}
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
            kwargs.pop("metavar", None)
        if kind is bool:
            parser.add_argument(flag_name(f.name), action="store_true", help=f"{doc} (default: off)", dest=f.name)
            continue
        if f.default is MISSING and f.default_factory is MISSING:
            kwargs["required"] = True
            help_text = f"{doc} (required)"
        else:
            kwargs["default"] = f.default
            help_text = doc if f.default is None else f"{doc} (default: {f.default})"
        if repeated:
            kwargs["action"] = "append"
        parser.add_argument(flag_name(f.name), type=kind, help=help_text, **kwargs)


def from_args(cls, args, **overrides):
    """The dataclass back from parsed flags; `overrides` set the fields the command fixes itself."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def _scalar_type(hint) -> tuple[type, bool]:
    """(argparse type, repeated flag) of an annotation: int, float, str, bool, X | None, list[X]."""
    origin = typing.get_origin(hint)
    if origin is list:
        return typing.get_args(hint)[0], True
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:  # X | None
        return _scalar_type(args[0])
    return hint, False
