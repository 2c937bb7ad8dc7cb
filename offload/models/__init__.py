"""Models built from torch alone, for offload's tests, benchmarks and examples to share.

A bottom layer: nothing here imports the rest of offload (tools/import_graph.py)."""

from offload.models.gpt import (
    CHECKPOINT_MODES,
    GPT,
    GPT_PRESETS,
    Block,
    Linear,
    SmallEmbedding,
    gpt_batches,
    lm_loss,
)

__all__ = ["CHECKPOINT_MODES", "GPT", "GPT_PRESETS", "Block", "Linear", "SmallEmbedding", "gpt_batches",
           "lm_loss"]
