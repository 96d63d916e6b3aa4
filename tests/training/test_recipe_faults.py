"""recipes/distill.py when things go wrong: every fault is one `error:` line (exit 2) or a clean fallback.

Damaged checkpoints, a changed config, --overwrite, a full disk and bad paths, on the tiny
models; the loop-level cases (every kind of damage, divergence, pruning, the lock) are in
test_checkpoints.py. The lock against a live recipe run is in test_distill_recipe.py's kill test.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil

import pytest
from test_checkpoints import garbage
from training_helpers import assert_same_weights, load_recipe, load_weights, recipe_args

import drafttrain.fileio


def copy_run(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def snapshot(out) -> dict:
    """Every file of a run (but the lock) with its content hash and modification time."""
    return {str(p.relative_to(out)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}


def main(assets, out, *overrides, flags=()):
    return load_recipe().main([*flags, *recipe_args(assets, out, *overrides)])


def stderr_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.strip() and "%|" not in line]


# ----------------------------------------------------------------------------- resuming


def test_a_damaged_newest_checkpoint_falls_back_and_ends_as_the_uninterrupted_run(distilled, assets, tmp_path, capfd):
    out = copy_run(distilled, tmp_path)
    garbage(out / "checkpoints" / "step-60" / "model.safetensors")
    shutil.rmtree(out / "final")
    capfd.readouterr()
    assert main(assets, out) == 0
    captured = capfd.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step-60: model.safetensors does not match its checksum" in warnings[0]
    assert "resuming from" in captured.out and "step-50" in captured.out
    for name in ("checkpoints/step-60", "final"):
        assert_same_weights(load_weights(out / name), load_weights(distilled / name))


def test_with_no_intact_checkpoint_the_run_stops_with_one_error_line(distilled, assets, tmp_path, capfd):
    out = copy_run(distilled, tmp_path)
    garbage(out / "checkpoints" / "step-60" / "model.safetensors")
    (out / "checkpoints" / "step-50" / "random_states_0.pkl").unlink()
    before = snapshot(out)
    capfd.readouterr()
    assert main(assets, out) == 2
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and lines[0].startswith("error: no intact checkpoint"), lines
    assert "step-60: model.safetensors does not match" in lines[0] and "step-50: random_states_0.pkl is missing" in lines[0]
    assert snapshot(out) == before


def test_a_changed_config_is_refused_naming_the_keys_and_nothing_is_touched(distilled, assets, capfd):
    before = snapshot(distilled)
    capfd.readouterr()
    assert main(assets, distilled, "optim.lr=1e-3", "loss.kind=tvd", "train.log_every=3") == 2
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "loss.kind ('forward_kl' -> 'tvd')" in lines[0] and "optim.lr (0.003 -> 0.001)" in lines[0]
    assert "log_every" not in lines[0] and "--overwrite" in lines[0]
    assert snapshot(distilled) == before


def test_a_key_that_is_safe_to_change_is_accepted(distilled, assets, tmp_path, capfd):
    out = copy_run(distilled, tmp_path)  # also moved: output_dir is safe to change too
    assert main(assets, out, "train.log_every=7", "train.keep_checkpoints=5") == 0
    saved = (out / "config.yaml").read_text()
    assert "log_every: 7" in saved and "keep_checkpoints: 5" in saved and f"output_dir: {out}" in saved
    assert "resuming from" in capfd.readouterr().out
    assert_same_weights(load_weights(out / "final"), load_weights(distilled / "final"))


def test_overwrite_starts_over(distilled, assets, tmp_path):
    out = copy_run(distilled, tmp_path)
    (out / ".final.abc.tmp").mkdir()  # a killed export's leftover
    assert main(assets, out, "train.max_steps=4", "train.eval_every=0", "train.checkpoint_every=0",
                "eval.num_prompts=2", flags=["--overwrite"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]
    log = (out / "train_log.jsonl").read_text()
    assert '"step": 50' not in log and '"step": 4' in log
    assert "max_steps: 4" in (out / "config.yaml").read_text()
    assert not (out / ".final.abc.tmp").exists()


def test_overwrite_never_deletes_files_a_run_did_not_write(distilled, assets, tmp_path, capfd):
    out = copy_run(distilled, tmp_path)
    (out / "notes.md").write_text("mine")
    before = snapshot(out)
    capfd.readouterr()
    assert main(assets, out, "train.max_steps=4", flags=["--overwrite"]) == 2
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and "notes.md" in lines[0]
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- I/O and load failures


def test_a_full_disk_during_a_checkpoint_is_one_error_line(assets, tmp_path, capfd, monkeypatch):
    from accelerate import Accelerator

    def disk_full(self, output_dir=None, **kwargs):
        open(os.path.join(output_dir, "model.safetensors"), "wb").write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Accelerator, "save_state", disk_full)
    out = tmp_path / "run"
    capfd.readouterr()
    assert main(assets, out, "train.max_steps=2", "train.eval_every=0", "eval.num_prompts=2") == 2
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and lines[0].startswith("error: writing checkpoint"), lines
    assert "No space left on device" in lines[0]
    assert not (out / "checkpoints" / "step-2").exists() and (out / "checkpoints" / ".step-2.tmp").is_dir()


def refuse_to_load(*args, **kwargs):
    raise AssertionError("a model was loaded before the output directory was checked")


@pytest.mark.parametrize("case", ["a file", "under a file", "not writable"])
def test_an_unusable_output_dir_is_refused_before_any_model_loads(case, assets, tmp_path, capfd, monkeypatch):
    import recipes.distill

    monkeypatch.setattr(recipes.distill, "load_causal_lm", refuse_to_load)
    monkeypatch.setattr(recipes.distill, "load_tokenizer", refuse_to_load)
    (tmp_path / "file").write_text("x")
    out = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run", "not writable": tmp_path / "run"}[case]
    if case == "not writable":  # as root, permission bits stop nothing: the file system says no instead
        def read_only(*args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        monkeypatch.setattr(drafttrain.fileio.tempfile, "mkstemp", read_only)
    capfd.readouterr()
    assert main(assets, out) == 2
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and lines[0].startswith("error: output directory"), lines
    assert {"a file": "is a file", "under a file": "which is a file", "not writable": "is not writable"}[case] in lines[0]


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_target_weights_are_one_error_line_and_leave_no_run_directory(damage, assets, tmp_path, capfd):
    target = tmp_path / "target"
    shutil.copytree(assets["target"], target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2] if damage == "truncated" else b"")
    out = tmp_path / "runs" / "run"
    capfd.readouterr()
    assert main(assets, out, f"target={target}") == 2
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and lines[0].startswith("error: cannot load the target"), lines
    assert not (tmp_path / "runs").exists()  # the lock was taken, and taken back with the directories it made


# ----------------------------------------------------------------------------- early failures


def test_a_start_refused_for_bad_input_does_not_pin_its_config(assets, tmp_path, capfd):
    """A start refused after the run directory was started (a missing prompt file, a batch larger
    than the data) saved no checkpoint: the corrected command starts it over instead of being
    refused as 'another config', and nothing a training step writes exists before it is fixed."""
    out = tmp_path / "run"
    capfd.readouterr()
    missing = f"data.sources=[{{kind: jsonl, path: {tmp_path / 'nowhere.jsonl'}}}]"
    assert main(assets, out, missing) == 2
    assert len(stderr_lines(capfd)) == 1
    assert main(assets, out, "train.micro_batch_size=100000") == 2
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and "fewer than one global batch" in lines[0], lines
    assert not (out / "best").exists() and not (out / "train_log.jsonl").exists()
    assert main(assets, out, "train.max_steps=2", "train.eval_every=0", "eval.num_prompts=2") == 0
    assert (out / "final" / "config.json").is_file()
