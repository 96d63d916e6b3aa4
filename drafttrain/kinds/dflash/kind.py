"""DFlash's declaration (`KIND`, `--dflash DIR`): loading, binding its context cache beside the
target's engine, its costs for the planner (one block forward whatever K), serving (vLLM's `dflash`)
and `replay`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...decoding.chain import ChainDecoder
from ...decoding.engines import CachedLM, StaticLM, device_tensor
from ...decoding.timing import single_token_seconds, timed
from ..base import Drafter, DrafterKind, chain_decoder, parameter_share, replayed_sequence, require_finite
from .decode import DFlashProposer, DFlashRuntime
from .model import DFlashDraft

if TYPE_CHECKING:
    from ...decoding.loop import Decoder
    from ...decoding.settings import DecodeSettings


def draft_of(d: Drafter) -> DFlashDraft:
    """The draft model of `d`, bound to a run time or not."""
    return d.model.draft if isinstance(d.model, DFlashRuntime) else d.model


def runtime_for(target_lm: CachedLM, draft: DFlashDraft, num_draft_tokens: int) -> DFlashRuntime:
    """The draft's run time beside `target_lm`: static and compiled (as the target) beside a static
    target, its feed K + 1 entries wide; eager otherwise."""
    if not isinstance(target_lm, StaticLM):
        return DFlashRuntime(draft)
    return DFlashRuntime(draft, "static", capacity=target_lm.capacity + num_draft_tokens + 1,
                         compile=target_lm.compile, feed_width=num_draft_tokens + 1)


def runtime_of(d: Drafter, target_lm: CachedLM, num_draft_tokens: int) -> DFlashRuntime:
    """`d`'s run time: the one `bind` made, else one made beside `target_lm` (a draft no run bound: a
    test's, `bench`'s, the planner's)."""
    if isinstance(d.model, DFlashRuntime):
        return d.model
    return runtime_for(target_lm, d.model, num_draft_tokens)


