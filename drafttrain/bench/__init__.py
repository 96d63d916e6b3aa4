"""`drafttrain bench` (SPEC §6): how close the decode engine runs to the hardware, in one process.

It measures, top to bottom: the device's read bandwidth and with it the roofline (weight bytes
read per decode step / bandwidth = the best batch-1 tokens/s any engine can reach); plain greedy
decoding on each of our engines and with transformers' `generate` (dynamic cache; static cache
+ compile); one forward by number of tokens (1 .. K+1 and a Medusa tree), which is what a
verification costs next to a plain step; and an oracle proposer at acceptance α, whose measured
speedup over plain decoding is set against Leviathan's prediction. The target is a model
directory or a random-weight shape built on the device (`--shape llama-8b`).

`config` (the settings), `target` (what is measured), `measure` (each timing), `run` (the run),
`report` (bench.md and the plot), `cli`.
"""

from .cli import add_cli, run_cli
from .config import BenchConfig
from .run import run_bench
from .target import shape_parameters

__all__ = ["BenchConfig", "add_cli", "run_bench", "run_cli", "shape_parameters"]
