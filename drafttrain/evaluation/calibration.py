"""A drafter's acceptance on other prompts than the evaluated ones, for its plan (`evaluation.plan`):
the held-out acceptance its export recorded, or what it does on `--calibration-prompts`.

What a plan reads of the calibration prompts, and why it is no more than the decision needs:
- The target's greedy continuations of the calibration prompts are decoded once (and kept,
  `plan_cache`), and shared by every drafter of the run: each lookup of the Gemma-3 demo decoded
  all 24 prompts itself, about 50 s each. A greedy lookup walks them (`planning.walk_chain`: exact,
  its proposal being a function of the text).
- They are decoded in one batch (`decoding.batch.BatchGenerator`: left-padded, greedy, at most
  `CONTINUATION_BATCH` rows), all that the run's plans may read (`continuation_prompts`:
  `LOOKUP_CALIBRATION_PROMPTS` where a lookup is planned, else `CALIBRATION_PROMPTS`). Decoded one
  at a time by n-gram lookup at K = 3 they cost the Gemma-3 demo 58 s, 2.4 s a prompt on 2 cores,
  each step reading the weights for one row; a batch's step reads them once for all its rows: 48 s
  there in one batch, 28 s once its prefill ran the 262k-token head over each row's last token
  only, not over every prompt token (its head over 24 rows is compute on 2 cores; a GPU gains more),
  24 s once each row's prompt was prefilled alone rather than padded to the longest. A
  drafter may stop before it reads them all (`enough_prompts`); the batch decodes them all anyway,
  a row more in it costing a fraction of a prompt decoded alone later. Greedy rows equal each
  prompt decoded alone in float64; in float32 (or lower) a row may take the other token at a near
  tie (a batch's matmuls sum in another order than one row's), which only changes which text
  calibration reads: the target's own greedy text still, to its rounding. A target the static
  engine cannot run (`static_support`) is decoded a prompt at a time, as before: by the first
  lookup (n-gram) at K = `CONTINUATION_K` (lossless, quicker than the target alone).
- A model drafter decoding greedily on the eager engine is decoded against its target's
  continuations rather than the target (`decoding.engines.teacher`: the target's hidden states
  along each prompt and continuation, kept by the batch that decoded it for the first drafter
  reading them (`BatchGenerator.greedy_with_hidden`), else one teacher-forced forward a prompt;
  every verdict is read off the continuation): the very
  steps a decode against the target takes, at the cost of the drafter's own work. EAGLE-3's tree
  recordings verified the largest tree (64 nodes) through Gemma-3 at every step of 8 prompts for
  each of 4 top-ks, most of its plan's 607 s. A sampled decode, and a decode on the static engine
  (a GPU's, where verification is cheap and the replay is not worth its own forwards), decode
  against the target as before. Replayed, EAGLE-3's tree recordings grow the narrower top-ks'
  trees beside the widest one's in the same draft forwards (`recorded_trees`): one decode a prompt
  for all of them, not one per top-k. Its hybrid (`+ngram`) planned after it in the same run reads
  its trees off that recording, the lookup's chain found at each step's start and the steps weighed
  as the hybrid would take them (`hybrid_trees`, `planning.as_hybrid_steps`): its own recording was
  12-13 s of the Gemma-3 demo's plans on 2 cores.
- Prompts are read one at a time until the drafter's tokens a step is known to within 7.5% at 95%
  confidence (`planning.enough_prompts`: half of the 15% a plan is to come within of its
  measurement), at least 3, at most `CALIBRATION_PROMPTS` (`LOOKUP_CALIBRATION_PROMPTS` for a
  lookup), as many as before: a drafter whose acceptance varies little stops early; one whose
  acceptance varies a lot reads the whole budget, as before.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import torch

from ..decoding import DecodeSettings, StaticLM, static_support
from ..decoding.batch import BatchGenerator
from ..decoding.chain import ChainDecoder, Proposer
from ..decoding.engines.teacher import TeacherForcedLM, teacher_forced
from ..errors import UserError
from ..export import RECORD
from ..kinds.base import Drafter
from ..kinds.factory import build_decoder, tree_choice
from ..kinds.registry import BY_NAME, LOOKUPS
from ..planning import (HybridStep, TreeStep, as_hybrid_steps, enough_prompts, lookup_beside, lookup_first_table,
                        tree_node_limit, tree_table, walk_chain, walk_hybrid, walked_rates)
from ..prompts import EncodedPrompt, PromptRecord, encode_prompts, prompt_content, read_prompts
from ..tokens import left_pad
from .config import PLAN_MAX_K, EvalConfig
from .loading import LoadedModels
from .plan_cache import Measurer, Store

CALIBRATION_PROMPTS = 8  # prompts of --calibration-prompts decoded per model drafter, at most
# n-gram lookup reads three times as many: copying varies from prompt to prompt far more than a
# model's acceptance does (walked tau at K=3 on SmolLM2's HumanEval answers: 1.02 to 3.31 per
# prompt; 1.47 over prompts 13-20, 1.58 over 13-36, 1.84 over the first 12), and its calibration
# is a walk over the target's continuations, with no draft model to run.
LOOKUP_CALIBRATION_PROMPTS = 24
CONTINUATION_K = 3  # n-gram lookup's K decoding a continuation alone (on 2 cores 4 tokens verify cheaply)
CONTINUATION_BATCH = 32  # continuations decoded together, at most: the batch's cache grows with it


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Per-position acceptance a_1 .. a_K and how often each position was proposed at all."""

    per_position: list[float]
    proposal_rates: list[float] | None
    source: str
    extra_tokens: float = 0.0  # a hybrid's n-gram nodes per step beside the model's K drafts
    by_k: dict[int, tuple[list[float], list[float]]] | None = None  # measured at each K (`planning.walk_chain`)
    hybrid_walks: dict[tuple[int, bool], list[HybridStep]] | None = None  # a chain hybrid's steps by (K, lookup
                                                                           # first) (`planning.walk_hybrid`)


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
    fit the caches; model drafters decode the first `CALIBRATION_PROMPTS` of them, at most."""
    return encode_prompts(read_calibration(cfg), tokenizer, max_new_tokens=cfg.max_new_tokens,
                          context_limit=context_limit)


def continuation_prompts(cfgs: list[EvalConfig]) -> int:
    """How many calibration prompts' continuations the run's plans may read: a planned lookup walks
    up to `LOOKUP_CALIBRATION_PROMPTS` (`walks`), a model drafter replays up to `CALIBRATION_PROMPTS`."""
    lookup = any(cfg.num_draft_tokens == "auto" and (walks(cfg) or chain_hybrid(cfg)) for cfg in cfgs)
    return LOOKUP_CALIBRATION_PROMPTS if lookup else CALIBRATION_PROMPTS


class Calibration:
    """What the plans of one run share about its calibration prompts: the target's greedy
    continuations (decoded once, the first `needed` of them together, kept in `store`) and its
    teacher-forced targets along them."""

    def __init__(self, cfg: EvalConfig, models: LoadedModels, prompts: list[EncodedPrompt], store: Store,
                 needed: int = CALIBRATION_PROMPTS):
        self.cfg, self.models, self.prompts, self.store = cfg, models, prompts, store
        self.needed = needed
        self._teachers: dict[tuple[int, tuple[int, ...]], object] = {}
        self._hidden: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # the batch's hidden states, by prompt
        self._decoder = None
        # a replayed model's recorded trees, by prompt, for its hybrid to read (`hybrid_trees`):
        # (model, depth, nodes, top-ks) -> [(prompt index, {top-k: its steps})]
        self.recordings: dict[tuple, list[tuple[int, dict[int, list[TreeStep]]]]] = {}

    def continuation(self, i: int, measurer: Measurer, layers: tuple[int, ...] = ()) -> list[int]:
        """The target's greedy continuation of calibration prompt `i`; where it is not decoded yet,
        those of every prompt up to the `needed`-th (or the `i`-th) not decoded yet, in one batch
        (which keeps the target's hidden `layers` along them for `teacher`); a target the static
        engine cannot run decodes only up to the `i`-th, a prompt at a time (a drafter may stop
        before it reads them all: `enough_prompts`). Read inside a drafter's calibration only: the
        plan rests on that calibration, measured when it was."""
        found = self.store.get("continuations")
        done = found[0] if found is not None else []
        if i >= len(done):
            batched = self._batchable()
            end = max(i + 1, min(self.needed, len(self.prompts))) if batched else i + 1
            missing = [p.ids for p in self.prompts[len(done):end]]
            if batched:
                decoded, hidden = self._decode_batched(missing, measurer, layers)
                self._hidden.update({(len(done) + j, layers): h for j, h in enumerate(hidden or [])
                                     if len(done) + j < CALIBRATION_PROMPTS})  # all a model drafter reads
            else:
                decoded = [self._decode_alone(ids, measurer) for ids in missing]
            done = [*done, *decoded]
            self.store.put("continuations", done)
        return done[i]

    def _max_length(self) -> int:
        return max(len(p.ids) for p in self.prompts) + self.cfg.max_new_tokens

    def _batchable(self) -> bool:
        """Whether the static engine runs this target (`BatchGenerator` is built on it)."""
        return static_support(self.models.target, self._max_length()) is None

    def _decode_batched(self, prompts: list[list[int]], measurer: Measurer,
                        layers: tuple[int, ...]) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """The target's greedy continuations of `prompts`, `CONTINUATION_BATCH` rows at a time, and
        with `layers` its hidden states along each prompt and continuation (None without)."""
        batches = "in one batch" if len(prompts) <= CONTINUATION_BATCH else f"in batches of {CONTINUATION_BATCH}"
        measurer.doing(f"the target's greedy continuations of {len(prompts)} calibration prompts, {batches}")
        max_length = max(len(p) for p in prompts) + self.cfg.max_new_tokens
        generator = continuation_generator(self.models.target, min(len(prompts), CONTINUATION_BATCH), max_length)
        done, hidden = [], []
        eos = sorted(self.models.eos)
        for start in range(0, len(prompts), CONTINUATION_BATCH):
            chunk = prompts[start:start + CONTINUATION_BATCH]
            ids, mask = left_pad(chunk, 0, generator.device)  # padding is masked out: any id does
            if layers:
                rows, states = generator.greedy_with_hidden(ids, mask, max_new_tokens=self.cfg.max_new_tokens,
                                                            eos_token_ids=eos, hidden_layers=layers)
                hidden += states
            else:
                rows = generator.generate(ids, mask, max_new_tokens=self.cfg.max_new_tokens, eos_token_ids=eos)[0]
            done += rows
            measurer.tick(len(chunk))
        return done, (hidden if layers else None)

    def _decode_alone(self, prompt: list[int], measurer: Measurer) -> list[int]:
        """One continuation by the first lookup (n-gram) at K = `CONTINUATION_K`: the target's own
        greedy text (lossless), quicker than the target alone."""
        measurer.doing("the target's greedy continuation of a calibration prompt")
        if self._decoder is None:
            settings = DecodeSettings(num_draft_tokens=CONTINUATION_K, eos_token_ids=frozenset(self.models.eos))
            self._decoder = build_decoder(self.models.target_lm or self.models.target, Drafter(LOOKUPS[0]), settings)
            self._decoder.warmup()
        tokens = self._decoder.generate(prompt, self.cfg.max_new_tokens).tokens
        measurer.tick()
        return tokens

    def teacher(self, i: int, layers: tuple[int, ...], measurer: Measurer):
        """The target along prompt `i` and its continuation (`decoding.engines.teacher`), with its
        hidden `layers`: kept from the batch that decoded the continuation where it kept those
        layers (EAGLE-3's 8 teacher-forced forwards were 4 s of its plan on Gemma-3, 2 cores),
        else one forward; shared by every drafter reading those layers."""
        if (i, layers) not in self._teachers:
            sequence = self.prompts[i].ids + self.continuation(i, measurer, layers)
            kept = self._hidden.pop((i, layers), None)
            if kept is not None:
                self._teachers[(i, layers)] = TeacherForcedLM(self.models.target, sequence, kept, layers)
            else:
                measurer.doing(f"the target's hidden states along calibration prompt {i + 1}")
                self._teachers[(i, layers)] = teacher_forced(self.models.target, sequence, layers)
        return self._teachers[(i, layers)]


def continuation_generator(target, batch_size: int, max_length: int) -> BatchGenerator:
    """A batch generator on the run's target (the HF model the run's engine wraps: its weights are
    not loaded again; the generator's own cache and fused weights go when it does). Uncompiled on
    a CPU, where compiling costs more than one batch's decode saves; on CUDA, its default (CUDA
    graphs: the batch's steps are many and small)."""
    device = next(target.parameters()).device
    return BatchGenerator(target, batch_size=batch_size, max_length=max_length,
                          compile=False if device.type == "cpu" else None)


def replays(cfg: EvalConfig, models: LoadedModels) -> bool:
    """Whether a model drafter's calibration decodes against the target's continuations (greedy, on
    the eager engine) rather than the target."""
    return cfg.greedy and not isinstance(models.target_lm, StaticLM)


def walks(cfg: EvalConfig) -> bool:
    """A greedy lookup (its proposal a function of the text so far): its acceptance at every K is
    walked over the calibration outputs."""
    return BY_NAME[cfg.drafter_kind].planned_from_walks and cfg.greedy


def drafter_acceptance(cfg: EvalConfig, models: LoadedModels, calibration: Calibration | None, measurer: Measurer,
                       store: Store) -> Acceptance:
    """The chain acceptance a plan reads: calibrated (kept in `store`), else the export's record."""
    if cfg.calibration_prompts:
        hybrid = walks_hybrid(cfg, models)
        budget = LOOKUP_CALIBRATION_PROMPTS if walks(cfg) or hybrid else CALIBRATION_PROMPTS
        prompts = min(budget, len(calibration.prompts))
        found = measurer.measured(store, "hybrid walks" if hybrid else "chain",
                                  lambda: calibrate_chain(cfg, models, calibration, measurer, prompts),
                                  f"calibration on up to {prompts} prompts", units=prompts)
        return Acceptance(found["per_position"], found["proposal_rates"],
                          f"{found['prompts']} calibration prompts from {cfg.calibration_prompts}", found["extra_tokens"],
                          {int(k): tuple(v) for k, v in found["by_k"].items()} if found["by_k"] else None,
                          hybrid_steps(found.get("hybrid_walks")))
    recorded = None if cfg.hybrid else recorded_acceptance(cfg)  # a hybrid's own acceptance is not recorded
    if recorded is None:
        raise UserError(f"--num-draft-tokens auto needs {cfg.drafter_name}'s acceptance on other prompts than the "
                        f"evaluated ones, and it has none recorded ({RECORD}); pass --calibration-prompts FILE")
    return recorded


def calibrate_chain(cfg: EvalConfig, models: LoadedModels, calibration: Calibration, measurer: Measurer,
                    prompts: int) -> dict:
    """A chain drafter's acceptance on up to `prompts` calibration prompts, as the cache keeps it."""
    if walks(cfg):
        return walked_acceptance(cfg, calibration, measurer, prompts)
    if walks_hybrid(cfg, models):
        return walked_hybrid(cfg, models, calibration, measurer, prompts)
    return calibrated_acceptance(cfg, models, calibration, measurer, prompts)


def walked_acceptance(cfg: EvalConfig, calibration: Calibration, measurer: Measurer, prompts: int) -> dict:
    """A lookup's acceptance and proposal rates at every K = 1 .. PLAN_MAX_K, walked exactly over
    the target's greedy continuations (`planning.walk_chain`): copying is bursty, so the deepest K's
    per-position acceptance misjudges a smaller K's. Its acceptance is the deepest K's."""
    new_lookup = BY_NAME[cfg.drafter_kind].lookup
    settings = cfg.decode_settings(k=PLAN_MAX_K, nodes=cfg.max_tree_nodes)
    steps: dict[int, list[tuple[int, int]]] = {k: [] for k in range(1, PLAN_MAX_K + 1)}
    per_prompt = []
    for i, p in enumerate(calibration.prompts[:prompts]):
        continuation = calibration.continuation(i, measurer)
        for k in steps:  # the deepest K last: its steps are this prompt's tokens a step
            walked = walk_chain(p.ids, continuation, looking_up(new_lookup(settings), p.ids), k, cfg.max_new_tokens)
            steps[k] += walked
        per_prompt.append((sum(a + 1 for _, a in walked), len(walked)))
        if enough_prompts(per_prompt):
            break
    by_k = {k: walked_rates(s, k) for k, s in steps.items()}
    per_position, rates = by_k[PLAN_MAX_K]
    return {"per_position": per_position, "proposal_rates": rates, "prompts": len(per_prompt), "extra_tokens": 0.0,
            "by_k": by_k}


def chain_hybrid(cfg: EvalConfig) -> bool:
    """Whether a hybrid's model drafts a chain, from its settings alone (`walks_hybrid` builds it)."""
    kind = BY_NAME[cfg.drafter_kind]
    return bool(cfg.hybrid) and cfg.greedy and (not kind.supports("tree") or cfg.tree == "chain")


def walks_hybrid(cfg: EvalConfig, models: LoadedModels) -> bool:
    """A greedy chain hybrid (its model drafts a chain: the kind's `tree` is None, as for a plan's
    chain path): walked over the target's continuations from its model's drafts at every position
    (`walked_hybrid`)."""
    settings = cfg.decode_settings(k=PLAN_MAX_K, nodes=cfg.max_tree_nodes)
    return bool(cfg.hybrid) and cfg.greedy and tree_choice(models.drafter, settings) is None


def lookup_modes(cfg: EvalConfig) -> tuple[bool, ...]:
    """The hybrid modes a plan weighs (`--lookup-first`): both verified each step (False), the
    lookup's chain alone where it finds one (True), or, auto, both modes."""
    return {"on": (True,), "off": (False,)}.get(cfg.lookup_first, (False, True))


class PositionDrafts(Proposer):
    """A chain proposer's `k` greedy drafts at every position of a decode that verifies none of them:
    each step proposes to it, records what it drafted and offers the target nothing, so the decode
    emits one token a step and the proposer is committed with it. What a model keeps is made of the
    emitted text and the target's states along it, so these are the drafts a decode at any K would see
    at each position (`planning.walk_hybrid`)."""

    def __init__(self, inner: Proposer, k: int):
        self.inner, self.k, self.drafts = inner, k, []
        self.hidden_layers = tuple(inner.hidden_layers)

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def reset(self, prompt, hidden=None):
        self.drafts = []
        if self.hidden_layers:
            self.inner.reset(prompt, hidden=hidden)
        else:
            self.inner.reset(prompt)

    def propose(self, k, sequence):
        drafts, _ = self.inner.propose(self.k, sequence)
        self.drafts.append(drafts.tolist())  # a host read: calibration is not timed
        return drafts[:0], None

    def keep(self, n_accepted, emitted, verdict, hidden):
        self.inner.keep(n_accepted, emitted, verdict, hidden)


def position_drafts(decoder: ChainDecoder, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[list[int]]]:
    """A chain decoder's output for `prompt` and its proposer's `PLAN_MAX_K` drafts at every position
    of it (`PositionDrafts`), the decoder left as it was."""
    proposer = decoder.proposer
    decoder.proposer = recorder = PositionDrafts(proposer, PLAN_MAX_K)
    try:
        return decoder.generate(prompt, max_new_tokens).tokens, recorder.drafts
    finally:
        decoder.proposer = proposer


def walked_hybrid(cfg: EvalConfig, models: LoadedModels, calibration: Calibration, measurer: Measurer,
                  prompts: int) -> dict:
    """A chain hybrid's steps at every K = 1 .. PLAN_MAX_K and mode (`lookup_modes`), walked exactly
    over the target's greedy continuations (`planning.walk_hybrid`) from its model's drafts at every
    position (`PositionDrafts`: one proposal a token, where a decode at the deepest K read the
    model's drafts at its steps only, and a step's mix of lookup and model could not be told from
    its per-position acceptance); prompts read until the deepest K's tokens a step is known. Its
    acceptance is the model's own at the deepest K, walked alone."""
    settings = cfg.decode_settings(k=PLAN_MAX_K, nodes=cfg.max_tree_nodes).alone()
    new_lookup, modes = BY_NAME[cfg.hybrid].lookup, lookup_modes(cfg)
    walked: dict[tuple[int, bool], list[HybridStep]] = {(k, f): [] for k in range(1, PLAN_MAX_K + 1) for f in modes}
    alone: list[HybridStep] = []
    per_prompt = []
    for i, (p, decoder) in enumerate(calibration_decoders(cfg, models, calibration, measurer, settings, prompts)):
        measurer.doing(f"calibration: drafts at every position of prompt {i + 1} of at most {prompts}")
        continuation, drafts = position_drafts(decoder, p.ids, cfg.max_new_tokens)
        for k, first in walked:
            walked[(k, first)] += walk_hybrid(p.ids, continuation, looking_up(new_lookup(settings), p.ids),
                                              drafts, k, cfg.max_new_tokens, first)
        alone += walk_hybrid(p.ids, continuation, lambda sequence, n: [], drafts, PLAN_MAX_K, cfg.max_new_tokens, False)
        deepest = walk_hybrid(p.ids, continuation, looking_up(new_lookup(settings), p.ids), drafts, PLAN_MAX_K,
                              cfg.max_new_tokens, modes[-1])
        per_prompt.append((sum(s.tokens for s in deepest), len(deepest)))
        measurer.tick()
        if enough_prompts(per_prompt):
            break
    steps = max(1, len(alone))
    return {"per_position": [sum(s.tokens > j for s in alone) / steps for j in range(1, PLAN_MAX_K + 1)],
            "proposal_rates": None, "prompts": len(per_prompt), "extra_tokens": 0.0, "by_k": None,
            "hybrid_walks": {f"{k},{int(first)}": sorted(Counter((s.nodes, s.model, s.tokens) for s in found).items())
                             for (k, first), found in walked.items()}}


def hybrid_steps(kept: dict | None) -> dict[tuple[int, bool], list[HybridStep]] | None:
    """`walked_hybrid`'s steps as the cache keeps them (counts of each step) back as steps."""
    if not kept:
        return None
    out = {}
    for key, counted in kept.items():
        k, first = (int(v) for v in key.split(","))
        out[(k, bool(first))] = [HybridStep(int(n), bool(m), int(t)) for (n, m, t), c in counted for _ in range(c)]
    return out


def looking_up(lookup, prompt: list[int]):
    """`walk_chain`'s proposal: `lookup` (a lookup proposer) reset to `prompt`, asked for n tokens."""
    lookup.reset(prompt)
    return lambda sequence, n: lookup.lookup(n, sequence)


def verified_layers(cfg: EvalConfig, models: LoadedModels, settings: DecodeSettings) -> tuple[int, ...]:
    """The target hidden layers this drafter's decoder verifies with (`Decoder.hidden_layers`:
    EAGLE-3's aux layers, Medusa's last; none for the rest): its verification is that graph, not
    the plain forward's, so its costs are timed with them, and its replays carry them."""
    return tuple(build_decoder(models.target_lm or models.target, models.drafter, settings).hidden_layers)


def calibration_decoders(cfg: EvalConfig, models: LoadedModels, calibration: Calibration, measurer: Measurer,
                         settings: DecodeSettings, prompts: int):
    """(prompt, a decoder of the drafter for it) for each of the first `prompts` calibration prompts:
    against the target's continuation where the drafter `replays`, else against the target."""
    settings = dataclasses.replace(settings, eos_token_ids=frozenset(models.eos))
    if not replays(cfg, models):
        decoder = build_decoder(models.target_lm or models.target, models.drafter, settings)
        for p in calibration.prompts[:prompts]:
            yield p, decoder
        return
    layers = verified_layers(cfg, models, settings)
    for i, p in enumerate(calibration.prompts[:prompts]):
        yield p, build_decoder(calibration.teacher(i, layers, measurer), models.drafter, settings)


def lookup_nodes(decoder) -> int | None:
    """A hybrid's n-gram nodes so far (None: no lookup joined)."""
    return getattr(getattr(decoder, "drafter", None), "lookup_nodes", None)


def calibrated_acceptance(cfg: EvalConfig, models: LoadedModels, calibration: Calibration, measurer: Measurer,
                          prompts: int) -> dict:
    """Decode calibration prompts with K = PLAN_MAX_K and count, per position, how often it was
    accepted and how often proposed (a hybrid: its n-gram nodes a step)."""
    settings = cfg.decode_settings(k=PLAN_MAX_K, nodes=cfg.max_tree_nodes)
    accepted, proposed, per_prompt, hybrid = [], [], [], None
    for i, (p, decoder) in enumerate(calibration_decoders(cfg, models, calibration, measurer, settings, prompts)):
        measurer.doing(f"calibration: prompt {i + 1} of at most {prompts}")
        before = lookup_nodes(decoder)
        gen = decoder.generate(p.ids, cfg.max_new_tokens)
        if before is not None:
            hybrid = (hybrid or 0) + lookup_nodes(decoder) - before
        accepted += gen.accepted_lengths
        proposed += gen.proposed_lengths
        per_prompt.append((len(gen.tokens), len(gen.accepted_lengths)))
        measurer.tick()
        if enough_prompts(per_prompt):
            break
    steps = max(1, len(accepted))
    return {"per_position": [sum(a >= j for a in accepted) / steps for j in range(1, PLAN_MAX_K + 1)],
            "proposal_rates": None if cfg.hybrid else [sum(m >= j for m in proposed) / steps
                                                       for j in range(1, PLAN_MAX_K + 1)],
            "prompts": len(per_prompt), "extra_tokens": hybrid / steps if hybrid is not None else 0.0, "by_k": None}


def recorded_trees(cfg: EvalConfig, models: LoadedModels, calibration: Calibration, measurer: Measurer,
                   prompts: int, depth: int, nodes: int, topks: list[int],
                   keep: tuple | None = None) -> dict[int, tuple[list[TreeStep], int]]:
    """Calibration prompts decoded with the largest tree, every step's candidates recorded
    (`planning.TreeStep`): {top-k: (its steps, prompts read)}.
    Where the decode replays the target's continuations and its drafter grows the other top-ks'
    trees beside the widest one's (`TreeDrafter.grow_beside`: EAGLE-2's trees on the eager engine),
    one decode a prompt records them all, each read at the widest tree's steps as smaller trees
    are read at the largest's: four top-ks cost about one (each level of all four trees is one
    draft forward, about as dear as one tree's), where a decode per top-k took most of EAGLE-3's
    plan (Gemma-3, 2 cores: 28 of its 75 s, and 18 of its hybrid's 25). Else a decode per top-k.
    `keep`: where those steps are kept by prompt in `calibration.recordings`, for a hybrid to read."""
    widest = max(topks)
    beside = tuple(k for k in topks if k != widest)
    if beside and replays(cfg, models):
        found = record_trees(cfg, models, calibration, measurer, prompts, depth, nodes, widest, beside, keep)
        if found is not None:
            return found
    return {k: v for topk in topks
            for k, v in record_trees(cfg, models, calibration, measurer, prompts, depth, nodes, topk, ()).items()}


def record_trees(cfg: EvalConfig, models: LoadedModels, calibration: Calibration, measurer: Measurer, prompts: int,
                 depth: int, nodes: int, topk: int, beside: tuple[int, ...], keep: tuple | None = None) -> dict | None:
    """`recorded_trees` of one decode a prompt with the largest top-`topk` tree and, grown beside
    it, those of `beside` (None: its drafter grows none beside); kept by prompt under `keep`."""
    settings = cfg.decode_settings(k=depth, nodes=nodes, topk=topk)
    what = f"top-{topk} trees" + (f" (top-{', '.join(map(str, beside))} grown beside)" if beside else "")
    by_prompt, per_prompt = [], []
    for i, (p, decoder) in enumerate(calibration_decoders(cfg, models, calibration, measurer, settings, prompts)):
        if beside and not decoder.drafter.grow_beside(beside):
            return None
        measurer.doing(f"{what}: prompt {i + 1} of at most {prompts}")
        decoder.recorded, decoder.recorded_beside = [], {}
        gen = decoder.generate(p.ids, cfg.max_new_tokens)
        by_prompt.append((i, {topk: decoder.recorded, **{k: decoder.recorded_beside.get(k, []) for k in beside}}))
        per_prompt.append((len(gen.tokens), len(gen.accepted_lengths)))
        measurer.tick(1 + len(beside))
        if enough_prompts(per_prompt):
            break
    if keep is not None:
        calibration.recordings[keep] = by_prompt
    return {k: ([s for _, recorded in by_prompt for s in recorded[k]], len(per_prompt)) for k in (topk, *beside)}


def hybrid_trees(cfg: EvalConfig, calibration: Calibration, measurer: Measurer, kept: tuple, depth: int,
                 topks: list[int]) -> dict[int, tuple[list[TreeStep], int]] | None:
    """A hybrid's `recorded_trees` read off its model's replayed recording in this run
    (`calibration.recordings[kept]`, None where there is none), its lookup's chain at each step's
    start (`planning.as_hybrid_steps`: the steps weighed as the hybrid would take them), rather than
    a decode of its own."""
    by_prompt = calibration.recordings.get(kept)
    if by_prompt is None:
        return None
    measurer.doing(f"trees read off its model's recording, with {cfg.hybrid} lookup beside")
    new_lookup, widest = BY_NAME[cfg.hybrid].lookup, max(topks)
    settings = cfg.decode_settings(k=depth, nodes=cfg.max_tree_nodes)
    steps: dict[int, list[TreeStep]] = {k: [] for k in topks}
    for i, recorded in by_prompt:
        prompt, continuation = calibration.prompts[i].ids, calibration.continuation(i, measurer)
        propose = looking_up(new_lookup(settings), prompt)
        for k, found in as_hybrid_steps(recorded, widest, continuation,
                                        lambda m: propose(prompt + continuation[:m], depth), depth).items():
            steps[k] += found
    return {k: (found, len(by_prompt)) for k, found in steps.items()}


def tree_depth_nodes(cfg: EvalConfig, models: LoadedModels, topk: int, depth: int, nodes: int) -> int:
    """The nodes a static tree holds cut to `depth` (its model's, a hybrid's lookup apart)."""
    decoder = build_decoder(models.target_lm or models.target, models.drafter,
                            cfg.decode_settings(k=depth, nodes=nodes, topk=topk))
    drafter = decoder.drafter
    return getattr(drafter, "model", drafter).max_nodes


def tree_acceptance(cfg: EvalConfig, models: LoadedModels, calibration: Calibration, measurer: Measurer, store: Store,
                    depths: list[int], nodes: list[int], topks: list[int], dynamic: bool, model: str) -> dict:
    """Every tree a plan weighs with its expected tokens a step and a hybrid's n-gram nodes beside
    it (`planning.tree_table`, as [top-k, depth, nodes, tokens, [[lookup nodes, share of steps], ..]]
    rows), and for a hybrid each as a lookup-first hybrid's model (`planning.lookup_first_table`, as
    [top-k, depth, nodes, tokens] rows), read off the recorded steps of the largest tree of each
    top-k, recorded verifying both branches (`cfg` with --lookup-first off); kept in `store`. A
    hybrid reads its model's recording where this run made one (`hybrid_trees`; `model`: the
    model's identity in the cache's keys), else records its own."""
    prompts = min(CALIBRATION_PROMPTS, len(calibration.prompts))
    kept = (model, max(depths), max(nodes), tuple(topks))

    def record() -> dict:
        found = hybrid_trees(cfg, calibration, measurer, kept, max(depths), topks) if cfg.hybrid else None
        if found is None:
            found = recorded_trees(cfg, models, calibration, measurer, prompts, max(depths), max(nodes), topks,
                                   None if cfg.hybrid else kept)
        steps = {k: found[k][0] for k in topks}
        extra = {k: sum(n * share for n, share in lookup_beside(steps[k], max(depths))) for k in topks}
        read = [found[k][1] for k in topks]
        held: dict[tuple[int, int], int] = {}

        def static_limit(k: int, d: int) -> int:
            if (k, d) not in held:
                held[(k, d)] = tree_depth_nodes(cfg, models, k, d, max(nodes))
            return held[(k, d)]

        table = tree_table(steps, depths, nodes, tree_node_limit if dynamic else static_limit,
                           depth_capped=dynamic and not cfg.hybrid)
        first = lookup_first_table(steps, table) if cfg.hybrid else {}
        return {"table": [[*key, tokens, [list(b) for b in beside]] for key, (tokens, beside) in sorted(table.items())],
                "extra_tokens": extra, "first_table": [[*key, tokens] for key, tokens in sorted(first.items())],
                "prompts": max(read), "steps": sum(len(s) for s in steps.values())}

    name = f"trees and their lookup nodes: depths {depths}, nodes {nodes}, top-k {topks}"
    return measurer.measured(store, name, record, f"recording trees on up to {prompts} prompts",
                             units=len(topks) * prompts)


__all__ = ["CALIBRATION_PROMPTS", "CONTINUATION_BATCH", "LOOKUP_CALIBRATION_PROMPTS", "Acceptance", "Calibration",
           "calibration_prompts", "check_calibration", "continuation_prompts", "drafter_acceptance", "read_calibration",
           "position_drafts", "recorded_acceptance", "replays", "tree_acceptance", "verified_layers", "walks",
           "walks_hybrid"]
