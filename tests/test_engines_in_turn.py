"""Engines one after another in one process (issue #36). At world size 2: train, close,
initialize again; two models in turn. `close()` used to destroy the process group the
engine had started, and re-creating it stalled one rank in `init_process_group` (6 of 8 runs
hung). Now the group an engine started stays for the next engine of the process (and is
destroyed at exit, every rank together); a group the user started is never touched. And a
notebook cell that runs `initialize` again on a model a live engine holds takes over from it."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.runtime.lifecycle import LIVE_ENGINES
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.test_engine import make_config


def _in_turn(rank: int, world_size: int, rounds: int) -> list[int]:
    import torch.distributed as dist

    sizes = []
    for i in range(rounds):
        torch.manual_seed(i)
        engine = offload.initialize(TinyGPT(n_layer=1 + i % 2), make_config())
        for x, y in gpt_batches(1):
            n = x.shape[0] // world_size
            engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
            engine.step()
        sizes.append(engine.world_size)
        engine.close()
        assert dist.is_initialized()  # kept for the next engine
    return sizes


def test_engines_in_turn_at_world_size_2():
    out = run_distributed(_in_turn, 2, 4, init_group=False, timeout_s=180)
    assert out == [[2, 2, 2, 2], [2, 2, 2, 2]]


# -- a notebook cell re-run: initialize on a model a live engine holds ------------------------------


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_initialize_again_on_a_held_model_takes_over(tier, tmp_path, caplog):
    """It failed with "in use by an engine of this process" (NVMe), and with the host tier
    built an engine over the first one's views. Now the first engine hands back its trained
    fp32 weights and closes; the new engine trains on from them."""
    import dataclasses

    from offload.config import OffloadConfig

    cfg = make_config()
    if tier == "nvme":
        cfg = dataclasses.replace(cfg, offload=OffloadConfig(param_tier="nvme", optimizer_tier="nvme",
                                                             nvme_path=str(tmp_path), pinned_budget_bytes=1 << 22))
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2)
    first = offload.initialize(model, cfg)
    x, y = gpt_batches(1)[0]
    first.backward(first(x, y))
    first.step()
    trained = first.full_state_dict()
    with caplog.at_level("WARNING", logger="offload.engine"):
        second = offload.initialize(model, cfg)  # the cell run again
    assert "taken over" in caplog.text
    assert all(torch.equal(second.full_state_dict()[k], trained[k]) for k in trained)
    assert first not in list(LIVE_ENGINES)  # closed
    second.backward(second(x, y))
    second.step()
    second.close()
