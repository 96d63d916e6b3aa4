"""The recipes: one readable script per drafter kind (run them as files; tests import them from here)."""
