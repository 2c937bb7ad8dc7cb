"""Leaf modules (issue #29, item 4): a mixture-of-experts block whose ranks route tokens to
different experts.

By default every child of a ModuleList is a unit, so each expert is gathered on its own,
and only by the ranks that route a token to it: the ranks' collectives no longer match, and
the run desynchronises. A leaf module is one unit with everything under it, so every rank
gathers the whole block. There are three ways to name it:
- `leaf_modules` in offload's config;
- DeepSpeed's `zero_optimization.leaf_module.classes`;
- `offload.compat.deepspeed.utils.set_z3_leaf_modules(model, [cls])`.

Trained at world size 2 with different experts per rank, the leaf-module model equals plain
PyTorch within the suite's measured fp32 bound.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import offload
from offload.compat.deepspeed import utils as ds_utils
from offload.config import Config, load_config
from offload.units.partition import plan_units
from tests.conftest import run_distributed
from tests.parity import Fp32Bound
from tests.test_reused_units import fp32_bound, random_batches, train_engine
from tests.test_engine import make_config

D, EXPERTS, STEPS = 8, 4, 5


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class MoE(nn.Module):
    """Top-1 routing; an expert no token of this batch picked is not called at all."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def routes(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x).argmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), -1)
        top = gates.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = top == e
            if sel.any():
                out = out.index_put((sel.nonzero().squeeze(1),), gates[sel, e : e + 1] * expert(x[sel]))
        return x + out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = (t.to(self.inp.weight.dtype) for t in (x, y))
        return torch.nn.functional.mse_loss(self.moe(torch.tanh(self.inp(x))), y)


def model() -> nn.Module:
    torch.manual_seed(0)
    return MoEModel()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_batches(seed=3, steps=STEPS, d=D)


def bound() -> Fp32Bound:
    return fp32_bound(model, batches)


def test_a_leaf_is_one_unit_whatever_the_policy_says_of_its_children():
    names = lambda plans: [p.name for p in plans]  # noqa: E731
    assert names(plan_units(model())) == ["", "moe.experts.0", "moe.experts.1", "moe.experts.2", "moe.experts.3"]
    assert names(plan_units(model(), leaf_modules=["MoE"])) == ["", "moe"]
    assert names(plan_units(model(), leaf_modules=[f"{MoE.__module__}.MoE"])) == ["", "moe"]
    marked = model()
    assert ds_utils.set_z3_leaf_modules(marked, [MoE]) == [marked.moe]
    assert ds_utils.z3_leaf_module(marked.moe) and ds_utils.get_z3_leaf_modules(marked) == [marked.moe]
    assert names(plan_units(marked)) == ["", "moe"]
    ds_utils.unset_z3_leaf_modules(marked, ["MoE"])
    assert len(plan_units(marked)) == 5
    with pytest.raises(ValueError, match="leaf_modules names .'Router'.*module classes present"):
        plan_units(model(), leaf_modules=["Router"])
    with pytest.raises(ValueError, match="no module of"):
        ds_utils.set_z3_leaf_modules(model(), ["Router"])


def test_deepspeed_configs_name_leaf_modules_and_units():
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["MoE"]}},
          "unit_modules": ["Expert"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(ds)
    assert cfg.leaf_modules == ("MoE",) and cfg.unit_modules == ("Expert",)
    bad = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "leaf_module": {"names": ["moe"]}}}
    with pytest.raises(Exception, match="leaf_module.names.*by class"):
        load_config(bad)
    assert Config.from_dict({"leaf_modules": ["MoE"]}).leaf_modules == ("MoE",)


def _rank_routes_differ() -> bool:
    m = model()
    with torch.no_grad():
        for x, _ in batches():
            h = torch.tanh(m.inp(x))
            r0, r1 = set(m.moe.routes(h[:4]).tolist()), set(m.moe.routes(h[4:]).tolist())
            if r0 != r1:
                return True
    return False


def train(rank: int, world_size: int, how: str) -> dict:
    m = model()
    cfg = make_config()
    if how == "config":
        cfg = dataclasses.replace(cfg, leaf_modules=("MoE",))
    else:
        ds_utils.set_z3_leaf_modules(m, [MoE])
    return train_engine(offload.initialize(m, cfg), rank, world_size, batches())


@pytest.mark.parametrize("how", ["config", "set_z3_leaf_modules"])
def test_ranks_routing_to_different_experts_train_as_plain_pytorch(how):
    assert _rank_routes_differ()  # the case this test is about: ranks pick different experts
    out = run_distributed(train, 2, how)
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])
    bound().check(out[0], f"MoE leaf module ws2 ({how})")


# -- transformers' Mixtral: experts as one module of 3-D weights, inside each decoder layer ------


def mixtral() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    cfg._experts_implementation = "eager"  # a loop over experts: runs in float64 too (the truth)
    return tf.MixtralForCausalLM(cfg)


