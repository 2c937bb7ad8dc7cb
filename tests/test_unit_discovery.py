"""Units wherever the blocks are ([Note: blocks wherever they are] in offload/units/partition.py).

torchtitan keeps its Llama's blocks in an `nn.ModuleDict` ("0", "1", ...), other code in an
`nn.Sequential` or as attributes (block0, block1); only an `nn.ModuleList`'s children were
units, so such a model was one unit and nothing was paged per block. Pinned here:
- the policy: repeated blocks of the model's own class in a ModuleDict, a Sequential or any
  module are units; torch.nn's own classes (a Sequential MLP's Linears) are not; a stack of
  blocks (two encoders of one class, each with its blocks in a ModuleList) leaves the blocks
  inside as the units; a ModuleList's children are units as before;
- the initialize line says what was chosen;
- a torchtitan-style Llama (ModuleDict) and a Sequential model train through the engine,
  one unit per block, within the suite's measured fp32 bound of plain PyTorch at world
  sizes 1 and 2 (tests/parity.py); the negative control (half of every batch) lands far
  outside.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.units.partition import describe_units, plan_units
from tests.conftest import run_distributed
from tests.parity import Fp32Bound, plain_loop
from tests.test_engine import LR, WD, make_config
from tests.test_reused_units import train_engine as train_shares

DIM, VOCAB, SEQ, LAYERS, STEPS = 16, 32, 8, 3, 4


class RMSNorm(nn.Module):
    """The model's own norm class (torchtitan's older code): two per block, siblings."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, 2, DIM // 2).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, DIM))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False), \
            nn.Linear(DIM, 2 * DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama 3 layout: the blocks in an nn.ModuleDict keyed "0", "1", ..."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return F.cross_entropy(self.output(self.norm(h)).flatten(0, 1).float(), labels.flatten())


class SequentialLM(nn.Module):
    """The blocks in an nn.Sequential, between an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(VOCAB, DIM), *(TransformerBlock() for _ in range(LAYERS)),
                                  RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(tokens).flatten(0, 1).float(), labels.flatten())


def titan() -> nn.Module:
    torch.manual_seed(0)
    return TitanLlama()


def sequential() -> nn.Module:
    torch.manual_seed(0)
    return SequentialLM()


MODELS = {"titan": titan, "sequential": sequential}


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def names(model: nn.Module) -> list[str]:
    return [p.name for p in plan_units(model)]


# -- the policy -----------------------------------------------------------------------------------


def test_blocks_in_a_module_dict_a_sequential_or_attributes_are_units() -> None:
    assert names(titan()) == ["", "layers.0", "layers.1", "layers.2"]
    assert names(sequential()) == ["", "body.1", "body.2", "body.3"]

    class Attributes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block0, self.block1, self.head = TransformerBlock(), TransformerBlock(), nn.Linear(DIM, DIM)

    assert names(Attributes()) == ["", "block0", "block1"]
    plans = plan_units(titan())
    assert describe_units(plans) == "3 TransformerBlock in layers (repeated in an nn.ModuleDict)"
    assert describe_units(plan_units(sequential())) == "3 TransformerBlock in body (repeated in an nn.Sequential)"


def test_torch_nn_siblings_and_single_children_are_not_units() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert names(mlp) == [""]
    assert describe_units(plan_units(mlp)).startswith("the model is one unit")
    assert names(TransformerBlock()) == [""]  # its two RMSNorms (no modules inside): parts, not blocks
    assert names(Attention()) == [""]  # wq, wk, wv, wo: torch.nn.Linear


def test_a_stack_of_blocks_leaves_the_blocks_inside_as_units() -> None:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(TransformerBlock() for _ in range(2))

    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.decoder = Stack(), Stack()

    assert names(EncoderDecoder()) == ["", "encoder.blocks.0", "encoder.blocks.1", "decoder.blocks.0",
                                       "decoder.blocks.1"]

    class DictStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(2)})

    class TwoDictStacks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = DictStack(), DictStack()

    assert names(TwoDictStacks()) == ["", "a.layers.0", "a.layers.1", "b.layers.0", "b.layers.1"]


def test_a_module_list_and_unit_modules_choose_as_before() -> None:
    lst = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])  # any class, as before
    holder = nn.Module()
    holder.items = lst
    assert names(holder) == ["", "items.0", "items.1"]
    plans = plan_units(titan(), unit_modules=["Attention"])
    assert [p.name for p in plans] == ["", "layers.0.attention", "layers.1.attention", "layers.2.attention"]
    assert describe_units(plans) == "3 Attention in 3 modules (unit_modules)"


def test_the_initialize_line_says_what_was_chosen(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="offload"):
        engine = offload.initialize(titan(), make_config())
    engine.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("initialized"))
    assert "4 units (3 TransformerBlock in layers (repeated in an nn.ModuleDict))" in line, line


# -- parity: trained per block, as plain PyTorch -------------------------------------------------


def train_engine(kind: str, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    engine = offload.initialize(MODELS[kind](), make_config())
    assert len(engine.units) == 1 + LAYERS
    return train_shares(engine, rank, world_size, token_batches())


def _ws2(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: train_engine(kind, rank, world_size) for kind in MODELS}


@pytest.fixture(scope="module")
def bounds() -> dict[str, Fp32Bound]:
    return {kind: Fp32Bound.measure(lambda make=make, **o: plain_loop(make, token_batches(), lr=LR,
                                                                       weight_decay=WD, **o))
            for kind, make in MODELS.items()}


@pytest.mark.parametrize("kind", list(MODELS))
def test_trained_per_block_within_the_fp32_bound_world_size_1(kind: str, bounds) -> None:
    bounds[kind].check(train_engine(kind, 0, 1), f"{kind} model, a unit per block, ws1")


def test_trained_per_block_within_the_fp32_bound_world_size_2(bounds) -> None:
    for rank, runs in enumerate(run_distributed(_ws2, 2)):
        for kind, got in runs.items():
            bounds[kind].check(got, f"{kind} model, a unit per block, ws2 rank {rank}")


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_negative_control_lands_far_outside(kind: str, bounds) -> None:
    half = [(x[:2], y[:2]) for x, y in token_batches()]
    worst, _, _ = bounds[kind].worst(plain_loop(MODELS[kind], half, lr=LR, weight_decay=WD))
    assert worst > 100, f"{kind}: the control is only {worst:.3g}x the bound"
