"""Drafters, one file per kind: where a decoder's drafts come from.

- `draft_lm`: a small same-family LM drafting K tokens in a row on its own cached LM;
- `ngram`: prompt lookup, no model;
- `oracle`: the target's own continuation, corrupted at a set rate (measures the engine);
- `medusa`: Medusa heads on the target, a static tree (greedy) or a sampled chain;
- `eagle3`: an EAGLE-3 draft layer reading the target's features, chain or EAGLE-2 tree;
  `eagle3_cache`: its KV caches and the draft bound to one on an engine;
- `hybrid`: `+ngram`, any of the model drafters above with n-gram lookup's chain merged into its
  chain or tree, verified in the same target pass.

Each kind's decoder is built by `decoding.factory.build_decoder`.
"""
