"""Settings of `eval` and `compare`: one dataclass from which the command-line flags, their
defaults, their `--help` text and their range checks are generated (`config.setting`,
`config.add_flags`, `config.check_settings`), so a default and a bound live in one place.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from ..config import check_settings, flag_name, setting
from ..decoding import NUM_DRAFT_TOKENS, DecodeSettings
from ..kinds.registry import BY_NAME, REGISTRY, flagged, methods
from ..decoding.dynamic_tree import DYNAMIC_TREE_TOPK
from ..decoding.engines import ENGINES
from ..errors import UserError
from ..trees import TREE_CHOICES, read_tree_file
from .windows import ACCEPTANCE_WINDOW


def _or(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else "".join(items)


def lookups() -> list:
    """Kinds whose chain a model drafter may verify beside its own (--ngram, compare's +ngram)."""
    return [kind for kind in REGISTRY if kind.supports("lookup")]


def drafter_fields() -> dict[str, tuple[str, object]]:
    """EvalConfig's drafter fields from the registry, in flag order: (annotation, setting) by name.
    A kind with a flag loads an export (--draft DIR), the kinds without weights share --method,
    a lookup kind may join a model drafter's tree (--ngram)."""
    with_path = _or([flag_name(k.flag) + " DIR" for k in flagged()])
    fields = {k.flag: ("str | None", setting(None, k.help, metavar="DIR", drafter=True)) for k in flagged()}
    described = _or([f"{k.name} ({k.help})" for k in methods()])
    fields["method"] = ("str | None", setting(None, f"A drafter without weights: {described}.",
                                             choices=tuple(k.name for k in methods()), drafter=True))
    for k in lookups():
        fields[k.name] = ("bool", setting(False, f"With {with_path}: also look up a {k.label} continuation each step "
                                          "and verify it as one more branch of the drafter's chain or tree, in the "
                                          "same target pass (greedy only).", drafter=True))
    return fields


def drafter_settings() -> dict:
    return {name: field for name, (_, field) in drafter_fields().items()}


def kind_fields() -> dict[str, tuple[str, object]]:
    """EvalConfig's fields of the kinds' own settings (`DrafterKind.settings`), registry order:
    (annotation, setting) by name, each a flag (--ngram-max N) and a `DecodeSettings.kind_settings` value."""
    return {name: declared for kind in REGISTRY for name, declared in kind.settings().items()}


def int_or_auto(text: str) -> int | str:
    """A flag's K: an integer, or "auto"."""
    return "auto" if text == "auto" else int(text)


def parse_concurrency(text: str) -> list[int]:
    """`--concurrency 1,4,16`: requests in flight, comma-separated, each measured in turn."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError as e:
        raise UserError(f"--concurrency {text!r} is not a comma-separated list of whole numbers, e.g. 1,4,16") from e
    if not values or len(set(values)) != len(values):
        raise UserError(f"--concurrency {text!r}: give each number of requests in flight once, e.g. 1,4,16")
    return sorted(values)


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")
ENGINE_CHOICES = ENGINES  # --engine: auto, eager, static
BACKEND_CHOICES = ("drafttrain", "vllm")
PLAN_MAX_K = 6  # the deepest K that --num-draft-tokens auto considers (and calibration drafts)
PLAN_MAX_NODES = 64  # the largest tree that --tree-nodes auto considers
# The largest --tree-nodes: every node is one more token of each verifying forward, and the caches
# preallocate room for a whole step (EAGLE-3's draft cache, the static engine's), so an unbounded
# value (100000) was accepted, sized every cache for it and recorded, while the tree decoded was far
# smaller. Four times the largest tree the planner weighs; EAGLE-2's own trees verify 60.
TREE_MAX_NODES = 256
PLAN_PROBE_TOKENS = 16  # tokens a plan decodes past a probe prompt to time steps (caches hold them too)


@dataclass(kw_only=True)
class EvalConfig:
    """One drafter against the target on held-out prompts (SPEC §2); `compare` runs several that
    differ only in the drafter and the output directory."""

    target: str = setting(doc="Target model: a local directory or a hub id.", metavar="T")
    prompts: list[str] = setting(doc="JSONL prompt file (SPEC §1); repeat the flag for several files.",
                                 metavar="FILE")
    out: str = setting(doc="Report directory. One that exists and is not empty is refused unless --overwrite.",
                       metavar="DIR")
    vars().update(drafter_settings())  # --draft DIR, --heads DIR, --eagle3 DIR, --method, --ngram: `drafter_settings`
    __annotations__.update({f: t for f, (t, _) in drafter_fields().items()})
    name: str | None = setting(None, "The drafter's name in titles and tables (unset: the draft or heads "
                               "directory's name, else the method).", drafter=True)
    limit: int | None = setting(None, "At most N prompts from each prompt file (unset: all).", metavar="N",
                                at_least=1)
    num_draft_tokens: int | str = setting(
        NUM_DRAFT_TOKENS, "K: draft tokens per verification step (Medusa heads: the tree's depth cap), or auto: "
        "the K (0 = the target alone) that this machine's measured costs and the drafter's acceptance on other "
        "prompts favour (drafttrain.planning).", metavar="K|auto", at_least=1, parse=int_or_auto, auto=True)
    calibration_prompts: str | None = setting(
        None, "With --num-draft-tokens auto or --tree-nodes auto: a JSONL prompt file (not the evaluated prompts) "
        "whose first prompts measure the drafter's acceptance; without it, the acceptance its export recorded "
        "(drafttrain.json; draft models only, trees always need this file).", metavar="FILE")
    replan: bool = setting(False, "With --num-draft-tokens auto or --tree-nodes auto: measure the plan's costs and "
                           "acceptance afresh rather than read what an earlier run on this machine, target and "
                           "calibration file kept under $DRAFTTRAIN_HOME/plans (drafttrain.evaluation.plan_cache), "
                           "and keep the new measurements there.")
    temperature: float = setting(0.0, "Sampling temperature; 0 is greedy decoding.", at_least=0)
    top_p: float = setting(1.0, "Nucleus sampling: keep the smallest set of tokens with this much probability.",
                           above=0, at_most=1)
    max_new_tokens: int = setting(128, "New tokens per prompt, at most (a prompt also ends at EOS).", metavar="N",
                                  at_least=1)
    seed: int = setting(0, "Seeds the run once: repeated prompts get independent samples, and the same command "
                        "gives the same outputs.")
    dtype: str = setting("auto", "Weights and compute dtype; auto is bfloat16 on CUDA, float32 on CPU.",
                         choices=DTYPE_CHOICES)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N; auto is cuda when available.")
    baseline: str = setting("ours", "ours: also decode and time every prompt with the target alone on the same "
                            "engine (speedups, output matching); none: skip it.", choices=("ours", "none"))
    engine: str = setting("auto", "Decoding engine: eager is the model's own forward on a dynamic cache; static "
                          "a preallocated KV cache with compiled fixed-shape steps (CUDA graphs on CUDA; Llama, "
                          "Mistral, Qwen2, Qwen3); auto is static on CUDA where supported, else eager.",
                          choices=ENGINE_CHOICES)
    backend: str = setting("drafttrain", "Who decodes: drafttrain (its own lossless decoder) or vllm (vLLM's offline "
                           "engine, one prompt at a time, the same settings: served acceptance; needs the [vllm] "
                           "extra). In compare, a drafter may end in @vllm or @drafttrain instead.",
                           choices=BACKEND_CHOICES)
    concurrency: list[int] = setting(
        [1], "With --backend vllm: requests in flight in vLLM's engine, comma-separated (1,4,16); each is measured "
        "for the target alone and every drafter on all prompts (the report's load block: tokens/s, tokens/s per "
        "request, speedup at that concurrency). drafttrain's own decoder is batch 1.", metavar="N,N,...",
        at_least=1, parse=parse_concurrency)
    acceptance_window: int = setting(ACCEPTANCE_WINDOW, "Output tokens per window of the report's acceptance by "
                                     "output position (by_window: tau and per-position acceptance per window).",
                                     metavar="N", at_least=1)
    vars().update({f: s for f, (_, s) in kind_fields().items()})  # --ngram-max N: the kinds' own, `kind_fields`
    __annotations__.update({f: t for f, (t, _) in kind_fields().items()})
    tree: str = setting("auto", "Candidate tree of Medusa heads and EAGLE-3 drafts (greedy): auto (heads: the tree "
                        "calibrated when they were trained, else default; EAGLE-3: dynamic), default (a static "
                        "22-node tree), chain, dynamic (EAGLE-3 only: EAGLE-2's tree grown by draft confidence, "
                        "--tree-nodes nodes, K deep), or a JSON file of paths like [[0], [1], [0, 0]].")
    tree_nodes: int | str | None = setting(
        None, "Nodes verified per step, the pending token included: EAGLE-3's dynamic tree grows this many (unset: "
        "32); a static tree (Medusa heads', or --tree default/FILE) keeps its first N-1 paths best first (unset: "
        "all). auto: the size (and, for the dynamic tree, the top-k up to --tree-topk) that this machine's "
        "measured costs and the drafter's acceptance on --calibration-prompts favour (drafttrain.planning). "
        f"At most {TREE_MAX_NODES}.", metavar="N|auto", at_least=2, at_most=TREE_MAX_NODES, parse=int_or_auto, auto=True)
    tree_topk: int = setting(DYNAMIC_TREE_TOPK, "EAGLE-3 dynamic tree: nodes expanded per depth, and children drafted per node.",
                             metavar="N", at_least=1)
    lookup_first: str = setting(
        "auto", "With a lookup joined to a model drafter: on verifies the lookup's continuation alone wherever it finds "
        "one, and the drafter drafts only where it finds nothing; off verifies both each step, as one tree (on a GPU "
        "extra nodes cost almost nothing; on a CPU each costs a share of a step); auto: off, or with "
        "--num-draft-tokens auto, whichever this machine's measured costs favour.", choices=("auto", "on", "off"))
    overwrite: bool = setting(False, "Replace an earlier report in --out whole (nothing of it remains).")
    quiet: bool = setting(False, "No progress bar.")

    def validate(self) -> None:
        check_settings(self, flag_name)
        self._check_drafter()
        if not self.prompts:
            raise UserError("no prompt file given; pass --prompts FILE")
        if self.temperature == math.inf:
            raise UserError("--temperature must be finite (0 = greedy)")
        if self.calibration_prompts and not self.planned:
            raise UserError("--calibration-prompts measures acceptance for --num-draft-tokens auto or --tree-nodes "
                            "auto; add one, or leave --calibration-prompts out")
        if self.replan and not self.planned:
            raise UserError("--replan measures a plan afresh for --num-draft-tokens auto or --tree-nodes auto; add "
                            "one, or leave --replan out")
        if self.tree not in TREE_CHOICES:
            read_tree_file(self.tree)
        kind = BY_NAME[self.drafter_kind]
        if self.tree == "dynamic" and kind.supports("tree") and not kind.grows_trees:
            growers = _or([flag_name(k.flag) + " DIR" for k in flagged() if k.grows_trees])
            raise UserError(f"--tree dynamic grows a tree with a drafter that grows its own ({growers}); "
                            f"{flag_name(kind.flag)} uses auto, default, chain or a tree file")
        if self.backend == "vllm":
            check_servable(self)
        elif max(self.concurrency) > 1:
            raise UserError(f"--concurrency {','.join(map(str, self.concurrency))} runs requests side by side in vLLM's "
                            f"engine, but {self.drafter_name} is decoded by drafttrain's own decoder, which is batch 1 "
                            "(one request at a time); add --backend vllm (compare: NAME=...@vllm), or leave "
                            "--concurrency out")

    def _check_drafter(self) -> None:
        """Exactly one drafter, and a lookup joined only to a drafter with weights, greedy."""
        paths = [flag_name(k.flag) + " DIR" for k in flagged()]
        chosen = [flag_name(k.flag) for k in flagged() if getattr(self, k.flag)]
        chosen += [f"--method {self.method}"] if self.method else []
        if len(chosen) != 1:
            offered = paths + [f"--method {k.name}" for k in methods()]
            raise UserError(f"choose exactly one drafter: {_or(offered)}"
                            + (f" (got {' and '.join(chosen)})" if chosen else ""))
        joined = [k for k in lookups() if getattr(self, k.name)]
        if len(joined) > 1:
            raise UserError(f"join one lookup to a drafter, not {' and '.join(flag_name(k.name) for k in joined)}")
        for k in joined:
            flag = flag_name(k.name)
            if self.method:
                raise UserError(f"{flag} joins {k.label} lookup to a drafter with weights ({_or(paths)}); "
                                f"--method {self.method} alone needs no {flag}")
            if self.temperature > 0:
                raise UserError(f"{flag} verifies the {k.label} branch and the drafter's as one tree, which is greedy; "
                                f"use --temperature 0 or leave {flag} out")

    @property
    def hybrid(self) -> str | None:
        """The lookup kind joined to the drafter's tree (--ngram: "ngram"), or None."""
        return next((k.name for k in lookups() if getattr(self, k.name)), None)

    @property
    def drafter_path(self) -> str | None:
        """The export the drafter loads from (--draft DIR, ...), or None for a method."""
        return next((getattr(self, k.flag) for k in flagged() if getattr(self, k.flag)), None)

    @property
    def planned(self) -> bool:
        """K or the tree's size is left to the planner (`evaluation.plan`)."""
        return "auto" in (self.num_draft_tokens, self.tree_nodes)

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts a step of this run may hold: K, or the deepest K a plan considers."""
        return PLAN_MAX_K if self.num_draft_tokens == "auto" else self.num_draft_tokens

    @property
    def max_tree_nodes(self) -> int | None:
        """The largest tree a step of this run may verify: the given size, or the largest a plan considers."""
        return PLAN_MAX_NODES if self.tree_nodes == "auto" else self.tree_nodes

    def decode_settings(self, *, generator=None, record_margins: bool = False, k: int | None = None,
                        nodes: int | None = None, topk: int | None = None) -> DecodeSettings:
        """What the decoder factory needs of these settings; `k`, `nodes` and `topk` override K, the
        tree's nodes and top-k (an `auto` one is resolved by `evaluation.plan` before decoding)."""
        if (k is None and self.num_draft_tokens == "auto") or (nodes is None and self.tree_nodes == "auto"):
            raise ValueError("--num-draft-tokens auto and --tree-nodes auto are resolved by evaluation.plan before "
                             "decoding")
        return DecodeSettings(num_draft_tokens=self.num_draft_tokens if k is None else k, temperature=self.temperature,
                              top_p=self.top_p, generator=generator, record_margins=record_margins, tree=self.tree,
                              tree_nodes=self.tree_nodes if nodes is None else nodes,
                              tree_topk=self.tree_topk if topk is None else topk, hybrid=self.hybrid,
                              lookup_first=bool(self.hybrid) and self.lookup_first == "on",
                              kind_settings={f: getattr(self, f) for f in kind_fields()})

    @property
    def drafter_kind(self) -> str:
        """Which kind of drafter runs (`kinds.registry`): the one whose flag is given,
        else the method. A draft LM that loads as a parallel one is still named by its flag's kind."""
        return next((k.name for k in flagged() if getattr(self, k.flag)), self.method)

    @property
    def drafter_name(self) -> str:
        """What titles and tables call the drafter."""
        if self.name:
            return self.name
        path = self.drafter_path
        served = "@vllm" if self.backend == "vllm" else ""
        if path:
            return (Path(path.rstrip("/")).name or path) + (f"+{self.hybrid}" if self.hybrid else "") + served
        return str(self.method) + served

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_servable(cfg: EvalConfig) -> None:
    """What vLLM cannot serve, found before any model loads (one `error:` line each); vLLM itself
    is imported by `vllm_backend` only."""
    where = f"--backend vllm ({cfg.drafter_name})"
    if cfg.num_draft_tokens == "auto":
        raise UserError(f"{where}: --num-draft-tokens auto plans drafttrain's own decoder; give vLLM a fixed K "
                        "(for instance the plan an auto run reported)")
    if cfg.hybrid:
        raise UserError(f"{where}: vLLM cannot verify a drafter and {cfg.hybrid} lookup as one tree (+{cfg.hybrid}); "
                        f"serve the drafter or {cfg.hybrid} lookup alone")
    if BY_NAME[cfg.drafter_kind].supports("tree") and cfg.tree not in ("auto", "chain"):
        raise UserError(f"{where}: vLLM serves tree drafters as a chain of K drafts, not the --tree {cfg.tree} tree "
                        "(EAGLE-2's dynamic tree included); use --tree chain")
    if cfg.device not in ("auto", "cpu") and not cfg.device.startswith("cuda"):
        raise UserError(f"{where}: vLLM runs on cpu or cuda, not {cfg.device}")


# Settings that may differ between the drafters of one `compare` run.
PER_DRAFTER = (*drafter_fields(), "name", "out", "backend")


def shared_settings(cfg: EvalConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_DRAFTER}
