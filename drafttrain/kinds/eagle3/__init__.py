"""EAGLE-3: a draft layer reading the target's features, a chain or EAGLE-2's dynamic tree (`recipes/train_eagle3.py`)."""
