"""Faults the training loop survives (toy model): damaged checkpoints, divergence, a full disk, pruning, locks."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_trainer import Crash, held_out_tau, mse, read_log, reset_accelerate, run, toy_model
from training_helpers import subprocess_env

from drafttrain.errors import UserError
from drafttrain.training.checkpoints import MANIFEST_FILE, complete_checkpoints, manifest_problem, write_manifest
from drafttrain.training.config import OptimConfig, TrainConfig
from drafttrain.training.run_dir import RunLock

CFG = dict(max_steps=9, micro_batch_size=3, gradient_accumulation_steps=2, eval_every=2, checkpoint_every=3,
           keep_checkpoints=3, log_every=1, seed=7)
OPTIM = OptimConfig(lr=0.05, warmup_steps=2, weight_decay=0.01)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run every resumed run must end identical to."""
    out = tmp_path_factory.mktemp("whole")
    result = run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)
    reset_accelerate()
    return out, result


def crash_at(step: int):
    def loss_fn(model, batch):
        if batch["step"] == step:
            raise Crash
        return mse(model, batch)
    return loss_fn


def interrupted(out, at: int = 8) -> None:
    """A run that dies while computing step `at` + 1 (checkpoints 3 and 6 are on disk)."""
    with pytest.raises(Crash):
        run(out, TrainConfig(**CFG), OPTIM, loss_fn=crash_at(at), evaluate_fn=held_out_tau)
    reset_accelerate()


