"""A parallel draft LM (PARD): K drafts from one forward over mask tokens (`recipes/distill.py` with `parallel`)."""
