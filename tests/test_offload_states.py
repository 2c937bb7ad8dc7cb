"""`engine.offload_states()` / `engine.reload_states()` (DeepSpeed's, issue #33): what lives on
the compute device is parked in host memory and comes back bit for bit.

The reference for "bit for bit" is the same engine trained without the round trip: the
weights, the fp32 masters and the Adam moments after the remaining steps are `torch.equal`.
While parked, the engine's 'device' bytes are 0 (its own accounting, which counts storages,
so a freed one shows), and every path that would read a parked storage refuses with the fix.
A CPU run's 'device' is main memory, so the same code path runs here; the `cuda` test checks
that the GPU's allocated memory really drops.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.runtime.accounting import device_tensors
from tests.conftest import run_distributed

D = 16
STEPS, PARK_AT = 4, 2


class Stack(nn.Module):
    """Three units and a buffer (buffers live on the compute device too)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(3)])
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x.to(self.layers[0].weight.dtype)
        for layer in self.layers:
            h = torch.tanh(layer(h)) * self.scale.to(h.dtype)
        return torch.nn.functional.mse_loss(h.float(), y)


def config(dtype: str, stage: int, tier: str, path: str = "", device: str = "auto") -> dict:
    off: dict = {"param_tier": tier, "optimizer_tier": "nvme" if tier == "nvme" else "cpu"}
    if tier == "nvme":
        off.update(nvme_path=path, pinned_budget_bytes=1 << 22)
    return {"offload": off, "optimizer": {"type": "AdamW", "lr": 1e-2, "weight_decay": 0.1},
            "precision": {"dtype": dtype}, "zero_stage": stage, "compute_device": device}


