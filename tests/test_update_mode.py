"""Where updates run (offload/runtime/update_mode.py): the decision alone, every transition,
without an engine; then the behaviour a user sees between backward and `step()`.

DeepSpeed's TestTensorFragmentGet pins it: after `backward`, `safe_get_full_fp32_param(p)` is
the weight before the step and `safe_get_full_grad(p)` the gradient. With the update in
backward (nonfinite_loss off, no clipping: the mode that overlaps the CPU optimizer with
backward) a loop that reads there learns it on the first step, which updates at `step()`
([Note: the update mode is learned]), and every later step updates at `step()` too.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch

import offload
from offload.compat.deepspeed import utils as ds_utils
from offload.runtime.update_mode import Eligibility, Pattern, Site, learn, observed, site_of_updates
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.test_engine import make_config

OPEN = Eligibility(enabled=True, whole_gradient_first=False, at_boundary=True, first_pass=True)


# -- the decision alone ----------------------------------------------------------------------------


def test_only_a_one_pass_pattern_or_transient_shards_update_in_backward():
    for pattern, transient in itertools.product(Pattern, (False, True)):
        want = Site.IN_BACKWARD if transient or pattern is Pattern.ONE_PASS else Site.AT_STEP
        assert site_of_updates(OPEN, pattern, transient) is want, (pattern, transient)


@pytest.mark.parametrize("field", ["enabled", "whole_gradient_first", "at_boundary", "first_pass"])
def test_each_condition_of_the_config_and_the_step_alone_sends_the_updates_to_step(field):
    closed = dataclasses.replace(OPEN, **{field: not getattr(OPEN, field)})
    for pattern, transient in itertools.product(Pattern, (False, True)):
        assert site_of_updates(closed, pattern, transient) is Site.AT_STEP, (field, pattern, transient)


def test_every_transition_of_the_pattern():
    assert learn(Pattern.LEARNING, 0) is Pattern.LEARNING  # a boundary with no backward teaches nothing
    assert learn(Pattern.LEARNING, 1) is Pattern.ONE_PASS
    assert learn(Pattern.LEARNING, 2) is Pattern.SEVERAL_PASSES
    assert learn(Pattern.ONE_PASS, 1) is Pattern.ONE_PASS
    assert learn(Pattern.ONE_PASS, 3) is Pattern.SEVERAL_PASSES
    for absorbing in (Pattern.SEVERAL_PASSES, Pattern.OBSERVED):
        for passes in (0, 1, 2):
            assert learn(absorbing, passes) is absorbing
    for pattern in Pattern:
        assert observed(pattern) is Pattern.OBSERVED


# -- what a user sees between backward and step() ---------------------------------------------------


def config(nvme_path=None):
    """Updates may run in backward (nonfinite_loss off), and gradient shards are held (two
    micro-batches a step: a CPU run with one keeps a shard only until its update, below).
    `nvme_path`: parameters and optimizer states on NVMe there."""
    cfg = dataclasses.replace(make_config(gas=2), nonfinite_loss="off")
    if nvme_path is None:
        return cfg
    return dataclasses.replace(cfg, offload=dataclasses.replace(
        cfg.offload, param_tier="nvme", optimizer_tier="nvme", nvme_path=str(nvme_path)))


def steps(engine, rank: int = 0, world_size: int = 1, n: int = 4):
    """Each of `n` steps: its first micro-batch's backward, then its last one's (the caller
    reads and calls step() after it); yields the step index."""
    batches = gpt_batches(2 * n)
    for i in range(n):
        for x, y in batches[2 * i : 2 * i + 2]:
            k = x.shape[0] // world_size
            engine.backward(engine(x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]))
            if engine.is_gradient_accumulation_boundary():
                yield i
            else:
                engine.step()


def _fragments(rank: int, world_size: int, read: bool, nvme_path=None) -> dict:
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=2), config(nvme_path))
    params = dict(engine.named_parameters())
    name = "blocks.1.fc.weight" if "blocks.1.fc.weight" in params else sorted(params)[-1]
    p = params[name]
    out: dict = {"before": [], "after": [], "grad": [], "in_backward": []}
    for _ in steps(engine, rank, world_size):
        out["in_backward"].append(engine.policy.updated != set())
        if read:
            out["before"].append(ds_utils.safe_get_full_fp32_param(p).clone())
            out["grad"].append(ds_utils.safe_get_full_grad(p).clone())
        engine.step()
        out["after"].append(ds_utils.safe_get_full_fp32_param(p).clone())
    out["pattern"] = engine.policy.pattern
    engine.close()
    return out


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_reads_between_backward_and_step_see_the_weight_before_the_step_and_the_gradient(world_size, tier, tmp_path):
    path = None if tier == "cpu" else tmp_path
    runs = [_fragments(0, 1, True, path)] if world_size == 1 else run_distributed(_fragments, 2, True, path)
    quiet = [_fragments(0, 1, False, path)] if world_size == 1 else run_distributed(_fragments, 2, False, path)
    for got, plain in zip(runs, quiet):
        assert got["pattern"] is Pattern.OBSERVED and not any(got["in_backward"])
        # the loop that does not read still overlaps: the learning step, then in backward
        assert plain["pattern"] is Pattern.ONE_PASS and plain["in_backward"] == [False, True, True, True]
        for step in range(4):
            before = got["after"][step - 1] if step else None
            if before is not None:
                assert torch.equal(got["before"][step], before), f"step {step}: the weight read after backward moved"
            assert got["grad"][step].abs().sum() > 0
            assert torch.equal(got["after"][step], plain["after"][step]), f"step {step}: reading changed training"


def test_a_read_after_this_steps_updates_ran_in_backward_warns_and_later_steps_update_at_step():
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=2), config())
    p = dict(engine.named_parameters())["blocks.1.fc.weight"]
    for i in steps(engine):
        if i == 2:  # after the learning step and one in backward
            assert engine.policy.updated  # this step's updates ran during backward
            with pytest.warns(RuntimeWarning, match="after this step's update ran during backward"):
                ds_utils.safe_get_full_fp32_param(p)
        if i == 3:
            assert not engine.policy.updated and engine.policy.pattern is Pattern.OBSERVED
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                before = ds_utils.safe_get_full_fp32_param(p).clone()
        engine.step()
    assert not torch.equal(before, ds_utils.safe_get_full_fp32_param(p))
    engine.close()


def test_a_run_that_keeps_no_gradient_shards_refuses_a_gradient_read_saying_what_to_set():
    """Transient shards (a CPU run, one micro-batch a step, nonfinite_loss off): no learning
    step, the shard is gone after its update; the error names the settings that hold it."""
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=2), dataclasses.replace(make_config(), nonfinite_loss="off"))
    assert engine.policy.transient_grads
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="consumed.*nonfinite_loss='skip'.*optimizer_in_backward=false"):
        engine.full_grad("blocks.1.fc.weight")
    engine.step()
    engine.close()