class DFlashKind(DrafterKind):
    """A DFlash block draft reading the target's features (`--dflash DIR`): K drafts from one forward."""

    name, flag = "dflash", "dflash"
    help = "DFlash block draft directory (vLLM's DFlashDraftModel layout) trained on this target."
    takes_lookup = True

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder:
        """A chain decoder of the block's K drafts with the run's rule, on the run time `bind` made (a
        draft not yet bound gets its own, following the target's engine)."""
        rule = s.rule()
        proposer = DFlashProposer(runtime_of(d, target, s.num_draft_tokens), rule, max_k=s.num_draft_tokens)
        return chain_decoder(target, proposer, s, rule=rule)

    def load(self, path: str | None, target: torch.nn.Module, tokenizer: object, device: torch.device,
             dtype: torch.dtype) -> Drafter:
        """A DFlash draft checked against the target, reading the target's embedding (and LM head rows)."""
        from .export import load_dflash

        draft, info = load_dflash(path, device=device, dtype=dtype, target_config=target.config,
                                  target_lm_head=target.get_output_embeddings().weight)
        require_finite(draft, "DFlash draft", path)
        draft.attach_embeddings(target.get_input_embeddings())
        return Drafter(self.name, draft.eval(), {"target_layer_ids": list(info.target_layer_ids),
                                                 "draft_vocab_size": info.draft_vocab_size,
                                                 **(info.config.get("drafttrain") or {})})

    def bind(self, d: Drafter, target_lm: CachedLM, engine: str, max_length: int, s: DecodeSettings) -> Drafter:
        """The draft's context cache follows the target: static (compiled) beside static."""
        return Drafter(d.kind, runtime_of(d, target_lm, s.num_draft_tokens), d.info)

    def depth_limit(self, d: Drafter) -> int:
        """A block drafts at most block_size - 1 tokens."""
        return draft_of(d).config.block_size - 1

    def step_seconds(self, d: Drafter, target_lm: CachedLM, ids: list[int], max_k: int, acceptance: list[float],
                     repeats: int) -> tuple[list[float], list[str]]:
        """One block forward of k + 1 slots to draft k."""
        return [0.0] + block_seconds(d, target_lm, ids, list(range(1, max_k + 1)), repeats), []

    def draft_forwards(self, d: Drafter, max_k: int, acceptance: list[float]) -> list[tuple[int, int]]:
        """One forward of k + 1 slots to draft k."""
        return [(1, k + 1) for k in range(1, max_k + 1)]

    def cost_ratio(self, d: Drafter, target_lm: CachedLM, ids: list[int], k: int) -> float:
        """One block forward per step, spread over its K drafts, over one target forward."""
        return block_seconds(d, target_lm, ids, [k])[0] / k / single_token_seconds(target_lm, ids)

    def gpu_costs(self, d: Drafter, target: torch.nn.Module, max_k: int) -> list[float]:
        """One forward for any k >= 1, its share of the target's parameters (the frozen LM head aside)."""
        return [0.0] + [parameter_share(draft_of(d), target, skip="lm_head")] * max_k

    def report(self, d: Drafter, decoder: Decoder, overall: dict) -> dict:
        """The draft's block size, target layers and export record."""
        c = draft_of(d).config
        return {"dflash": {"block_size": c.block_size, "target_layer_ids": list(c.target_layer_ids),
                           "layers": c.num_hidden_layers, **d.info}}

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """A fresh two-layer draft over the target's vocabulary, blocks of K + 1: alone and with n-gram lookup."""
        from ..vocab import build_draft_vocab

        size = target.config.vocab_size
        vocab = build_draft_vocab([list(range(size))], size, size)
        drafter = Drafter(self.name, DFlashDraft.from_target(target, vocab, layers=2, block_size=k + 1,
                                                             target_layer_ids=(0, 1), dtype=target.dtype, seed=0))
        return [("DFlash block", drafter, {}), ("DFlash + n-gram", drafter, {"hybrid": "ngram"})]

    def vllm(self, path: str | None, k: int, d: Drafter, s: DecodeSettings | None) -> dict:
        """vLLM's DFlash with the draft at `path`."""
        return {"method": "dflash", "model": path, "num_speculative_tokens": k}

    def vllm_forwards(self, k: int, d: Drafter) -> int:
        """One block forward per step."""
        return 1

    @torch.no_grad()
    def replay_matches(self, d: Drafter, target: torch.nn.Module, prompt: list[int], target_tokens: list[int],
                       k: int) -> list[list[bool]]:
        """The grid from ONE forward of the `target` (its features) and ONE draft forward of every step's
        block over (prompt + the target's greedy output): a step that begins with c tokens (pending at
        index c - 1, the context indices 0 .. c-2) drafts tokens c .. c+k-1 from the block anchored at
        c - 1, which is the training forward's block there. A one-token prompt's first step has no
        context: it proposes nothing, as the decoder does."""
        if not target_tokens:
            return []
        draft = draft_of(d)
        sequence, ids = replayed_sequence(draft, prompt, target_tokens)
        hidden_states = target(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
        starts = [len(prompt) + t for t in range(len(target_tokens))]
        anchors = torch.tensor([[c - 1 for c in starts]], device=ids.device)
        logits = draft(draft.target_features(hidden_states), ids, anchors, size=k + 1,
                       position_ids=torch.arange(ids.shape[1], device=ids.device)[None],
                       attention_mask=torch.ones_like(ids))
        guesses = draft.to_target_ids(logits[0].argmax(-1)).tolist()  # [step][slot]
        return [[] if c < 2 else [c + j < len(sequence) and guesses[i][j] == sequence[c + j] for j in range(k)]
                for i, c in enumerate(starts)]


@torch.inference_mode()
def block_seconds(d: Drafter, target_lm: CachedLM, prompt: list[int], ks: list[int], repeats: int = 10
                  ) -> list[float]:
    """Median time of one block forward drafting each k of `ks` (on the draft's engine beside
    `target_lm`), after feeding the prompt's target features once (a block writes nothing to the cache):
    the draft's share of a step."""
    runtime = runtime_of(d, target_lm, max(ks))
    for k in ks:
        runtime.warmup(k)
    target_lm.reset()
    hidden = target_lm.prefill(device_tensor(prompt[:-1], target_lm.device), hidden_layers=runtime.hidden_layers)
    runtime.reset(prompt, hidden)
    pending = device_tensor(prompt[-1:], target_lm.device)
    return [timed(lambda k=k: runtime._block(pending, k).argmax(-1), repeats, target_lm.device) for k in ks]


KIND = DFlashKind()

__all__ = ["KIND", "DFlashKind", "draft_of", "runtime_for", "runtime_of"]
