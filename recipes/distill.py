"""Distill a draft model from a target (SPEC §4): a small LM learns to say what the target would.

    accelerate launch recipes/distill.py --config recipes/configs/NAME.yaml [--overwrite] [key=value ...]
    python recipes/distill.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.

The story of the run (the shared steps are `drafttrain.training.recipe.Recipe.run`):

1. Load the target, frozen, and the draft: an existing small model of the target's family, or a
   copy of a subset of the target's own layers (`draft.from_target_layers`, e.g. copy:6).
   They must speak the same tokens; that is checked before anything is written.
2. Export the untrained draft to `initial/` (the baseline of the model card).
3. The target answers the training prompts itself (cached): a draft that imitates the target's
   own outputs is accepted far more often than one trained on someone else's text.
4. Train (DistillSpec, Zhou et al. 2023): per response token, a divergence between the target's
   next-token distribution and the draft's - computed on the fly from the same batch, or read
   from the target's stored top-k (`data.store_topk`) - optionally on the prompt's positions
   too, and on a fraction of steps on continuations the current draft samples itself (GKD,
   Agarwal et al. 2024) so it also learns on the text it actually proposes. A parallel draft
   (`draft.parallel_tokens`, PARD) learns every depth at once: K-1 mask tokens after each trained
   position, in the same forward (`drafttrain.kinds.parallel_lm.model`).
5. Measure what matters: greedy speculative decoding of held-out prompts with drafttrain's own
   decoder. Its mean accepted length tau picks the exported weights, not the loss.
6. Export the best draft to `final/` (SPEC §3) with its acceptance table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from drafttrain.config import setting
from drafttrain.data import DataConfig, onpolicy_batch, onpolicy_step, response_window
from drafttrain.data.collate import TrainingCollator
from drafttrain.decoding import NUM_DRAFT_TOKENS, DecodeSettings
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.draft_lm.kind import draft_lm_drafter
from drafttrain.kinds.draft_lm.model import draft_from_target
from drafttrain.errors import UserError
from drafttrain.evaluation.plan import export_plans
from drafttrain.export import export_draft
from drafttrain.home import expand_vars
from drafttrain.losses import LOSSES, TopKTeacher, distill_loss
from drafttrain.models import DTYPES, check_model_path, load_causal_lm, load_tokenizer, resolve_dtype
from drafttrain.kinds.parallel_lm.model import (PARALLEL_LIMIT_REASON, PARALLEL_MAX_TOKENS, depth_balanced, mark_parallel, parallel_info, parallel_layout)
from drafttrain.tokens import mask_token_id
from drafttrain.preflight import compatibility_checks, first_vocab_difference, require_compatible
from drafttrain.tokens import output_vocab_size
from drafttrain.training.distributed import is_sharded
from drafttrain.training.acceptance import held_out_acceptance, table_row
from drafttrain.training.recipe import (Recipe, RecipeConfig, RecipeEvalConfig, exit_with, held_out_eval,
                                         recipe_main, run_directory, training_data)

LossKind = Literal[LOSSES]  # the losses module's own list: its --help choices and config check


# ----------------------------------------------------------------------------- config


@dataclass
class DraftConfig:
    path: str | None = setting(
        None, doc="An existing small model of the target's family (same tokenizer): a directory or hub id.")
    from_target_layers: str | None = setting(
        None, doc="Or build the draft from a subset of the target's decoder layers: every:N, first:N, a list "
                  "like 0,4,8, or copy:N (N layers that keep the target's copying circuit - its strongest "
                  "induction head and the previous-token head feeding it - whole). Embeddings, final norm and "
                  "LM head are copied too.")
    freeze_embeddings: bool = setting(
        False, doc="Keep the draft's input embeddings and LM head fixed (the target's, when built from its layers): "
                   "a same-family draft already shares them, and the step gets cheaper.")
    parallel_tokens: int = setting(
        0, doc="0: a sequential draft (K drafts, K forwards). K >= 2: a parallel draft (PARD): trained to propose K "
               "tokens from ONE forward over the sequence and K-1 mask tokens (drafttrain.kinds.parallel_lm.model); the export's "
               "config.json names the mask as pard_token. Decode it with K <= this.", at_least=0)
    parallel_keep: float = setting(
        0.7, doc="Parallel drafts: PARD's conditional drop. Depth b's masks keep a random max(keep^b, 0.2) of the "
                 "trained positions (each with its whole chain), so deep masks cost a fraction of a forward; 1 keeps "
                 "all.", above=0, at_most=1)
    parallel_loss: str = setting(
        "rows", doc="Parallel drafts: how the depths share the loss. rows: every trained row weighs the same (the "
                    "conditional drop leaves the real tokens' rows the most numerous); depths: each depth's mean "
                    "weighs the same, so the deep masks, the fewest rows, get as much of the gradient as the first "
                    "draft.", choices=("rows", "depths"))
    mask_token: int | str = setting(
        "auto", doc="Parallel drafts: the mask token, an id or a token the training text never contains; auto: the "
                    "tokenizer's last added token that is not a special token (SmolLM2: <empty_output>).")


@dataclass
class LossConfig:
    kind: LossKind = setting(
        "forward_kl", doc="Divergence between target (p) and draft (q): forward_kl KL(p||q), reverse_kl KL(q||p), "
                          "jsd (generalised Jensen-Shannon, see beta), tvd (total variation: 1 - TVD is the "
                          "acceptance probability), ce (cross-entropy on the target's tokens only).")
    beta: float = setting(0.5, doc="jsd only: the mixture weight, sliding from KL(p||q) (near 0) to KL(q||p) (near 1).",
                         at_least=0, at_most=1)
    temperature: float = setting(1.0, doc="Both distributions are softened by this temperature before the loss.",
                                above=0)
    chunk_size: int = setting(
        1024, doc="Token positions per chunk of the float32 softmaxes (bounds the loss's peak memory).", at_least=1)


@dataclass
class OnPolicyConfig:
    fraction: float = setting(
        0.0, doc="Fraction of optimizer steps (lambda in GKD) whose batches are continuations sampled from the "
                 "current draft for the batch's prompts, scored by the target on the fly; 0: off.",
        at_least=0, at_most=1)
    temperature: float = setting(1.0, doc="Sampling temperature of the draft's continuations (0: greedy).",
                                at_least=0)
    max_new_tokens: int | None = setting(
        None, doc="Longest on-policy continuation; default data.max_response_tokens.", at_least=1)


@dataclass
class DistillEvalConfig(RecipeEvalConfig):
    num_prompts: int = setting(32, doc="Held-out prompts decoded at each evaluation (the first ones).", at_least=1)
    num_draft_tokens: int = setting(
        NUM_DRAFT_TOKENS, doc="K: draft tokens proposed per target verification step (the default K of `drafttrain eval`).",
        at_least=1)


@dataclass
class DistillConfig(RecipeConfig):
    output_dir: str = run_directory("initial/ and final/ drafts")
    data: DataConfig = training_data(
        "With data.store_topk > 0 the loss reads the target's stored top-k log-probs instead of running the target "
        "(an approximation: the rest of the probability mass is spread evenly over the other tokens); on-policy "
        "batches always run it.")
    eval: DistillEvalConfig = held_out_eval(DistillEvalConfig)
    draft: DraftConfig = setting(default_factory=DraftConfig, doc="Where the draft starts from (give one).")
    loss: LossConfig = setting(default_factory=LossConfig, doc="The distillation loss.")
    onpolicy: OnPolicyConfig = setting(default_factory=OnPolicyConfig, doc="On-policy (GKD) batches.")

    def validate_own(self) -> None:
        if (self.draft.path is None) == (self.draft.from_target_layers is None):
            raise UserError("give exactly one of draft.path (an existing small model) and draft.from_target_layers "
                            "(e.g. every:5)" + (" - both are set" if self.draft.path else ""))
        if self.draft.path is not None:
            self.draft.path = expand_vars(self.draft.path, "draft.path")
            check_model_path(self.draft.path, "draft")

        if self.loss.kind not in LOSSES:
            raise UserError(f"loss.kind {self.loss.kind!r} is unknown; use one of {', '.join(LOSSES)}")
        if self.draft.parallel_tokens == 1:
            raise UserError("draft.parallel_tokens=1 drafts one token per forward, as a sequential draft does; set 0 "
                            "(sequential) or K >= 2 (parallel)")
        if self.draft.parallel_tokens > PARALLEL_MAX_TOKENS:
            raise UserError(f"draft.parallel_tokens={self.draft.parallel_tokens} is too many: a parallel draft takes "
                            f"{PARALLEL_LIMIT_REASON}; set 2 .. {PARALLEL_MAX_TOKENS}")
        if self.draft.parallel_tokens and (self.onpolicy.fraction > 0 or self.data.prompt_loss_weight > 0):
            raise UserError("a parallel draft (draft.parallel_tokens) trains on the target's answers only; set "
                            "onpolicy.fraction=0 and data.prompt_loss_weight=0")
        if self.onpolicy.fraction > 0 and self.loss.kind == "ce":
            raise UserError("onpolicy.fraction > 0 needs the target's distribution, but loss.kind=ce only uses its "
                            "tokens; pick forward_kl, reverse_kl, jsd or tvd, or set onpolicy.fraction=0")


# ----------------------------------------------------------------------------- the recipe


class DistillRecipe(Recipe[DistillConfig]):
    script = "recipes/distill.py"
    drafter_name = "draft"
    run_entries = frozenset({"initial"})

    def load_models(self) -> None:
        """(tokenizer, target, draft), checked to be usable together."""
        cfg = self.config
        tokenizer = load_tokenizer(cfg.target, "target")
        draft_tok = load_tokenizer(cfg.draft.path, "draft") if cfg.draft.path else tokenizer
        if cfg.draft.path:  # the cheap check first: a foreign vocabulary fails before any weights load
            diff = first_vocab_difference(tokenizer.get_vocab(), draft_tok.get_vocab())
            if diff:
                raise UserError(f"draft and target disagree (token-to-id map): {diff}; "
                                "use a draft trained with the target's tokenizer")
        target = load_causal_lm(cfg.target, resolve_dtype(cfg.target_dtype, self.device), self.device, "target")
        target.requires_grad_(False)
        if cfg.draft.path:
            draft = load_causal_lm(cfg.draft.path, torch.float32, self.device, "draft")
        else:
            draft = draft_from_target(target, cfg.draft.from_target_layers).to(torch.float32)
        require_compatible(compatibility_checks(target, tokenizer, draft, draft_tok))
        draft.requires_grad_(True)
        if cfg.draft.freeze_embeddings:
            draft.get_input_embeddings().requires_grad_(False)
            draft.get_output_embeddings().requires_grad_(False)
        if cfg.draft.parallel_tokens:
            mark_parallel(draft, mask_token_id(tokenizer, cfg.draft.mask_token), cfg.draft.parallel_tokens)
        draft.train()
        self.tokenizer, self.target, self.draft = tokenizer, target, draft
        self.target_vocab = output_vocab_size(target)

    def describe(self) -> str:
        layers = getattr(self.draft, "source_layers", None)
        return f"draft: the target's layers {layers}" if layers is not None else ""

    def save_initial(self) -> None:
        """The draft before training, exported like the final one: the model card's baseline."""
        if not (self.out / "initial").is_dir():
            export_draft(self.draft, self.tokenizer, self.out / "initial", eos_token_id=self.export_eos,
                         base_info={**self.card_info, "stage": "initial (before distillation)"})

    def make_collator(self) -> TrainingCollator:
        """Prompts aligned (one block of trained positions); prompt positions too when they are trained."""
        data = self.config.data
        return TrainingCollator(data.max_seq_len, self.pad_id, align_prompts=True,
                               prompt_positions=data.prompt_loss_weight > 0)

    def build_trainable(self) -> torch.nn.Module:
        return self.draft

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        cfg = self.config
        on = onpolicy_step(cfg.onpolicy.fraction, cfg.train.seed, batch["step"])
        if on:
            batch = onpolicy_batch(self.accelerator.unwrap_model(model), batch, self.collator,
                                   temperature=cfg.onpolicy.temperature,
                                   max_new_tokens=cfg.onpolicy.max_new_tokens or cfg.data.max_response_tokens,
                                   eos_ids=self.eos_ids, pad_id=self.pad_id,
                                   synced_gpus=is_sharded(self.accelerator) and self.accelerator.num_processes > 1,
                                   seed=cfg.train.seed * 1_000_003 + batch["batch_index"])
        prompt_weight = cfg.data.prompt_loss_weight
        trained = batch["loss_mask"] | batch["prompt_mask"] if prompt_weight > 0 else batch["loss_mask"]
        start = response_window(trained)
        keep = batch["input_ids"].shape[1] - start  # logits only from the first trained position on
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        teacher = self.teacher(batch, inputs, start, keep, onpolicy=on)
        labels = batch["labels"][:, start:] if cfg.loss.kind == "ce" else None
        mask = batch["loss_mask"][:, start:]
        depths = None
        if cfg.draft.parallel_tokens:
            student, teacher, labels, mask, depths = self.parallel_student(model, batch, start, teacher, labels)
        else:
            student = model(**inputs, logits_to_keep=keep).logits

        def divergence(mask):
            return distill_loss(student, teacher, mask, kind=cfg.loss.kind, beta=cfg.loss.beta,
                                temperature=cfg.loss.temperature, chunk_size=cfg.loss.chunk_size, labels=labels)

        if depths is not None and cfg.draft.parallel_loss == "depths":
            loss = depth_balanced(divergence, mask, depths)
        else:
            loss = divergence(mask)
        logs = {"onpolicy": float(on), "tokens": mask.sum()}
        if prompt_weight > 0:
            prompt_mask = batch["prompt_mask"][:, start:]
            prompt_loss = divergence(prompt_mask)
            loss = loss + prompt_weight * prompt_loss
            logs |= {"prompt_loss": prompt_loss.detach(), "prompt_tokens": prompt_mask.sum()}
        return loss, logs

    def parallel_student(self, model, batch: dict, start: int, teacher, labels):
        """A parallel draft's logits for every depth at once (`drafttrain.kinds.parallel_lm.model`), and the
        teacher, labels and loss mask repeated to match, and each row's depth: depth b's row p
        learns the target's distribution at p from x_0 .. x_{p-b} and b masks."""
        depth = self.config.draft.parallel_tokens
        generator = torch.Generator().manual_seed(self.config.train.seed * 1_000_003 + batch["batch_index"])
        layout = parallel_layout(batch["input_ids"], batch["attention_mask"], batch["position_ids"], start=start,
                                 depth=depth, mask_id=self.draft.config.pard_token,
                                 keep=self.config.draft.parallel_keep, generator=generator)
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids,
                       attention_mask=layout.additive_mask(dtype), logits_to_keep=layout.logits_to_keep).logits
        if isinstance(teacher, TopKTeacher):
            teacher = TopKTeacher(layout.repeat(teacher.ids), layout.repeat(teacher.logprobs), teacher.vocab_size)
        elif teacher is not None:
            teacher = layout.repeat(teacher)
        labels = layout.repeat(labels) if labels is not None else None
        return logits, teacher, labels, layout.trained(batch["loss_mask"], batch["attention_mask"]), layout.row_depths()

    def teacher(self, batch: dict, inputs: dict, start: int, keep: int, onpolicy: bool):
        """The target's side of the loss: nothing for ce, its stored top-k when the batch carries
        it (not on-policy batches: the draft wrote those), else its logits, computed now."""
        if self.config.loss.kind == "ce":
            return None
        if "topk_ids" in batch and not onpolicy:
            return TopKTeacher(batch["topk_ids"][:, start:], batch["topk_logprobs"][:, start:], self.target_vocab)
        with torch.no_grad():
            return self.target(**inputs, logits_to_keep=keep).logits

    def evaluate(self, model) -> dict:
        e = self.config.eval
        settings = DecodeSettings(num_draft_tokens=e.num_draft_tokens, eos_token_ids=frozenset(self.eos_ids))
        return held_out_acceptance(self.target, self.drafter(model), self.prompts, settings, e.max_new_tokens)

    def drafter(self, model) -> Drafter:
        """The factory's view of the draft being trained: sequential, or parallel with the mask its
        config names (`mark_parallel`), decided where every draft LM's is (`draft_lm_drafter`)."""
        return draft_lm_drafter(model)

    def export(self, result, initial: dict, final: dict, extra: dict) -> None:
        cfg = self.config
        rows = [table_row("initial (before training)", initial), table_row(f"final (step {result.best_step})", final)]
        model = result.model.to(DTYPES[cfg.export_dtype])
        plans = self.plans(model, final)

        def write(served: list[dict]) -> None:
            export_draft(model, self.tokenizer, self.out / "final", eos_token_id=self.export_eos,
                         acceptance_table=rows + served,
                         base_info={**self.card_info, "loss": cfg.loss.kind, **self.trained_info(result, plans)},
                         record=self.card_record(final, plans))

        self.export_with_served_row(write, "draft", cfg.eval.num_draft_tokens)

    def plans(self, model, final: dict) -> dict:
        """K planned from the held-out acceptance, for this machine (measured) and a GPU at batch 1."""
        probe = self.prompts[0].ids
        return export_plans(self.target, final["per_position_acceptance"], probe, where=str(self.out / "final"),
                            draft=model, parallel=parallel_info(model.config))

    @property
    def export_eos(self) -> int | list[int]:
        return self.eos_ids[0] if len(self.eos_ids) == 1 else self.eos_ids

    @property
    def card_info(self) -> dict:
        cfg = self.config
        source = cfg.draft.path or (f"the target's layers {cfg.draft.from_target_layers} = "
                                    f"{getattr(self.draft, 'source_layers', '?')}")
        return {"target": cfg.target, "draft initialised from": source, "recipe": f"drafttrain {self.script}"}


def main(argv: list[str] | None = None) -> int:
    return recipe_main(DistillRecipe, argv)


if __name__ == "__main__":
    exit_with(main())
