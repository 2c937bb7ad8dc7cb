"""`load_checkpoint`'s DeepSpeed flags (issue #33): `load_optimizer_states=False`,
`load_lr_scheduler_states=False`, `load_module_only=True` — each restores what DeepSpeed's
does and keeps the rest of this engine's own (they raised NotImplementedError before).
Exact comparisons: a load copies values, it computes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload
from offload.compat.deepspeed import DeepSpeedEngine
from offload.config import OffloadConfig
from tests.conftest import TinyGPT, gpt_batches
from tests.test_engine import make_config


def config(tier: str, path) -> offload.Config:
    cfg = make_config()
    if tier == "nvme":
        cfg = dataclasses.replace(cfg, offload=OffloadConfig(param_tier="nvme", optimizer_tier="nvme",
                                                             nvme_path=str(path), pinned_budget_bytes=1 << 22))
    return cfg


def engine_of(cfg, scheduler: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    sched = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)) if scheduler else None
    return offload.initialize(TinyGPT(n_layer=2), cfg, lr_scheduler=sched)


def train(engine, steps: int = 3) -> None:
    for x, y in gpt_batches(steps):
        engine.backward(engine(x, y))
        engine.step()


def moments(engine) -> dict:
    return {n: engine.param_state.full(p, "exp_avg") for n, p in engine.named_parameters()}


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_load_optimizer_states_false_takes_the_weights_and_keeps_fresh_moments(tier, tmp_path):
    saved = engine_of(config(tier, tmp_path / "a"))
    train(saved)
    saved.save_checkpoint(str(tmp_path / "ckpt"))
    want, lr_saved = saved.full_state_dict(), saved.get_lr()
    saved.close()
    fresh = engine_of(config(tier, tmp_path / "b"), seed=1)  # other weights, zero moments
    fresh.optimizer.param_groups[0]["weight_decay"] = 0.5  # this engine's hyperparameters stay
    fresh.load_checkpoint(str(tmp_path / "ckpt"), load_optimizer_states=False)
    got = fresh.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(not m.any() for m in moments(fresh).values())  # its own (zero) moments
    assert fresh.optimizer.param_groups[0]["weight_decay"] == 0.5
    assert fresh.global_steps == 3 and fresh.get_lr() == lr_saved  # counters and scheduler loaded
    train(fresh, 1)  # trains on from the loaded weights
    assert any(not torch.equal(fresh.full_state_dict()[k], want[k]) for k in want)
    fresh.close()


def test_load_module_only_and_without_the_scheduler(tmp_path):
    saved = engine_of(config("cpu", tmp_path))
    train(saved)
    saved.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 7})
    want, lr_saved = saved.full_state_dict(), saved.get_lr()
    saved_moments = moments(saved)
    saved.close()

    other = engine_of(config("cpu", tmp_path), seed=1)
    lr0 = other.get_lr()
    path, client = other.load_checkpoint(str(tmp_path / "ckpt"), load_module_only=True)
    got = other.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want) and client == {"epoch": 7}
    assert other.global_steps == 0 and other.get_lr() == lr0  # counters and schedule untouched
    assert all(not m.any() for m in moments(other).values())
    other.close()

    # no scheduler here, one in the checkpoint: refused unless the scheduler is left out
    plain = engine_of(config("cpu", tmp_path), scheduler=False)
    with pytest.raises(ValueError, match="load_lr_scheduler_states=False"):
        plain.load_checkpoint(str(tmp_path / "ckpt"))
    plain.load_checkpoint(str(tmp_path / "ckpt"), load_lr_scheduler_states=False)
    got = plain.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want) and plain.global_steps == 3
    assert all(torch.equal(m, saved_moments[n]) for n, m in moments(plain).items())  # the optimizer's too
    plain.close()
    del lr_saved


def test_deepspeed_engine_passes_the_flags(tmp_path):
    saved = engine_of(config("cpu", tmp_path))
    train(saved)
    saved.save_checkpoint(str(tmp_path / "ckpt"))
    want = saved.full_state_dict()
    saved.close()
    ds = DeepSpeedEngine.__new__(DeepSpeedEngine)  # the wrapper around a fresh engine
    ds.__dict__["engine"] = engine_of(config("cpu", tmp_path), seed=1)
    ds.load_checkpoint(str(tmp_path / "ckpt"), load_optimizer_states=False, load_lr_scheduler_states=False)
    got = ds.engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    ds.engine.close()


def test_deepspeed_engine_without_latest_returns_none_as_deepspeed(tmp_path, caplog):
    ds = DeepSpeedEngine.__new__(DeepSpeedEngine)
    ds.__dict__["engine"] = engine_of(config("cpu", tmp_path))
    with caplog.at_level("WARNING"):
        assert ds.load_checkpoint(str(tmp_path / "empty")) == (None, None)
    assert "Unable to find latest file" in caplog.text
    ds.engine.close()


def _different_tags(rank: int, world_size: int, mode: str, path: str):
    import warnings

    cfg = dataclasses.replace(make_config(), checkpoint_tag_validation=mode)
    engine = engine_of(cfg, scheduler=False)
    train(engine, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            saved = engine.save_checkpoint(path, tag=f"step1-rank{rank}")
        except ValueError as exc:
            saved = f"error: {exc}"
    engine.close()
    return saved, [str(w.message) for w in caught]


@pytest.mark.parametrize("mode", ["Warn", "Fail"])
def test_different_tags_across_ranks_follow_tag_validation(tmp_path, mode):
    from tests.conftest import run_distributed

    out = run_distributed(_different_tags, 2, mode, str(tmp_path))
    if mode == "Fail":
        assert all(s.startswith("error: save_checkpoint: the ranks passed different tags") for s, _ in out)
        assert not (tmp_path / "latest").exists()
    else:
        assert out[0][0] == out[1][0] == str(tmp_path / "step1-rank0")
        assert any("different tags" in m for m in out[0][1])
