"""EAGLE-3 drafters: the draft model, its vocabulary, loss, export and teacher-forced acceptance.

model.py   the draft (training-time-test unroll + KV-cached decoding steps)
vocab.py   the reduced draft vocabulary and its d2t / t2d maps
loss.py    forward KL to the target restricted to the draft vocabulary, per unrolled step
export.py  save / load in the layout SGLang and vLLM serve
replay.py  greedy chain acceptance from one target forward and one unroll
"""
