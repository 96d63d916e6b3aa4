"""Drafter kinds, one folder each: everything one kind of drafter is, together.

A kind's folder holds what it has of these, by name (the layering test places each file by it):
- `model.py` (and `vocab.py`, `calibrate.py`): its trainable model, beside the target's models;
- `loss.py`: its training loss, beside the other losses;
- `export.py`: writing and reading its export in the layout transformers, vLLM and SGLang load;
- `decode.py`: its run time, the `Proposer` (chain) or `TreeDrafter` (tree) the decoders drive;
- `kind.py`: its declaration, a `base.DrafterKind` subclass and its one instance `KIND`.

Shared by the kinds: `base.py` (the typed kind and the loaded `Drafter`), `features.py` (the run time
of drafts that read the target's hidden states: their cache, feed, compiled steps and warm-up),
`registry.py` (`KINDS`, one line per kind) and `factory.py` (the one decoder factory). A recipe in
`recipes/` trains a kind's model with its loss and writes its export.
"""
