"""DeepSpeed's warmup schedules: formulas pinned by hand-computed values, and (where
DeepSpeed is installed) step-for-step equality with DeepSpeed's own schedulers."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from offload.config import SCHEDULER_PARAMS, SchedulerConfig
from offload.optim.lr_schedules import (
    SCHEDULES,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def _optimizer(lrs=(0.1,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


def _rates(optimizer: torch.optim.Optimizer, scheduler: LRScheduler, steps: int) -> list[list[float]]:
    """The learning rate each of `steps` optimizer steps runs with (step, then schedule)."""
    out = []
    for _ in range(steps):
        out.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


# Hand-computed from DeepSpeed's formulas. Optimizer step k runs at DeepSpeed iteration
# k - 1 (iteration -1 = the rate set at construction).

def test_warmup_lr_log_matches_hand_computed_values():
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4)
    got = [r[0] for r in _rates(opt, sched, 7)]
    # iterations -1, 0: min; 1: log2/log4 = 1/2; 2: log3/log4; 3: 1; then hold.
    want = [0.0, 0.0, 0.05, 0.1 * math.log(3) / math.log(4), 0.1, 0.1, 0.1]
    assert got == pytest.approx(want, rel=1e-15, abs=0)


def test_warmup_lr_linear_matches_hand_computed_values():
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.05, warmup_num_steps=4, warmup_type="linear")
    got = [r[0] for r in _rates(opt, sched, 7)]
    assert got == pytest.approx([0.01, 0.01, 0.02, 0.03, 0.04, 0.05, 0.05], rel=1e-15)


def test_warmup_lr_default_max_is_each_groups_own_rate():
    opt = _optimizer((0.2, 0.04))
    sched = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    # W = 2: iterations -1, 0 -> 0; 1 -> half; 2 -> full.
    assert _rates(opt, sched, 4) == [[0.0, 0.0], [0.0, 0.0], [0.1, 0.02], [0.2, 0.04]]


def test_warmup_lr_clamps_warmup_steps_to_two_as_deepspeed():
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    assert [r[0] for r in _rates(opt, sched, 4)] == [0.0, 0.0, 0.5, 1.0]


def test_warmup_decay_lr_matches_hand_computed_values():
    opt = _optimizer()
    sched = WarmupDecayLR(opt, total_num_steps=8, warmup_min_lr=0.0, warmup_max_lr=0.1,
                          warmup_num_steps=4, warmup_type="linear")
    got = [r[0] for r in _rates(opt, sched, 12)]
    # Warmup 0, .025, .05, .075 (iterations 0..3); decay (8 - i) / 4 from i = 4; 0 from 8 on.
    want = [0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0, 0.0]
    assert got == pytest.approx(want, rel=1e-15, abs=1e-18)


def test_warmup_decay_lr_default_max_is_deepspeeds_fixed_0_001():
    # DeepSpeed quirk kept on purpose: WarmupDecayLR's warmup_max_lr defaults to 0.001,
    # not to the optimizer's learning rate.
    opt = _optimizer((0.5,))
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=2, warmup_type="linear")
    assert _rates(opt, sched, 4)[-1] == [pytest.approx(0.001 * 98 / 98)]


def test_warmup_cosine_lr_matches_hand_computed_values():
    opt = _optimizer((1.0,))
    sched = WarmupCosineLR(opt, total_num_steps=6, warmup_min_ratio=0.2, warmup_num_steps=2,
                           cos_min_ratio=0.1, warmup_type="linear")
    got = [r[0] for r in _rates(opt, sched, 9)]
    c = lambda p: 0.1 + 0.9 * (1 + math.cos(math.pi * p)) / 2  # noqa: E731
    # -1: 0; 0: 0.2; 1: 0.2 + 0.5 * 0.8; then p = (i - 1) / 4, clamped to 1.
    want = [0.0, 0.2, 0.6, c(0.25), c(0.5), c(0.75), 0.1, 0.1, 0.1]
    assert got == pytest.approx(want, rel=1e-14, abs=1e-18)


def test_warmup_cosine_lr_scales_each_group_and_stays_at_floor_past_the_end():
    opt = _optimizer((0.4, 0.02))
    sched = WarmupCosineLR(opt, total_num_steps=5, warmup_num_steps=2, cos_min_ratio=0.25)
    rates = _rates(opt, sched, 12)
    assert rates[-1] == pytest.approx([0.1, 0.005])
    assert all(r[0] / r[1] == pytest.approx(20.0) for r in rates[2:])  # 0 at iterations -1 and 0


def test_schedules_are_torch_lr_schedulers_with_get_last_lr():
    opt = _optimizer()
    for sched in (WarmupLR(opt, warmup_num_steps=3), WarmupDecayLR(opt, total_num_steps=9, warmup_num_steps=3),
                  WarmupCosineLR(opt, total_num_steps=9, warmup_num_steps=3)):
        assert isinstance(sched, LRScheduler)
        opt.step()
        sched.step()
        assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


@pytest.mark.parametrize("cls,kwargs", [
    (WarmupLR, dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=5)),
    (WarmupDecayLR, dict(total_num_steps=12, warmup_num_steps=4, warmup_type="linear")),
    (WarmupCosineLR, dict(total_num_steps=12, warmup_num_steps=4, warmup_min_ratio=0.1)),
])
def test_state_dict_resume_continues_the_same_schedule(cls, kwargs):
    opt = _optimizer((0.1, 0.3))
    sched = cls(opt, **kwargs)
    _rates(opt, sched, 6)
    saved_state, saved_lrs = sched.state_dict(), [g["lr"] for g in opt.param_groups]
    expected = _rates(opt, sched, 8)

    opt2 = _optimizer((0.1, 0.3))
    sched2 = cls(opt2, **kwargs)
    sched2.load_state_dict(saved_state)
    for group, lr in zip(opt2.param_groups, saved_lrs):  # the optimizer's state_dict holds the rate
        group["lr"] = lr
    assert _rates(opt2, sched2, 8) == expected


def test_load_state_dict_accepts_deepspeeds_format():
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    sched.load_state_dict({"last_batch_iteration": 4})
    assert sched.last_batch_iteration == 4
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_resuming_with_last_batch_iteration_sets_that_iterations_rate():
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear",
                     last_batch_iteration=3)
    assert sched.last_batch_iteration == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)


@pytest.mark.parametrize("cls,kwargs,message", [
    (WarmupLR, dict(warmup_num_steps=0), "warmup_num_steps must be a positive integer"),
    (WarmupLR, dict(warmup_num_steps=10.0), "warmup_num_steps must be a positive integer"),
    (WarmupLR, dict(warmup_type="cosine"), "warmup_type must be one of 'log', 'linear'"),
    (WarmupLR, dict(warmup_min_lr=[0.0, 0.1, 0.2]), "warmup_min_lr has 3 values but the optimizer has 1"),
    (WarmupDecayLR, dict(total_num_steps=0), "total_num_steps must be a positive integer"),
    (WarmupCosineLR, dict(total_num_steps=-5), "total_num_steps must be a positive integer"),
    (WarmupLR, dict(last_batch_iteration=-2), "last_batch_iteration must be an integer >= -1"),
])
def test_bad_arguments_raise_value_error_naming_the_argument(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(_optimizer(), **kwargs)


def test_build_scheduler_builds_the_named_schedule_with_its_params():
    opt = _optimizer((0.5,))
    sched = build_scheduler(opt, SchedulerConfig(type="WarmupCosineLR",
                                                 params={"total_num_steps": 10, "warmup_num_steps": 2}))
    assert isinstance(sched, WarmupCosineLR) and sched.total_num_steps == 10
    assert opt.param_groups[0]["lr"] == 0.0


def test_config_parameter_spec_matches_the_constructors():
    # SCHEDULER_PARAMS lets the config validate without torch; it must not drift from the
    # constructors' signatures and defaults.
    assert set(SCHEDULER_PARAMS) == set(SCHEDULES)
    for name, cls in SCHEDULES.items():
        params = list(inspect.signature(cls).parameters.values())[1:]  # drop optimizer
        spec = {p.name: (... if p.default is inspect.Parameter.empty else p.default) for p in params}
        assert spec == SCHEDULER_PARAMS[name], name


# ---- against DeepSpeed itself (skipped where DeepSpeed is not installed) -----------------

CASES = [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.05, warmup_num_steps=10)),
    ("WarmupLR", dict(warmup_num_steps=7, warmup_type="linear")),
    ("WarmupLR", dict(warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.02], warmup_num_steps=1)),
    ("WarmupDecayLR", dict(total_num_steps=30, warmup_max_lr=0.01, warmup_num_steps=5, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=20, warmup_min_lr=0.001, warmup_num_steps=8)),
    ("WarmupDecayLR", dict(total_num_steps=3, warmup_num_steps=6)),
    ("WarmupCosineLR", dict(total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=5, cos_min_ratio=0.01)),
    ("WarmupCosineLR", dict(total_num_steps=25, warmup_num_steps=10, warmup_type="linear")),
    ("WarmupCosineLR", dict(total_num_steps=3, warmup_num_steps=5)),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name,kwargs", CASES)
def test_rates_are_bit_identical_to_deepspeeds(name, kwargs):
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours_opt, ds_opt = _optimizer((0.1, 0.02)), _optimizer((0.1, 0.02))
    ours = SCHEDULES[name](ours_opt, **kwargs)
    theirs = getattr(ds, name)(ds_opt, **kwargs)
    # Exact equality: same formulas in the same order of operations.
    assert _rates(ours_opt, ours, 40) == _rates(ds_opt, theirs, 40)
    assert ours.last_batch_iteration == theirs.last_batch_iteration
    assert ours.get_last_lr() == theirs.get_last_lr()
