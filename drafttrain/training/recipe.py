"""The run every drafter kind shares, told once: a recipe supplies only what is its own.

A recipe (`recipes/distill.py`, `recipes/train_heads.py`, ...) is a `Recipe` subclass with a
`RecipeConfig` subclass. `Recipe.run` is the whole story, in this order:

    setup()
      validate the config                       (nothing touched yet)
      build the Accelerator
      open the output directory                 (a usable path, the run's lock, the same config)
      load_models()          <- the recipe      (target, and whatever can fail to load)
      start the output directory                (--overwrite clears, leftovers go, config.yaml)
      save_initial()         <- the recipe      (e.g. the untrained draft, exported)
      prepare the data                          (the target's answers, every rank a share; held-out prompts)
      make_collator(), build_trainable()  <- the recipe
    train()
      the generic loop (training.trainer) with the recipe's loss() and evaluate()
      final_evaluations()    <- the recipe      (more measurements of the chosen weights, if any)
      export()               <- the recipe      (final/, from the best evaluated weights)
      eval/initial.json, eval/final.json, a summary
    cleanup()                                   (the lock is released)

So a drafter kind writes its config sections, and five methods: load_models, build_trainable,
loss, evaluate, export (final_evaluations if it measures more than `evaluate` does). Anything
that fails before the output directory is started leaves no trace; every failure is one
`error:` line and exit code 2 (`recipe_main`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch

from ..config import check_settings, config_to_dict, parse_argv, setting
from ..data.collate import TrainingCollator
from ..data.config import DataConfig
from ..data.generation import target_fingerprint
from ..data.pipeline import TrainingData, prepare_distillation_data
from ..data.sources import write_prompts_jsonl
from ..errors import UserError
from ..fileio import atomic_write_json
from ..home import expand_vars
from ..models import DTYPES, check_model_path, first_line, load_causal_lm, load_tokenizer, resolve_dtype
from ..prompts import EncodedPrompt
from ..tokens import eos_token_ids, pad_token_id
from .config import OptimConfig, TrainConfig
from .distributed import answer_ranks, build_accelerator, close_process_group, is_sharded, zero3_init_disabled
from .frozen import local_fraction, shard_frozen
from .acceptance import eval_prompts, served_row
from .run_dir import RunDirectory
from .sampler import check_enough_examples
from .trainer import TrainResult, train
from .worker import ctrl_c_raises, exit_with, say_interrupted, say_once

TargetDtype = Literal["auto", "float32", "bfloat16", "float16", "float64"]
ExportDtype = Literal["float32", "bfloat16", "float16"]

RECIPE_FLAGS = {
    "--overwrite": "Start over: delete the earlier run in output_dir (its checkpoints, logs and exports) first. "
                   "Without it, a run with the same output_dir and config resumes, and another config is refused.",
}


# ----------------------------------------------------------------------------- the config every recipe has


@dataclass
class RecipeEvalConfig:
    num_prompts: int = setting(16, doc="Held-out prompts decoded at each evaluation (the first ones).", at_least=1)
    max_new_tokens: int = setting(64, doc="Tokens generated per prompt during evaluation.", at_least=1)


def run_directory(exports: str = "final/") -> Any:
    """The `output_dir` setting; `exports`: what the recipe exports into the run directory, as its
    doc lists it (e.g. "initial/ and final/ drafts")."""
    return setting(doc=f"Run directory: config.yaml, heldout.jsonl, train_log.jsonl, checkpoints/, best/, {exports}, "
                       "eval/. Started again with the same directory and config, the run resumes; with another "
                       "config it is refused (--overwrite starts over).")


def training_data(note: str = "") -> Any:
    """The `data` setting; `note`: what the recipe adds to its doc (how it reads the answers)."""
    return setting(default_factory=DataConfig, doc=f"Prompts and the target's answers to them. {note}")


def held_out_eval(section: type[RecipeEvalConfig] = RecipeEvalConfig) -> Any:
    """The `eval` setting, of `section`: a recipe re-declares `eval` with its RecipeEvalConfig subclass."""
    return setting(default_factory=section, doc="Acceptance on held-out prompts: logged, and picks the best weights.")


@dataclass
class RecipeConfig:
    """The fields and checks every recipe shares; a recipe's config subclasses it, adds its own
    sections (checked in `validate_own`), and re-declares a shared setting with the helpers above:
    `output_dir = run_directory(...)` to list its exports, `data = training_data(...)` to add to the
    data's doc, `eval = held_out_eval(ItsEvalConfig)` for its own evaluation settings."""

    # A recipe whose drafter trains on response positions only names it here ("heads train"): then a
    # prompt loss weight, a distillation setting, is refused.
    responses_only: ClassVar[str] = ""

    output_dir: str = run_directory()
    target: str = setting(doc="The target model: a local directory or hub id. ${VAR}s are expanded "
                                 "(${DRAFTTRAIN_HOME} defaults to ~/.cache/drafttrain).")
    target_dtype: TargetDtype = setting(
        "auto", doc="dtype of the target: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16, "
                    "float64. What trains is float32 (see train.mixed_precision).")
    export_dtype: ExportDtype = setting("float32", doc="dtype of the exported drafter's weights.")
    data: DataConfig = training_data()
    optim: OptimConfig = setting(default_factory=OptimConfig, doc="Optimizer and learning-rate schedule.")
    train: TrainConfig = setting(default_factory=TrainConfig, doc="Training loop, checkpoints and logging.")
    eval: RecipeEvalConfig = held_out_eval()

    def validate(self) -> None:
        """Everything that can be checked without loading a model; raises a one-line UserError.
        Paths are ${VAR}-expanded in place. The shared settings first, then the recipe's own (`validate_own`)."""
        if not str(self.output_dir).strip():
            raise UserError("output_dir is empty; set output_dir=runs/NAME")
        self.output_dir = expand_vars(self.output_dir, "output_dir")
        self.target = expand_vars(self.target, "target")
        check_model_path(self.target, "target")
        if self.target_dtype != "auto" and self.target_dtype not in DTYPES:
            raise UserError(f"target_dtype {self.target_dtype!r} is unknown; use auto, {', '.join(DTYPES)}")
        if self.export_dtype not in ("float32", "bfloat16", "float16"):
            raise UserError(f"export_dtype {self.export_dtype!r} is unknown; use float32, bfloat16 or float16")

        data = self.data
        for src in data.sources:
            if src.path:
                src.path = expand_vars(src.path, "data.sources[].path")
        data.cache_dir = expand_vars(data.cache_dir, "data.cache_dir")
        data.validate()
        if not data.sources:
            raise UserError("data.sources is empty; add at least one prompt source (jsonl, hf or self_instruct)")
        if data.heldout_size == 0 or (data.heldout_size is None and data.heldout_fraction == 0):
            raise UserError("evaluation needs held-out prompts; set data.heldout_size > 0 or data.heldout_fraction > 0")
        self.train.validate()
        check_settings(self)  # every section's declared choices and bounds (recipes' own sections too)
        if self.responses_only and self.data.prompt_loss_weight:
            raise UserError(f"data.prompt_loss_weight is a distillation setting; {self.responses_only} on response "
                            "positions only, so set data.prompt_loss_weight=0")
        self.validate_own()

    def validate_own(self) -> None:
        """A recipe's checks of its own sections, run by `validate` after the shared ones."""


