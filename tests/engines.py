"""The engines every lossless decoding test runs on (imported by tests/decoding and tests/eagle3)."""

from __future__ import annotations

from drafttrain.decoding import StaticLM

# eager: the model's own forward on a DynamicCache. static: the preallocated cache, uncompiled.
# static-bucket: the same with the decoder's step sizes registered, so shorter steps are padded
# to a bucket exactly as the compiled CUDA path pads them.
ENGINES = ("eager", "static", "static-bucket")


def on_engine(model, engine: str, max_length: int = 96):
    """The model as a decoder's target or draft on `engine` (eager: the plain model, which
    decoders wrap themselves)."""
    if engine == "eager":
        return model
    return StaticLM(model, max_length=max_length, compile=False)


def ready(decoder, engine: str):
    if engine == "static-bucket":
        assert decoder.warmup() > 0, "warm-up ran no step"  # uncompiled: each registered size runs once
        assert decoder.target.sizes, "warm-up registered no bucket"
    return decoder
