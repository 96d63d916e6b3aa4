import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `import tiny` from every test directory
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