def assert_same_run(out, whole_out, resumed, reference) -> None:
    for (name, got), want in zip(resumed.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert resumed.best_step == reference.best_step

    def comparable(path):  # the same log, minus wall-clock figures
        return [{k: v for k, v in e.items() if k not in ("steps_per_s", "eval_seconds")} for e in read_log(path)]

    assert comparable(out) == comparable(whole_out)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path):
    """64 bytes overwritten in the middle: the same size, a different content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes((b + 1) % 256 for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


DAMAGE = {
    "weights truncated": ("model.safetensors", truncate),
    "weights emptied": ("model.safetensors", lambda p: p.write_bytes(b"")),
    "weights deleted": ("model.safetensors", lambda p: p.unlink()),
    "weights garbled, same size": ("model.safetensors", garbage),
    "optimizer truncated": ("optimizer.bin", truncate),
    "optimizer deleted": ("optimizer.bin", lambda p: p.unlink()),
    "scheduler state deleted": ("custom_checkpoint_0.pkl", lambda p: p.unlink()),
    "random states deleted": ("random_states_0.pkl", lambda p: p.unlink()),
    "trainer state edited": ("trainer_state.json", lambda p: p.write_text(p.read_text().replace('"step": 6', '"step": 7'))),
    "trainer state bad fields, manifest rewritten to match": ("trainer_state.json", lambda p: bad_state(p)),
}


def bad_state(path):
    """A trainer_state.json without best_tau and with evals that are no list, whose manifest was
    rewritten to match: the files verify, the state is still unusable."""
    state = json.loads(path.read_text())
    del state["best_tau"]
    state["evals"] = 5
    path.write_text(json.dumps(state))
    write_manifest(path.parent)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(case, whole, tmp_path, capsys):
    whole_out, reference = whole
    out = tmp_path / "run"
    interrupted(out)
    name, damage = DAMAGE[case]
    damage(out / "checkpoints" / "step-6" / name)
    capsys.readouterr()

    resumed = run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step-6" in warnings[0] and name in warnings[0], warnings
    assert resumed.resumed_from == 3
    assert (out / "checkpoints" / "step-6.damaged").is_dir()  # set aside, not deleted
    assert_same_run(out, whole_out, resumed, reference)
    assert [s for s, _ in complete_checkpoints(out)] == [3, 6, 9]  # step-6 written again, intact
    assert manifest_problem(out / "checkpoints" / "step-6") is None


def test_with_no_intact_checkpoint_the_resume_stops_and_touches_nothing(tmp_path):
    out = tmp_path / "run"
    interrupted(out)
    garbage(out / "checkpoints" / "step-6" / "model.safetensors")
    (out / "checkpoints" / "step-3" / "optimizer.bin").unlink()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(UserError, match=r"no intact checkpoint .*step-6: model.safetensors does not match its "
                                        r"checksum; step-3: optimizer.bin is missing.*--overwrite"):
        run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_checkpoints_replaced_by_a_file_stop_the_resume_and_touch_nothing(tmp_path):
    """Resuming as if from nothing would overwrite best/ and cut the training log."""
    out = tmp_path / "run"
    interrupted(out)
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").write_text("not a directory")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(UserError, match=r"checkpoints is not a directory .*--overwrite"):
        run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_checkpoint_from_before_manifests_is_resumed_with_a_warning(whole, tmp_path, capsys):
    whole_out, reference = whole
    out = tmp_path / "run"
    interrupted(out)
    for step in (3, 6):
        (out / "checkpoints" / f"step-{step}" / MANIFEST_FILE).unlink()
    capsys.readouterr()
    resumed = run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)
    err = capsys.readouterr().err
    assert "step-6 was written before drafttrain verified its checkpoints" in err
    assert resumed.resumed_from == 6
    assert_same_run(out, whole_out, resumed, reference)


def test_a_damaged_best_copy_is_an_error_not_an_export(tmp_path):
    out = tmp_path / "run"
    interrupted(out)
    garbage(out / "best" / "model.safetensors")
    with pytest.raises(UserError, match="best.*is damaged"):
        run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)


# ----------------------------------------------------------------------------- divergence


def test_a_nan_loss_stops_the_run_before_anything_is_written_or_pruned(tmp_path):
    cfg = TrainConfig(**{**CFG, "keep_checkpoints": 1, "eval_every": 3})

    def nan_at_step_8(model, batch):
        loss, logs = mse(model, batch)
        return (loss * float("nan") if batch["step"] == 7 else loss), logs

    with pytest.raises(UserError, match="training diverged: the loss became NaN or inf by step 8"):
        run(tmp_path, cfg, OPTIM, loss_fn=nan_at_step_8, evaluate_fn=held_out_tau)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6]  # step 9 would have pruned it
    log = read_log(tmp_path)
    assert max(e["step"] for e in log) == 7 and all(e.get("loss", 0) == e.get("loss", 0) for e in log)
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] <= 6


class ToyWithSpare(torch.nn.Module):
    """The toy model plus a parameter the loss never reaches (no gradient, so only the check sees it)."""

    def __init__(self):
        super().__init__()
        self.inner = toy_model()
        self.spare = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))

    def forward(self, x):
        return self.inner(x)


def test_nan_weights_stop_the_run_too(tmp_path):
    model = ToyWithSpare()

    def poison_at_step_5(m, batch):
        if batch["step"] == 4:
            with torch.no_grad():
                model.spare[0, 0] = float("nan")
        return mse(m, batch)

    with pytest.raises(UserError, match="the weights became NaN or inf by step 5"):
        run(tmp_path, TrainConfig(**CFG), OPTIM, loss_fn=poison_at_step_5, evaluate_fn=held_out_tau, model=model)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [3]
    assert max(e["step"] for e in read_log(tmp_path)) == 4


# ----------------------------------------------------------------------------- pruning and a full disk


def test_pruning_keeps_the_newest_checkpoint_that_passed_an_evaluation(tmp_path):
    # Checkpoints at 2, 4, 6, 8; evaluations at 0, 3, 6, 9. keep_checkpoints=1 alone would leave
    # only step-8, whose weights were never evaluated: step-6, the newest evaluated one, stays too.
    cfg = TrainConfig(max_steps=10, micro_batch_size=2, checkpoint_every=2, eval_every=3, keep_checkpoints=1,
                      log_every=1)
    with pytest.raises(Crash):
        run(tmp_path, cfg, OptimConfig(lr=0.01), loss_fn=crash_at(9), evaluate_fn=held_out_tau)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6, 8]


def test_a_full_disk_during_a_checkpoint_is_a_user_error_and_the_partial_one_is_never_used(whole, tmp_path,
                                                                                           monkeypatch):
    from accelerate import Accelerator

    whole_out, reference = whole
    real_save = Accelerator.save_state

    def disk_full_at_step_6(self, output_dir=None, **kwargs):
        if output_dir.endswith(".step-6.tmp"):
            open(os.path.join(output_dir, "model.safetensors"), "wb").write(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(self, output_dir, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(Accelerator, "save_state", disk_full_at_step_6)
    with pytest.raises(UserError, match=r"writing checkpoint .*step-6 failed \(\[Errno 28\] No space left on device"):
        run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)
    reset_accelerate()
    monkeypatch.undo()
    assert [s for s, _ in complete_checkpoints(out)] == [3]
    assert (out / "checkpoints" / ".step-6.tmp").is_dir()

    resumed = run(out, TrainConfig(**CFG), OPTIM, evaluate_fn=held_out_tau)
    assert resumed.resumed_from == 3 and not (out / "checkpoints" / ".step-6.tmp").exists()
    assert_same_run(out, whole_out, resumed, reference)


# ----------------------------------------------------------------------------- the run directory


def test_leftovers_of_killed_runs_are_removed_at_the_next_start(tmp_path):
    leftovers = [tmp_path / ".best.k2j4.tmp", tmp_path / ".final.8dd1.tmp", tmp_path / ".best.old",
                 tmp_path / "checkpoints" / ".step-4.tmp", tmp_path / "checkpoints" / ".step-2.deleting.tmp"]
    for p in leftovers:
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"partial")
    files = [tmp_path / ".config.yaml.x1.tmp", tmp_path / "eval" / ".final.json.x2.tmp"]
    for p in files:
        p.parent.mkdir(exist_ok=True)
        p.write_text("partial")
    (tmp_path / "notes.md").write_text("mine")
    run(tmp_path, TrainConfig(max_steps=2, micro_batch_size=2, eval_every=0, log_every=1), OptimConfig(lr=0.01))
    assert not any(p.exists() for p in leftovers + files)
    assert (tmp_path / "notes.md").read_text() == "mine"


LOCK_HOLDER = """
import sys, time
from drafttrain.training.run_dir import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE,
                              env=subprocess_env(), text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"in use by another run \(pid {holder.pid}\)"):
            run(tmp_path, TrainConfig(max_steps=2, micro_batch_size=2, eval_every=0), OptimConfig(lr=0.01))
        assert not (tmp_path / "train_log.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    reset_accelerate()
    capsys.readouterr()
    result = run(tmp_path, TrainConfig(max_steps=2, micro_batch_size=2, eval_every=0), OptimConfig(lr=0.01))
    assert result.step == 2
    assert f"locked by a run (pid {holder.pid}) that ended without releasing it" in capsys.readouterr().out
    assert (tmp_path / ".lock").read_text() == ""  # released cleanly: no pid left behind


def test_the_lock_excludes_even_the_same_process_through_another_handle(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(UserError, match=rf"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    finally:
        first.release()
    second = RunLock(tmp_path)
    second.acquire()  # free again
    assert second.taken_over_from is None  # a clean release leaves no pid to take over from
    second.release()
    shutil.rmtree(tmp_path)
