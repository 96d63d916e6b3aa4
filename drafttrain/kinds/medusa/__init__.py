"""Medusa heads on the target: a static tree (greedy) or a sampled chain (`recipes/train_heads.py`)."""
