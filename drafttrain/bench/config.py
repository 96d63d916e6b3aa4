"""`drafttrain bench` settings (SPEC §6): one dataclass, from which the flags, their defaults, their
help and their range checks come (`config.setting`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import check_settings, flag_name, setting
from ..decoding import ENGINES, NUM_DRAFT_TOKENS
from ..errors import UserError

# Random-weight shapes built directly on the device.
SHAPES = {
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
}
DEFAULT_ALPHAS = (0.3, 0.5, 0.7, 0.9)
PROMPTS_PER_FILE = 4  # --limit unset
RANDOM_PROMPTS = (4, 128)  # --num-prompts and --prompt-length unset




def parse_alphas(text: str) -> list[float]:
    """`--oracle-alpha 0.3,0.5`: comma-separated acceptance rates."""
    try:
        values = [float(a) for a in text.split(",") if a.strip()]
    except ValueError as e:
        raise UserError(f"--oracle-alpha {text!r} is not a comma-separated list of numbers, e.g. 0.3,0.5,0.7,0.9"
                        ) from e
    if any(math.isnan(a) for a in values):
        raise UserError(f"--oracle-alpha {text!r}: nan is not an acceptance rate")
    return values




@dataclass(kw_only=True)
class BenchConfig:
    """What `drafttrain bench` measures, on which target and device."""

    target: str | None = setting(None, "Target model: a local directory or a hub id.", metavar="T", group="target")
    shape: str | None = setting(None, f"Random-weight target of a known shape: {', '.join(SHAPES)}.",
                                choices=tuple(SHAPES), group="target")
    engine: str = setting("auto", "Engine of the forward and oracle figures: auto, eager or static (plain decoding "
                                  "is measured on every engine).", choices=ENGINES)
    prompts: list[str] = setting([], "JSONL prompt file (SPEC §1; needs --target); repeat for several. Without it: "
                                     "random prompts.", metavar="FILE")
    limit: int | None = setting(None, f"Prompts taken from each --prompts file (unset: {PROMPTS_PER_FILE}).",
                                metavar="N", at_least=1)
    num_prompts: int | None = setting(None, f"Random prompts, without --prompts (unset: {RANDOM_PROMPTS[0]}).",
                                      metavar="N", at_least=1)
    prompt_length: int | None = setting(None, f"Tokens per random prompt, without --prompts (unset: "
                                        f"{RANDOM_PROMPTS[1]}).", metavar="N", at_least=1)
    num_draft_tokens: int = setting(NUM_DRAFT_TOKENS, "K of the oracle.", metavar="K", at_least=1)
    oracle_alpha: list[float] = setting(list(DEFAULT_ALPHAS), "Comma-separated per-token acceptance rates of the "
                                        "oracle, each in [0, 1].", metavar="A,B,...", parse=parse_alphas)
    max_new_tokens: int = setting(128, "New tokens per prompt.", metavar="N", at_least=2)
    repeats: int = setting(3, "Timed repeats (medians reported).", metavar="N", at_least=1)
    dtype: str = setting("auto", "auto, float32, bfloat16, float16 or float64; auto is bfloat16 on CUDA, float32 on "
                                 "CPU.")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N.")
    seed: int = setting(0, "Seeds the random prompts and the oracle.")
    bandwidth_mib: int = setting(0, "Bandwidth probe size (0: 1024 on CUDA, 64 on CPU).", metavar="MIB", at_least=0)
    hf_generate: bool = setting(True, "Also time transformers' generate.", negated=True)
    step_overhead: bool = setting(True, "Also count each drafter kind's step overhead with tiny models (host "
                                        "syncs, eager ops, step time).", negated=True)
    overwrite: bool = setting(False, "Replace a non-empty --out.")
    quiet: bool = setting(False, "No progress lines.")
    out: str = setting(doc="Output directory (bench.json, bench.md, bench.png).", metavar="DIR")

    def validate(self) -> None:
        if (self.target is None) == (self.shape is None):
            raise UserError("give exactly one of --target DIR and --shape (llama-8b or tiny)")
        if self.prompts and self.target is None:
            raise UserError("--prompts needs --target (its tokenizer encodes them); a --shape uses random prompts")
        self.check_prompt_flags()
        if not self.oracle_alpha or not all(0 <= a <= 1 for a in self.oracle_alpha):
            raise UserError(f"--oracle-alpha must list acceptance rates in [0, 1], got {self.oracle_alpha}")
        check_settings(self, flag_name)

    def check_prompt_flags(self) -> None:
        """--num-prompts and --prompt-length shape random prompts, --limit samples prompt files: a flag
        of the kind not in use was silently ignored (all of a file benched under --num-prompts 2).
        `vllm bench` caps a dataset with --num-prompts; here --limit is per file, as lm-eval's is per
        task, and two caps on one file would be ambiguous, so the flag that does not apply is refused."""
        random_flags = [f for f, v in (("--num-prompts", self.num_prompts), ("--prompt-length", self.prompt_length))
                        if v is not None]
        if self.prompts and random_flags:
            raise UserError(f"{' and '.join(random_flags)} shape random prompts, but --prompts gives a file; take N "
                            "prompts from each file with --limit N, or leave --prompts out")
        if not self.prompts and self.limit is not None:
            raise UserError("--limit takes prompts from each --prompts file, and none is given; for random prompts "
                            "use --num-prompts N")

    @property
    def prompts_per_file(self) -> int:
        return self.limit or PROMPTS_PER_FILE

    @property
    def random_prompts(self) -> tuple[int, int]:
        """(how many, tokens each) of the random prompts."""
        return self.num_prompts or RANDOM_PROMPTS[0], self.prompt_length or RANDOM_PROMPTS[1]