class MixtralLoss(nn.Module):
    """The plain loop's model(x, y): the causal LM loss of x, in float64 for the truth
    (HF's own loss casts logits to float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = mixtral()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.lm.dtype != torch.float64:
            return self.lm(input_ids=x, labels=x).loss
        logits = self.lm(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def mixtral_batches():
    from tests.conftest import gpt_batches

    return gpt_batches(3, batch=4, seq=8, vocab=64)


def mixtral_bound() -> Fp32Bound:
    return fp32_bound(MixtralLoss, mixtral_batches)


def train_mixtral(rank: int, world_size: int) -> dict:
    engine = offload.initialize(mixtral(), make_config())
    assert [u.name for u in engine.units] == ["", "model.layers.0", "model.layers.1"]
    for x, _ in mixtral_batches():
        n = x.shape[0] // world_size
        ids = x[rank * n:(rank + 1) * n]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    sd = {"lm." + k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return sd


def test_mixtral_trains_as_plain_pytorch_at_world_size_2():
    """Its experts sit inside each decoder layer's unit: every rank gathers them all,
    whatever it routes (no leaf module needed; this keeps it so)."""
    pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")
    out = run_distributed(train_mixtral, 2)
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])
    mixtral_bound().check(out[0], "Mixtral ws2")


# -- the model itself the leaf: DeepSpeed's TestSetZ3LeafModule, routing by rank --------------


class ChooseByRank(nn.Module):
    """DeepSpeed's ChooseModuleByRankModel (tanh for its ReLU: no kink for the fp32 bound):
    each rank runs one of two layers, picked by its rank."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linears = nn.ModuleList([nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)])

    def route(self) -> int:
        return torch.distributed.get_rank() % 2 if torch.distributed.is_initialized() else 0

    def half(self, x: torch.Tensor, y: torch.Tensor, r: int) -> torch.Tensor:
        x = x.to(self.linears[0].weight.dtype)
        return nn.functional.cross_entropy(torch.tanh(self.linears[r](x)), y)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.half(x, y, self.route())


class EveryRank(ChooseByRank):
    """The plain PyTorch reference of `ranks` ranks averaging gradients: rank r's slice of
    the batch through layer r % 2, the mean of the ranks' losses."""

    ranks = 2

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n = x.shape[0] // self.ranks
        return sum(self.half(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n], r % 2) for r in range(self.ranks)) / self.ranks


class FourRanks(EveryRank):
    ranks = 4


def by_rank_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g)) for _ in range(3)]


def _by_rank(rank: int, world_size: int, how: str, nonfinite: str, worker: str = "auto") -> dict:
    import offload.compat.deepspeed as deepspeed

    m = ChooseByRank()
    dotted = f"{ChooseByRank.__module__}.{ChooseByRank.__qualname__}"
    if how == "deepspeed":
        conf = {"train_micro_batch_size_per_gpu": 8 // world_size, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": 3, "leaf_module": {"classes": [dotted]}}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=conf)
        assert engine.config.nonfinite_loss == nonfinite  # fp32: the guard's default
    else:
        cfg = dataclasses.replace(make_config(), optimizer=dataclasses.replace(make_config().optimizer, lr=1e-2),
                                  nonfinite_loss=nonfinite, leaf_modules=(dotted,) if how == "config" else ())
        cfg = dataclasses.replace(cfg, prefetch=dataclasses.replace(cfg.prefetch, optimizer_worker=worker))
        engine = offload.initialize(m, cfg)
    assert [u.name for u in engine.units] == ([""] if how != "none" else ["", "linears.0", "linears.1"])
    n = 8 // world_size
    for x, y in by_rank_batches():
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])[1])
        engine.step()
    sd = engine.full_state_dict()
    engine.close()
    return sd


def by_rank_reference(world_size: int = 2, **kw) -> dict:
    from tests.parity import plain_loop

    return plain_loop(EveryRank if world_size == 2 else FourRanks, by_rank_batches(), lr=1e-2,
                      weight_decay=make_config().optimizer.weight_decay, **kw)


@pytest.mark.parametrize("world_size,how,nonfinite", [(2, "deepspeed", "skip"), (2, "config", "off"),
                                                      (4, "deepspeed", "skip")])
def test_the_model_class_as_its_own_leaf_trains_per_rank_routing_as_plain_pytorch(world_size, how, nonfinite):
    bound = Fp32Bound.measure(lambda **kw: by_rank_reference(world_size, **kw))
    out = run_distributed(_by_rank, world_size, how, nonfinite)
    bound.check(out[0], f"per-rank routing at world size {world_size}, the model a leaf ({how}, "
                f"nonfinite_loss {nonfinite})")


@pytest.mark.parametrize("nonfinite,worker", [("off", "auto"), ("skip", "auto"), ("off", "on")])
def test_ranks_that_reduce_different_units_fail_naming_leaf_modules(nonfinite, worker):
    """Without a leaf, rank 0 reduces linears.0 and rank 1 linears.1: same shapes, so the
    collectives pair silently; caught before any update (in backward, or at step(); on the
    optimizer worker, which reads the ranks' agreement, before the unit's update)."""
    with pytest.raises(RuntimeError, match="ran different submodules.*leaf_modules"):
        run_distributed(_by_rank, 2, "none", nonfinite, worker)
