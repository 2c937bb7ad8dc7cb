"""What a new user needs to be told (issue #43, item 6), tried as such a user would.

Before (1750db6) each of these was silent: a model without repeated blocks became one unit
holding every parameter (nothing paged); `engine.step()` before any backward advanced
`global_steps` and the LR schedule; a missing `nvme_path` was created with its parents,
wherever it pointed.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import offload
from offload.models.gpt import GPT

CPU = {"offload": {"param_tier": "cpu", "optimizer_tier": "cpu"}, "precision": {"dtype": "fp32"},
       "compute_device": "cpu"}


def flat_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def test_one_unit_holding_most_parameters_is_warned_about_naming_unit_modules(caplog):
    with caplog.at_level(logging.WARNING, logger="offload"), \
            pytest.warns(UserWarning, match=r"one unit, the root .* holds 2,128 of the model's 2,128 parameters "
                         r"\(100 %\).*Set unit_modules"):
        offload.initialize(flat_model(), CPU).close()
    assert sum("Set unit_modules" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_a_model_with_repeated_blocks_is_not_warned_about(recwarn, caplog):
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload.initialize(GPT(vocab=64, d_model=32, n_layer=4, n_head=2, seq=16), CPU).close()
    assert not [w for w in recwarn if "unit_modules" in str(w.message)]
    assert "unit_modules" not in caplog.text


def test_a_step_before_any_backward_is_not_counted_and_is_warned_about(caplog):
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_layer=2, n_head=2, seq=16)
    engine = offload.initialize(model, CPU)
    before = engine.full_state_dict()
    with caplog.at_level(logging.WARNING, logger="offload"), \
            pytest.warns(UserWarning, match=r"accumulation window in which no engine.backward\(\) ran.*nothing was done"):
        engine.step()
        engine.step()  # warned once
    assert sum("nothing was done" in r.getMessage() for r in caplog.records) == 1
    assert engine.global_steps == 0 and engine.skipped_steps == 0
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, x))
    engine.step()  # a real step counts as always
    assert engine.global_steps == 1
    engine.step()  # and a second step() without backward again does nothing
    assert engine.global_steps == 1
    engine.close()


def test_a_missing_nvme_path_is_created_and_said_where(tmp_path, caplog):
    path = tmp_path / "swap"
    cfg = {**CPU, "offload": {"param_tier": "cpu", "optimizer_tier": "nvme", "nvme_path": str(path)}}
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload.initialize(GPT(vocab=64, d_model=32, n_layer=2, n_head=2, seq=16), cfg).close()
    assert os.path.isdir(path)
    assert any(f"created offload.nvme_path {path} (it did not exist) on the" in r.getMessage()
               and "filesystem" in r.getMessage() for r in caplog.records), caplog.text


def test_an_nvme_path_whose_parent_is_missing_is_refused(tmp_path):
    path = tmp_path / "nvme0" / "swap"  # a mount point mistyped, or a disk not mounted
    cfg = {**CPU, "offload": {"param_tier": "cpu", "optimizer_tier": "nvme", "nvme_path": str(path)}}
    with pytest.raises(FileNotFoundError, match=r"does not exist, and neither does its parent .*nvme0'"):
        offload.initialize(GPT(vocab=64, d_model=32, n_layer=2, n_head=2, seq=16), cfg)
    assert not os.path.exists(tmp_path / "nvme0")
