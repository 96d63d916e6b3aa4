"""`--num-draft-tokens auto`, `--tree-nodes auto`: each drafter's K (and tree) chosen from this
machine's measured costs and the drafter's acceptance on OTHER prompts (`drafttrain.planning`
holds the model and the search; `evaluation.calibration` measures acceptance; `evaluation.plan_cache`
keeps what was measured).

The story, per drafter, before anything is timed. A chain drafter (draft models, parallel drafts,
n-gram, EAGLE-3 chains, Medusa heads when sampling): find its per-position acceptance (the
held-out acceptance its export recorded in `drafttrain.json`, else `--calibration-prompts` at the
deepest K), measure the target's forward of 1 .. K+1 tokens and the decode loop's own overhead per
step, and the drafter's step, on the run's engines (interleaved repeats, medians), and plan. A tree
drafter (Medusa heads and EAGLE-3 when greedy): record the calibration prompts' steps with the
largest tree of each top-k weighed, every step's candidates kept (what any smaller tree would have
accepted is read off them; EAGLE-3's narrower top-ks grown beside the widest, `calibration.
recorded_trees`), measure the target's verification of n tree nodes and a plain step,
and search the trees, measuring whole steps as the decision needs them. A cost curve that looks
like a busy machine is one `warning:` line and a note in the report: a plan made from noise is
said to be one. Each drafter's plan is one progress line: what is measured now, and the time left.

What is not measured, and why that is safe (the issue's Gemma-3 demo: 20 of its 32 minutes were
plans, EAGLE-3's 607 s and its hybrid's 479 s):
- Nothing twice. The target's costs (a verification curve by hidden layers and sizes, a plain step,
  the loop's overhead) are measured once per run and shared by every drafter verifying the same way
  (n-gram and suffix lookup; EAGLE-3 and EAGLE-3 + n-gram), and kept with all the rest under
  `$DRAFTTRAIN_HOME/plans` (`plan_cache`): a second identical run measures nothing. `--replan`
  measures afresh. The drafter's share of a chain step is measured in rounds of its own. A chain's
  forwards are not read off a tree plan's curve: a tree's mask costs other than a chain's at some
  sizes (Gemma-3, 2 cores, 2026-11-28: 3 tree nodes 99.5 ms, 3 chain tokens 80 ms).
- No prefill twice. The target keeps its prefills of the probes while planning
  (`CachedLM.keeping_prefills`, eager engine): every whole step, loop overhead and forward curve
  starts from one. The Gemma-3 demo's plans prefilled its 167-token probe 16 times, 6.1 s (2 cores,
  2026-11-28); now twice (with and without EAGLE-3's layers).
- Rounds of a chain's costs: two, and a third only where the two disagree (any cost's round medians
  more than `ROUND_AGREEMENT`, 5%, apart): on a quiet machine a third could not move the plan; nor
  a third of the target's where the plan made with either round alone is the plan made with both
  (`settles`). The target's rounds were 33 s of the Gemma-3 demo's plans. They are taken at one probe where the
  run's prompts are alike in length (`PROBE_SPAN`), at three where they are not; the loop's
  overhead beyond a forward in the first round only (`chain_target_rounds`).
- Acceptance: see `evaluation.calibration` (the target's continuations decoded once; model drafters
  replayed against them instead of verified by the target; prompts read until the confidence
  interval is tight).
- Trees: no whole step of every (top-k, depth) at the largest tree (24 of them for EAGLE-3, each
  verifying 64 nodes); a tree's step is measured only when, priced at the least it can cost, it
  leads (`planning.plan_tree_measured`: the plan measuring every tree would give, unless a leader
  is within 3% of a measured tree, which no timing could tell apart), and a narrower top-k of a
  measured tree's depth and nodes is priced by it, the most it can cost, rather than measured. The verification curve is
  measured as far as a leader's nodes need (`CURVE_CHUNK` sizes at a time past 8), `CURVE_REPEATS`
  rounds: on a CPU the large trees are ruled out before it reaches them. A whole step is timed over one short decode
  (`STEP_PROBE_TOKENS`), its first two steps left out as warm-up: the median of the 3 to 14 steps
  left, as many as the tree takes, where three decodes ran before, then two (each a prefill and its
  steps: 1.5-2 s a tree on Gemma-3, 2 cores). A tree's step repeats alike within a decode (one
  size, one graph), and trees whose steps differ by less than `planning.TIE` are not told apart. A
  hybrid's steps are its model's alone (`plan_tree_drafter`: EAGLE-3 + n-gram reuses the steps
  EAGLE-3's own plan timed), its lookup's nodes priced on the curve as many as the calibration
  verified (`planning.tree_seconds`): timed whole on the probe's short decode, they were as many as
  that decode's lookup found.

Everything timed is warmed up first as the run will be: a whole step through its decoder's own
`warmup()`, a forward through the engine's with the sizes AND the hidden layers the decoder
verifies with (`verified_layers`). The static engine compiles one graph per (size, hidden layers):
a step it was never warmed for runs uncompiled, or compiles while it is timed, and would be
priced against compiled ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import time
from pathlib import Path
from statistics import fmean, median

from ..decoding import DecodeSettings, as_cached_lm
from ..errors import UserError
from ..kinds.factory import build_decoder, tree_choice
from ..kinds.registry import BY_NAME, target_alone, trained_drafter
from ..planning import (NODE_BUDGETS, Costs, Plan, TreeCosts, fallback_plan, implausible, noisy, plan_chain,
                        plan_hybrid_chain, plan_tree_measured)
from ..prompts import EncodedPrompt
from ..trees import TREE_CHOICES
from .calibration import (CALIBRATION_PROMPTS, LOOKUP_CALIBRATION_PROMPTS, Acceptance, Calibration,
                          calibration_prompts, chain_hybrid, check_calibration, continuation_prompts, drafter_acceptance,
                          lookup_modes, tree_acceptance, verified_layers)
from .config import PLAN_MAX_K, PLAN_MAX_NODES, PLAN_PROBE_TOKENS, EvalConfig
from .costs import forward_curve
from .loading import LoadedModels
from .plan_cache import (Measurer, PlanCache, Store, acceptance_key, content_hash, costs_key, drafter_identity, now,
                         plans_home)
from .report import LOOKUP_MODE, weights_fingerprint

TOPK_CHOICES = (1, 2, 4, 8)  # EAGLE-2 top-k weighed by --tree-nodes auto, up to --tree-topk
STEP_PROBE_TOKENS = PLAN_PROBE_TOKENS  # tokens decoded on the probe prompt to time a tree's steps
WARM_STEPS = 2  # a whole step's first timed steps left out (caches, allocator)
COST_ROUNDS = 3  # interleaved rounds of every chain cost, at every probe, at most
MIN_COST_ROUNDS = 2  # rounds every chain cost takes; the rest only where these disagree (`agreeing`)
# Round medians within 5% of each other measured a quiet machine: a cost kept as the median of its
# rounds lies between two of them whatever a third says (the median of three lies between the other
# two; the verification curve, a median of every round's timings, about so), so a third round moves
# it by about their spread at most, a third of the 15% a plan is to come within of its measurement.
# A busy machine's rounds disagree by more, and get the third.
ROUND_AGREEMENT = 0.05
ROUND_REPEATS = 3  # timed repeats of each cost per round
COST_ATTEMPTS = 2  # measurements of impossible costs (`planning.implausible`) before a plan falls back
PROBE_BUCKETS = 3  # prompt-length buckets whose mid-decode costs a plan averages
# Probes whose lengths all lie within this ratio are one probe, the middle one: a forward's cost
# grows about linearly with the context, and slowly (Gemma-3-270M, 2 cores: the 1- and 7-token
# forwards at 148 and 180 tokens of context differ by under 3%), so two more probes there bought
# nothing for two thirds of a chain plan's cost rounds (n-gram's 23 s in the Gemma-3 demo).
PROBE_SPAN = 1.25
CURVE_CHUNK = 3  # node budgets a tree plan's verification curve grows by, past 8 nodes
# Timed rounds of a tree plan's verification curve: as many as a chain cost's round (`ROUND_REPEATS`),
# whose medians agree within `ROUND_AGREEMENT` on a quiet machine; 7 took 7 s of EAGLE-3's plan on
# Gemma-3 (2 cores). A curve that looks busy is said to be (`planning.noisy`), as before: measured
# again, Gemma-3's 10-node verification stayed dearer than its 11-node one (MKL's kernels, not noise).
CURVE_REPEATS = ROUND_REPEATS
EXPECTED_TREE_STEPS = 6  # whole tree steps a plan's progress line expects to measure


@dataclasses.dataclass
class DrafterPlanning:
    """What planning one drafter reads and writes: its settings and models, the run's shared
    calibration, the cache's stores (the target's costs; the drafter's own costs, the same store
    where its weights have a fingerprint, else one kept for this run only; its acceptance) and the
    drafter's name in cost entries (`drafter`), and its `Measurer` (progress line, measurement times)."""

    cfg: EvalConfig
    models: LoadedModels
    calibration: Calibration | None
    costs: Store
    own_costs: Store
    acceptance: Store
    drafter: str
    measurer: Measurer

    def measured(self, store: Store, name: str, measure, what: str, **kwargs):
        return self.measurer.measured(store, name, measure, what, **kwargs)


