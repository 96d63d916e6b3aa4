"""Batched generation on the static engine: the target's answers for the recipes.

B left-padded prompts decode together on one preallocated cache: row b's padding slots are
masked out of every attention (`key_valid`), its positions count its own tokens only, and every
row writes its next token at the same cache slot, so one fixed-shape [B, 1] step (compiled and
captured as a CUDA graph on CUDA) serves the whole answer. Rows stop at their own EOS; the batch
stops when all rows have (or at max_new_tokens), and what a finished row generated after its EOS
is cut. Greedy rows equal each prompt decoded alone; sampled rows follow the target's
temperature/top-p distribution, each row drawing from its own seed (`sample_rows`), so a row's
answer does not depend on the batch it was put in.
"""

from __future__ import annotations

import functools

import torch

from ..errors import UserError
from ..tokens import cut_at_eos
from .verify import probabilities
from .engines.compiled import timed_warmup
from .engines.static import StaticLM, lm_logits


def _int64(value: int) -> int:
    """`value` modulo 2**64, as the signed int64 with the same bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN, MIX1, MIX2 = (_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # a logical shift: torch shifts int64 arithmetically


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (products wrap): integer arithmetic, so the same
    bits on every device."""
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def row_uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """[B] float64 uniforms in (0, 1), each a pure function of its row's seed and the step (a
    counter-based generator): a row draws the same number whatever batch, rank or device it is in,
    with no generator state to carry."""
    bits = _shr(_mix(seeds.to(torch.long) + _int64(GOLDEN * (step + 1))), 11)  # 53 random bits
    return (bits.to(torch.float64) + 0.5) / float(1 << 53)


