"""The cached-LM interface: the only way a decoder touches a model.

A decoder does four things to a model's KV cache: append tokens (`forward`, optionally as a
tree of candidates; `prefill` where their logits are not read), forget the newest ones
(`rollback`), keep only an accepted tree path (`compact`), and start over (`reset`). Two
implementations sit behind it: `EagerLM` (the model's own forward on transformers' DynamicCache,
the reference) and `StaticLM` (a preallocated cache and fixed-shape compiled steps, CUDA graphs on
CUDA). Decoders never see which one they drive.
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import UserError


class CachedLM:
    """A causal LM bound to its own KV cache (batch size 1).

    `length` is the number of tokens the cache holds. `max_length` (None: unbounded) is the most it
    may ever hold; exceeding it is an error, never a silent truncation.
    """

    engine = "none"
    model: torch.nn.Module
    device: torch.device
    length: int = 0
    max_length: int | None = None
    compile_seconds: float = 0.0  # spent compiling/capturing steps; never part of a timed decode

    @property
    def num_layers(self) -> int:
        """L: `hidden_layers=(L,)` asks for the final, post-norm hidden state (what the LM head reads)."""
        return self.model.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def supports_trees(self) -> bool:
        return True

    def reset(self) -> None:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, *, tree=None, hidden_layers: tuple[int, ...] = ()):
        """Append `tokens` [n] (on the model's device). Returns (logits [n, V], hidden or None).

        `tree` (a `trees.Tree` of n nodes): node i sits at position `length + depth[i]` and
        attends to the cache and to its tree ancestors; its KV goes to slot `length + i`.
        `hidden_layers` indexes like transformers' `output_hidden_states` (0 = embeddings, i = the
        output of layer i - 1, L = the final post-norm state); `hidden` is those layers
        concatenated along the last dimension, [n, len(hidden_layers) * H].
        """
        raise NotImplementedError

    def prefill(self, tokens: torch.Tensor, *, hidden_layers: tuple[int, ...] = ()):
        """Append `tokens` [n] whose logits no one reads (a prompt but its last token; tokens a
        draft catches up on). Returns the hidden layers as `forward` does (None without any). An
        engine may leave the LM head out: over a prompt it is most of the forward where the
        vocabulary is large (Gemma-3-270M's head, 262k rows of 640, holds 170M of its 270M weights:
        over a 400-token prompt, 134 GFLOP against its 18 layers' ~80, for logits thrown away)."""
        return self.forward(tokens, hidden_layers=hidden_layers)[1]

    def verify(self, tokens: torch.Tensor, verdict, *, tree=None, hidden_layers: tuple[int, ...] = ()):
        """`forward`, then `verdict(logits, tokens, tree)` (a `verify.GreedyVerdict`): returns
        (the verdict, hidden or None). The static engine runs both as one compiled graph, so a
        step's verification is one launch; its hidden rows may include padding after the n real
        ones (callers index the rows they keep)."""
        logits, hidden = self.forward(tokens, tree=tree, hidden_layers=hidden_layers)
        return verdict(logits, tokens, tree), hidden

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        raise NotImplementedError

    def known_continuation(self, past: int, n: int) -> list[int] | None:
        """The target's own next `n` tokens after the one at position `past`, where it knows them
        before verifying (a teacher-forced target replaying its decode, `engines.teacher`; cut
        where its sequence ends); None for a real forward, which learns them verifying only."""
        return None

    def compact(self, past_len: int, nodes, path: torch.Tensor | None = None) -> None:
        """After a tree forward at `past_len`: keep the prefix and the given nodes' entries, in order.
        `path`: the same nodes on the device, padded by repeating the last (the verdict's), so an
        engine can move them with fixed-size gathers instead of copying host indices over.

        Afterwards the cache equals one built by decoding the kept nodes' tokens one by one
        (node i's entry was at slot past_len + i, its position past_len + depth: a root-to-node
        path has depths 0, 1, 2, ..., exactly the positions of sequential decoding).
        """
        raise NotImplementedError

    def keeping_prefills(self):
        """A context in which a prefill of tokens prefilled before (from an empty cache, with the same
        hidden layers) is the kept one's copy, not computed again: a plan times many short decodes
        and forward curves after the same probe, each after its prefill (`engines.eager`). An engine
        whose prefill is cheap (the static engine's compiled chunks, on a GPU) keeps none."""
        return contextlib.nullcontext()

    def warmup(self, sizes, *, hidden_layers: tuple[int, ...] = (), keep_width: int = 0, verdict=None,
               tree_depth: int = -1) -> float:
        """Prepare the fixed-shape steps of `sizes` tokens (compile and capture where that applies).
        Returns the seconds spent. The eager LM has nothing to prepare."""
        return 0.0

    # -- shared checks --------------------------------------------------------------------------

    def _check_room(self, n: int) -> None:
        if self.max_length is not None and self.length + n > self.max_length:
            raise UserError(f"the KV cache holds at most {self.max_length} tokens, but {self.length} cached plus "
                            f"{n} new would need {self.length + n}; build the cached LM with a larger max_length "
                            "(longest prompt + max_new_tokens + K + 1)")

    def _check_rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length}")

    def _check_compact(self, past_len: int, nodes: list[int]) -> None:
        if not 0 <= past_len <= self.length:
            raise ValueError(f"past_len {past_len} out of range for a cache of {self.length} entries")
        if nodes and (min(nodes) < 0 or past_len + max(nodes) >= self.length):
            raise ValueError(f"node indices {nodes} out of range for a cache of {self.length} entries "
                             f"with past_len={past_len}")


def device_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values -> device tensor without a host sync: a pinned staging copy on CUDA (a plain
    `torch.tensor(..., device="cuda")` waits for the GPU to drain first)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def select_hidden(states, hidden_layers: tuple[int, ...]) -> torch.Tensor | None:
    """`hidden_layers` of transformers' `hidden_states` tuple, concatenated on the last dim."""
    if not hidden_layers:
        return None
    picked = [states[i] for i in hidden_layers]
    return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. Timings bracket work with it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
