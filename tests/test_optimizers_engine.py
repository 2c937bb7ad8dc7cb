"""The engine runs Lion and Adagrad (offload/optim/kinds.py) as it runs Adam.

- Adagrad through the engine against torch.optim.Adagrad in a plain loop, Lion against a
  plain loop with a torch-ops Lion (`lion_step_flat_reference`, lion-pytorch's definition):
  world sizes 1 and 2, optimizer state in host memory and on NVMe, gradient accumulation
  and clipping, fp32; bounds measured as tests/parity.py does (a float64 truth, fp32
  references) and a negative control each (Adagrad without its lr_decay, Lion with another
  beta) landing far outside;
- bf16 state (`moments_dtype: bf16`): a trajectory bound against the same loop whose state
  is rounded to bf16 after every step;
- checkpoints: save / resume bit for bit per type (host and NVMe), a checkpoint of one type
  refused by an engine of another, naming both;
- DeepSpeed configs naming Lion and Adagrad train as offload's own config does; Lamb is
  refused with its reason; torch.optim.Adagrad handed to initialize gives its groups and
  hyperparameters, and a flag its kernel lacks goes to the generic path (torch's class);
- the planner's bytes equal `engine.memory_bytes()` with one state tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import pytest
import torch

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig
from offload.optim.one_state import lion_step_flat_reference
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.parity import Fp32Bound, TrajectoryBound, plain_loop

STEPS = 8
GAS = 2
CLIP = 0.05
HYPER = {
    "Adagrad": {"lr": 2e-2, "weight_decay": 0.01, "lr_decay": 0.05, "eps": 1e-10,
                "initial_accumulator_value": 0.1},
    "Lion": {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.99)},
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(n_layer=2)


def batches(n: int = STEPS * GAS):
    return gpt_batches(n)


# -- plain-loop optimizers ------------------------------------------------------------------------


class RefLion(torch.optim.Optimizer):
    """Lion in torch ops (`lion_step_flat_reference`), any dtype; `state_dtype` rounds the
    momentum after every step as a store keeping it in that dtype would."""

    def __init__(self, params: Any, lr: float, weight_decay: float, betas=(0.9, 0.99),
                 state_dtype: Any = None, **_impl: Any) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": betas})
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                lion_step_flat_reference(p.view(-1), p.grad.view(-1), m.view(-1), lr=g["lr"],
                                         beta1=g["betas"][0], beta2=g["betas"][1],
                                         weight_decay=g["weight_decay"])
                if self.state_dtype is not None:
                    m.copy_(m.to(self.state_dtype))


class RefAdagrad(torch.optim.Adagrad):
    """torch.optim.Adagrad (for-loop, or foreach when asked for `fused`), whose sum may be
    rounded to `state_dtype` after every step."""

    def __init__(self, params: Any, lr: float, weight_decay: float, state_dtype: Any = None,
                 fused: bool = False, foreach: bool = False, **hp: Any) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, foreach=fused or foreach, **hp)
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        super().step()
        if self.state_dtype is not None:
            for st in self.state.values():
                st["sum"].copy_(st["sum"].to(self.state_dtype))


def reference(kind: str, state_dtype: Any = None, **over: Any) -> dict[str, torch.Tensor]:
    """The plain loop (tests/parity.py) with `kind`'s torch optimizer and HYPER."""
    hp = {**HYPER[kind], **over.pop("hp", {})}
    lr, wd = hp.pop("lr"), hp.pop("weight_decay")
    cls = RefAdagrad if kind == "Adagrad" else RefLion
    opt_cls = functools.partial(cls, state_dtype=state_dtype, **hp)
    return plain_loop(make_model, batches(), lr=lr, weight_decay=wd, gas=GAS, clip=CLIP,
                      opt_cls=opt_cls, **over)