# ----------------------------------------------------------------------------- the skeleton


C = TypeVar("C", bound=RecipeConfig)


class Recipe(Generic[C]):
    """One training run of one drafter kind. A subclass names its config class as the parameter
    (`class HeadsRecipe(Recipe[HeadsConfig])`: its `config_class`, and the type of `self.config`),
    sets the class attributes and implements the hooks; `run()` (setup, train, cleanup) is the same
    for all. Available to the hooks: `self.config`, `self.accelerator`, `self.device`, `self.out`
    (the run directory), and once loaded `self.tokenizer`, `self.target` (set them in load_models),
    `self.eos_ids`, `self.pad_id`, `self.data` (TrainingData: `train` rows, `heldout` records),
    `self.prompts` (what evaluate decodes)."""

    config_class: ClassVar[type[RecipeConfig]] = RecipeConfig  # set from Recipe[ConfigClass]
    script: ClassVar[str] = "recipe"              # e.g. "recipes/distill.py": --help, model cards
    drafter_name: ClassVar[str] = "drafter"       # what final/ holds, for the closing line
    run_entries: ClassVar[frozenset[str]] = frozenset()  # what the recipe writes into output_dir beyond the usual

    tokenizer: Any
    target: torch.nn.Module
    # True once load_frozen_target(shard=True) split the target across the ranks: every forward is
    # then a collective, so evaluation runs on every rank in lockstep, not on the main one alone.
    target_sharded: bool = False
    target_fingerprint: str | None = None  # taken before sharding, for the answer cache

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            if typing.get_origin(base) is Recipe:
                cls.config_class = typing.get_args(base)[0]

    def __init__(self, config: C, *, overwrite: bool = False):
        self.config = config
        self.overwrite = overwrite
        self.run_dir: RunDirectory | None = None

    # ------------------------------------------------------------------------- hooks, in the order run() calls them

    def load_models(self) -> None:
        """Load `self.tokenizer`, `self.target` and anything else that can fail before the run
        writes its directory (models, compatibility checks)."""
        raise NotImplementedError

    def load_frozen_target(self, *, shard: bool = False) -> None:
        """`self.tokenizer` and `self.target`, frozen: what drafters that read the target's own
        features (heads, EAGLE-3) start their `load_models` with. `shard`: split the target across
        the ranks of an FSDP / ZeRO-3 launch (`training.frozen`); it is loaded whole on the CPU
        first, so each GPU only ever holds its share."""
        cfg = self.config
        if shard and not is_sharded(self.accelerator):
            raise ValueError("sharding the target needs an FSDP or DeepSpeed ZeRO-3 launch")
        self.tokenizer = load_tokenizer(cfg.target, "target")
        dtype = resolve_dtype(cfg.target_dtype, self.device)
        self.target = load_causal_lm(cfg.target, dtype, torch.device("cpu") if shard else self.device, "target")
        self.target.requires_grad_(False)
        if shard:
            self.target_fingerprint = target_fingerprint(cfg.target, self.target)
            shard_frozen(self.accelerator, self.target)
            self.target_sharded = True
            self.accelerator.print(f"the target is sharded across {self.accelerator.num_processes} ranks (each holds "
                                   f"{local_fraction(self.target):.0%} of its weights); evaluation runs on every rank")

    def save_initial(self) -> None:
        """Main process, once the directory is started: save what the run starts from, if anything."""

    def describe(self) -> str:
        """A few words on what trains, for the start-up line."""
        return ""

    def make_collator(self):
        """Batches of prompt + response, prompts aligned so the trained positions form one block."""
        return TrainingCollator(self.config.data.max_seq_len, self.pad_id, align_prompts=True)

    def build_trainable(self) -> torch.nn.Module:
        """The module the optimizer trains (its requires_grad parameters); built after the data."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        """The micro-batch's mean loss and a dict of values to log (see `training.trainer.train`)."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module) -> dict:
        """Greedy acceptance of `model` on `self.prompts` (see `training.acceptance.held_out_acceptance`)."""
        raise NotImplementedError

    def final_evaluations(self, result: TrainResult) -> dict[str, dict]:
        """More measurements of the chosen weights `result.model`, saved as eval/NAME.json and handed
        to `export`. On the main process, or on every rank when the target is sharded."""
        return {}

    def export(self, result: TrainResult, initial: dict, final: dict, extra: dict[str, dict]) -> None:
        """Main process: write `final/` from `result.model` (`extra`: what final_evaluations measured)."""
        raise NotImplementedError

    def summary_fields(self) -> dict:
        return {}

    # ------------------------------------------------------------------------- what export() shares

    def card_record(self, chain: dict, plans: dict) -> dict:
        """final/'s record: the chosen weights' held-out chain acceptance and the plans it implies."""
        from ..export import held_out_record

        return held_out_record(chain, len(self.prompts)) | {"plans": plans}

    def trained_info(self, result: TrainResult, plans: dict) -> dict:
        """The model card's lines on the run: steps, which weights were exported, held-out prompts, K planned."""
        from ..evaluation.plan import planned_k

        chosen = "best held-out tau" if self.config.train.keep_best else "last"
        return {"training steps": result.step, "exported weights": f"step {result.best_step} ({chosen})",
                "held-out prompts": len(self.prompts), **planned_k(plans)}

    def export_with_served_row(self, write, kind: str, num_draft_tokens: int, *, verifier: str | None = None,
                               beside: tuple[dict, ...] = ()) -> None:
        """Write final/ with `write(rows)` (the rows after the recipe's own): first with none, then,
        where vLLM is installed, again with the row of the export as vLLM serves it (`kind`: its
        drafter kind; greedy, a chain of `num_draft_tokens`, on the held-out prompts, against
        `verifier` or the target), after the rows `beside`, so a user sees the trained and the
        served acceptance agree before deploying."""
        cfg = self.config
        write([])
        served = served_row(self.out / "final", kind, verifier or cfg.target, self.prompts, dtype=cfg.export_dtype,
                            num_draft_tokens=num_draft_tokens, max_new_tokens=cfg.eval.max_new_tokens,
                            eos_token_ids=set(self.eos_ids))
        if served:
            write([*beside, served])

    # ------------------------------------------------------------------------- the run

    def run(self) -> dict:
        """The whole recipe; returns a summary (initial/final tau, best step, output paths)."""
        try:
            self.setup()
            return self.train()
        finally:
            self.cleanup()

    def setup(self) -> None:
        cfg = self.config
        cfg.validate()
        self.accelerator = build_accelerator(cfg.train)
        self.device = self.accelerator.device
        self.main = self.accelerator.is_main_process
        self.out = Path(cfg.output_dir)
        self.run_dir = RunDirectory(self.out, self.accelerator, self.run_entries)
        self.run_dir.open(cfg, self.overwrite)
        with zero3_init_disabled(self.accelerator):
            self.load_models()
        self.eos_ids = eos_token_ids(self.tokenizer, self.target, required=True)
        self.pad_id = pad_token_id(self.tokenizer, self.target)

        # Everything is checked: from here on the run writes its directory.
        self.run_dir.start(cfg, self.overwrite)
        if self.main:
            self.save_initial()
        self.data, self.prompts = self.prepare_data()
        check_enough_examples(len(self.data.train), cfg.train.micro_batch_size, self.accelerator.num_processes,
                              cfg.train.gradient_accumulation_steps)  # before any evaluation writes best/
        about = self.describe()
        self.accelerator.print(f"{len(self.data.train)} training examples, {len(self.data.heldout)} held-out prompts "
                               f"({len(self.prompts)} used for evaluation)" + (f"; {about}" if about else ""))
        self.collator = self.make_collator()
        self.trainable = self.build_trainable()

    def prepare_data(self) -> tuple[TrainingData, list[EncodedPrompt]]:
        """The target's answers to the training prompts (generated once, cached), the held-out
        prompts (saved to heldout.jsonl for `drafttrain eval`) and the first of them that
        evaluation decodes."""
        cfg = self.config
        # Every rank writes a share of the answers (data.shards); a sharded target's ranks run every
        # forward together and the main process writes.
        ranks = answer_ranks(self.accelerator, lockstep=self.target_sharded)
        data = prepare_distillation_data(cfg.data, self.target, self.tokenizer, target_path=cfg.target,
                                         fingerprint=self.target_fingerprint, ranks=ranks)
        if self.main:
            write_prompts_jsonl(self.out / "heldout.jsonl", data.heldout)
        prompts = eval_prompts(data.heldout, self.tokenizer, self.target, num_prompts=cfg.eval.num_prompts,
                               max_new_tokens=cfg.eval.max_new_tokens)
        return data, prompts

    def train(self) -> dict:
        cfg = self.config
        result = train(self.accelerator, self.trainable, self.data.train, self.collator, self.loss, self.evaluate,
                       cfg.train, cfg.optim, self.out, run_config=config_to_dict(cfg),
                       evaluate_everywhere=self.target_sharded)
        initial = next(e for e in result.evals if e["step"] == 0)
        final = result.best_metrics
        summary = {"output_dir": str(self.out), **self.summary_fields(), "initial_tau": initial["tau"],
                   "final_tau": final["tau"], "best_step": result.best_step, "steps": result.step,
                   "final_dir": str(self.out / "final")}
        extra = self.final_evaluations(result) if self.main or self.target_sharded else {}
        if self.main:
            self.export(result, initial, final, extra)
            for name, metrics in {"initial": initial, "final": final, **extra}.items():
                atomic_write_json(self.out / "eval" / f"{name}.json", metrics)
            self.accelerator.print(f"tau {initial['tau']:.3f} -> {final['tau']:.3f} (step {result.best_step}); "
                                   f"{self.drafter_name} in {self.out / 'final'}")
        self.accelerator.wait_for_everyone()
        return summary

    def cleanup(self) -> None:
        if self.run_dir is not None:
            self.run_dir.close()


