"""The target alone (K = 0): every speedup's baseline."""
