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

--speed-out: training steps, samples, tokens and the seconds spent in the training epochs (validation and
checkpoints excluded), and samples/s, as JSON.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    speed_out = None
    if "--speed-out" in argv:
        i = argv.index("--speed-out")
        speed_out = argv[i + 1]
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
    train_main(TrainConfig.resolve(argv))
    if speed_out:
        seconds = counts["seconds"]
        record = {**counts, "samples_per_s": counts["samples"] / seconds if seconds else 0.0,
                  "device": "cpu" if cpu else str(torch.accelerator.current_accelerator()),
                  "patched_get_local_rank": cpu, "threads": torch.get_num_threads()}
        with open(speed_out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
