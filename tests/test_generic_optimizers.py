"""Any elementwise torch optimizer handed to `initialize` runs on the shards (the generic
path, offload/optim/generic.py): SGD with momentum, RMSprop, Adam with amsgrad.

- through the engine against the same torch optimizer in a plain loop: world sizes 1 and 2,
  state in host memory and on NVMe, gradient accumulation and clipping, fp32; bounds
  measured as tests/parity.py does (a float64 truth; fp32 references: torch's for-loop and
  foreach implementations, the batch split in two) and a negative control (another momentum)
  landing far outside;
- an LR schedule over the engine's optimizer follows torch's; bf16 state stays on the
  trajectory of a loop whose state is rounded to bf16 after every step;
- checkpoints resume bit for bit (host and NVMe);
- optimizers that need a parameter whole are refused at `initialize`, each with its reason.
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
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.parity import Fp32Bound, TrajectoryBound, plain_loop

STEPS, GAS, CLIP = 8, 2, 0.05
LR, WD = 2e-2, 0.01
CASES = {
    "SGD": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "RMSprop": (torch.optim.RMSprop, {"momentum": 0.5, "centered": True, "alpha": 0.9}),
    "Adam-amsgrad": (torch.optim.Adam, {"amsgrad": True, "betas": (0.8, 0.9)}),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(n_layer=2)


def batches():
    return gpt_batches(STEPS * GAS)


class _Rounded:
    """Wraps a torch optimizer class for the plain loop: `fused` asks for its foreach
    implementation (the second fp32 reference); `state_dtype` rounds every state tensor
    after each step, as a store keeping them in that dtype does."""

    def __init__(self, cls: type, hp: dict, state_dtype: Any = None) -> None:
        self.cls, self.hp, self.state_dtype = cls, hp, state_dtype

    def __call__(self, params: Any, lr: float, weight_decay: float, fused: bool = False,
                 foreach: bool = False) -> torch.optim.Optimizer:
        opt = self.cls(params, lr=lr, weight_decay=weight_decay, foreach=fused or foreach, **self.hp)
        if self.state_dtype is not None:
            original, dtype = opt.step, self.state_dtype

            def step(closure: Any = None) -> Any:
                out = original()
                for st in opt.state.values():
                    for v in st.values():
                        if torch.is_tensor(v) and v.numel() > 1:
                            v.copy_(v.to(dtype))
                return out

            opt.step = step
        return opt


def reference(case: str, state_dtype: Any = None, hp: Any = None, **over: Any) -> dict[str, torch.Tensor]:
    cls, base = CASES[case]
    return plain_loop(make_model, batches(), lr=LR, weight_decay=WD, gas=GAS, clip=CLIP,
                      opt_cls=_Rounded(cls, {**base, **(hp or {})}, state_dtype), **over)


@functools.lru_cache(maxsize=None)
def fp32_bound(case: str) -> Fp32Bound:
    refs = {"torch for-loop": reference(case), "torch foreach": reference(case, fused=True),
            "batch split in 2": reference(case, split=2)}
    return Fp32Bound(reference(case, master_dtype=torch.float64), refs)


def make_config(tier: str = "cpu", nvme_path: Any = None, moments: str = "fp32") -> Config:
    if tier == "nvme":
        os.makedirs(nvme_path, exist_ok=True)
    return Config(
        compute_device="cpu",
        optimizer=OptimizerConfig(moments_dtype=moments),  # the torch optimizer's type rules
        precision=PrecisionConfig(dtype="fp32"),
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        offload=OffloadConfig(param_tier="cpu", optimizer_tier=tier,
                              nvme_path=str(nvme_path) if tier == "nvme" else None,
                              pinned_budget_bytes=1 << 28),
    )


def torch_optimizer(case: str, **hp: Any):
    cls, base = CASES[case]
    return lambda m: cls(m.parameters(), lr=LR, weight_decay=WD, **{**base, **hp})


def engine_train(cfg: Any, case: str, rank: int = 0, world_size: int = 1, steps: Any = None,
                 engine: Any = None, scheduler: Any = None, **hp: Any) -> Any:
    if engine is None:
        m = make_model()
        engine = offload.initialize(m, cfg, optimizer=torch_optimizer(case, **hp)(m),
                                    lr_scheduler=scheduler)
    data = batches()
    for i in (range(len(data)) if steps is None else steps):
        x, y = data[i]
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()
    return engine


def trained(cfg: Any, case: str, rank: int = 0, world_size: int = 1, **kw: Any) -> dict[str, torch.Tensor]:
    engine = engine_train(cfg, case, rank, world_size, **kw)
    sd = engine.full_state_dict()
    engine.close()
    return sd


def _distributed(rank: int, world_size: int, case: str, path: str) -> list:
    out = [trained(make_config(), case, rank, world_size),
           trained(make_config("nvme", f"{path}/r{rank}"), case, rank, world_size)]
    return out if rank == 0 else []


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_the_torch_optimizer_at_world_sizes_1_and_2(case, tmp_path):
    bound = fp32_bound(case)
    engine = engine_train(make_config(), case)
    assert engine.optimizer.kind.startswith("torch.optim.")  # the generic path ran it
    bound.check(engine.full_state_dict(), f"{case} engine, world size 1, host state")
    engine.close()
    bound.check(trained(make_config("nvme", tmp_path / "w1"), case), f"{case} engine, ws 1, NVMe state")
    host, nvme = run_distributed(_distributed, 2, case, str(tmp_path))[0]
    bound.check(host, f"{case} engine, world size 2, host state")
    bound.check(nvme, f"{case} engine, world size 2, NVMe state")
    # Negative control: a hyperparameter the engine must honour, changed.
    wrong = {"SGD": {"momentum": 0.5}, "RMSprop": {"alpha": 0.99}, "Adam-amsgrad": {"betas": (0.9, 0.9)}}[case]
    worst, _, _ = bound.worst(trained(make_config(), case, **wrong))
    assert worst > 100, f"{case} with {wrong}: only {worst:.3g} x the bound from the truth"


def test_state_names_are_the_optimizers_own_and_an_lr_schedule_follows_torch():
    engine = engine_train(make_config(), "Adam-amsgrad", steps=range(2))
    assert engine.optimizer.state_names == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    engine.close()
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)  # noqa: E731
    bound = Fp32Bound(reference("SGD", scheduler=sched, master_dtype=torch.float64),
                      {"torch for-loop": reference("SGD", scheduler=sched),
                       "torch foreach": reference("SGD", scheduler=sched, fused=True),
                       "batch split in 2": reference("SGD", scheduler=sched, split=2)})
    bound.check(trained(make_config(), "SGD", scheduler=sched), "SGD engine with StepLR")
    # Negative control: the same run without the schedule is far from the scheduled truth.
    worst, _, _ = bound.worst(trained(make_config(), "SGD"))
    assert worst > 100, f"without the schedule only {worst:.3g} x the bound"


def test_bf16_state_stays_on_the_trajectory_of_a_bf16_rounded_loop():
    ref = reference("SGD", state_dtype=torch.bfloat16)
    bound = TrajectoryBound(ref, {"batch split in 2": reference("SGD", state_dtype=torch.bfloat16, split=2),
                                  "fp32 state": reference("SGD")}, make_model().state_dict())
    engine = engine_train(make_config(moments="bf16"), "SGD")
    assert all(m.dtype == torch.bfloat16 for st in engine.states for m in (st.moments or {}).values())
    got = engine.full_state_dict()
    engine.close()
    bound.check(got, "SGD engine, bf16 momentum")


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_checkpoint_resumes_bit_for_bit(tier, tmp_path):
    half = STEPS * GAS // 2
    cfg = make_config(tier, tmp_path / "swap")
    engine = engine_train(cfg, "RMSprop", steps=range(half))
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="mid")
    engine_train(cfg, "RMSprop", steps=range(half, 2 * half), engine=engine)
    straight = engine.full_state_dict()
    engine.close()
    m = make_model()
    again = offload.initialize(m, make_config(tier, tmp_path / "swap2"),
                               optimizer=torch_optimizer("RMSprop")(m))
    again.load_checkpoint(str(tmp_path / "ckpt"), tag="mid")
    engine_train(cfg, "RMSprop", steps=range(half, 2 * half), engine=again)
    resumed = again.full_state_dict()
    again.close()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("make,reason", [
    (lambda p: torch.optim.Adafactor(p, lr=1e-2), "is not elementwise"),
    (lambda p: torch.optim.LBFGS(p), "cannot step a flat tensor"),
    (lambda p: torch.optim.NAdam(p, lr=1e-3), "keeps state 'mu_product' of shape ()"),
])
def test_optimizers_that_need_a_whole_parameter_are_refused_with_the_reason(make, reason):
    m = make_model()
    with pytest.raises(TypeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        offload.initialize(m, make_config(), optimizer=make(m.parameters()))


def test_config_and_deepspeed_sgd_run_torch_sgd_on_the_shards():
    """optimizer.type 'SGD' (offload's config, and DeepSpeed's, which builds torch.optim.SGD
    from its params) trains exactly as torch.optim.SGD handed to initialize."""
    import warnings

    hp = {"lr": LR, "momentum": 0.9, "nesterov": True, "weight_decay": WD}
    cfg = make_config()
    want = trained(cfg, "SGD")  # torch.optim.SGD(momentum 0.9, nesterov) handed over
    own = dataclasses.replace(cfg, optimizer=OptimizerConfig(type="SGD", **hp))
    got = engine_train(own, "SGD", engine=offload.initialize(make_model(), own))
    assert got.optimizer.state_names == ("momentum_buffer",)
    sd = got.full_state_dict()
    got.close()
    assert all(torch.equal(sd[k], want[k]) for k in want)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
          "gradient_clipping": CLIP, "optimizer": {"type": "SGD", "params": hp},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        translated = Config.from_deepspeed(ds)
    assert translated.optimizer.type == "SGD" and translated.optimizer.momentum == 0.9
    translated = dataclasses.replace(translated, compute_device="cpu", precision=PrecisionConfig(dtype="fp32"))
    sd = trained(translated, "SGD", engine=offload.initialize(make_model(), translated))
    assert all(torch.equal(sd[k], want[k]) for k in want)


def test_a_generic_kind_is_the_engines_own_record_not_a_module_table_entry():
    """Issue #32: a generic kind used to be written into module tables (kinds.STATE_NAMES,
    HYPERPARAMS, generic.GENERIC) at run time, so one engine's optimizer outlived it and
    changed what the next engine's lookups found. Now it is a record built for the engine:
    the native registry is read-only and unchanged, and two engines with different generic
    classes each keep their own."""
    from offload.optim import generic, kinds

    before = dict(kinds.REGISTRY)
    with pytest.raises(TypeError):
        kinds.REGISTRY["SGD"] = kinds.REGISTRY["Adam"]  # type: ignore[index]
    engines = []
    for cls, hp in (CASES["SGD"], CASES["RMSprop"]):
        model = make_model()
        engines.append(offload.initialize(model, make_config(), optimizer=cls(model.parameters(), lr=LR, **hp)))
    sgd, rms = (e.optimizer.record for e in engines)
    assert sgd.generic and rms.generic and sgd.torch_class is torch.optim.SGD and rms.torch_class is torch.optim.RMSprop
    assert sgd.state_names == ("momentum_buffer",) and rms.state_names == ("square_avg", "momentum_buffer", "grad_avg")
    assert dict(kinds.REGISTRY) == before and not hasattr(generic, "GENERIC")
    for e in engines:
        e.close()