def cost_probes(prompts: list[EncodedPrompt], max_new_tokens: int) -> list[list[int]]:
    """The sequences a plan's costs are measured at: the middle-length prompt of each of up to
    `PROBE_BUCKETS` equal-size buckets of the run's prompts by length, continued halfway through its
    decode (a forward's cost grows about linearly with the context, so mid-decode costs a decode's
    mean). One probe prompt planned n-gram on a mixed set at 1.10x that measured 0.94x: the costs
    of ~10-token prompts do not hold for ~850-token ones; probes within `PROBE_SPAN` of each other
    are one."""
    ordered = sorted(prompts, key=lambda p: len(p.ids))
    n = min(PROBE_BUCKETS, len(ordered))
    chosen = [ordered[(2 * b + 1) * len(ordered) // (2 * n)].ids for b in range(n)]
    at_length = {len(ids) + max_new_tokens // 2: ids for ids in chosen}  # one probe per length
    lengths = sorted(at_length)
    if lengths[-1] <= PROBE_SPAN * lengths[0]:
        lengths = [lengths[len(lengths) // 2]]
    return [list(itertools.islice(itertools.cycle(at_length[n]), n)) for n in lengths]


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


def hybrid_lookup_seconds(cfg: EvalConfig, probes: list[list[int]], max_k: int) -> list[float]:
    """A chain hybrid's lookup share of a step looking up k = 0 .. max_k, the mean over the probes: a
    lookup-first step's drafting, where its model's steps pay the hybrid's measured share (host time
    of milliseconds: measured each plan, not kept)."""
    at = [lookup_seconds(cfg, cfg.hybrid, ids, max_k) for ids in probes]
    return [fmean(s[k] for s in at) for k in range(max_k + 1)]


def walked_summary(walks: dict) -> list[dict]:
    """The report's line per walked hybrid setting: tokens a step, the share of steps the model
    drafted, the nodes a step verified (beside the pending token)."""
    out = []
    for (k, first), steps in sorted(walks.items()):
        n = max(1, len(steps))
        out.append({"num_draft_tokens": k, "lookup_first": first, "steps": len(steps),
                    "tokens_per_step": sum(s.tokens for s in steps) / n, "model_share": sum(s.model for s in steps) / n,
                    "nodes_per_step": sum(s.nodes for s in steps) / n})
    return out


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


def target_round(cfg: EvalConfig, models: LoadedModels, ids: list[int], layers: tuple[int, ...],
                 sizes: int, overhead: float | None = None) -> tuple[list[list[float]], float]:
    """One round of a chain plan's target costs at the end of `ids`: its forwards of 1 .. `sizes`
    tokens (timings by size) and a plain step's overhead beyond its forward (`overhead`, where an
    earlier round measured it). The forwards of 2 .. n tokens are the decoder's verifications, with
    its drafter's hidden `layers`; one token is what K = 0 runs, the target alone, which reads none
    (so a plain step costs verify[0] plus the overhead, as measured)."""
    target_lm = models.target_lm or as_cached_lm(models.target)
    verify = forward_curve(target_lm, ids, sizes, repeats=ROUND_REPEATS, hidden_layers=layers)
    if layers:  # K = 0 decodes with the target alone: a plain one-token forward
        verify[0] = forward_curve(target_lm, ids, [1], repeats=ROUND_REPEATS)[0]
    return verify, loop_overhead(models, ids, median(verify[0])) if overhead is None else overhead


def agreeing(series: list[list[float]]) -> bool:
    """Whether every cost's round medians (`series`: one list per cost, a median per round) lie within
    `ROUND_AGREEMENT` of their median."""
    return all(max(s) - min(s) <= ROUND_AGREEMENT * median(s) for s in series)


def interleaved_rounds(one_round, series) -> list:
    """`one_round(r)` for r = 0, 1, ..: `MIN_COST_ROUNDS` rounds, then more, up to `COST_ROUNDS`, while
    their costs (`series(rounds)`: one list per cost, a median per round) disagree (`agreeing`)."""
    rounds: list = []
    while len(rounds) < MIN_COST_ROUNDS or (len(rounds) < COST_ROUNDS and not agreeing(series(rounds))):
        rounds.append(one_round(len(rounds)))
    return rounds


def round_label(r: int) -> str:
    """Round r's place on the progress line: the rounds to come are known only after the first ones."""
    return f"round {r + 1} of {COST_ROUNDS if r >= MIN_COST_ROUNDS else f'{MIN_COST_ROUNDS}-{COST_ROUNDS}'}"


def target_series(rounds: list) -> list[list[float]]:
    """A chain's target costs, one list of round medians each (`agreeing`): at every probe, the
    forward of each size and a plain step (a one-token forward and the loop's overhead: the
    overhead alone is a small difference of two timings, whose relative spread says little of a
    step's cost)."""
    out = []
    for p in range(len(rounds[0])):
        out += [[median(r[p][0][n]) for r in rounds] for n in range(len(rounds[0][p][0]))]
        out.append([median(r[p][0][0]) + r[p][1] for r in rounds])
    return out


def drafter_series(rounds: list) -> list[list[float]]:
    """A chain drafter's costs, one list of its rounds' seconds each (`agreeing`): drafting each k at
    every probe."""
    return [[r[p][0][k] for r in rounds] for p in range(len(rounds[0])) for k in range(len(rounds[0][p][0]))]


def round_noise(rounds: list[list[list[float]]]) -> list[str]:
    """A busy machine: the rounds' medians at a probe disagree (a spike within a round is left to
    its median). `rounds[r][n]`: round r's timings of n + 1 tokens."""
    return noisy([[median(r[n]) for r in rounds] for n in range(len(rounds[0]))])


def round_at_probes(plan: DrafterPlanning, probes: list[list[int]], what: str, at_probe, r: int) -> list:
    """Round r: `at_probe(ids)` at every probe, each on the progress line as `what` at the probe's
    length: `[probe]`."""
    measured = []
    for ids in probes:
        plan.measurer.doing(f"{what} at {len(ids)} ({round_label(r)})")
        measured.append(at_probe(ids))
        plan.measurer.tick()
    return measured


def rounds_at_probes(plan: DrafterPlanning, probes: list[list[int]], what: str, at_probe, series) -> list:
    """`round_at_probes` round after round (`interleaved_rounds`, `series` telling whether they
    agree): `[round][probe]`."""
    return interleaved_rounds(lambda r: round_at_probes(plan, probes, what, at_probe, r), series)


def chain_target_rounds(plan: DrafterPlanning, probes: list[list[int]], max_k: int, fresh: bool,
                        settled=lambda rounds: False) -> list:
    """The target's chain costs at every probe in interleaved rounds (a machine that slows down
    mid-measurement hits every size alike): `[round][probe]` = (verify timings by size, overhead).
    Two rounds, and a third only where they disagree (`agreeing`) and the plan is not `settled` by
    them (`settles`), kept as an entry of its own: a drafter reading the first two from the cache
    measures it only where its own plan needs it. The loop's overhead is the first round's at each
    probe, kept by the rest: a plain decode of its own a round (0.7-1.0 s on Gemma-3, 2 cores) for a
    difference of two timings that came out at 0 to 0.5 ms there. Shared by every drafter verifying
    with the same hidden layers and sizes."""
    cfg, models = plan.cfg, plan.models
    layers = verified_layers(cfg, models, cfg.decode_settings(k=max_k, nodes=cfg.max_tree_nodes))
    sizes = max_k + 1 + (max_k if cfg.hybrid else 0)
    what = f"target: forwards of 1 .. {sizes} tokens"
    name = f"chain target: layers {list(layers)}, 1 .. {sizes} tokens at {[len(p) for p in probes]}"
    overheads: dict[int, float] = {}  # by probe: its first round's

    def at_probe(ids: list[int]) -> tuple[list[list[float]], float]:
        verify, overhead = target_round(cfg, models, ids, layers, sizes, overheads.get(len(ids)))
        overheads[len(ids)] = overhead
        return verify, overhead

    def one_round(r: int) -> list:
        return round_at_probes(plan, probes, what, at_probe, r)

    rounds = plan.measured(plan.costs, name, lambda: [one_round(r) for r in range(MIN_COST_ROUNDS)], what,
                           units=MIN_COST_ROUNDS * len(probes), fresh=fresh)
    overheads.update({len(ids): overhead for ids, (_, overhead) in zip(probes, rounds[0])})
    for r in range(len(rounds), COST_ROUNDS):
        if agreeing(target_series(rounds)) or settled(rounds):
            break
        rounds = [*rounds, plan.measured(plan.costs, f"{name}, round {r + 1}", lambda: one_round(r), what,
                                         units=len(probes), fresh=fresh)]
    return rounds


def chain_drafter_rounds(plan: DrafterPlanning, probes: list[list[int]], acceptance: Acceptance, max_k: int,
                         fresh: bool) -> list:
    """The drafter's share of a chain step drafting 0 .. max_k at every probe, in 2 or 3 rounds
    (`interleaved_rounds`): `[round][probe]` = (seconds by k, noise warnings)."""
    cfg, models = plan.cfg, plan.models

    def measure():
        return rounds_at_probes(plan, probes, f"{cfg.drafter_name}: drafting 1 .. {max_k}",
                                lambda ids: drafter_seconds(cfg, models, ids, acceptance, max_k), drafter_series)

    name = (f"chain drafter {plan.drafter}: 1 .. {max_k} at {[len(p) for p in probes]}, acceptance "
            f"{content_hash(acceptance.per_position)}")
    return plan.measured(plan.own_costs, name, measure, f"{cfg.drafter_name}: drafting 1 .. {max_k}",
                         units=COST_ROUNDS * len(probes), fresh=fresh)


def chain_costs(target: list, drafter: list, probes: int, noise: tuple[str, ...] = ()) -> Costs:
    """Chain costs from rounds of the target's (`chain_target_rounds`) and the drafter's
    (`chain_drafter_rounds`): each the median of its rounds at a probe, then the mean over the
    probes (equal-size buckets of the run's prompts)."""
    verify = [[[t for r in target for t in r[p][0][n]] for n in range(len(target[0][p][0]))] for p in range(probes)]
    return Costs(tuple(fmean(median(v[n]) for v in verify) for n in range(len(verify[0]))),
                 tuple(fmean(median(r[p][0][k] for r in drafter) for p in range(probes))
                       for k in range(len(drafter[0][0][0]))),
                 fmean(median(r[p][1] for r in target) for p in range(probes)), noise)


def settles(decide, target: list, drafter: list, probes: int) -> bool:
    """Whether the target's rounds settle the plan (`decide(costs)`: its choice): the plan made
    with each round alone is the one made with them all. A third round would put each cost about
    between the two's (the median of three round medians lies between the first two; the median of
    their pooled timings, what `chain_costs` takes, about so), so where either end makes the plan
    both make, it is not measured: on Gemma-3's 2 cores the two disagreed by more than
    `ROUND_AGREEMENT` in every run of the demo (a 4-token forward 81.9 and 75.7 ms), so the third,
    2.5-3.3 s, ran every time; n-gram planned K = 3 in every run, with three rounds and with two."""
    whole = decide(chain_costs(target, drafter, probes))
    return all(decide(chain_costs([r], drafter, probes)) == whole for r in target)


def measure_chain_costs(plan: DrafterPlanning, probes: list[list[int]], acceptance: Acceptance, max_k: int,
                        decide, fresh: bool = False) -> tuple[Costs, dict]:
    """Every chain cost at every probe (`chain_costs`), the drafter's first, the target's rounds
    then measured as the plan (`decide`) needs them (`settles`); and the rounds each took."""
    drafter = chain_drafter_rounds(plan, probes, acceptance, max_k, fresh)
    target = chain_target_rounds(plan, probes, max_k, fresh,
                                 lambda rounds: settles(decide, rounds, drafter, len(probes)))
    noise = sorted({w for p in range(len(probes)) for w in round_noise([r[p][0] for r in target])}
                   | {w for r in drafter for _, warnings in r for w in warnings})
    return chain_costs(target, drafter, len(probes), tuple(noise)), {"target": len(target), "drafter": len(drafter)}


def trusted_chain_costs(plan: DrafterPlanning, probes: list[list[int]], acceptance: Acceptance,
                        max_k: int, decide) -> tuple[Costs, list[str], dict]:
    """The chain costs, measured again (up to `COST_ATTEMPTS` times, never from the cache) while
    `planning.implausible` finds them impossible; its reasons where they stayed so; the rounds taken."""
    for attempt in range(COST_ATTEMPTS):
        costs, rounds = measure_chain_costs(plan, probes, acceptance, max_k, decide, fresh=attempt > 0)
        doubts = implausible(costs, draft_forwards(plan.cfg, plan.models, acceptance, max_k))
        if not doubts:
            break
    return costs, doubts, rounds


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


def plan_drafter(plan: DrafterPlanning, probes: list[list[int]]) -> tuple[Plan, dict]:
    """The plan for one drafter and the report's `plan` block (SPEC §7); `probes`: `cost_probes`."""
    cfg, models = plan.cfg, plan.models
    if plans_a_tree(cfg, models):
        return plan_tree_drafter(plan, probes[len(probes) // 2])
    start = time.perf_counter()
    acceptance = drafter_acceptance(cfg, models, plan.calibration, plan.measurer, plan.acceptance)
    max_k = min(PLAN_MAX_K, len(acceptance.per_position))
    lookup = hybrid_lookup_seconds(cfg, probes, max_k) if acceptance.hybrid_walks else None

    def chain_plan(costs: Costs) -> Plan:
        if lookup is not None:
            return plan_hybrid_chain(acceptance.hybrid_walks, costs, lookup)
        return plan_chain(acceptance.per_position, costs, acceptance.proposal_rates, max_k, acceptance.extra_tokens,
                          acceptance.by_k)

    def choice(costs: Costs) -> tuple:
        chosen = chain_plan(costs)
        return chosen.num_draft_tokens, chosen.lookup_first

    costs, doubts, rounds = trusted_chain_costs(plan, probes, acceptance, max_k, choice)
    chosen = fallback_plan() if doubts else chain_plan(costs)
    block = {"num_draft_tokens": chosen.num_draft_tokens, "tree_nodes": None, "tree_topk": None,
             **({"lookup_first": chosen.lookup_first, "lookup_seconds": lookup,
                 "walked_hybrid": walked_summary(acceptance.hybrid_walks)} if lookup is not None else {}),
             "costs": {**costs.as_dict(), "context_lengths": [len(ids) for ids in probes], "rounds": rounds},
             "untrusted": doubts,
             "planned_speedup": chosen.planned_speedup, "expected_tokens": chosen.expected_tokens,
             "source": acceptance.source, "acceptance": acceptance.per_position,
             "proposal_rates": acceptance.proposal_rates, "extra_tokens": acceptance.extra_tokens,
             "walked": {str(k): {"acceptance": a, "proposal_rates": r} for k, (a, r) in acceptance.by_k.items()}
             if acceptance.by_k else None,
             "candidates": [{k: v for k, v in c.items() if k != "measured"} for c in chosen.as_dict()["candidates"]],
             "noise": list(costs.warnings), "seconds": time.perf_counter() - start}
    return chosen, block


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


def tree_step_seconds(cfg: EvalConfig, models: LoadedModels, ids: list[int], depth: int, nodes: int,
                      topk: int) -> tuple[int, float]:
    """(the model's tree nodes, median seconds) of a whole decoding step (draft, verification,
    bookkeeping) with this tree on the probe prompt; K = 0 is a plain step. Warmed up by the
    decoder's own `warmup` (every graph its steps run: the target's for its tree size and hidden
    layers, the drafter's); the first `WARM_STEPS` steps timed are left out (caches, allocator), as
    a run's own warm-up decode leaves them out."""
    settings = cfg.decode_settings(k=depth, nodes=nodes, topk=topk)
    decoder = build_decoder(models.target_lm or models.target, models.drafter if depth else target_alone(),
                            settings if depth else settings.alone())
    decoder.warmup()
    seconds = decoder.generate(ids, STEP_PROBE_TOKENS).step_seconds
    drafter = getattr(decoder, "drafter", None)
    model = getattr(drafter, "model", drafter)  # a hybrid's n-gram nodes are counted apart
    return (model.max_nodes if model is not None else 1), median(seconds[WARM_STEPS:] or seconds)


def curve_chunks(depths: list[int], nodes: list[int]) -> list[list[int]]:
    """The verification sizes a tree plan may need, in the chunks it measures them by: 1 .. 8 tree
    nodes, then `CURVE_CHUNK` node budgets at a time up to the largest tree and its n-gram nodes."""
    beyond = [n for n in NODE_BUDGETS if 8 < n <= max(nodes) + max(depths)]
    return [list(range(1, 9))] + [beyond[i:i + CURVE_CHUNK] for i in range(0, len(beyond), CURVE_CHUNK)]


def tree_verification(cfg: EvalConfig, models: LoadedModels, ids: list[int], layers: tuple[int, ...],
                      sizes: list[int]) -> list[list[float]]:
    """The target's verification of `sizes` tree nodes after `ids` (timings by size), with the hidden
    `layers` the tree decoder verifies with, in `CURVE_REPEATS` rounds."""
    return forward_curve(models.target_lm or as_cached_lm(models.target), ids, sizes, repeats=CURVE_REPEATS, tree=True,
                         hidden_layers=layers)


class TreeCurve:
    """A tree plan's verification curve, measured chunk by chunk (`curve_chunks`) as its search
    needs it (`extend`), each chunk shared and kept as the target's cost."""

    def __init__(self, plan: DrafterPlanning, ids: list[int], layers: tuple[int, ...], chunks: list[list[int]]):
        self.plan, self.ids, self.layers, self.chunks = plan, ids, layers, chunks
        self.timings: list[list[float]] = []

    def chunk(self, sizes: list[int], fresh: bool = False) -> list[list[float]]:
        plan = self.plan
        name = f"tree verification: layers {list(self.layers)}, {sizes} nodes at {len(self.ids)}"
        return plan.measured(plan.costs, name, lambda: tree_verification(plan.cfg, plan.models, self.ids, self.layers,
                                                                         sizes),
                             f"target: verifying {sizes[0]} .. {sizes[-1]} tree nodes", fresh=fresh)

    def first(self, plain: float, fresh: bool = False) -> TreeCosts:
        self.timings = self.chunk(self.chunks[0], fresh)
        return self.costs(self.chunks[0], plain, {})

    def costs(self, sizes: list[int], plain: float, exact: dict) -> TreeCosts:
        return TreeCosts(tuple(sizes), tuple(median(t) for t in self.timings), plain, tuple(noisy(self.timings)), exact)

    def extend(self, costs: TreeCosts) -> TreeCosts | None:
        """The costs with the next chunk of the curve measured, None when it is all measured."""
        done = len(costs.sizes)
        following = next((c for c in self.chunks if c[0] > costs.sizes[-1]), None)
        if following is None:
            return None
        self.timings = self.timings[:done] + self.chunk(following)
        wider = self.costs([*costs.sizes, *following], costs.plain, costs.exact)
        return dataclasses.replace(wider, lookup=costs.lookup)


def plain_step(plan: DrafterPlanning, ids: list[int], fresh: bool = False) -> float:
    """A plain decoding step's seconds at the end of `ids` (the target's cost: shared and kept)."""
    return plan.measured(plan.costs, f"plain step at {len(ids)}",
                         lambda: tree_step_seconds(plan.cfg, plan.models, ids, 0, 1, 1)[1],
                         "target: a plain decoding step", fresh=fresh)


def trusted_tree_costs(plan: DrafterPlanning, curve: TreeCurve, ids: list[int]) -> tuple[TreeCosts, list[str]]:
    """The target's first chunk of tree verification and a plain step, measured again (up to
    `COST_ATTEMPTS` times, never from the cache) while a plain step's overhead beyond its forward is
    impossible (`planning.implausible`); and its reasons where it stayed so."""
    for attempt in range(COST_ATTEMPTS):
        plain = plain_step(plan, ids, fresh=attempt > 0)
        costs = curve.first(plain, fresh=attempt > 0)
        doubts = implausible(Costs((costs.verify[0],), (0.0,), max(0.0, plain - costs.verify[0])))
        if not doubts:
            break
    return costs, doubts


def plan_tree_drafter(plan: DrafterPlanning, ids: list[int]) -> tuple[Plan, dict]:
    """The plan for Medusa heads or an EAGLE-3 draft verifying trees: depth, nodes and top-k, and a
    hybrid's mode (`--lookup-first`). A hybrid's trees are recorded verifying both branches (a
    lookup-first hybrid's read off them, `planning.lookup_first_table`), and its model's steps timed
    alone, as its model's own plan times them (the same cache entries: EAGLE-3's plan and its
    hybrid's share them); its lookup's nodes are priced on the curve (`planning.tree_seconds`)."""
    cfg, models = dataclasses.replace(plan.cfg, lookup_first="off"), plan.models
    if plan.calibration is None or not plan.calibration.prompts:
        raise UserError(f"planning {cfg.drafter_name}'s tree needs its acceptance on other prompts than the evaluated "
                        "ones; pass --calibration-prompts FILE")
    start = time.perf_counter()
    depths, nodes, topks, dynamic = tree_settings(cfg, models)
    model = dataclasses.replace(cfg, **{cfg.hybrid: False}) if cfg.hybrid else cfg  # its steps timed without the lookup
    identity = drafter_key(model) or plan.drafter
    recorded = tree_acceptance(cfg, models, plan.calibration, plan.measurer, plan.acceptance, depths, nodes, topks,
                               dynamic, identity)
    table = {(k, d, n): (e, tuple((int(m), float(share)) for m, share in x)) for k, d, n, e, x in recorded["table"]}
    first = {(k, d, n): t for k, d, n, t in recorded.get("first_table") or []} or None
    modes = lookup_modes(plan.cfg) if first else (False,)
    layers = verified_layers(cfg, models, cfg.decode_settings(k=max(depths), nodes=max(nodes), topk=max(topks)))
    curve = TreeCurve(plan, ids, layers, curve_chunks(depths, nodes))
    costs, doubts = trusted_tree_costs(plan, curve, ids)
    if cfg.hybrid:  # host time, milliseconds: measured each plan, not kept
        costs = dataclasses.replace(costs, lookup=tuple(lookup_seconds(cfg, cfg.hybrid, ids, max(depths))))

    def measure(topk, depth, n):
        depth = min(depth, n - 1) if dynamic else depth  # EAGLE-2's tree of n nodes is at most n - 1 deep
        return plan.measured(plan.own_costs, f"tree step {identity}: top-{topk}, K {depth}, {n} nodes at {len(ids)}",
                             lambda: tree_step_seconds(model, models, ids, depth, n, topk)[1],
                             f"a whole step of top-{topk}, K = {depth}, {n} nodes")

    chosen = fallback_plan() if doubts else None
    if chosen is None:
        chosen, costs = plan_tree_measured(table, costs, measure, curve.extend, first=first, modes=modes)
    ranked = sorted(chosen.candidates, key=lambda c: -c.planned_speedup)
    block = {"num_draft_tokens": chosen.num_draft_tokens, "tree_nodes": chosen.tree_nodes,
             "tree_topk": chosen.tree_topk if dynamic else None,
             **({"lookup_first": chosen.lookup_first} if first else {}),
             "costs": {**costs.as_dict(), "context_lengths": [len(ids)]}, "untrusted": doubts,
             "planned_speedup": chosen.planned_speedup, "expected_tokens": chosen.expected_tokens,
             "source": f"{recorded['prompts']} calibration prompts from {cfg.calibration_prompts} "
                       f"({recorded['steps']} recorded tree steps)",
             "extra_tokens": recorded["extra_tokens"], "candidates": [dataclasses.asdict(c) for c in ranked],
             "noise": list(costs.warnings), "seconds": time.perf_counter() - start}
    return chosen, block


def warn_untrusted(cfg: EvalConfig, doubts: list[str]) -> None:
    """One `warning:` line for costs that stayed impossible when measured again: the plan fell back."""
    if doubts:
        print(f"warning: {cfg.drafter_name}: the measured costs cannot be the machine's ({'; '.join(doubts)}), "
              f"measured {COST_ATTEMPTS} times; planned the target alone (K = 0) rather than speculate on noise: "
              "run alone, or pass --num-draft-tokens K", file=sys.stderr)


def warn_noise(cfg: EvalConfig, warnings, cached: bool = False) -> None:
    """One `warning:` line for a cost measurement that looks like a busy machine (kept as it was
    measured: a plan from the cache says so again, until `--replan`)."""
    if warnings:
        again = " and measure it again with --replan" if cached else ""
        print(f"warning: {cfg.drafter_name}: the cost measurement looks like a busy machine ({'; '.join(warnings)}); "
              f"the plan may be made from noise: run alone{again}", file=sys.stderr)


def drafter_key(cfg: EvalConfig) -> str | None:
    """The drafter's identity in the cache's keys (`plan_cache.drafter_identity`): its kind, its
    weights, its own flags, a lookup joined, and the tree it drafts (a tree file by its content)."""
    tree = cfg.tree if cfg.tree in TREE_CHOICES else content_hash(Path(cfg.tree).read_text())
    kind_settings = {f: getattr(cfg, f) for f in BY_NAME[cfg.drafter_kind].settings()}
    lookup_settings = {f: getattr(cfg, f) for f in BY_NAME[cfg.hybrid].settings()} if cfg.hybrid else {}
    return drafter_identity(cfg.drafter_kind, cfg.drafter_path, {"hybrid": cfg.hybrid, "kind": kind_settings,
                                                                  "lookup": lookup_settings, "tree": tree,
                                                                  "tree_topk": cfg.tree_topk})


def decode_settings_key(cfg: EvalConfig) -> dict:
    """The settings that move acceptance, beside the drafter's own (`drafter_key`)."""
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed, "max_new_tokens": cfg.max_new_tokens,
            "num_draft_tokens": cfg.num_draft_tokens, "tree_nodes": cfg.tree_nodes, "plan_max_k": PLAN_MAX_K,
            **({"lookup_first": cfg.lookup_first} if cfg.hybrid else {})}


class PlanRun:
    """What the plans of one run share: the cache (`plan_cache`), its keys' parts that every drafter
    shares (the target's fingerprint, the calibration set's content), and the calibration prompts'
    continuations (`calibration.Calibration`: the first `continuations` of them decoded together)."""

    def __init__(self, cfg: EvalConfig, models: LoadedModels, calibration: list[EncodedPrompt],
                 continuations: int = CALIBRATION_PROMPTS):
        self.started = now()
        self.target = weights_fingerprint(cfg.target)
        self.cache = PlanCache(plans_home(), replan=cfg.replan)
        self.calibration_set = content_hash([p.ids for p in calibration])
        self.dtype, self.device = models.dtype_name, models.device
        self.costs_key = costs_key(self.target, getattr(models.target_lm, "engine", "eager"), self.dtype, self.device)
        self.costs = self.cache.costs(self.costs_key)
        store = self.cache.acceptance(acceptance_key(self.target, "the target alone", self.calibration_set,
                                                     {"max_new_tokens": cfg.max_new_tokens, "eos": sorted(models.eos)},
                                                     self.dtype, self.device))
        self.calibration = Calibration(cfg, models, calibration, store, continuations) if calibration else None

    def drafter(self, cfg: EvalConfig, models: LoadedModels, bar) -> DrafterPlanning:
        identity = drafter_key(cfg)
        store = self.cache.acceptance(acceptance_key(self.target, identity, self.calibration_set,
                                                     decode_settings_key(cfg), self.dtype, self.device))
        own = self.costs if identity else self.cache.costs({**self.costs_key, "drafter": None, "name": cfg.drafter_name})
        return DrafterPlanning(cfg, models, self.calibration, self.costs, own, store, identity or cfg.drafter_name,
                               Measurer(self.started, bar))


def expected_units(cfg: EvalConfig, models: LoadedModels, probes: list[list[int]], calibration: int) -> int:
    """A plan's units of work for its progress line, at most: calibration prompts, cost rounds, trees."""
    if plans_a_tree(cfg, models):
        return len(tree_settings(cfg, models)[2]) * min(CALIBRATION_PROMPTS, calibration) + 2 + EXPECTED_TREE_STEPS
    walked = BY_NAME[cfg.drafter_kind].planned_from_walks or chain_hybrid(cfg)
    prompts = min(LOOKUP_CALIBRATION_PROMPTS if walked else CALIBRATION_PROMPTS,
                  calibration) if cfg.calibration_prompts else 0
    return prompts + 2 * COST_ROUNDS * len(probes)


def resolve_plans(cfgs: list[EvalConfig], models: list[LoadedModels], prompts: list[EncodedPrompt],
                  calibration: list[EncodedPrompt], progress: bool = False) -> tuple[list[EvalConfig], list[dict | None]]:
    """Every `auto` config with its planned K and tree (K = 0: the target alone), and the plans
    for the reports (`cached`: made from measurements of earlier runs alone; `measured_at`: the
    oldest). Costs are measured at `cost_probes` of the evaluated `prompts` (their lengths:
    acceptance comes from other prompts); `progress`: one line per drafter's plan. A chain drafter
    has no tree to size: beside a tree drafter in a compare (`run.check_tree_nodes_auto` refuses it
    alone), its report says `--tree-nodes auto` did not apply. The target keeps its prefills while
    planning (`CachedLM.keeping_prefills`): every cost is timed after the same few probes."""
    probes = cost_probes(prompts, cfgs[0].max_new_tokens)
    target_lm = models[0].target_lm
    with target_lm.keeping_prefills() if target_lm is not None else contextlib.nullcontext():
        return plan_each(cfgs, models, probes, calibration, progress)


def plan_each(cfgs: list[EvalConfig], models: list[LoadedModels], probes: list[list[int]],
              calibration: list[EncodedPrompt], progress: bool) -> tuple[list[EvalConfig], list[dict | None]]:
    """`resolve_plans`, drafter by drafter, sharing one `PlanRun` (made by the first that plans)."""
    from tqdm.auto import tqdm

    run = None
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
        run = run or PlanRun(cfgs[0], models[0], calibration, continuation_prompts(cfgs))
        with tqdm(total=expected_units(cfg, m, probes, len(calibration)), desc=f"plan {cfg.drafter_name}",
                  unit="step", disable=not progress) as bar:
            planning = run.drafter(cfg, m, bar)
            plan, block = plan_drafter(planning, probes)
            bar.total = bar.n
            planning.measurer.doing(f"K = {plan.num_draft_tokens}" + (f", {plan.tree_nodes} nodes" if tree else "")
                                    + (f", lookup {LOOKUP_MODE[plan.lookup_first]}" if plan.lookup_first is not None else "")
                                    + (" (from the plan cache)" if planning.measurer.cached else ""))
        warn_noise(cfg, block["noise"], planning.measurer.cached)  # below its progress line, not inside it
        warn_untrusted(cfg, block["untrusted"])
        mode = {True: "on", False: "off"}.get(plan.lookup_first, cfg.lookup_first)
        planned.append(dataclasses.replace(cfg, num_draft_tokens=plan.num_draft_tokens, lookup_first=mode,
                                           tree_nodes=plan.tree_nodes if tree else None,
                                           tree_topk=plan.tree_topk if tree and plan.tree_topk else cfg.tree_topk))
        blocks.append({**block, **not_applicable, "cached": planning.measurer.cached,
                       "measured_at": planning.measurer.measured_at})
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


__all__ = ["export_plans", "no_tree_reason", "planned_k", "plan_drafter", "plan_tree_drafter", "resolve_plans"]