# ----------------------------------------------------------------------------- the command line


def recipe_main(recipe_class: type[Recipe], argv: list[str] | None = None) -> int:
    """A recipe script's `main`: parse `--config FILE [--overwrite] [key=value ...]`, run. A bad input,
    a load failure or an I/O error prints one `error:` line (exit 2); Ctrl-C one line (exit 130)."""
    ctrl_c_raises()
    try:
        cfg, flags = parse_argv(recipe_class.config_class, argv, prog=recipe_class.script, flags=RECIPE_FLAGS)
        recipe_class(cfg, overwrite="--overwrite" in flags).run()
    except UserError as e:
        say_once(f"error: {e}")
        return e.exit_code
    except BrokenPipeError:  # e.g. `--help | head`
        return 141
    except OSError as e:
        say_once(f"error: {first_line(e)}; fix the file system problem (space, permissions) and start the same "
                 "command again: the run resumes from its newest complete checkpoint")
        return 2
    except KeyboardInterrupt:
        say_interrupted()
        return 130
    finally:
        close_process_group()
    return 0


__all__ = ["ExportDtype", "RECIPE_FLAGS", "Recipe", "RecipeConfig", "RecipeEvalConfig", "TargetDtype", "exit_with",
           "held_out_eval", "recipe_main", "run_directory", "training_data"]
