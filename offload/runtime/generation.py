"""Keeping Hugging Face `generate()` in step across ranks.

[Note: generation in step]
Every forward of a wrapped model all-gathers each unit's parameters, a collective all ranks
must enter. `generate()` runs one forward per new token and stops when a rank's sequences
are done (EOS, max_length, max_new_tokens): with different prompts or lengths per rank, the
rank that stops first leaves the others waiting in a gather that never completes. HF's
answer is `synced_gpus=True`: a finished rank keeps running (dummy) forwards until every rank
is done, agreed by one all-reduce per token. HF turns it on by itself only when it detects
DeepSpeed ZeRO-3 or FSDP (transformers generation/utils.py: `is_deepspeed_zero3_enabled()
or is_fsdp_managed_module(self)`, and only at world size > 1).

So at world size > 1 the engine marks the wrapped model as FSDP2's `fully_shard` marks the
modules it manages, `model._is_fsdp_managed_module = True`, and HF's own default applies.
What else reads that attribute (transformers 5.23, accelerate 1.15, torch 2.13, checked):
- transformers' `is_fsdp_managed_module`: generate's and Seq2SeqTrainer's `synced_gpus`
  default, and the layerdrop of audio models (wav2vec2, hubert, ...), which then runs every
  layer on every rank (what the engine's gathers need too); Trainer's gradient-sync deferral
  only for a model transformers itself sharded at load (`distributed_config`).
- torch dynamo treats such a module as FSDP-managed when compiling it (fewer guards on its
  parameters); a compiled forward of a marked model still ran and gave the same loss.
- accelerate: nothing.
An explicit `generate(..., synced_gpus=False)` still wins, and hangs as above until the
waiting rank's gather times out (torch.distributed's error, after `collective_timeout_s`
when the engine started the group, else after the group's own timeout): the engine cannot
see a rank that stopped calling forward.
"""

from __future__ import annotations

from torch import nn

__all__ = ["mark_synced_generation", "unmark_synced_generation"]

_FLAG = "_is_fsdp_managed_module"


def mark_synced_generation(model: nn.Module, world_size: int) -> bool:
    """Mark `model` so HF `generate()` defaults to `synced_gpus=True` ([Note: generation in
    step]); a no-op at world size 1. Returns whether this call set the mark."""
    if world_size <= 1 or getattr(model, _FLAG, False):
        return False
    setattr(model, _FLAG, True)
    return True


def unmark_synced_generation(model: nn.Module) -> None:
    """Remove the mark `mark_synced_generation` set (at `engine.close()`)."""
    if model.__dict__.get(_FLAG, False):
        delattr(model, _FLAG)
