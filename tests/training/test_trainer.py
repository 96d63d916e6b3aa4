"""The generic training loop on a toy regression model, checked against a plain PyTorch loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from drafttrain.training.checkpoints import complete_checkpoints
from drafttrain.training.config import OptimConfig, TrainConfig
from drafttrain.training.distributed import build_accelerator
from drafttrain.training.optim import lr_factor
from drafttrain.training.sampler import MicroBatches
from drafttrain.training.trainer import train

N_EXAMPLES = 22


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(4, 3)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def toy_model() -> Toy:
    return Toy().double()


def toy_dataset() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_EXAMPLES, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1 * torch.randn(
        N_EXAMPLES, 1, generator=g, dtype=torch.float64)
    return [{"x": x[i], "y": y[i]} for i in range(N_EXAMPLES)]


def collate(rows):
    return {"x": torch.stack([r["x"] for r in rows]), "y": torch.stack([r["y"] for r in rows])}


def mse(model, batch):
    err = model(batch["x"]) - batch["y"]
    return (err ** 2).mean(), {"mae": err.abs().mean().detach()}


def run(out, cfg: TrainConfig, optim: OptimConfig, *, loss_fn=mse, evaluate_fn=None, model=None):
    accelerator = build_accelerator(cfg)
    return train(accelerator, model or toy_model(), toy_dataset(), collate, loss_fn,
                 evaluate_fn or (lambda m: {"tau": 1.0}), cfg, optim, out)


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "train_log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- schedule and data order


def test_lr_schedule_matches_hand_computed_values():
    cfg = OptimConfig(lr=1.0, warmup_steps=3, schedule="cosine", min_lr_ratio=0.2)
    # Warm-up: (s+1)/(w+1); then cosine from 1 to 0.2 over the remaining 8 of 11 steps.
    assert [lr_factor(s, cfg, 11) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert lr_factor(3, cfg, 11) == pytest.approx(1.0)
    assert lr_factor(7, cfg, 11) == pytest.approx(0.2 + 0.8 * 0.5)  # halfway: cos(pi/2) = 0
    assert lr_factor(11, cfg, 11) == pytest.approx(0.2)
    linear = OptimConfig(lr=1.0, warmup_steps=0, schedule="linear")
    assert [lr_factor(s, linear, 4) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    constant = OptimConfig(lr=1.0, warmup_steps=1, schedule="constant")
    assert [lr_factor(s, constant, 4) for s in range(4)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_two_processes_see_the_global_batches_of_one_process_with_accumulation():
    n, b, steps = 23, 2, 14  # 23 // 4 = 5 steps per epoch: crosses two epoch boundaries
    one = take(MicroBatches(n, b, world_size=1, rank=0, seed=3, gradient_accumulation_steps=2), 2 * steps)
    ranks = [take(MicroBatches(n, b, world_size=2, rank=r, seed=3, gradient_accumulation_steps=1), steps)
             for r in (0, 1)]
    for s in range(steps):
        assert one[2 * s] + one[2 * s + 1] == ranks[0][s] + ranks[1][s]
    # Each epoch uses 20 distinct examples of a fresh permutation, and epochs differ.
    epochs = [sum(one[10 * e:10 * e + 10], []) for e in range(2)]
    assert all(len(set(e)) == 20 and set(e) <= set(range(n)) for e in epochs)
    assert epochs[0] != epochs[1]
    # Resuming at micro-batch k gives exactly what follows k.
    resumed = take(MicroBatches(n, b, 1, 0, seed=3, gradient_accumulation_steps=2, start=7), 10)
    assert resumed == one[7:17]


def test_a_dataset_smaller_than_one_global_batch_is_a_user_error():
    from drafttrain.errors import UserError

    with pytest.raises(UserError, match="fewer than one global batch"):
        MicroBatches(5, 2, world_size=2, rank=0, seed=0, gradient_accumulation_steps=2)


# ----------------------------------------------------------------------------- the optimisation itself


def reference_training(cfg: TrainConfig, optim: OptimConfig):
    """The same run as a hand-written PyTorch loop: returns (model, per-micro-batch losses, lrs)."""
    model = toy_model()
    data = toy_dataset()
    global_batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    per_epoch = N_EXAMPLES // global_batch * cfg.gradient_accumulation_steps
    order = []
    for epoch in range(cfg.max_steps * cfg.gradient_accumulation_steps // per_epoch + 1):
        perm = torch.randperm(N_EXAMPLES, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)).tolist()
        order += [perm[j * cfg.micro_batch_size:(j + 1) * cfg.micro_batch_size] for j in range(per_epoch)]
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=optim.lr, betas=optim.betas, eps=optim.eps)
    losses, lrs = [], []
    w, total = optim.warmup_steps, cfg.max_steps
    for step in range(cfg.max_steps):
        if step < w:
            factor = (step + 1) / (w + 1)
        else:
            factor = optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (step - w) / (total - w)))
        for group in opt.param_groups:
            group["lr"] = optim.lr * factor
        lrs.append(optim.lr * factor)
        opt.zero_grad()
        for a in range(cfg.gradient_accumulation_steps):
            batch = collate([data[i] for i in order[step * cfg.gradient_accumulation_steps + a]])
            loss = mse(model, batch)[0]
            (loss / cfg.gradient_accumulation_steps).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)
        opt.step()
    return model, losses, lrs


def test_training_matches_a_plain_pytorch_loop(tmp_path):
    cfg = TrainConfig(max_steps=7, micro_batch_size=3, gradient_accumulation_steps=2, seed=5, log_every=3,
                      eval_every=0, checkpoint_every=0, keep_best=False)
    optim = OptimConfig(lr=0.05, weight_decay=0.1, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1,
                        max_grad_norm=0.3)  # small enough that clipping is active
    result = run(tmp_path, cfg, optim)
    expected, losses, lrs = reference_training(cfg, optim)
    for (name, got), want in zip(result.model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
    assert result.step == 7 and result.best_step == 7  # keep_best off: the last step

    train_lines = [e for e in read_log(tmp_path) if e["type"] == "train"]
    assert [e["step"] for e in train_lines] == [3, 6, 7]
    for entry, (lo, hi) in zip(train_lines, [(0, 3), (3, 6), (6, 7)]):
        window = losses[2 * lo:2 * hi]
        assert entry["loss"] == pytest.approx(sum(window) / len(window), rel=1e-9)
        assert entry["lr"] == pytest.approx(lrs[hi - 1])
        assert "mae" in entry and entry["grad_norm"] > 0.3  # clipped norms are logged before clipping


# ----------------------------------------------------------------------------- best weights, resume


def test_best_weights_are_chosen_by_tau_not_by_loss(tmp_path):
    taus = iter([1.0, 1.5, 2.5, 1.2, 2.0])  # evaluations at steps 0, 2, 4, 6, 8
    snapshots = []

    def evaluate(model):
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"tau": next(taus), "loss": mse(model, collate(toy_dataset()))[0].item()}

    cfg = TrainConfig(max_steps=8, micro_batch_size=2, eval_every=2, checkpoint_every=0, log_every=1)
    result = run(tmp_path, cfg, OptimConfig(lr=0.05), evaluate_fn=evaluate)

    by_loss = min(result.evals, key=lambda e: e["loss"])["step"]
    assert by_loss != 4  # the loss would have picked other weights
    assert result.best_step == 4 and result.best_metrics["tau"] == 2.5
    assert [e["step"] for e in result.evals] == [0, 2, 4, 6, 8]
    for k, v in result.model.state_dict().items():
        torch.testing.assert_close(v, snapshots[2][k], rtol=0, atol=0)
    assert not torch.equal(snapshots[2]["out.weight"], snapshots[4]["out.weight"])
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 4
    evals = [e for e in read_log(tmp_path) if e["type"] == "eval"]
    assert [e["best_step"] for e in evals] == [0, 2, 4, 4, 4]


class Crash(Exception):
    pass


def held_out_tau(model):
    """A deterministic tau from the weights, so a replayed evaluation gives the same number."""
    data = collate(toy_dataset()[:6])
    return {"tau": 1.0 / (1.0 + mse(model, data)[0].item())}


def test_resume_after_a_crash_matches_the_uninterrupted_run(tmp_path):
    cfg = TrainConfig(max_steps=9, micro_batch_size=3, gradient_accumulation_steps=2, eval_every=2,
                      checkpoint_every=3, keep_checkpoints=2, log_every=1, seed=7)
    optim = OptimConfig(lr=0.05, warmup_steps=2, weight_decay=0.01)
    whole = run(tmp_path / "whole", cfg, optim, evaluate_fn=held_out_tau)
    reset_accelerate()

    def crash_at_step_8(model, batch):  # after the eval of step 8, before the checkpoint of step 9
        if batch["step"] == 8:
            raise Crash
        return mse(model, batch)

    out = tmp_path / "resumed"
    with pytest.raises(Crash):
        run(out, cfg, optim, loss_fn=crash_at_step_8, evaluate_fn=held_out_tau)
    reset_accelerate()
    assert [s for s, _ in complete_checkpoints(out)] == [3, 6]
    assert max(e["step"] for e in read_log(out)) == 8  # log lines past the checkpoint, to be dropped
    # A checkpoint cut short while being written, and a directory that merely looks like one.
    partial = out / "checkpoints" / ".step-9.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"garbage")
    (out / "checkpoints" / "step-12").mkdir()

    resumed = run(out, cfg, optim, evaluate_fn=held_out_tau)
    assert resumed.resumed_from == 6
    assert not partial.exists()
    for (name, got), want in zip(resumed.model.named_parameters(), whole.model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert resumed.best_step == whole.best_step
    assert [(e["step"], e["tau"]) for e in resumed.evals] == [(e["step"], e["tau"]) for e in whole.evals]

    def comparable(path):  # the same log, minus wall-clock figures
        drop = ("steps_per_s", "eval_seconds")
        return [{k: v for k, v in e.items() if k not in drop} for e in read_log(path)]

    assert comparable(out) == comparable(tmp_path / "whole")
    assert [s for s, _ in complete_checkpoints(out)] == [6, 9]  # keep_checkpoints=2

    # Started again once finished: nothing to train, same answer.
    reset_accelerate()
    again = run(out, cfg, optim, evaluate_fn=held_out_tau)
    assert again.resumed_from == 9 and again.best_step == whole.best_step
    for got, want in zip(again.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fresh_run_ignores_leftovers_of_a_run_that_never_checkpointed(tmp_path):
    (tmp_path / "best").mkdir(parents=True)
    (tmp_path / "best" / "best.json").write_text(json.dumps({"step": 50, "metrics": {"tau": 9.0}}))
    (tmp_path / "train_log.jsonl").write_text('{"type": "train", "step": 50}\n')
    result = run(tmp_path, TrainConfig(max_steps=2, micro_batch_size=2, eval_every=0, log_every=1),
                 OptimConfig(lr=0.01), evaluate_fn=held_out_tau)
    assert result.resumed_from is None and result.best_step in (0, 2)
    assert max(e["step"] for e in read_log(tmp_path)) == 2


def test_wandb_logging_stays_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tmp_path, TrainConfig(max_steps=2, micro_batch_size=2, eval_every=0, log_every=1, report_to="wandb"),
        OptimConfig(lr=0.01))
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_config_errors_are_user_errors():
    from drafttrain.errors import UserError

    with pytest.raises(UserError, match="train.micro_batch_size"):
        TrainConfig(micro_batch_size=0).validate()
    with pytest.raises(UserError, match="optim.lr"):
        OptimConfig(lr=0).validate()
    with pytest.raises(UserError, match="betas"):
        OptimConfig(betas=(0.9, 1.0)).validate()