@functools.lru_cache(maxsize=None)
def fp32_bound(kind: str) -> Fp32Bound:
    truth = reference(kind, master_dtype=torch.float64)
    if kind == "Adagrad":
        refs = {"torch for-loop Adagrad": reference(kind), "torch foreach Adagrad": reference(kind, fused=True),
                "batch split in 2": reference(kind, split=2)}
    else:
        refs = {"torch-ops Lion fp32": reference(kind), "batch split in 2": reference(kind, split=2)}
    return Fp32Bound(truth, refs)


# -- the engine -----------------------------------------------------------------------------------


def make_config(kind: str, tier: str = "cpu", nvme_path: Any = None, moments: str = "fp32",
                **hp: Any) -> Config:
    if tier == "nvme":
        os.makedirs(nvme_path, exist_ok=True)
    return Config(
        compute_device="cpu",
        optimizer=OptimizerConfig(type=kind, moments_dtype=moments, **{**HYPER[kind], **hp}),
        precision=PrecisionConfig(dtype="fp32"),
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        offload=OffloadConfig(param_tier="cpu", optimizer_tier=tier,
                              nvme_path=str(nvme_path) if tier == "nvme" else None,
                              pinned_budget_bytes=1 << 28),
    )


def engine_train(cfg: Any, rank: int = 0, world_size: int = 1, optimizer: Any = None,
                 steps: Any = None, engine: Any = None) -> Any:
    """Train on `batches()` (or the micro-batches `steps` selects); returns the engine."""
    if engine is None:
        m = make_model()
        engine = offload.initialize(m, cfg, optimizer=optimizer(m) if callable(optimizer) else optimizer)
    data = batches()
    for i in (range(len(data)) if steps is None else steps):
        x, y = data[i]
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()
    return engine


def trained(cfg: Any, rank: int = 0, world_size: int = 1, **kw: Any) -> dict[str, torch.Tensor]:
    engine = engine_train(cfg, rank, world_size, **kw)
    sd = engine.full_state_dict()
    engine.close()
    return sd


def _distributed(rank: int, world_size: int, kind: str, path: str) -> list[dict[str, torch.Tensor]]:
    out = [trained(make_config(kind), rank, world_size),
           trained(make_config(kind, "nvme", f"{path}/r{rank}"), rank, world_size)]
    return out if rank == 0 else []


# -- parity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Adagrad", "Lion"])
def test_engine_matches_the_plain_loop_at_world_sizes_1_and_2(kind, tmp_path):
    bound = fp32_bound(kind)
    bound.check(trained(make_config(kind)), f"{kind} engine, world size 1, host state")
    bound.check(trained(make_config(kind, "nvme", tmp_path / "w1")), f"{kind} engine, world size 1, NVMe state")
    host, nvme = run_distributed(_distributed, 2, kind, str(tmp_path))[0]
    bound.check(host, f"{kind} engine, world size 2, host state")
    bound.check(nvme, f"{kind} engine, world size 2, NVMe state")
    # Negative control: one hyperparameter the engine must honour, changed.
    wrong = {"Adagrad": {"lr_decay": 0.0}, "Lion": {"betas": (0.95, 0.99)}}[kind]
    worst, _, _ = bound.worst(trained(make_config(kind, **wrong)))
    assert worst > 100, f"{kind} with {wrong}: only {worst:.3g} x the bound from the truth"


def test_torch_adagrad_handed_to_initialize_gives_its_groups_and_hyperparameters():
    hp = {k: v for k, v in HYPER["Adagrad"].items()}

    def torch_groups(m: torch.nn.Module) -> torch.optim.Adagrad:
        return torch.optim.Adagrad(m.parameters(), **hp)

    # The config says Adam with other numbers: the torch optimizer's type and values rule.
    cfg = make_config("Adagrad")
    adam_cfg = dataclasses.replace(cfg, optimizer=OptimizerConfig(type="Adam", lr=1.0))
    engine = engine_train(adam_cfg, optimizer=torch_groups)
    assert engine.optimizer.kind == "Adagrad" and engine.optimizer.state_names == ("sum",)
    assert engine.optimizer.param_groups[0]["lr_decay"] == hp["lr_decay"]
    got = engine.full_state_dict()
    engine.close()
    want = trained(cfg)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # A flag the native kernel lacks: torch's own class runs it (the generic path).
    m = make_model()
    flagged = offload.initialize(m, cfg, optimizer=torch.optim.Adagrad(m.parameters(), maximize=True))
    assert flagged.optimizer.kind == "torch.optim.adagrad.Adagrad"
    flagged.close()


