"""DFlash: a block of drafts from one forward on the target's features (`recipes/train_dflash.py`)."""
