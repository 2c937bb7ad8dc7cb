"""Hugging Face integration: DeepSpeed configs as Trainer users write them.

`resolve_auto(ds_config, training_args, num_training_steps=..., model=...)` fills a
DeepSpeed config's `"auto"` values from `transformers.TrainingArguments` by the rules the
Trainer uses, so that `offload.load_config` / `offload.initialize` can read it. Nothing here
imports transformers: the training arguments are read by attribute.
"""

from offload.integrations.hf.auto import resolve_auto

__all__ = ["resolve_auto"]