@pytest.mark.parametrize("kind", ["Adagrad", "Lion"])
def test_bf16_state_stays_on_the_trajectory_of_a_bf16_rounded_loop(kind):
    ref = reference(kind, state_dtype=torch.bfloat16)
    init = make_model().state_dict()
    bound = TrajectoryBound(ref, {"batch split in 2": reference(kind, state_dtype=torch.bfloat16, split=2),
                                  "fp32 state": reference(kind)}, init)
    engine = engine_train(make_config(kind, moments="bf16"))
    assert all(m.dtype == torch.bfloat16 for st in engine.states for m in st.moments.values())
    got = engine.full_state_dict()
    engine.close()
    bound.check(got, f"{kind} engine, bf16 state")


# -- checkpoints ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", ["Adagrad", "Lion"])
def test_checkpoint_resumes_bit_for_bit_and_refuses_another_type(kind, tier, tmp_path):
    half = STEPS * GAS // 2
    cfg = make_config(kind, tier, tmp_path / "swap")
    engine = engine_train(cfg, steps=range(half))
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="mid")
    at_mid = engine.full_state_dict()
    engine_train(cfg, steps=range(half, 2 * half), engine=engine)
    straight = engine.full_state_dict()
    engine.close()

    again = offload.initialize(make_model(), make_config(kind, tier, tmp_path / "swap2"))
    again.load_checkpoint(str(tmp_path / "ckpt"), tag="mid")
    engine_train(cfg, steps=range(half, 2 * half), engine=again)
    resumed = again.full_state_dict()
    again.close()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    # Consolidation reads the masters whatever the optimizer's state is.
    from safetensors.torch import load_file

    from offload.checkpoint import consolidate
    files = consolidate(str(tmp_path / "ckpt"), str(tmp_path / "full"), tag="mid")
    full = {}
    for f in files:
        if f.endswith(".safetensors"):
            full.update(load_file(f))
    assert all(torch.equal(full[k], at_mid[k]) for k in full) and full

    other = "Lion" if kind == "Adagrad" else "Adagrad"
    mismatch = offload.initialize(make_model(), make_config(other))
    with pytest.raises(ValueError, match=f"state of a {kind} optimizer.*this engine runs {other}"):
        mismatch.load_checkpoint(str(tmp_path / "ckpt"), tag="mid")
    mismatch.close()


def test_adagrad_state_starts_at_initial_accumulator_value_and_is_named_sum():
    engine = offload.initialize(make_model(), make_config("Adagrad"))
    with engine.optimizer.unit_state(engine.units[-1].index) as s:
        assert set(s) == {"master", "sum", "slot_steps"}
        assert torch.all(s["sum"] == HYPER["Adagrad"]["initial_accumulator_value"])
    engine.close()


# -- DeepSpeed configs ----------------------------------------------------------------------------


def _ds(optimizer: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "zero_optimization": {"stage": 3}, "optimizer": optimizer}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["Adagrad", "Lion"])
def test_deepspeed_config_trains_lion_and_adagrad(kind):
    params = {k: v for k, v in HYPER[kind].items() if k not in ("lr_decay", "initial_accumulator_value")}
    cfg = Config.from_deepspeed(_ds({"type": kind.lower() if kind == "Lion" else kind, "params": params}))
    assert cfg.optimizer.type == kind
    ours = make_config(kind, lr_decay=0.0, initial_accumulator_value=0.0) if kind == "Adagrad" else make_config(kind)
    got = trained(cfg)
    want = trained(ours)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("name,reason", [("Lamb", "trust ratio"), ("OneBitAdam", "compresses"),
                                         ("ZeroOneAdam", "compresses"), ("MuSGD", "shape")])
