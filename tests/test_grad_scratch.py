"""Transient gradient shards at world size 1 borrow one scratch buffer from their reduce to
their update ([Note: one scratch for transient gradient shards] in offload/runtime/backward.py):
the same memory every step (no page faults per step), every shard released between steps,
and results bit-identical to fresh memory per shard."""

from __future__ import annotations

import torch

import offload
from tests.conftest import TinyGPT, gpt_batches


def _train(scratch: bool):
    torch.manual_seed(0)
    # CPU, no clipping, one micro-batch per step: every unit updates during backward, so the
    # gradient shards are transient.
    engine = offload.initialize(TinyGPT(), {"precision": {"dtype": "fp32"}, "gradient_clipping": 0.0,
                                            "nonfinite_loss": "off"})  # transient shards: guard off
    tracker = engine.backward_tracker
    if not scratch:
        tracker.scratch.enabled = False
    seen = []
    for x, y in gpt_batches(4):
        engine.backward(engine(x, y))
        engine.step()
        buf = tracker.scratch.buf
        seen.append(None if buf is None else buf.data_ptr())
        assert all(st.grad.untyped_storage().nbytes() == 0 for st in engine.states)  # released
    sd = engine.full_state_dict()
    engine.close()
    return sd, seen


def test_the_scratch_is_reused_every_step_and_changes_no_bit():
    with_scratch, seen = _train(True)
    assert seen[0] is not None and len(set(seen)) == 1  # one buffer, the same every step
    fresh, none = _train(False)
    assert none == [None] * 4  # the control: no scratch, fresh memory per shard
    for k in fresh:
        assert torch.equal(with_scratch[k], fresh[k]), k
