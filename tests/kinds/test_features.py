"""The shared run time of feature-reading drafts (`kinds/features.py`): one KV cache of any number of
draft layers on two storages that hold the same entries, and the runtime's feed skeleton, whose
static engine pads a verification's feed to one fixed shape and keeps the cache where the eager
engine keeps it. A toy draft stands in for a kind: one layer whose keys and values are a
projection of the target's features (what a block drafter's context entries are)."""

from __future__ import annotations

import pytest
import torch

from drafttrain.kinds.features import DraftKVCache, FeatureDraftRuntime

LAYERS, HEADS, DIM, FEATURES = 2, 2, 4, 6


def entries(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM, generator=g)


def write(cache: DraftKVCache, n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """One forward's writes: every layer, in order, n entries each; what each `update` returned."""
    return [cache.update(layer, *entries(n, seed + layer)) for layer in range(LAYERS)]


def test_both_storages_hold_the_same_entries_of_every_layer():
    grown, static = DraftKVCache(LAYERS), DraftKVCache(LAYERS, capacity=8, kv_heads=HEADS, head_dim=DIM)
    for cache in (grown, static):
        first = cache.update(0, *entries(3, 0))
        assert cache.length == 0  # the forward is done with its last layer's write
        cache.update(1, *entries(3, 1))
        assert cache.length == 3 and first[2][0, :3].all()
        write(cache, 2, 10)
        cache.rollback(4)
        write(cache, 1, 20)
    assert grown.length == static.length == 5
    for layer in range(LAYERS):
        assert torch.equal(static.keys[layer][:, :, :5], grown.keys[layer])
        assert torch.equal(static.values[layer][:, :, :5], grown.values[layer])
    assert bool(static.valid[0, :5].all()) and not bool(static.valid[0, 5:].any())
    with pytest.raises(ValueError, match="holds 8 entries"):
        static.check_room(4)
    with pytest.raises(ValueError):
        grown.rollback(6)
    grown.rollback(0)
    assert grown.length == 0 and grown.valid is None


def test_a_write_at_tensor_slots_leaves_the_length_to_its_caller():
    cache = DraftKVCache(LAYERS, capacity=8, kv_heads=HEADS, head_dim=DIM)
    write(cache, 2, 0)
    keys, values = entries(2, 5)
    for layer in range(LAYERS):
        cache.update(layer, keys, values, slots=torch.tensor([2, 3]))
    assert cache.length == 2 and bool(cache.valid[0, :4].all())
    assert torch.equal(cache.keys[1][:, :, 2:4], keys) and torch.equal(cache.values[0][:, :, 2:4], values)


class ProjectedDraft(FeatureDraftRuntime):
    """A one-layer toy: an entry's key and value are a projection of the target's features there;
    its output is the last entry's key."""

    def __init__(self, engine: str = "eager", **kwargs):
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(FEATURES, HEADS * DIM), engine, kv_heads=HEADS, head_dim=DIM,
                         dtype=torch.float32, **kwargs)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (1, 2)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.draft(features).view(1, -1, HEADS, DIM).transpose(1, 2)

    def feed_as_written(self, features, next_tokens, start):
        keys = self.project(features)
        self.cache.update(0, keys, keys)
        return keys[:, :, -1]

    def feed_padded(self, features, meta):
        width = features.shape[1]
        keys = self.project(features[0])
        self.cache.update(0, keys, keys, slots=meta[width] + torch.arange(width))
        return keys[:, :, meta[width + 1] - 1]


def test_the_static_feed_is_one_padded_shape_and_keeps_what_the_eager_one_does():
    g = torch.Generator().manual_seed(1)
    prompt, hidden = [5, 6, 7, 8, 9], torch.randn(4, FEATURES, generator=g)
    kept = [torch.randn(n, FEATURES, generator=g) for n in (1, 3, 2)]
    runs = {engine: ProjectedDraft(engine, capacity=16, feed_width=3) for engine in ("eager", "static")}
    for runtime in runs.values():
        runtime.reset(prompt, hidden)
        for i, features in enumerate(kept):
            runtime.cache.update(0, *entries(2, i))  # drafted entries, scratch past the committed ones
            runtime.commit(features, list(range(features.shape[0])))
    eager, static = runs["eager"], runs["static"]
    assert static.padded and not eager.padded
    assert eager.committed == static.committed == eager.length == static.length == 4 + 6
    assert eager.forwards == static.forwards == 4
    assert static.meta.tolist() == [0, 1, 0, 8, 2]  # the last feed: its tokens padded, its start and count
    assert torch.allclose(static.last, eager.last)
    assert torch.allclose(static.cache.keys[0][:, :, :10], eager.cache.keys[0])
    with pytest.raises(TypeError):
        FeatureDraftRuntime(torch.nn.Linear(1, 1), kv_heads=1, head_dim=1, dtype=torch.float32)