def test_deepspeed_optimizers_offload_cannot_run_are_refused_with_the_reason(name, reason):
    with pytest.raises(ValueError, match=f"'{name}' is not supported: .*{reason}"):
        Config.from_deepspeed(_ds({"type": name, "params": {}}))


# -- the planner -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,moments", [("Lion", "fp32"), ("Adagrad", "bf16")])
def test_planner_counts_one_state_tensor(kind, moments):
    from offload.plan import plan
    from tests.test_plan import check, cpu_machine

    cfg = make_config(kind, moments=moments)
    engine = engine_train(cfg, steps=range(GAS))
    with torch.device("meta"):
        meta = TinyGPT(n_layer=2)
    est = plan(meta, machine=cpu_machine(), config=cfg).estimate("cpu", "cpu")
    check(est.per_rank, engine.memory_bytes())
    adam_cfg = dataclasses.replace(cfg, optimizer=OptimizerConfig(moments_dtype=moments))
    adam = plan(meta, machine=cpu_machine(), config=adam_cfg).estimate("cpu", "cpu")
    trainable = sum(p.numel() for p in meta.parameters())
    saved = adam.per_rank.host - est.per_rank.host
    # One state tensor fewer: 4 B (fp32) or 2 B (bf16) per trainable parameter, plus the
    # alignment of the tensor that is gone.
    per = 4 if moments == "fp32" else 2
    assert trainable * per <= saved <= trainable * per + 2 * 4096 * len(engine.units)
    engine.close()


@pytest.mark.parametrize("kind", ["Adagrad", "Lion"])
def test_updates_during_backward_equal_updates_at_the_step(kind):
    # The optimizer-in-backward path (docs/prefetch.md) needs one micro-batch per step and
    # no clipping; it calls the same kernel per unit as the step does.
    base = dataclasses.replace(make_config(kind), gradient_accumulation_steps=1, gradient_clipping=0.0,
                               nonfinite_loss="off")  # the guard would update at step()
    inside = dataclasses.replace(base, prefetch=dataclasses.replace(base.prefetch, optimizer_in_backward=True))
    at_step = dataclasses.replace(base, prefetch=dataclasses.replace(base.prefetch, optimizer_in_backward=False))
    engine = engine_train(inside, steps=range(4))
    assert engine.step_stats()["optimizer_in_backward_units"] > 0
    got = engine.full_state_dict()
    engine.close()
    want = trained(at_step, steps=range(4))
    assert all(torch.equal(got[k], want[k]) for k in want)


def _state_total(engine: Any) -> float:
    total = 0.0
    for unit in engine.units:
        with engine.optimizer.unit_state(unit.index) as s:
            total += sum(float(s[n].double().sum()) for n in engine.optimizer.state_names)
    return total


def _save_at_world_size_2(rank: int, world_size: int, kind: str, path: str) -> Any:
    engine = engine_train(make_config(kind), rank, world_size, steps=range(GAS * 2))
    engine.save_checkpoint(path, tag="ws2")
    out = (engine.full_state_dict(), _state_total(engine))
    engine.close()
    return out


@pytest.mark.parametrize("kind", ["Adagrad", "Lion"])
def test_checkpoint_of_world_size_2_loads_at_world_size_1(kind, tmp_path):
    (sd, total0), (_, total1) = run_distributed(_save_at_world_size_2, 2, kind, str(tmp_path / "ckpt"))
    engine = offload.initialize(make_model(), make_config(kind))
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="ws2")
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    # Every state element of the two saved shards is in the one shard now.
    assert _state_total(engine) == pytest.approx(total0 + total1, rel=1e-6)
    engine.close()
