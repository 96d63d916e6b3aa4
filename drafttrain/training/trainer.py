"""The training loop: any trainable module, any loss, resumable exactly, measured by tau.

The loop knows nothing about drafters: a recipe hands it the trainable module, a map-style
dataset with its collate function, `loss_fn(model, batch) -> (loss, logs)` and
`evaluate_fn(model) -> {"tau": ..., ...}`. What makes a long run safe is split by job:

- `sampler`: the data order, a pure function of (seed, epoch, position), so a resumed run and
  any process count see the same global batches.
- `checkpoints`: atomic, self-verifying checkpoints; pruning that keeps the good ones.
- `run_dir`: one run per output directory (the lock, also taken here when the loop is used
  without a recipe) and no leftovers of killed runs.
- `distributed`: the Accelerator and how ranks agree.

This module is the loop itself. Evaluation runs on the main process (other ranks wait), or on
every rank in lockstep when evaluate_fn runs a sharded target (`evaluate_everywhere`); the
weights with the best `tau` (mean accepted length, not the loss) are kept in `best/`, so the
export is the best drafter. Under ZeRO-3 / FSDP the full weights are gathered into a plain copy
of the module first. A loss or weights that turn NaN/inf stop the run with a UserError before
anything else is written, so no log line, `best/` or checkpoint ever holds them.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..fileio import atomic_write_text
from ..models import first_line
from .checkpoints import (BEST_DIR, ResumePoint, find_resume_checkpoint, load_best_weights, newest_evaluated_checkpoint,
                          prune_checkpoints, read_best, read_state, save_best, save_checkpoint, set_aside)
from .config import OptimConfig, TrainConfig
from .distributed import (broadcast, broadcast_weights, configure_deepspeed, full_state_dict, is_sharded,
                          load_full_state_dict, on_main, raise_if_any)
from .optim import build_optimizer, build_scheduler
from .run_dir import acquire_run_lock, release_run_lock, remove_leftovers
from .sampler import MicroBatches

LOG_FILE = "train_log.jsonl"

LossFn = Callable[[torch.nn.Module, dict], "tuple[torch.Tensor, dict]"]
EvalFn = Callable[[torch.nn.Module], dict]


@dataclass
class TrainResult:
    step: int                    # optimizer steps done
    best_step: int               # step whose weights `model` holds (the last one if keep_best is off)
    best_metrics: dict           # evaluate_fn's result for those weights
    evals: list[dict]            # every evaluation: {"step": s, **metrics}, step 0 first
    model: torch.nn.Module | None  # plain module, chosen weights (main process, or every rank: evaluate_everywhere)
    resumed_from: int | None = None


@dataclass
class TrainerState:
    """What a checkpoint adds to accelerate's state: progress, the best evaluation, every evaluation."""

    step: int = 0
    best_step: int | None = None
    best_tau: float | None = None
    evals: list[dict] = field(default_factory=list)

    def to_json(self, cfg: TrainConfig, world_size: int) -> dict:
        per_step = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world_size
        return {"step": self.step, "best_step": self.best_step, "best_tau": self.best_tau, "evals": self.evals,
                "data": {"micro_batches_per_rank": self.step * cfg.gradient_accumulation_steps,
                         "examples_seen": self.step * per_step, "world_size": world_size,
                         "micro_batch_size": cfg.micro_batch_size,
                         "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "seed": cfg.seed}}


def train(accelerator, model: torch.nn.Module, dataset, collate_fn: Callable[[list], dict], loss_fn: LossFn,
          evaluate_fn: EvalFn, cfg: TrainConfig, optim: OptimConfig, output_dir: str | Path, *,
          run_config: dict | None = None, evaluate_everywhere: bool = False) -> TrainResult:
    """Train `model` (its `requires_grad` parameters) for `cfg.max_steps` optimizer steps.

    `dataset` is map-style (`len`, integer indexing); `collate_fn` turns a list of its rows into a
    dict of tensors. The trainer moves tensors to the device and adds two ints to every batch:
    `step` (the optimizer step being computed) and `batch_index` (the micro-batch's position in
    the global data stream, identical for any process count), so a `loss_fn` can seed its own
    randomness reproducibly. `loss_fn` returns the micro-batch's mean loss and a dict of floats
    (the same keys every call), averaged into the log. `evaluate_fn` gets a plain module with the
    full weights, in eval mode under no_grad, on the main process only (`evaluate_everywhere`: on
    every rank at once, each with the same weights, for an evaluate_fn whose forwards are
    collectives); it returns a dict with at least `tau` (higher is better) and JSON-friendly
    values; the main process's result counts.

    Started again with the same `output_dir`, it resumes from the newest intact checkpoint.
    """
    return Trainer(accelerator, model, dataset, collate_fn, loss_fn, evaluate_fn, cfg, optim, output_dir,
                   run_config=run_config, evaluate_everywhere=evaluate_everywhere).fit()


class Trainer:
    """One call of `train`: set up, resume or start, loop, hand back the chosen weights."""

    def __init__(self, accelerator, model, dataset, collate_fn, loss_fn: LossFn, evaluate_fn: EvalFn,
                 cfg: TrainConfig, optim: OptimConfig, output_dir: str | Path, *, run_config: dict | None = None,
                 evaluate_everywhere: bool = False):
        cfg.validate()
        optim.validate()
        self.accelerator, self.model, self.dataset, self.collate_fn = accelerator, model, dataset, collate_fn
        self.loss_fn, self.evaluate_fn, self.cfg, self.optim = loss_fn, evaluate_fn, cfg, optim
        self.out = Path(output_dir)
        self.run_config = run_config or {}
        self.main = accelerator.is_main_process
        self.evaluates = self.main or evaluate_everywhere  # this rank runs evaluate_fn
        self.everywhere = evaluate_everywhere
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.state = TrainerState()
        self.resumed_from: int | None = None
        self._pending_best: tuple[int, float] | None = None  # (step, tau) of a best/ newer than the checkpoint
        self._bad_loss = torch.zeros((), dtype=torch.bool, device=accelerator.device)
        self._window: dict[str, list] = {}
        self._window_seconds = 0.0

    def fit(self) -> TrainResult:
        on_main(self.accelerator, lambda: acquire_run_lock(self.out) and None)
        try:
            if self.main:
                remove_leftovers(self.out)
            self.accelerator.wait_for_everyone()
            self._prepare()
            self._restore()
            self._start_tracking()
            if self.state.step == 0 and not self.state.evals:
                self.evaluate()  # step 0: the "before" figure, and a candidate for best
            self._loop()
            return self._result()
        finally:
            if self.main:
                release_run_lock(self.out)

    # ------------------------------------------------------------------------- set-up

    def _prepare(self) -> None:
        acc = self.accelerator
        self.sharded = is_sharded(acc)
        # A plain copy holds gathered weights for evaluation/export when no rank holds them all.
        self.shadow = copy.deepcopy(self.model) if self.sharded and self.evaluates else None
        optimizer = build_optimizer(self.model, self.optim)
        self.scheduler = build_scheduler(optimizer, self.optim, self.cfg.max_steps)
        configure_deepspeed(acc, self.cfg, self.optim)
        self.model, self.optimizer = acc.prepare(self.model, optimizer)
        acc.register_for_checkpointing(self.scheduler)  # ours: stepped once per optimizer step

    def _restore(self) -> None:
        """Resume from the newest intact checkpoint (setting damaged newer ones aside), or start fresh."""
        point: ResumePoint = on_main(self.accelerator, self._find_checkpoint)
        if point.path is not None:
            error = None
            try:
                self.accelerator.load_state(str(point.path))
            except Exception as e:  # a checkpoint that verifies but still does not fit (e.g. another world size)
                error = (f"cannot resume from {point.path} ({first_line(e)}); move that checkpoint away to resume "
                         "from the one before it, or start over with --overwrite")
            raise_if_any(self.accelerator, error)
            self._require_finite(f"the weights loaded from {point.path}")
        self.state, self._pending_best = on_main(self.accelerator, lambda: self._read_state(point))
        if point.path is not None:
            self.resumed_from = self.state.step

    def _find_checkpoint(self) -> ResumePoint:
        point = find_resume_checkpoint(self.out)
        for path, why in point.skipped:
            aside = set_aside(path)
            warn(f"skipping checkpoint {path}: {why}; set aside as {aside.name}")
        if point.path is not None and not point.verified:
            warn(f"{point.path} was written before drafttrain verified its checkpoints (no manifest.json); "
                 "resuming from it unverified")
        return point

    def _read_state(self, point: ResumePoint) -> tuple[TrainerState, tuple[int, float] | None]:
        if point.path is None:  # a fresh start: leftovers of an earlier run that never checkpointed go
            shutil.rmtree(self.out / BEST_DIR, ignore_errors=True)
            (self.out / LOG_FILE).unlink(missing_ok=True)
            return TrainerState(), None
        saved = read_state(point.path)
        state = TrainerState(step=saved["step"], best_step=saved["best_step"], best_tau=saved["best_tau"],
                             evals=saved["evals"])
        self._warn_if_order_changed(saved.get("data", {}))
        print(f"resuming from {point.path} (step {state.step})", flush=True)
        _truncate_log(self.out / LOG_FILE, state.step)
        return state, self._best_on_disk(state)

    def _best_on_disk(self, state: TrainerState) -> tuple[int, float] | None:
        """`best/` may be newer than the checkpoint: evaluated after it, before the crash (or after a
        damaged checkpoint the resume fell back past). Those weights were really measured, so they
        stay a candidate - but they count only once the resumed run reaches their step (with
        `_pending_best`), so every log line before it reads as in an uninterrupted run."""
        meta = read_best(self.out)
        if meta is None:
            return None
        tau = float(meta["metrics"]["tau"])
        if meta["step"] > state.step:
            return meta["step"], tau
        if state.best_tau is None or tau > state.best_tau or meta["step"] == state.best_step:
            state.best_step, state.best_tau = meta["step"], tau
        return None

    def _warn_if_order_changed(self, saved: dict) -> None:
        cfg = self.cfg
        now = {"world_size": self.world, "micro_batch_size": cfg.micro_batch_size,
               "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "seed": cfg.seed}
        changed = [f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
        if changed:
            warn("resuming with a different " + ", ".join(changed) + ": the data order after the checkpoint "
                 "differs from an uninterrupted run")

    def _start_tracking(self) -> None:
        if self.cfg.report_to == "wandb":
            name = self.cfg.run_name or self.out.resolve().name
            self.accelerator.init_trackers(self.cfg.wandb_project, config=self.run_config,
                                           init_kwargs={"wandb": {"name": name, "dir": str(self.out)}})

    # ------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        cfg, ga = self.cfg, self.cfg.gradient_accumulation_steps
        sampler = MicroBatches(len(self.dataset), cfg.micro_batch_size, self.world, self.rank, cfg.seed, ga,
                               start=self.state.step * ga)
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collate_fn,
                                             num_workers=cfg.num_workers)
        batches = iter(loader)
        self.model.train()
        # the bar closes however the loop ends: its line ends before an error's, and an interrupted run
        # leaves no open bar for the interpreter's exit to close (a traceback after Ctrl-C's one line)
        with tqdm(total=cfg.max_steps, initial=self.state.step, desc="train", unit="step", disable=not self.main,
                  dynamic_ncols=True) as bar:
            while self.state.step < cfg.max_steps:
                lr, grad_norm = self._step(batches)
                bar.update(1)
                step = self.state.step
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    entry = self._log(lr, grad_norm)
                    bar.set_postfix(loss=f"{entry['loss']:.4f}", lr=f"{lr:.2e}")
                if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
                    self.evaluate()
                    bar.set_postfix(tau=f"{self.state.evals[-1]['tau']:.3f}", best=f"{self.state.best_tau:.3f}")
                if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.max_steps:
                    self.checkpoint()

    def _step(self, batches) -> tuple[float, torch.Tensor | None]:
        """One optimizer step over `gradient_accumulation_steps` micro-batches: (lr used, grad norm)."""
        acc, ga, start = self.accelerator, self.cfg.gradient_accumulation_steps, time.perf_counter()
        grad_norm = None
        for micro in range(ga):
            batch = _to_device(next(batches), acc.device)
            batch["step"] = self.state.step
            batch["batch_index"] = (self.state.step * ga + micro) * self.world + self.rank
            with acc.accumulate(self.model):
                loss, logs = self.loss_fn(self.model, batch)
                acc.backward(loss)
                if micro == ga - 1 and not acc.sync_gradients:
                    raise RuntimeError("gradient accumulation fell out of step with the optimizer steps")
                if acc.sync_gradients:
                    max_norm = self.optim.max_grad_norm or float("inf")
                    grad_norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self._bad_loss |= ~torch.isfinite(loss.detach()).all()  # checked, with one sync, before any write
            for k, v in {"loss": loss, **logs}.items():  # tensors stay on the device until the log line
                self._window.setdefault(k, []).append(v.detach() if torch.is_tensor(v) else float(v))
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.state.step += 1
        self._window_seconds += time.perf_counter() - start
        return lr, grad_norm

    def _log(self, lr: float, grad_norm) -> dict:
        """The mean of every logged value since the last line, over all ranks."""
        self._require_finite()
        acc, window, ga = self.accelerator, self._window, self.cfg.gradient_accumulation_steps
        keys = sorted(window)
        means = torch.tensor([sum(float(v) for v in window[k]) / len(window[k]) for k in keys],
                             dtype=torch.float64, device=acc.device)
        means = acc.reduce(means, reduction="mean").tolist() if self.world > 1 else means.tolist()
        entry = {"type": "train", "step": self.state.step, "lr": lr, **dict(zip(keys, means)),
                 "grad_norm": None if grad_norm is None else float(grad_norm),
                 "steps_per_s": round(len(window.get("loss", [])) / ga / max(self._window_seconds, 1e-9), 4)}
        if self.main:
            _append_log(self.out, entry)
            acc.log({k: v for k, v in entry.items() if isinstance(v, (int, float))}, step=self.state.step)
        self._window, self._window_seconds = {}, 0.0
        return entry

    def evaluate(self) -> None:
        """evaluate_fn on the current weights (main process); keeps them in best/ if they are the best."""
        self._require_finite()
        acc, state, module = self.accelerator, self.state, self._plain_model()
        metrics = None
        if self.evaluates:
            was_training = module.training
            module.eval()
            start = time.perf_counter()
            with torch.no_grad():
                metrics = dict(self.evaluate_fn(module))
            module.train(was_training)
            if "tau" not in metrics:
                raise TypeError("evaluate_fn must return a dict with a 'tau' entry")
            metrics["eval_seconds"] = round(time.perf_counter() - start, 3)
        metrics = broadcast(acc, metrics)
        entry = {"step": state.step, **metrics}
        state.evals.append(entry)
        tau = float(metrics["tau"])
        improved = not self.cfg.keep_best or state.best_tau is None or tau > state.best_tau
        pending = self._pending_best
        if improved:
            state.best_step, state.best_tau = state.step, tau
            self._pending_best = None  # best/ is rewritten below
        elif pending is not None and pending[0] == state.step:
            if pending[1] > state.best_tau:  # this evaluation, repeated, scored lower: keep what best/ holds
                state.best_step, state.best_tau = pending
            self._pending_best = None
        error = None
        if self.main:
            if improved and self.cfg.keep_best:
                weights = {k: v.detach().cpu() for k, v in module.state_dict().items()}
                try:
                    save_best(self.out, weights, state.step, metrics)
                except OSError as e:
                    error = f"writing {self.out / BEST_DIR} failed ({first_line(e)}); free disk space and start again"
            if error is None:
                _append_log(self.out, {"type": "eval", **entry, "best_step": state.best_step})
                acc.log({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=state.step)
        raise_if_any(acc, error)

    def checkpoint(self) -> None:
        """Save checkpoints/step-N, then prune, never deleting the newest one that passed an evaluation."""
        self._require_finite()
        save_checkpoint(self.accelerator, self.out, self.state.step, self.state.to_json(self.cfg, self.world))
        if self.main:
            prune_checkpoints(self.out, self.cfg.keep_checkpoints,
                              protect=newest_evaluated_checkpoint(self.out, self.state.evals))
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------------- guards and results

    def _require_finite(self, what: str | None = None) -> None:
        """A UserError on every rank if any rank's loss since the start, or weights, are NaN/inf."""
        acc = self.accelerator
        params = [p for p in self.model.parameters() if p.numel()]
        bad_weights = torch.stack([~torch.isfinite(p.detach()).all() for p in params]).any() if params else \
            torch.zeros((), dtype=torch.bool, device=acc.device)
        flags = torch.stack([self._bad_loss.to(acc.device), bad_weights.to(acc.device)]).float()
        if self.world > 1:
            flags = acc.reduce(flags, reduction="sum")
        bad_loss, bad_weights = (flags > 0).tolist()
        if not (bad_loss or bad_weights):
            return
        if what is not None:
            raise UserError(f"{what} are not finite (NaN or inf); move that checkpoint away to resume from the "
                            "one before it, or start over with --overwrite")
        raise UserError(f"training diverged: the {'loss' if bad_loss else 'weights'} became NaN or inf by step "
                        f"{self.state.step}; nothing of it was saved. Lower optim.lr (or keep optim.max_grad_norm "
                        "on) and start over with --overwrite")

    def _plain_model(self) -> torch.nn.Module | None:
        """The module evaluate_fn and the export see: the unwrapped one, or the filled shadow."""
        if not self.sharded:
            return self.accelerator.unwrap_model(self.model) if self.evaluates else None
        weights = full_state_dict(self.accelerator, self.model)  # collective: every rank gathers
        if self.main:
            load_full_state_dict(self.shadow, weights)
        if self.everywhere:
            broadcast_weights(self.accelerator, self.shadow)
        return self.shadow

    def _result(self) -> TrainResult:
        self._require_finite()
        state, cfg = self.state, self.cfg
        module = self._plain_model()  # the last step's weights (main process)

        def best_metrics() -> dict | None:
            found = next((e for e in reversed(state.evals) if e["step"] == state.best_step), None)
            if cfg.keep_best:
                load_full_state_dict(module, load_best_weights(self.out))
                if found is None:  # best/ was evaluated after max_steps of this run (max_steps lowered)
                    found = {"step": state.best_step, **read_best(self.out)["metrics"]}
            return found

        metrics = on_main(self.accelerator, best_metrics)
        if self.everywhere and cfg.keep_best:
            broadcast_weights(self.accelerator, module)  # best/ as the main process read it
        if cfg.report_to == "wandb":
            self.accelerator.end_training()
        return TrainResult(step=state.step, best_step=state.best_step, best_metrics=metrics, evals=state.evals,
                           model=module, resumed_from=self.resumed_from)


# ----------------------------------------------------------------------------- helpers


def warn(message: str) -> None:
    """One `warning:` line on stderr (main process callers only)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _append_log(output_dir: Path, entry: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / LOG_FILE, "a") as f:
        f.write(json.dumps(entry, default=float) + "\n")


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines of steps after the checkpoint: the resumed run writes them again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        if entry.get("step", 0) <= step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


__all__ = ["LOG_FILE", "TrainResult", "Trainer", "TrainerState", "train"]