def batches(world_size: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)
        n = 4 // world_size
        out.append((x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
    return out


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Weights, fp32 masters and Adam moments, gathered (a collective)."""
    out = {f"w.{k}": v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    for name, p in engine.module.named_parameters():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            out[f"{key}.{name}"] = engine.param_state.full(p, key).clone()
    return out


def run(rank: int, world_size: int, cfg: dict, park: bool) -> dict:
    """Train STEPS steps; with `park`, offload_states / reload_states after PARK_AT of them.
    Returns the final snapshot and, when parked, what the engine reported meanwhile."""
    torch.manual_seed(0)
    engine = offload.initialize(Stack(), cfg)
    seen: dict = {}
    for i, (x, y) in enumerate(batches(world_size, rank)):
        if park and i == PARK_AT:
            seen["before"] = engine.memory_bytes()
            device = [t.untyped_storage() for t in device_tensors(engine.sharded_state)]
            engine.offload_states()
            engine.offload_states()  # idempotent, as DeepSpeed's
            seen["parked"] = engine.memory_bytes()
            seen["storages"] = sorted({s.nbytes() for s in device})
            errors = []
            for call in (lambda: engine(x, y), engine.step, lambda: engine.full_state_dict(),
                         lambda: engine.module.state_dict(), lambda: engine.save_checkpoint("/nonexistent")):
                try:
                    call()
                    errors.append(None)
                except RuntimeError as exc:
                    errors.append(str(exc))
            seen["errors"] = errors
            engine.reload_states()
            engine.reload_states()  # nothing parked: a no-op
            seen["after"] = engine.memory_bytes()
        engine.backward(engine(x, y))
        engine.step()
    seen["final"] = snapshot(engine)
    engine.close()
    return seen


def check(reference: dict, parked: dict) -> None:
    assert parked["before"]["device"] > 0
    assert parked["parked"]["device"] == 0, parked["parked"]
    # Gathered copies the schedule rebuilds are freed, the rest moved: host gains at most
    # what the device gave up, and gives exactly that back.
    assert 0 < parked["parked"]["host"] - parked["before"]["host"] <= parked["before"]["device"]
    assert parked["after"]["host"] == parked["before"]["host"]
    assert 0 < parked["after"]["device"] <= parked["before"]["device"]
    assert parked["storages"] == [0], parked["storages"]  # every device storage emptied
    for err in parked["errors"]:
        assert err is not None and "after engine.offload_states()" in err and "engine.reload_states() first" in err
    assert reference["final"].keys() == parked["final"].keys()
    for k, v in reference["final"].items():
        assert torch.equal(v, parked["final"][k]), k


CASES = [("bf16", 3, "device"), ("bf16", 2, "device"), ("fp32", 3, "device"), ("fp32", 3, "cpu"),
         ("bf16", 3, "cpu")]


@pytest.mark.parametrize("dtype,stage,tier", CASES)
def test_round_trip_is_bit_identical_world_size_1(dtype, stage, tier):
    cfg = config(dtype, stage, tier)
    check(run(0, 1, cfg, park=False), run(0, 1, cfg, park=True))


def test_round_trip_on_the_nvme_tiers(tmp_path):
    cfg = config("bf16", 3, "nvme", str(tmp_path))
    check(run(0, 1, cfg, park=False), run(0, 1, cfg, park=True))


def _both(rank: int, world_size: int, cfg: dict) -> tuple[dict, dict]:
    return run(rank, world_size, cfg, park=False), run(rank, world_size, cfg, park=True)


@pytest.mark.parametrize("dtype,stage", [("bf16", 3), ("fp32", 2)])
def test_round_trip_is_bit_identical_world_size_2(dtype, stage):
    for reference, parked in run_distributed(_both, 2, config(dtype, stage, "device")):
        check(reference, parked)


def test_the_round_trip_changes_what_is_trained_negative_control():
    """The comparison can fail: parking without the copy back (bytes lost) diverges."""
    from offload.runtime import residency

    cfg = config("bf16", 3, "device")
    reference = run(0, 1, cfg, park=False)
    original = residency.DeviceResidency.reload

    def lossy(self):  # the storages come back zero-filled instead of with their bytes
        for storage, host in self._parked:
            host.zero_()
        original(self)

    residency.DeviceResidency.reload = lossy
    try:
        parked = run(0, 1, cfg, park=True)
    finally:
        residency.DeviceResidency.reload = original
    assert any(not torch.equal(v, parked["final"][k]) for k, v in reference["final"].items())


def test_arguments_follow_deepspeed():
    torch.manual_seed(0)
    engine = offload.initialize(Stack(), config("bf16", 3, "device"))
    with pytest.raises(ValueError, match=r"'hp_param' is not a state kind; the kinds are optim_states, hp_params"):
        engine.offload_states(include=["hp_param"])
    with pytest.raises(ValueError, match="only 'cpu' is supported"):
        engine.offload_states(device="nvme")
    before = engine.memory_bytes()
    engine.offload_states(device="none")  # DeepSpeed: a warning, nothing moved
    engine.offload_states(include=["optim_states", "hp_params", "lp_grads"])  # in host memory already
    assert engine.memory_bytes() == before and not engine.residency.parked
    engine.offload_states(include=["lp_params"], pin_memory=False, non_blocking=True)
    assert engine.memory_bytes()["device"] == 0
    engine.reload_states(non_blocking=True)
    assert engine.memory_bytes() == before
    engine.close()


def test_deepspeeds_enum_is_accepted():
    enum = pytest.importorskip("deepspeed.runtime.zero.offload_config",
                               reason="DeepSpeed is not installed").OffloadStateTypeEnum
    torch.manual_seed(0)
    engine = offload.initialize(Stack(), config("bf16", 3, "device"))
    engine.offload_states(include=[enum.lp_params, enum.optim_states])
    assert engine.memory_bytes()["device"] == 0
    engine.reload_states()
    engine.close()


def test_close_while_parked_keeps_the_models_weights():
    torch.manual_seed(0)
    engine = offload.initialize(Stack(), config("bf16", 3, "device"))
    x, y = batches(1, 0)[0]
    engine.backward(engine(x, y))
    engine.step()
    weights = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.offload_states()
    engine.close()
    with torch.no_grad():
        assert engine.module.scale.untyped_storage().nbytes() > 0
        assert torch.equal(engine.module.scale, weights["scale"])


@pytest.mark.cuda
def test_gpu_memory_is_handed_back_and_restored():
    torch.manual_seed(0)
    engine = offload.initialize(Stack(), config("bf16", 3, "device", device="cuda"))
    x, y = (t.cuda() for t in batches(1, 0)[0])
    engine.backward(engine(x, y))
    engine.step()
    torch.cuda.synchronize()
    before = snapshot(engine)
    allocated = torch.cuda.memory_allocated()
    device_bytes = engine.memory_bytes()["device"]
    engine.offload_states()
    assert torch.cuda.memory_allocated() <= allocated - device_bytes
    engine.reload_states()
    after = snapshot(engine)
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    engine.backward(engine(x, y))
    engine.step()
    engine.close()


def test_the_deepspeed_wrapper_passes_them_through():
    import offload.compat.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Stack()
    ds = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    engine.offload_states()
    assert engine.memory_bytes()["device"] == 0
    engine.reload_states()
    engine.destroy()
