"""Medusa heads' declaration (`KIND`, `--heads DIR`): loading, the calibrated or default tree,
costs, serving and `replay`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...decoding.chain import ChainDecoder
from ...decoding.engines import CachedLM
from ...decoding.tree import TreeDecoder
from ...errors import UserError
from ...trees import resolve_tree
from ..base import Drafter, DrafterKind, parameter_share, per_token, require_finite
from .decode import medusa_decoder, medusa_heads_seconds
from .model import MedusaHeads

if TYPE_CHECKING:
    from ...decoding.settings import DecodeSettings
    from ...decoding.loop import Decoder


class MedusaKind(DrafterKind):
    """Medusa heads on the target (`--heads DIR`): a static tree (greedy) or a sampled chain."""

    name, flag, help = "medusa", "heads", "Medusa heads directory (vLLM's format) trained on this target."
    takes_lookup = True

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder | TreeDecoder:
        """`medusa_decoder` of the heads with their tree (`tree`) and the run's rule."""
        return medusa_decoder(target, d.model, tree=self.tree(d, s)[1], rule=s.rule(), eos_token_ids=s.eos_token_ids,
                              record_margins=s.record_margins)

    def load(self, path: str | None, target: torch.nn.Module, tokenizer: object, device: torch.device,
             dtype: torch.dtype) -> Drafter:
        """Medusa heads and what their export recorded, or one `error:` line for a damaged weights
        file or non-finite weights."""
        from .export import load_medusa, read_heads_info
        from ...models import first_line

        try:
            heads = load_medusa(path, device=device, dtype=dtype)
        except UserError:
            raise
        except Exception as e:  # safetensors' SafetensorError (truncated or empty file), a bad pickle, ...
            raise UserError(f"cannot load the Medusa heads from {path!r}: their weights file is damaged "
                            f"({first_line(e)}); export the heads again") from e
        require_finite(heads, "Medusa heads", path)
        return Drafter("medusa", heads, read_heads_info(path))

    def tree(self, d: Drafter, s: DecodeSettings) -> tuple[str, list]:
        """The heads' tree (auto: the one calibrated at training), at most as deep as K and the
        heads; when sampling only its depth is used: a chain that deep."""
        depth = min(s.num_draft_tokens, d.model.config.num_heads)  # head i drafts position i + 1
        name, paths = resolve_tree(s.tree, depth, auto=d.info.get("tree"), nodes=s.tree_nodes)
        return (name if s.temperature == 0 else "chain (sampling)"), paths

    def tree_vocab(self, d: Drafter) -> tuple[int, str]:
        """The heads' vocabulary: a tree's choices index their top-k."""
        return d.model.config.vocab_size, "the Medusa heads'"

    def depth_limit(self, d: Drafter) -> int:
        """One head per draft position."""
        return d.model.config.num_heads

    def step_seconds(self, d: Drafter, target_lm: CachedLM, ids: list[int], max_k: int, acceptance: list[float],
                     repeats: int) -> tuple[list[float], list[str]]:
        """Sampling: one pass of the first k heads."""
        return [0.0] + [medusa_heads_seconds(d.model, k, target_lm.device, repeats) for k in range(1, max_k + 1)], []

    def draft_forwards(self, d: Drafter, max_k: int, acceptance: list[float]) -> list[tuple[int, int]]:
        """One pass of the heads over one hidden state, whatever k."""
        return [(1, 1)] * max_k

    def gpu_costs(self, d: Drafter, target: torch.nn.Module, max_k: int) -> list[float]:
        """Each draft token one head: the heads' share of the target's parameters, per head."""
        return per_token(parameter_share(d.model, target) / d.model.config.num_heads, max_k)

    def report(self, d: Drafter, decoder: Decoder, overall: dict) -> dict:
        """Position i is head i's token; a static tree's nodes; the heads' export record."""
        overall["per_head_acceptance"] = overall["per_position_acceptance"]
        if "tree" in overall:
            overall["tree_nodes"] = decoder.num_tree_nodes
        return {"heads": d.info} if d.info else {}

    def report_note(self, report: dict) -> list[str]:
        """report.md's lines on the heads' export: which kind, and the verifier when it is not the target."""
        info = report.get("heads")
        if not info:
            return []
        lines = [f"Medusa heads: {info.get('kind', 'medusa-1')}, trained on target `{info.get('target')}`."]
        if info.get("verifier"):
            lines.append(f"**The verifier is the adapted target** `{info['verifier']}` (Medusa-2: LoRA adapters "
                         "were trained jointly with the heads), not the original target; pass it as --target.")
        return lines + [""]

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """Three fresh heads on the target, verifying the default tree."""
        heads = MedusaHeads.from_target(target, 3).to(device=target.device, dtype=target.dtype)
        return [("Medusa tree", Drafter(self.name, heads), {"tree": "default"})]

    def vllm(self, path: str | None, k: int, d: Drafter, s: DecodeSettings | None) -> dict:
        """vLLM's Medusa at `path`, one token per head: K no more than the heads."""
        heads = d.model.config.num_heads
        if k > heads:
            raise UserError(f"--backend vllm: vLLM drafts one token per Medusa head and these heads are {heads}; use "
                            f"--num-draft-tokens {heads} or less")
        return {"method": "medusa", "model": path, "num_speculative_tokens": k}

    def vllm_forwards(self, k: int, d: Drafter) -> int:
        """One pass of the heads a step."""
        return 1


KIND = MedusaKind()
