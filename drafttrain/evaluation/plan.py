"""`--num-draft-tokens auto`, `--tree-nodes auto`: each drafter's K (and tree) chosen from this
machine's measured costs and the drafter's acceptance on OTHER prompts (`drafttrain.planning`
holds the model and the search).

The story, per drafter, before anything is timed. A chain drafter (draft models, parallel drafts,
n-gram, EAGLE-3 chains, Medusa heads when sampling): find its per-position acceptance (the
held-out acceptance its export recorded in `drafttrain.json`, else a decode of
`--calibration-prompts` at the deepest K), measure the target's forward of 1 .. K+1 tokens and
the drafter's step on the run's engines (interleaved repeats, medians), measure the decode
loop's own overhead per step, and plan. A tree drafter (Medusa heads and EAGLE-3 when greedy):
decode the calibration prompts with the largest tree of each top-k weighed, recording every
step's candidates (what any smaller tree would have accepted is read off them), measure the
target's verification of n tree nodes and whole steps of each (top-k, depth), and plan. A cost
curve that looks like a busy machine is one `warning:` line and a note in the report: a plan
made from noise is said to be one.

Everything timed is warmed up first as the run will be: a whole step through its decoder's own
`warmup()`, a forward through the engine's with the sizes AND the hidden layers the decoder
verifies with (`verified_layers`). The static engine compiles one graph per (size, hidden layers):
a step it was never warmed for runs uncompiled, or compiles while it is timed, and would be
priced against compiled ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from statistics import fmean, median

from ..decoding import DecodeSettings, as_cached_lm
from ..kinds.factory import build_decoder
from ..kinds.registry import BY_NAME, target_alone, trained_drafter
from ..kinds.factory import tree_choice
from ..errors import UserError
from ..export import RECORD
from ..planning import (NODE_BUDGETS, Costs, Plan, TreeCosts, fallback_plan, implausible, noisy, plan_chain,
                        plan_tree_measured, tree_node_limit, walk_chain, walked_rates)
from ..prompts import EncodedPrompt, PromptRecord, encode_prompts, prompt_content, read_prompts
from .config import PLAN_MAX_K, PLAN_MAX_NODES, PLAN_PROBE_TOKENS, EvalConfig
from .costs import forward_curve
from .loading import LoadedModels

CALIBRATION_PROMPTS = 8  # prompts of --calibration-prompts decoded per drafter
# n-gram lookup reads three times as many: copying varies from prompt to prompt far more than a
# model's acceptance does (walked tau at K=3 on SmolLM2's HumanEval answers: 1.02 to 3.31 per
# prompt; 1.47 over prompts 13-20, 1.58 over 13-36, 1.84 over the first 12), and its calibration
# is one greedy decode at lookup speed, with no draft model to run.
LOOKUP_CALIBRATION_PROMPTS = 24
TOPK_CHOICES = (1, 2, 4, 8)  # EAGLE-2 top-k weighed by --tree-nodes auto, up to --tree-topk
STEP_PROBE_TOKENS = PLAN_PROBE_TOKENS  # tokens decoded on the probe prompt to time a tree's steps
COST_ROUNDS = 3  # interleaved rounds of every chain cost, at every probe
ROUND_REPEATS = 3  # timed repeats of each cost per round
COST_ATTEMPTS = 2  # measurements of impossible costs (`planning.implausible`) before a plan falls back
PROBE_BUCKETS = 3  # prompt-length buckets whose mid-decode costs a plan averages


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Per-position acceptance a_1 .. a_K and how often each position was proposed at all."""

    per_position: list[float]
    proposal_rates: list[float] | None
    source: str
    extra_tokens: float = 0.0  # a hybrid's n-gram nodes per step beside the model's K drafts
    by_k: dict[int, tuple[list[float], list[float]]] | None = None  # measured at each K (`planning.walk_chain`)


