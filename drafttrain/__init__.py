"""drafttrain: train drafters for speculative decoding and measure the speedup they bring."""

__version__ = "0.1.0"
