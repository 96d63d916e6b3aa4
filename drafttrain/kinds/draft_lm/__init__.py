"""A small same-family draft LM drafting K tokens in a row on its own cached LM (`recipes/distill.py`)."""
