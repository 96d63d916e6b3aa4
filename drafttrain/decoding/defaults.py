"""Defaults shared by every entry point that decodes (eval, compare, the recipes' evaluation)."""

NUM_DRAFT_TOKENS = 4  # K: draft tokens per verification step
