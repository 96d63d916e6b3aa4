"""Run speculators' trainer (`speculators train`, the same flags) in .venv-speculators, on a CPU too,
and record its training speed: scripts/parity.sh's launcher (issue 41).

    .venv-speculators/bin/python scripts/speculators_train.py --speed-out FILE.json [speculators train flags]

On a machine without an accelerator speculators 0.9.0 stops before its first step:

    speculators/train/trainer.py:348 in setup_model: self.model.to(self.local_rank)
    RuntimeError: Cannot access accelerator device when none is available.

Its trainer sends the model and every batch to `get_local_rank()`, the integer 0, which torch reads as
the accelerator's device 0. With that fixed, its step timer stops at the first step (log_freq divides
step 0 whatever --log-freq is):

    speculators/train/trainer.py:80 in mark: torch.accelerator.synchronize()
    RuntimeError: Cannot access accelerator device when none is available.

The two changes made here, only where `torch.accelerator` finds no device: the trainer's
`get_local_rank` returns "cpu", and `torch.accelerator.synchronize` does nothing (there is nothing
asynchronous to wait for on a CPU). Its autocast then names "cuda" (its fallback device type)
and torch disables it with a warning, so the run computes in float32: pass --hidden-states-dtype float32
(the default bfloat16 hidden states would meet float32 weights). Nothing else is patched; run with
--draft-attn-impl sdpa or eager if flex attention does not compile here.

--max-steps does not end a run by itself: once it is reached, every later epoch still trains one
step (speculators 0.9.0, trainer.py run_training/train_epoch: 2 steps asked over 3 epochs train 4). So
where --epochs is not given and --max-steps is, the epochs are set here to the fewest whose batches (its
own packing sampler, per epoch, as its loader will draw them) reach --max-steps: the run then trains
exactly --max-steps steps.

--samples-per-step B: speculators packs whole sequences into one row of at most --total-seq-len tokens
a step; this sets that length to the shortest (not below the longest row, nor below the --total-seq-len
given) at which its sampler draws at least B sequences a step on average over the first epoch, so that
its steps see as many sequences as drafttrain's batches of B.

--speed-out: training steps, samples, tokens and the seconds spent in the training epochs (validation and
checkpoints excluded), and samples/s, as JSON.
"""

from __future__ import annotations

import json
import sys
import time


def train_lengths(cfg) -> list[int]:
    from datasets import load_from_disk

    lengths = list(load_from_disk(cfg.data.data_path).with_format(None)["seq_len"])
    return lengths[: int(len(lengths) * cfg.data.train_data_ratio)]


def sampler(cfg, total_seq_len: int, lengths: list[int]):
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    return MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                              rank=0, seed=cfg.seed)


def seq_len_for(cfg, samples_per_step: float) -> int:
    """The shortest packed row (at least the longest sequence and the given --total-seq-len) whose first
    epoch averages at least `samples_per_step` sequences a step."""
    lengths = train_lengths(cfg)
    low = max(max(lengths), cfg.data.total_seq_len)
    if samples_per_step >= len(lengths):
        return max(low, sum(lengths))

    def enough(total: int) -> bool:
        return len(lengths) / len(sampler(cfg, total, lengths)) >= samples_per_step

    high = max(low, sum(lengths))
    while low < high:
        mid = (low + high) // 2
        if enough(mid):
            high = mid
        else:
            low = mid + 1
    return low


def epochs_for_steps(cfg) -> int:
    """The fewest epochs whose packed batches reach cfg.trainer.max_steps (speculators' own sampler,
    seeded and split as `create_train_val_loaders` does)."""
    batches = sampler(cfg, cfg.data.total_seq_len, train_lengths(cfg))
    steps = epochs = 0
    while steps < cfg.trainer.max_steps:
        batches.set_epoch(epochs)
        steps += len(batches)
        epochs += 1
    return epochs


def main(argv: list[str]) -> int:
    speed_out, samples_per_step = None, None
    if "--speed-out" in argv:
        i = argv.index("--speed-out")
        speed_out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if "--samples-per-step" in argv:
        i = argv.index("--samples-per-step")
        samples_per_step = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]

    import torch
    import speculators.train.data as data
    import speculators.train.trainer as trainer
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    cpu = torch.accelerator.current_accelerator() is None
    if cpu:  # the two changes: see the module docstring
        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *args, **kwargs: None

    counts = {"steps": 0, "samples": 0, "tokens": 0, "seconds": 0.0}
    training = [False]
    collate = data.CollateFn.__call__

    def counting_collate(self, batch):
        out = collate(self, batch)
        if training[0]:
            docs = out["document_ids"]
            counts["samples"] += int(docs.max()) + 1 if bool((docs >= 0).any()) else 0
            counts["tokens"] += int((docs >= 0).sum())
        return out

    data.CollateFn.__call__ = counting_collate
    train_epoch = trainer.Trainer.train_epoch

    def timed_epoch(self, epoch, **kw):
        training[0] = True
        start, before = time.perf_counter(), self.global_step
        try:
            return train_epoch(self, epoch, **kw)
        finally:
            training[0] = False
            counts["seconds"] += time.perf_counter() - start
            counts["steps"] += self.global_step - before

    trainer.Trainer.train_epoch = timed_epoch
    cfg = TrainConfig.resolve(argv)
    if samples_per_step:
        cfg.data.total_seq_len = seq_len_for(cfg, samples_per_step)
    if cfg.provenance.get("epochs") == "default" and cfg.trainer.max_steps:
        cfg.trainer.epochs = epochs_for_steps(cfg)
    train_main(cfg)
    if speed_out:
        seconds = counts["seconds"]
        record = {**counts, "samples_per_s": counts["samples"] / seconds if seconds else 0.0,
                  "samples_per_step": counts["samples"] / counts["steps"] if counts["steps"] else 0.0,
                  "epochs": cfg.trainer.epochs, "total_seq_len": cfg.data.total_seq_len,
                  "device": "cpu" if cpu else str(torch.accelerator.current_accelerator()),
                  "patched_get_local_rank": cpu, "threads": torch.get_num_threads()}
        with open(speed_out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