def sample_rows(probs: torch.Tensor, seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inverting its CDF at the row's own uniform
    (`row_uniform`): token i where cdf[i-1] <= u * total < cdf[i], so probability p_i, and a token
    of probability 0 never. One draw per row, not one per token: an exponential race over Gemma-3's
    262k tokens cost 0.5 s a step for 8 rows on 2 CPU cores, more than the model's forward."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    u = row_uniform(seeds.to(probs.device), step).view(-1, 1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).view(-1).clamp_max(probs.shape[-1] - 1)


class BatchGenerator:
    def __init__(self, model, *, batch_size: int, max_length: int, compile: bool | None = None):
        """`max_length`: the longest prompt plus max_new_tokens this generator will see."""
        self.lm = StaticLM(model, max_length=max_length, compile=compile, batch_size=batch_size)
        self.batch_size = batch_size
        self.device = self.lm.device
        self._warm = False

    @property
    def compile_seconds(self) -> float:
        return self.lm.compile_seconds

    def _decode_step(self, tokens, positions, key_valid, hidden_layers: tuple[int, ...] = ()):
        """The [B, 1] step: (logits [B, V], hidden [B, D] or None). One with hidden layers runs
        uncompiled (the compiled graph is the plain step's)."""
        logits, hidden = self.lm.run(tokens[:, None], positions[:, None], self.lm.causal(1), key_valid=key_valid,
                                     hidden_layers=hidden_layers, compiled=not hidden_layers)
        return logits[:, -1], (hidden[:, -1] if hidden is not None else None)

    @torch.no_grad()
    def warmup(self) -> float:
        """Compile and capture the [B, 1] decode step once; returns the seconds spent."""
        if self._warm or not self.lm.compile:
            return 0.0
        B = self.batch_size
        tokens = torch.zeros(B, dtype=torch.long, device=self.device)
        key_valid = torch.ones(B, self.lm.capacity, dtype=torch.bool, device=self.device)
        self.lm.length = 0
        seconds = timed_warmup(self.lm, [functools.partial(self._decode_step, tokens, tokens, key_valid)])
        self._warm = True
        return seconds

    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, key_valid: torch.Tensor,
                 hidden_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Every row's prompt alone, right-aligned in its cache row (its padding slots are never
        written, and never read: `key_valid`): the logits at each row's last token [B, V] (zeros
        for the batch's empty rows), and its `hidden_layers` along its prompt ([n, D], or None). A
        prefill of the whole batch ran every row as wide as the longest, padding included: 24
        calibration prompts of 42 to 282 tokens filled 6768 slots for 2557 tokens, 10.2 s of their
        28.9 s continuations on 2 cores (5.0 s a row at a time). The rows' last tokens take the LM
        head together, as a decode step's do: Gemma-3's 262k-row head read its weights once a row,
        65 ms each on 2 cores, 1.6 s for 24 rows, where one product over them all costs 0.16 s."""
        width = tokens.shape[1]
        last, hidden = [], []
        self.lm.reset()
        for b, n in enumerate(valid.sum(-1).tolist()):
            if n == 0:
                last.append(None)
                hidden.append(None)
                continue
            self.lm.length = width - n
            final, h = self.lm.run(tokens[b:b + 1, width - n:], positions[b:b + 1, width - n:], self.lm.causal(n),
                                   key_valid=key_valid[b:b + 1], last_only=True, rows=slice(b, b + 1),
                                   hidden_layers=hidden_layers)
            last.append(final[0, -1])
            hidden.append(h[0] if h is not None else None)
        self.lm.length = width
        real = [b for b, row in enumerate(last) if row is not None]
        logits = lm_logits(self.lm.model, torch.stack([last[b] for b in real]))
        out = logits.new_zeros(len(last), logits.shape[-1])  # the batch's empty rows: zeros
        out[real] = logits
        return out, hidden

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 eos_token_ids, temperature: float = 0.0, top_p: float = 1.0,
                 seeds: torch.Tensor | None = None, topk: int = 0):
        """Left-padded `input_ids`/`attention_mask` [b, W] (b <= batch size) -> (new tokens per row,
        each cut after its first EOS; top-k log-probs [b, steps, k] and their ids, float32/long on
        the CPU, or None): the target's raw (temperature 1) log-softmax at each generated position.
        Sampling (temperature > 0) needs `seeds` [b], one per row (`sample_rows`)."""
        cut, values, ids, _ = self._generate(input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                             eos_token_ids=eos_token_ids, temperature=temperature, top_p=top_p,
                                             seeds=seeds, topk=topk)
        return cut, values, ids

    def greedy_with_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                           eos_token_ids, hidden_layers: tuple[int, ...]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy `generate` and each row's `hidden_layers` (transformers' `hidden_states` indexing,
        concatenated) along its prompt and continuation, [prompt + continuation, D]: what one
        teacher-forced forward over them gives (`engines.teacher`), to rounding, without it. The
        continuation's last token is fed one step more for its own."""
        cut, _, _, hidden = self._generate(input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                           eos_token_ids=eos_token_ids, hidden_layers=tuple(hidden_layers))
        return cut, hidden

    @torch.no_grad()
    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                  eos_token_ids, temperature: float = 0.0, top_p: float = 1.0, seeds: torch.Tensor | None = None,
                  topk: int = 0, hidden_layers: tuple[int, ...] = ()):
        b, width = input_ids.shape
        B = self.batch_size
        if b > B:
            raise ValueError(f"{b} prompts do not fit a batch of {B}")
        if temperature > 0 and (seeds is None or len(seeds) != b):
            raise ValueError("sampling needs one seed per row")
        if width + max_new_tokens > self.lm.max_length:
            raise UserError(f"a prompt of {width} tokens plus {max_new_tokens} new exceeds the generator's "
                            f"max_length {self.lm.max_length}; build it with a larger max_length")
        self.warmup()
        valid = attention_mask.to(self.device).bool()
        tokens = input_ids.to(self.device)
        if b < B:  # fixed shapes: pad the batch with rows of one (masked) token
            tokens = torch.cat([tokens, tokens.new_zeros(B - b, width)])
            valid = torch.cat([valid, valid.new_zeros(B - b, width)])
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        key_valid = torch.ones(B, self.lm.capacity, dtype=torch.bool, device=self.device)
        key_valid[:, :width] = valid
        eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=self.device)
        if seeds is not None:  # the batch's padding rows draw too; what they draw is dropped
            seeds = torch.cat([seeds.to(self.device, torch.long),
                               torch.zeros(B - b, dtype=torch.long, device=self.device)])

        last, prompt_hidden = self._prefill(tokens, positions, valid, key_valid, hidden_layers)
        position = positions[:, -1] + 1
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        finished[b:] = True
        generated, top_values, top_ids, fed = [], [], [], []
        for step in range(max_new_tokens):
            if temperature == 0:
                token = last.argmax(dim=-1)
            else:
                token = sample_rows(probabilities(last, temperature, top_p), seeds, step)
            if topk:
                logprobs = last.to(torch.promote_types(last.dtype, torch.float32)).log_softmax(-1)
                values, ids = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
                top_values.append(values)
                top_ids.append(ids)
            generated.append(token)
            finished |= torch.isin(token, eos)
            done = step + 1 == max_new_tokens or bool(finished.all())  # the step's one host sync
            if done and not hidden_layers:
                break
            last, hidden = self._decode_step(token, position, key_valid, hidden_layers)
            self.lm.length += 1
            position = position + 1
            if hidden_layers:
                fed.append(hidden)
                if done:  # the last token was fed for its hidden states
                    break
        rows = torch.stack(generated, dim=1)[:b].tolist()
        cut = [cut_at_eos(r, eos_token_ids) for r in rows]
        hidden = None
        if hidden_layers:
            along = torch.stack(fed, dim=1)  # [B, steps, D]: the hidden states of each generated token
            hidden = [torch.cat([prompt_hidden[r], along[r, :len(c)]]) for r, c in enumerate(cut)]
        if not topk:
            return cut, None, None, hidden
        values = torch.stack(top_values, dim=1)[:b].float().cpu()
        ids = torch.stack(top_ids, dim=1)[:b].cpu()
        return cut, values, ids, hidden
