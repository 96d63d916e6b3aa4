"""Suffix lookup: no model; the most frequent continuation of the longest suffix match."""