def recorded_acceptance(cfg: EvalConfig) -> Acceptance | None:
    """The held-out chain acceptance an export recorded (`drafttrain.json`: draft LMs, EAGLE-3
    drafts, Medusa heads), if there is one."""
    export = cfg.drafter_path
    path = Path(export) / RECORD if export else None
    if path is None or not path.is_file():
        return None
    try:
        held_out = json.loads(path.read_text())["held_out"]
        per_position = [float(a) for a in held_out["per_position_acceptance"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is damaged ({type(e).__name__}: {e}); re-export the draft, or plan from "
                        "--calibration-prompts FILE") from None
    return Acceptance(per_position, None, f"held-out acceptance recorded at export ({path})")


def read_calibration(cfg: EvalConfig) -> list[PromptRecord]:
    """The first `LOOKUP_CALIBRATION_PROMPTS` records of --calibration-prompts (none without it): all
    that any drafter's plan reads."""
    if not cfg.calibration_prompts:
        return []
    return read_prompts([cfg.calibration_prompts], LOOKUP_CALIBRATION_PROMPTS, flag="--calibration-prompts")


def check_calibration(cfg: EvalConfig, evaluated: list[PromptRecord]) -> None:
    """Calibration prompts must be other prompts than the evaluated ones (SPEC §7). Compared by what
    they send, not by path: a copy of the evaluated file under another name, or a file that shares
    some prompts with it, would fit the plan to the test as surely as the file itself."""
    tested = {prompt_content(r): r for r in evaluated}
    read = read_calibration(cfg)
    shared = [r for r in read if prompt_content(r) in tested]
    if shared:
        raise UserError(f"{len(shared)} of the {len(read)} prompts read from --calibration-prompts {cfg.calibration_prompts} are "
                        f"also in an evaluated prompt file ({shared[0].source} is {tested[prompt_content(shared[0])].source}); "
                        "a plan fitted to the evaluated prompts is no plan: give other prompts")


def calibration_prompts(cfg: EvalConfig, tokenizer, context_limit: int | None) -> list[EncodedPrompt]:
    """The calibration records (`read_calibration`), encoded before the engines are sized, so they
    fit the caches; model drafters decode the first `CALIBRATION_PROMPTS` of them."""
    return encode_prompts(read_calibration(cfg), tokenizer, max_new_tokens=cfg.max_new_tokens,
                          context_limit=context_limit)


def calibrated_acceptance(cfg: EvalConfig, models: LoadedModels, prompts: list[EncodedPrompt]) -> Acceptance:
    """Decode the calibration prompts with K = PLAN_MAX_K and count, per position, how often it was
    accepted and how often proposed."""
    settings = dataclasses.replace(cfg.decode_settings(k=PLAN_MAX_K, nodes=cfg.max_tree_nodes),
                                   eos_token_ids=frozenset(models.eos))
    decoder = build_decoder(models.target_lm or models.target, models.drafter, settings)
    accepted, proposed, continuations = [], [], []
    for p in prompts:
        gen = decoder.generate(p.ids, cfg.max_new_tokens)
        accepted += gen.accepted_lengths
        proposed += gen.proposed_lengths
        continuations.append(gen.tokens)
    steps = max(1, len(accepted))
    hybrid = getattr(getattr(decoder, "drafter", None), "lookup_nodes", None)
    return Acceptance([sum(a >= j for a in accepted) / steps for j in range(1, PLAN_MAX_K + 1)],
                      None if cfg.hybrid else [sum(m >= j for m in proposed) / steps for j in range(1, PLAN_MAX_K + 1)],
                      f"{len(prompts)} calibration prompts from {cfg.calibration_prompts}",
                      hybrid / steps if hybrid is not None else 0.0,
                      walked_lookup(cfg, prompts, continuations) if walks(cfg) else None)


def walks(cfg: EvalConfig) -> bool:
    """A greedy lookup (its proposal a function of the text so far): its acceptance at every K is
    walked over the calibration outputs."""
    return BY_NAME[cfg.drafter_kind].planned_from_walks and cfg.greedy


def walked_lookup(cfg: EvalConfig, prompts: list[EncodedPrompt], continuations: list[list[int]]) -> dict:
    """A lookup's acceptance and proposal rates at every K = 1 .. PLAN_MAX_K, walked exactly over
    the calibration prompts' greedy continuations (`planning.walk_chain`): copying is bursty, so
    the deepest K's per-position acceptance misjudges a smaller K's."""
    new_lookup = BY_NAME[cfg.drafter_kind].lookup
    settings = cfg.decode_settings(k=PLAN_MAX_K, nodes=cfg.max_tree_nodes)
    by_k = {}
    for k in range(1, PLAN_MAX_K + 1):
        steps = []
        for p, c in zip(prompts, continuations):
            lookup = new_lookup(settings)
            lookup.reset(p.ids)
            steps += walk_chain(p.ids, c, lambda sequence, n: lookup.lookup(n, sequence), k, cfg.max_new_tokens)
        by_k[k] = walked_rates(steps, k)
    return by_k


def drafter_acceptance(cfg: EvalConfig, models: LoadedModels, calibration: list[EncodedPrompt]) -> Acceptance:
    if cfg.calibration_prompts:
        return calibrated_acceptance(cfg, models, calibration if walks(cfg) else calibration[:CALIBRATION_PROMPTS])
    recorded = None if cfg.hybrid else recorded_acceptance(cfg)  # a hybrid's own acceptance is not recorded
    if recorded is None:
        raise UserError(f"--num-draft-tokens auto needs {cfg.drafter_name}'s acceptance on other prompts than the "
                        f"evaluated ones, and it has none recorded ({RECORD}); pass --calibration-prompts FILE")
    return recorded


def cost_probes(prompts: list[EncodedPrompt], max_new_tokens: int) -> list[list[int]]:
    """The sequences a plan's costs are measured at: the middle-length prompt of each of up to
    `PROBE_BUCKETS` equal-size buckets of the run's prompts by length, continued halfway through its
    decode (a forward's cost grows about linearly with the context, so mid-decode costs a decode's
    mean). One probe prompt planned n-gram on a mixed set at 1.10x that measured 0.94x: the costs
    of ~10-token prompts do not hold for ~850-token ones."""
    ordered = sorted(prompts, key=lambda p: len(p.ids))
    n = min(PROBE_BUCKETS, len(ordered))
    chosen = [ordered[(2 * b + 1) * len(ordered) // (2 * n)].ids for b in range(n)]
    at_length = {len(ids) + max_new_tokens // 2: ids for ids in chosen}  # one probe per length
    return [list(itertools.islice(itertools.cycle(ids), length)) for length, ids in sorted(at_length.items())]


def loop_overhead(models: LoadedModels, ids: list[int], single: float, tokens: int = 12) -> float:
    """Seconds a plain decoding step spends beyond its forward (sampling, bookkeeping, the sync),
    `single`: a plain one-token forward. The plain decoder is warmed up first (`warmup`: its
    verification is a graph of its own, which the forwards' warm-up does not compile)."""
    settings = DecodeSettings(num_draft_tokens=1)
    decoder = build_decoder(models.target_lm or models.target, target_alone(), settings)
    decoder.warmup()
    gen = decoder.generate(ids, tokens)
    return max(0.0, median(gen.step_seconds) - single) if gen.step_seconds else 0.0


def lookup_seconds(cfg: EvalConfig, kind: str, ids: list[int], max_k: int, repeats: int = ROUND_REPEATS) -> list[float]:
    """A lookup's host time proposing k = 0 .. max_k tokens at the end of `ids`: it reads the
    context, so it grows with the context's length, and beside a small model's forward on a CPU it
    is no free lunch (a plan that counted n-gram lookup as zero promised 1.10x and measured 0.94x)."""
    lookup = BY_NAME[kind].lookup(cfg.decode_settings(k=max_k, nodes=cfg.max_tree_nodes))

    def once(k: int) -> float:
        lookup.reset(ids[:-1])  # a lookup that keeps state catches up with the last token, as a step does
        start = time.perf_counter()
        lookup.lookup(k, ids)
        return time.perf_counter() - start

    return [0.0] + [median(once(k) for _ in range(repeats)) for k in range(1, max_k + 1)]


def drafter_seconds(cfg: EvalConfig, models: LoadedModels, ids: list[int], acceptance: Acceptance,
                    max_k: int) -> tuple[list[float], list[str]]:
    """The drafter's share of a step drafting k = 0 .. max_k tokens at the end of `ids` (a hybrid's
    lookup included), and any noise warnings: a lookup's host time, or the kind's own step."""
    kind = BY_NAME[models.drafter.kind]
    if kind.supports("lookup"):
        return lookup_seconds(cfg, kind.name, ids, max_k), []
    seconds, noise = model_drafter_seconds(cfg, models, ids, acceptance, max_k)
    if cfg.hybrid:  # a hybrid also looks up its lookup's branch every step
        seconds = [s + lookup for s, lookup in zip(seconds, lookup_seconds(cfg, cfg.hybrid, ids, max_k))]
    return seconds, noise


def model_drafter_seconds(cfg: EvalConfig, models: LoadedModels, ids: list[int], acceptance: Acceptance,
                          max_k: int) -> tuple[list[float], list[str]]:
    """A model drafter's own step drafting k = 0 .. max_k, as its kind times it (`step_seconds`)."""
    kind = BY_NAME[models.drafter.kind]
    target_lm = models.target_lm or as_cached_lm(models.target)
    return kind.step_seconds(models.drafter, target_lm, ids, max_k, acceptance.per_position, ROUND_REPEATS)


def draft_forwards(cfg: EvalConfig, models: LoadedModels, acceptance: Acceptance,
                   max_k: int) -> list[tuple[int, int]] | None:
    """(forwards, tokens each) of a model drafter drafting k = 1 .. max_k, for `planning.implausible`."""
    kind = BY_NAME[models.drafter.kind]
    return kind.draft_forwards(models.drafter, max_k, acceptance.per_position)


def verified_layers(cfg: EvalConfig, models: LoadedModels, settings: DecodeSettings) -> tuple[int, ...]:
    """The target hidden layers this drafter's decoder verifies with (`Decoder.hidden_layers`:
    EAGLE-3's aux layers, Medusa's last; none for the rest): its verification is that graph, not
    the plain forward's, so its costs are timed with them."""
    return tuple(build_decoder(models.target_lm or models.target, models.drafter, settings).hidden_layers)


def chain_round(cfg: EvalConfig, models: LoadedModels, ids: list[int], acceptance: Acceptance, max_k: int):
    """One round of a chain plan's costs at the end of `ids`: the target's forwards of 1 .. n tokens
    (timings by size), the drafter's share of a step drafting 0 .. max_k, its noise, and a plain
    step's overhead beyond its forward. The forwards of 2 .. n tokens are the decoder's
    verifications, with its drafter's hidden layers; one token is what K = 0 runs, the target
    alone, which reads none (so a plain step costs verify[0] plus the overhead, as measured)."""
    target_lm = models.target_lm or as_cached_lm(models.target)
    layers = verified_layers(cfg, models, cfg.decode_settings(k=max_k, nodes=cfg.max_tree_nodes))
    verify = forward_curve(target_lm, ids, max_k + 1 + (max_k if cfg.hybrid else 0), repeats=ROUND_REPEATS,
                           hidden_layers=layers)
    if layers:  # K = 0 decodes with the target alone: a plain one-token forward
        verify[0] = forward_curve(target_lm, ids, [1], repeats=ROUND_REPEATS)[0]
    draft, noise = drafter_seconds(cfg, models, ids, acceptance, max_k)
    return verify, draft, noise, loop_overhead(models, ids, median(verify[0]))


def measure_chain_costs(cfg: EvalConfig, models: LoadedModels, probes: list[list[int]], acceptance: Acceptance,
                        max_k: int) -> Costs:
    """Every chain cost at every probe, in `COST_ROUNDS` interleaved rounds (a machine that slows
    down mid-measurement hits target, drafter and overhead alike); each cost the median of its
    rounds at a probe, then the mean over the probes (equal-size buckets of the run's prompts)."""
    rounds = [[chain_round(cfg, models, ids, acceptance, max_k) for ids in probes] for _ in range(COST_ROUNDS)]
    at_probe = list(zip(*rounds))  # per probe: its rounds' (verify, draft, noise, overhead)
    curves = [[[t for r in rs for t in r[0][n]] for n in range(len(rs[0][0]))] for rs in at_probe]
    # a busy machine: the rounds' medians at a probe disagree (a spike within a round is left to its median)
    rounds_medians = [[[median(r[0][n]) for r in rs] for n in range(len(rs[0][0]))] for rs in at_probe]
    noise = sorted({w for c in rounds_medians for w in noisy(c)} | {w for rs in at_probe for r in rs for w in r[2]})
    return Costs(tuple(fmean(median(c[n]) for c in curves) for n in range(len(curves[0]))),
                 tuple(fmean(median(r[1][k] for r in rs) for rs in at_probe) for k in range(max_k + 1)),
                 fmean(median(r[3] for r in rs) for rs in at_probe), tuple(noise))


def trusted_chain_costs(cfg: EvalConfig, models: LoadedModels, probes: list[list[int]], acceptance: Acceptance,
                        max_k: int) -> tuple[Costs, list[str]]:
    """The chain costs, measured again (up to `COST_ATTEMPTS` times) while `planning.implausible`
    finds them impossible; and its reasons where they stayed so."""
    for _ in range(COST_ATTEMPTS):
        costs = measure_chain_costs(cfg, models, probes, acceptance, max_k)
        doubts = implausible(costs, draft_forwards(cfg, models, acceptance, max_k))
        if not doubts:
            break
    return costs, doubts


def no_tree_reason(cfg: EvalConfig) -> str | None:
    """Why this drafter verifies no tree, for `--tree-nodes auto` to say (None: it may verify one)."""
    if not BY_NAME[cfg.drafter_kind].supports("tree"):
        trees = ", ".join(f"--{k.flag}" for k in BY_NAME.values() if k.supports("tree"))
        return f"{cfg.drafter_name} drafts a chain (only tree drafters verify trees: {trees})"
    if not cfg.greedy:
        return f"{cfg.drafter_name} drafts a chain when sampling (trees are verified greedily: --temperature 0)"
    if cfg.tree == "chain":
        return f"--tree chain makes {cfg.drafter_name} draft a chain"
    return None


def plans_a_tree(cfg: EvalConfig, models: LoadedModels) -> bool:
    """Tree drafters (Medusa heads, EAGLE-3 drafts) verify trees when greedy, unless their tree is
    a chain (EAGLE-3 with --tree chain)."""
    settings = cfg.decode_settings(k=cfg.max_draft_tokens, nodes=cfg.max_tree_nodes)
    return cfg.greedy and tree_choice(models.drafter, settings) is not None


def plan_drafter(cfg: EvalConfig, models: LoadedModels, probes: list[list[int]],
                 calibration: list[EncodedPrompt]) -> tuple[Plan, dict]:
    """The plan for one drafter and the report's `plan` block (SPEC §7); `probes`: `cost_probes`."""
    if plans_a_tree(cfg, models):
        return plan_tree_drafter(cfg, models, probes[len(probes) // 2], calibration)
    acceptance = drafter_acceptance(cfg, models, calibration)
    max_k = min(PLAN_MAX_K, len(acceptance.per_position))
    start = time.perf_counter()
    costs, doubts = trusted_chain_costs(cfg, models, probes, acceptance, max_k)
    plan = fallback_plan() if doubts else plan_chain(acceptance.per_position, costs, acceptance.proposal_rates, max_k,
                                                     acceptance.extra_tokens, acceptance.by_k)
    warn_noise(cfg, costs.warnings)
    warn_untrusted(cfg, doubts)
    block = {"num_draft_tokens": plan.num_draft_tokens, "tree_nodes": None, "tree_topk": None,
             "costs": {**costs.as_dict(), "context_lengths": [len(ids) for ids in probes], "rounds": COST_ROUNDS},
             "untrusted": doubts,
             "planned_speedup": plan.planned_speedup, "expected_tokens": plan.expected_tokens,
             "source": acceptance.source, "acceptance": acceptance.per_position,
             "proposal_rates": acceptance.proposal_rates, "extra_tokens": acceptance.extra_tokens,
             "walked": {str(k): {"acceptance": a, "proposal_rates": r} for k, (a, r) in acceptance.by_k.items()}
             if acceptance.by_k else None,
             "candidates": plan.as_dict()["candidates"],
             "noise": list(costs.warnings), "seconds": time.perf_counter() - start}
    return plan, block


def tree_settings(cfg: EvalConfig, models: LoadedModels) -> tuple[list[int], list[int], list[int], bool]:
    """(depths, node budgets, top-ks) a tree plan weighs, and whether the tree is EAGLE-2's dynamic one."""
    kind = BY_NAME[models.drafter.kind]
    limit = kind.depth_limit(models.drafter)
    deepest = cfg.max_draft_tokens if limit is None else min(cfg.max_draft_tokens, limit)
    depths = list(range(1, deepest + 1)) if cfg.num_draft_tokens == "auto" else [deepest]
    shape = tree_choice(models.drafter, cfg.decode_settings(k=deepest, nodes=cfg.max_tree_nodes))[1]
    dynamic = shape == "dynamic"
    largest = PLAN_MAX_NODES if dynamic else len(shape) + 1
    if cfg.tree_nodes == "auto":
        nodes = sorted({n for n in NODE_BUDGETS if n < largest} | {largest})
    else:
        nodes = [cfg.tree_nodes or largest]
    topks = [k for k in TOPK_CHOICES if k <= cfg.tree_topk] if dynamic and cfg.tree_nodes == "auto" else [cfg.tree_topk]
    return depths, nodes, topks or [cfg.tree_topk], dynamic


def recorded_trees(cfg: EvalConfig, models: LoadedModels, prompts: list[EncodedPrompt], depth: int, nodes: int,
                   topk: int):
    """The calibration prompts decoded with the largest tree of this top-k, every step's candidates
    recorded (`planning.TreeStep`), and a hybrid's n-gram nodes per step."""
    settings = dataclasses.replace(cfg.decode_settings(k=depth, nodes=nodes, topk=topk),
                                   eos_token_ids=frozenset(models.eos))
    decoder = build_decoder(models.target_lm or models.target, models.drafter, settings)
    decoder.recorded = []
    lookups = getattr(decoder.drafter, "lookup_nodes", 0)
    for p in prompts:
        decoder.generate(p.ids, cfg.max_new_tokens)
    steps = decoder.recorded
    extra = (getattr(decoder.drafter, "lookup_nodes", 0) - lookups) / max(1, len(steps))
    return steps, extra


def tree_step_seconds(cfg: EvalConfig, models: LoadedModels, ids: list[int], depth: int, nodes: int,
                      topk: int) -> tuple[int, float]:
    """(the model's tree nodes, median seconds) of a whole decoding step (draft, verification,
    bookkeeping) with this tree on the probe prompt; K = 0 is a plain step. Warmed up by the
    decoder's own `warmup` (every graph its steps run: the target's for its tree size and hidden
    layers, the drafter's), then by a short decode (caches, allocator), as a run warms up."""
    settings = cfg.decode_settings(k=depth, nodes=nodes, topk=topk)
    decoder = build_decoder(models.target_lm or models.target, models.drafter if depth else target_alone(),
                            settings if depth else settings.alone())
    decoder.warmup()
    decoder.generate(ids, 4)
    seconds = []
    for _ in range(2):
        seconds += decoder.generate(ids, STEP_PROBE_TOKENS).step_seconds
    drafter = getattr(decoder, "drafter", None)
    model = getattr(drafter, "model", drafter)  # a hybrid's n-gram nodes are counted apart
    return (model.max_nodes if model is not None else 1), median(seconds)


def trusted_tree_costs(cfg: EvalConfig, models: LoadedModels, ids: list[int], measured: dict,
                       sizes: list[int]) -> tuple[TreeCosts, list[str]]:
    """The target's tree verification (with the hidden layers the tree decoder verifies with) and
    a plain step, measured again (up to `COST_ATTEMPTS` times) while a plain step's overhead
    beyond its forward is impossible (`planning.implausible`); and its reasons where it stayed so."""
    target_lm = models.target_lm or as_cached_lm(models.target)
    depths, nodes, topks, _ = tree_settings(cfg, models)
    layers = verified_layers(cfg, models, cfg.decode_settings(k=max(depths), nodes=max(nodes), topk=max(topks)))
    for _ in range(COST_ATTEMPTS):
        verify = forward_curve(target_lm, ids, sizes, tree=True, hidden_layers=layers)
        plain = tree_step_seconds(cfg, models, ids, 0, 1, 1)[1]
        single = median(verify[0])
        doubts = implausible(Costs((single,), (0.0,), max(0.0, plain - single)))
        if not doubts:
            break
    return TreeCosts(tuple(sizes), tuple(median(v) for v in verify), measured, plain, tuple(noisy(verify))), doubts


def plan_tree_drafter(cfg: EvalConfig, models: LoadedModels, ids: list[int],
                      calibration: list[EncodedPrompt]) -> tuple[Plan, dict]:
    """The plan for Medusa heads or an EAGLE-3 draft verifying trees: depth, nodes and top-k."""
    if not calibration:
        raise UserError(f"planning {cfg.drafter_name}'s tree needs its acceptance on other prompts than the evaluated "
                        "ones; pass --calibration-prompts FILE")
    calibration = calibration[:CALIBRATION_PROMPTS]
    depths, nodes, topks, dynamic = tree_settings(cfg, models)
    start = time.perf_counter()
    steps, extra, measured = {}, {}, {}
    for topk in topks:
        steps[topk], extra[topk] = recorded_trees(cfg, models, calibration, max(depths), max(nodes), topk)
        for depth in depths:
            measured[(topk, depth)] = tree_step_seconds(cfg, models, ids, depth, max(nodes), topk)
    sizes = sorted({1, *range(2, 9), *(n for n in NODE_BUDGETS if n <= max(nodes) + max(depths))})
    costs, doubts = trusted_tree_costs(cfg, models, ids, measured, sizes)
    limit = tree_node_limit if dynamic else (lambda topk, depth: measured[(topk, depth)][0])

    def measure(topk, depth, n):
        return tree_step_seconds(cfg, models, ids, depth, n, topk)[1]

    plan = fallback_plan() if doubts else plan_tree_measured(steps, costs, depths, nodes, measure, extra,
                                                             node_limit=limit)
    warn_noise(cfg, costs.warnings)
    warn_untrusted(cfg, doubts)
    ranked = sorted(plan.candidates, key=lambda c: -c.planned_speedup)
    block = {"num_draft_tokens": plan.num_draft_tokens, "tree_nodes": plan.tree_nodes,
             "tree_topk": plan.tree_topk if dynamic else None,
             "costs": {**costs.as_dict(), "context_lengths": [len(ids)]}, "untrusted": doubts,
             "planned_speedup": plan.planned_speedup, "expected_tokens": plan.expected_tokens,
             "source": f"{len(calibration)} calibration prompts from {cfg.calibration_prompts} "
                       f"({sum(len(s) for s in steps.values())} recorded tree steps)",
             "extra_tokens": extra, "candidates": [dataclasses.asdict(c) for c in ranked],
             "noise": list(costs.warnings), "seconds": time.perf_counter() - start}
    return plan, block


def warn_untrusted(cfg: EvalConfig, doubts: list[str]) -> None:
    """One `warning:` line for costs that stayed impossible when measured again: the plan fell back."""
    if doubts:
        print(f"warning: {cfg.drafter_name}: the measured costs cannot be the machine's ({'; '.join(doubts)}), "
              f"measured {COST_ATTEMPTS} times; planned the target alone (K = 0) rather than speculate on noise: "
              "run alone, or pass --num-draft-tokens K", file=sys.stderr)


def warn_noise(cfg: EvalConfig, warnings) -> None:
    """One `warning:` line for a cost measurement that looks like a busy machine."""
    if warnings:
        print(f"warning: {cfg.drafter_name}: the cost measurement looks like a busy machine ({'; '.join(warnings)}); "
              "the plan may be made from noise: run alone", file=sys.stderr)


def resolve_plans(cfgs: list[EvalConfig], models: list[LoadedModels], prompts: list[EncodedPrompt],
                  calibration: list[EncodedPrompt]) -> tuple[list[EvalConfig], list[dict | None]]:
    """Every `auto` config with its planned K and tree (K = 0: the target alone), and the plans
    for the reports; costs are measured at `cost_probes` of the evaluated `prompts` (their lengths:
    acceptance comes from other prompts). A chain drafter has no tree to size: beside a tree drafter
    in a compare (`run.check_tree_nodes_auto` refuses it alone), its report says `--tree-nodes auto`
    did not apply."""
    probes = cost_probes(prompts, cfgs[0].max_new_tokens)
    planned, blocks = [], []
    for cfg, m in zip(cfgs, models):
        tree = BY_NAME[cfg.drafter_kind].drafts and plans_a_tree(cfg, m)
        not_applicable = {"tree_nodes_auto_not_applicable": no_tree_reason(cfg) or "it verifies no tree"} \
            if cfg.tree_nodes == "auto" and not tree else {}
        if cfg.num_draft_tokens != "auto" and not (tree and cfg.tree_nodes == "auto"):
            planned.append(dataclasses.replace(cfg, tree_nodes=None) if cfg.tree_nodes == "auto" else cfg)
            blocks.append(not_applicable or None)
            continue
        if not BY_NAME[cfg.drafter_kind].drafts:
            planned.append(dataclasses.replace(cfg, num_draft_tokens=0, tree_nodes=None))
            blocks.append(None)
            continue
        plan, block = plan_drafter(cfg, m, probes, calibration)
        planned.append(dataclasses.replace(cfg, num_draft_tokens=plan.num_draft_tokens,
                                           tree_nodes=plan.tree_nodes if tree else None,
                                           tree_topk=plan.tree_topk if tree and plan.tree_topk else cfg.tree_topk))
        blocks.append({**block, **not_applicable})
    return planned, blocks




def export_plans(target, acceptance: list[float], probe: list[int], *, where: str, **exported) -> dict:
    """The plans an export records beside its held-out chain acceptance (`drafttrain.json` "plans",
    the model card): one from costs measured now on the training machine, and one for a GPU at
    batch 1, where a forward of a few tokens costs what one token does (memory-bound) and a
    drafter's step costs its share of the target's parameters; with the launch settings that GPU
    plan means in vLLM (`speculative_config`) and SGLang (its server flags), for the export at
    `where`. `exported`: the trained drafter as its recipe names it (`drafters.trained_drafter`:
    draft=, parallel=, or the model under its kind's flag)."""
    from ..decoding import EagerLM

    drafter = trained_drafter(**exported)
    kind = BY_NAME[drafter.kind]
    limit = kind.depth_limit(drafter)
    limit = PLAN_MAX_K if limit is None else limit
    max_k = min(PLAN_MAX_K, len(acceptance), limit)
    if max_k == 0:
        return {}
    target_lm = EagerLM(target)
    verify = tuple(median(t) for t in forward_curve(target_lm, probe, max_k + 1))
    here = tuple(kind.step_seconds(drafter, target_lm, probe, max_k, acceptance, 7)[0])
    gpu_draft = tuple(kind.gpu_costs(drafter, target, max_k))
    cpu = plan_chain(acceptance, Costs(verify, here))
    gpu = plan_chain(acceptance, Costs((1.0,) * (max_k + 1), gpu_draft))
    k = max(gpu.num_draft_tokens, 1)
    return {"this_machine": {"num_draft_tokens": cpu.num_draft_tokens, "planned_speedup": cpu.planned_speedup,
                             "costs": Costs(verify, here).as_dict()},
            "gpu_batch1": {"num_draft_tokens": gpu.num_draft_tokens, "planned_speedup": gpu.planned_speedup,
                           "assumption": "verification flat in tokens; a drafter step costs its share of the "
                                         f"target's parameters ({gpu_draft[1]:.3f} for the first draft token)"},
            **served_settings(k, where, drafter)}


def planned_k(plans: dict) -> dict:
    """The model card's line for an export's plans (empty without any)."""
    if not plans:
        return {}
    return {"planned K (drafttrain.json)": f"{plans['gpu_batch1']['num_draft_tokens']} on a GPU at batch 1 (vLLM "
            f"num_speculative_tokens), {plans['this_machine']['num_draft_tokens']} on the training machine (0: no "
            "speculation pays there)"}


def served_settings(k: int, where: str, drafter) -> dict:
    """vLLM's `speculative_config` and SGLang's server flags (where SGLang serves the kind) for K
    drafts a step of the export at `where`."""
    kind = BY_NAME[drafter.kind]
    out = {"vllm_speculative_config": kind.vllm(where, k, drafter, None)}
    if kind.sglang is not None:
        out["sglang_server_args"] = {"speculative_algorithm": kind.sglang, "speculative_draft_model_path": where,
                                     "speculative_num_steps": k, "speculative_eagle_topk": 1,
                                     "speculative_num_draft_tokens": k + 1}
    return out


__all__ = ["CALIBRATION_PROMPTS", "LOOKUP_CALIBRATION_PROMPTS", "Acceptance", "export_plans", "planned_k", "plan_drafter", "plan_tree_drafter", "resolve_plans"]
