"""EAGLE-3 drafters: the draft model, its vocabulary, the target's features, loss and export.

model.py     the draft (training-time-test unroll + KV-cached decoding steps)
vocab.py     the reduced draft vocabulary and its d2t / t2d maps
features.py  the target's hidden states at the draft's aux layers, for training
loss.py      forward KL to the target restricted to the draft vocabulary, per unrolled step
export.py    save / load in the layout SGLang and vLLM serve

Decoding with the draft (its KV caches, chain and trees) is `decoding/drafters/eagle3*.py`;
teacher-forced acceptance (`drafttrain replay`) is `evaluation/replay.py`.
"""
