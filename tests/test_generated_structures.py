"""Generated model structures (issue #29): random models from a small grammar, each trained
by the engine and judged against plain PyTorch by the suite's measured fp32 bound
([Note: derived tolerances] in tests/parity.py).

The grammar (`ModelSpec`): an `nn.ModuleList` of 1-4 blocks (each one unit, the default
policy), and a forward that is a list of calls:
- a block is called any number of times, at any depth: on the running activation, on the
  raw input (which needs no grad), or under `torch.no_grad()`; a call may add a second block
  beside it (a branch: the two summed), keep a residual or not (a call without one cuts
  what came before out of the graph: units called whose outputs reach no loss);
- blocks no call names are unused;
- a block may be frozen in part (its weight) or whole (`requires_grad=False`);
- a block returns a tensor, `(out, its bias)` (a parameter returned out of its unit, added
  right away or at the end of the forward), `{"out": ..., "aux": None}` or `(out, None)`;
- a block's weight may be tied to an earlier block's (`b.lin.weight = a.lin.weight`: the
  shared weight belongs to no unit's subtree alone, so it goes to the root);
- a parameter on the root outside every block (a scale, applied first or last);
- a mixture-of-experts block (top-1 routing: ranks route their halves of a batch to
  different experts), made one unit by `leaf_modules`;
- after training, a forward under `torch.no_grad()` that no backward follows.
A case (`Case`) is a spec with a mode: the update in backward (gas 1, no clipping) or at
`step()` (gas 2, or clipping at 0.5), and a tier (host, or NVMe for both tiers).

World size 1 (host tier) trains in this process, one case per example. World size 1 with
NVMe, and world size 2, train in spawned processes (`run_distributed`), a list of cases per
example, so that a crash (a segfault) fails the example instead of pytest, and says which
case it was training. Each case is checked against its own measured bound (float64 truth
and three fp32 references of the plain loop).

Profiles (tests/conftest.py): `ci`, the default, is derandomized (the same examples on every
run, about a minute on 2 cores); `long` draws fresh examples, many more (6-7 minutes):
    OFFLOAD_HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_generated_structures.py
A failure prints the case as Python (`Case(...)`) and as the forward it generated, and the
tensors outside their bound (or the rank's traceback); `repro(case)` replays one case.

Run on 9275980 (before #29's items 1 and 2; MoE off, `leaf_modules` did not exist yet), the
`ci` profile failed all three training tests; the `long` profile shrank them to:
- one Linear block called twice, the first call on the raw input: world size 1 raises
  "unit blocks.0 received gradients after its optimizer update ran during backward";
  world size 2 with gas 2 trains wrong weights (27 000x the bound); world size 2 with gas 1
  raises the same, or segfaults (seed 2);
- one block returning (out, its bias), the bias added after it: a segfault at world size 2
  and at world size 1 on NVMe (gas 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
from typing import Optional

import torch
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st
from torch import nn

import offload
from offload.config import OffloadConfig
from tests.conftest import run_distributed
from tests.parity import Fp32Bound, plain_loop
from tests.test_engine import LR, WD, make_config

D = 8
BATCH = 8
STEPS = 4
WITH_MOE = True
"""Draw mixture-of-experts blocks (they need `leaf_modules`, which older engines lack)."""

PROFILE = os.environ.get("OFFLOAD_HYPOTHESIS_PROFILE", "ci")
# examples per test: (world size 1 host in process, world size 1 NVMe spawned, world size 2 spawned)
EXAMPLES = {"ci": (150, 2, 5), "long": (800, 20, 30)}[PROFILE]
CASES_PER_SPAWN = 4
# A spawned example takes seconds: under `ci` a failing one is reported as drawn (its message
# names the failing case) instead of shrunk for minutes; `long` shrinks it. Neither runs the
# explain phase for them (minutes of reruns).
SPAWNED_PHASES = tuple(p for p in Phase if p != Phase.explain and (PROFILE != "ci" or p != Phase.shrink))


# -- the grammar -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    kind: str = "tensor"  # "tensor" | "bias" (returns (out, bias)) | "dict" | "tuple_none" | "moe"
    frozen: str = "none"  # "none" | "weight" | "all"
    tie: Optional[int] = None  # lin.weight is blocks[tie].lin.weight (an earlier block)


@dataclasses.dataclass(frozen=True)
class CallSpec:
    block: int
    branch: Optional[int] = None  # a second block on the same input, summed with the first
    source: str = "h"  # "h" (the running activation) | "raw" (the input x: needs no grad) | "nograd"
    residual: bool = True  # h = tanh(h + z), else h = tanh(z)
    defer: bool = False  # a returned bias is added at the end of the forward, not right away


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    blocks: tuple[BlockSpec, ...] = (BlockSpec(),)
    calls: tuple[CallSpec, ...] = (CallSpec(0),)
    root: str = "none"  # a root parameter (a scale): "none" | "in" (first) | "out" (last)
    seed: int = 0  # of the weights and the batches


@dataclasses.dataclass(frozen=True)
class Case:
    model: ModelSpec = ModelSpec()
    gas: int = 1
    clip: float = 0.0
    tier: str = "cpu"  # "cpu" | "nvme"
    eval_after: bool = False  # a forward under no_grad after the last step, no backward after it


KINDS = ("tensor", "bias", "dict", "tuple_none") + (("moe",) if WITH_MOE else ())
MODES = ((1, 0.0), (2, 0.0), (1, 0.5))  # the update in backward; at step(): accumulation, clipping


def describe(case: Case) -> str:
    """The case as the model and forward it generates (for failure messages)."""
    m = case.model
    lines = [f"gas {case.gas}, clip {case.clip}, tier {case.tier}, seed {m.seed}"
             + (", a no_grad forward after training" if case.eval_after else "")]
    used = {c.block for c in m.calls} | {c.branch for c in m.calls if c.branch is not None}
    for i, b in enumerate(m.blocks):
        what = {"tensor": "Linear -> out", "bias": "Linear(bias=False) -> (out, its bias)",
                "dict": "Linear -> {'out': out, 'aux': None}", "tuple_none": "Linear -> (out, None)",
                "moe": "MoE (router + 2 experts, top-1; a leaf module)"}[b.kind]
        extra = [f"frozen: {b.frozen}"] if b.frozen != "none" else []
        if b.tie is not None:
            extra.append(f"lin.weight tied to blocks[{b.tie}]")
        if i not in used:
            extra.append("unused")
        lines.append(f"  blocks[{i}]: {what}" + (f" ({', '.join(extra)})" if extra else ""))
    if m.root != "none":
        lines.append(f"  root parameter: scale, applied {'first' if m.root == 'in' else 'last'}")
    lines.append("  forward:")
    if m.root == "in":
        lines.append("    h = x * scale")
    else:
        lines.append("    h = x")
    for c in m.calls:
        src = "x" if c.source == "raw" else "h"
        z = f"blocks[{c.block}]({src})" + (f" + blocks[{c.branch}]({src})" if c.branch is not None else "")
        if any(m.blocks[i].kind == "bias" for i in (c.block, c.branch) if i is not None):
            z += "  [bias " + ("kept for the end]" if c.defer else "added now]")
        pre = "with no_grad: " if c.source == "nograd" else ""
        lines.append(f"    {pre}h = tanh({'h + ' if c.residual else ''}{z})")
    if any(c.defer and m.blocks[i].kind == "bias" for c in m.calls for i in (c.block, c.branch) if i is not None):
        lines.append("    h = h + (the kept biases)")
    if m.root == "out":
        lines.append("    h = h * scale")
    lines.append("    loss = mse(h, y)")
    return "\n".join(lines)


# -- the model a spec builds -----------------------------------------------------------------


class TensorOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x)


class BiasOut(nn.Module):
    """Returns its bias beside its product (the bias leaves the unit as a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)
        self.bias = nn.Parameter(0.1 * torch.randn(D))

    def forward(self, x):
        return self.lin(x), self.bias


class DictOut(TensorOut):
    def forward(self, x):
        return {"out": self.lin(x), "aux": None}


class TupleNoneOut(TensorOut):
    def forward(self, x):
        return self.lin(x), None


class GenExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class GenMoE(nn.Module):
    """Top-1 routing over 2 experts; an expert no sample picked is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 2)  # the router
        self.experts = nn.ModuleList(GenExpert() for _ in range(2))

    def forward(self, x):
        gates = torch.softmax(self.lin(x), -1)
        top = gates.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = top == e
            if sel.any():
                out = out.index_put((sel.nonzero().squeeze(1),), gates[sel, e:e + 1] * expert(x[sel]))
        return out


BLOCKS = {"tensor": TensorOut, "bias": BiasOut, "dict": DictOut, "tuple_none": TupleNoneOut, "moe": GenMoE}


class Generated(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList(BLOCKS[b.kind]() for b in spec.blocks)
        if spec.root != "none":
            self.scale = nn.Parameter(1 + 0.1 * torch.randn(D))
        for b, module in zip(spec.blocks, self.blocks):
            if b.tie is not None:
                module.lin.weight = self.blocks[b.tie].lin.weight
        for b, module in zip(spec.blocks, self.blocks):
            if b.frozen == "all":
                module.requires_grad_(False)
            elif b.frozen == "weight":
                module.lin.weight.requires_grad_(False)

    def _call(self, i: int, inp: torch.Tensor, kept: list, defer: bool) -> torch.Tensor:
        out = self.blocks[i](inp)
        kind = self.spec.blocks[i].kind
        if kind == "bias":
            out, bias = out
            if defer:
                kept.append(bias)
            else:
                out = out + bias
        elif kind == "dict":
            assert out["aux"] is None
            out = out["out"]
        elif kind == "tuple_none":
            out, none = out
            assert none is None
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtype = next(self.parameters()).dtype  # float64 for the truth
        x, y = x.to(dtype), y.to(dtype)
        h = x * self.scale if self.spec.root == "in" else x
        kept: list = []
        for c in self.spec.calls:
            src = x if c.source == "raw" else h
            with torch.no_grad() if c.source == "nograd" else contextlib.nullcontext():
                z = self._call(c.block, src, kept, c.defer)
                if c.branch is not None:
                    z = z + self._call(c.branch, src, kept, c.defer)
            h = torch.tanh(h + z) if c.residual else torch.tanh(z)
        for bias in kept:
            h = h + bias
        if self.spec.root == "out":
            h = h * self.scale
        return nn.functional.mse_loss(h, y)


def build(spec: ModelSpec) -> nn.Module:
    torch.manual_seed(spec.seed)
    return Generated(spec)


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + seed)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)) for _ in range(STEPS)]


def trains_something(spec: ModelSpec) -> bool:
    """Whether the loss reaches a trainable parameter (else there is nothing to backward)."""
    x, y = batches(spec.seed)[0]
    return build(spec)(x, y).requires_grad


# -- strategies ------------------------------------------------------------------------------


@st.composite
def model_specs(draw) -> ModelSpec:
    n = draw(st.integers(1, 4))
    blocks = []
    for i in range(n):
        kind = draw(st.sampled_from(KINDS))
        frozen = draw(st.sampled_from(("none", "none", "none", "weight", "all")))
        tie = None
        tieable = [j for j in range(i) if blocks[j].kind != "moe"]
        if kind != "moe" and tieable:
            tie = draw(st.none() | st.sampled_from(tieable))
        blocks.append(BlockSpec(kind, frozen, tie))
    index = st.integers(0, n - 1)
    calls = draw(st.lists(st.builds(CallSpec, index, st.none() | index, st.sampled_from(("h", "raw", "nograd")),
                                    st.booleans(), st.booleans()), min_size=1, max_size=5))
    root = draw(st.sampled_from(("none", "in", "out")))
    seed = draw(st.integers(0, 3))
    return ModelSpec(tuple(blocks), tuple(calls), root, seed)


@st.composite
def cases(draw, tiers=("cpu",)) -> Case:
    model = draw(model_specs().filter(trains_something))
    gas, clip = draw(st.sampled_from(MODES))
    return Case(model, gas, clip, draw(st.sampled_from(tiers)), draw(st.booleans()))


# -- training --------------------------------------------------------------------------------


def case_config(case: Case, rank: int, path: str):
    cfg = make_config(gas=case.gas, clip=case.clip)
    if any(b.kind == "moe" for b in case.model.blocks):
        cfg = dataclasses.replace(cfg, leaf_modules=("GenMoE",))  # every rank gathers the whole block
    if case.tier == "nvme":
        os.makedirs(f"{path}/r{rank}", exist_ok=True)
        cfg = dataclasses.replace(cfg, offload=OffloadConfig(param_tier="nvme", optimizer_tier="nvme",
                                                             nvme_path=f"{path}/r{rank}", pinned_budget_bytes=1 << 22))
    return cfg


def train_case(case: Case, rank: int, world_size: int, path: str) -> dict:
    """The engine on this rank's share of every batch; the full state dict, closed."""
    engine = offload.initialize(build(case.model), case_config(case, rank, path))
    data = batches(case.model.seed)
    try:
        for x, y in data:
            n = x.shape[0] // world_size
            engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
            engine.step()
        if case.eval_after:
            with torch.no_grad():
                engine(*data[0])
        return {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    finally:
        engine.close()


def train_cases(rank: int, world_size: int, cases_: list, path: str) -> list:
    """Every case in turn (one spawned group); `progress-r<rank>` names the case under way,
    for a rank that dies without a traceback."""
    out = []
    for i, case in enumerate(cases_):
        with open(f"{path}/progress-r{rank}", "w") as f:
            f.write(str(i))
        try:
            out.append(train_case(case, rank, world_size, f"{path}/c{i}"))
        except Exception as e:
            raise RuntimeError(f"case {i} raised: {case!r}\n{describe(case)}") from e
    return out


@functools.lru_cache(maxsize=256)
def bound(spec: ModelSpec, gas: int, clip: float) -> Fp32Bound:
    make = functools.partial(build, spec)
    return Fp32Bound.measure(lambda **o: plain_loop(make, batches(spec.seed), lr=LR, weight_decay=WD, gas=gas,
                                                    clip=clip, **o))


def check(case: Case, got: dict, what: str) -> None:
    b = bound(case.model, case.gas, case.clip)
    try:
        b.check(got, what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{case!r}\n{describe(case)}") from None


class RankCrashed(RuntimeError):
    """A spawned rank died without a traceback (a signal: a segfault, an abort)."""


class RankRaised(RuntimeError):
    """A spawned rank raised (its traceback follows)."""


class RanksHung(TimeoutError):
    """The spawned ranks did not finish (collectives out of step?)."""


def run_spawned(cases_: list, world_size: int) -> list:
    """`train_cases` on `world_size` spawned ranks; a failure says which case each rank was
    training. The three ways to fail raise three types, so that hypothesis keeps them apart."""
    with tempfile.TemporaryDirectory() as path:
        try:
            return run_distributed(train_cases, world_size, cases_, path, timeout_s=150)
        except (RuntimeError, TimeoutError) as e:
            at: dict[int, list[int]] = {}
            for r in range(world_size):
                with contextlib.suppress(OSError, ValueError):
                    at.setdefault(int(open(f"{path}/progress-r{r}").read()), []).append(r)
            kind = (RanksHung if "did not finish within" in str(e) else RankCrashed if "terminated with signal" in str(e)
                    else RankRaised)
            where = [] if kind is RankRaised else [  # a traceback names its case itself
                f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} {'were' if len(ranks) > 1 else 'was'} "
                f"training case {i}: {cases_[i]!r}\n{describe(cases_[i])}" for i, ranks in sorted(at.items())]
            raise kind(f"world size {world_size}: {e}\n" + "\n".join(where)) from None


def repro(case: Case, world_size: int = 1) -> None:
    """Replay one case (e.g. pasted from a failure): train it and check it."""
    if world_size == 1 and case.tier == "cpu":
        with tempfile.TemporaryDirectory() as path:
            got = train_case(case, 0, 1, path)
    else:
        got = run_spawned([case], world_size)[0][0]  # rank 0's first case
    check(case, got, f"generated ws{world_size}")


# -- the tests -------------------------------------------------------------------------------


@settings(max_examples=EXAMPLES[0])
@given(case=cases())
def test_world_size_1(case):
    note(describe(case))
    with tempfile.TemporaryDirectory() as path:
        got = train_case(case, 0, 1, path)
    check(case, got, "generated ws1")


@settings(max_examples=EXAMPLES[1], phases=SPAWNED_PHASES)
@given(cases_=st.lists(cases(tiers=("nvme",)), min_size=1, max_size=CASES_PER_SPAWN))
def test_world_size_1_nvme(cases_):
    for i, (case, got) in enumerate(zip(cases_, run_spawned(cases_, 1)[0])):
        check(case, got, f"generated ws1 nvme (case {i})")


@settings(max_examples=EXAMPLES[2], phases=SPAWNED_PHASES)
@given(cases_=st.lists(cases(), min_size=1, max_size=CASES_PER_SPAWN))
def test_world_size_2(cases_):
    out = run_spawned(cases_, 2)
    for i, case in enumerate(cases_):
        r0, r1 = out[0][i], out[1][i]
        differ = [k for k in r0 if not torch.equal(r0[k], r1[k])]
        assert not differ, f"case {i}: the ranks' weights differ in {differ}\n{case!r}\n{describe(case)}"
        check(case, r0, f"generated ws2 (case {i})")


def test_a_dropped_call_lands_outside_the_bound():
    """The check can fail: a block called twice whose first call loses its gradient (what
    reducing a reused unit early did) is far outside the bound of the real model."""
    spec = ModelSpec((BlockSpec(), BlockSpec()), (CallSpec(0), CallSpec(1), CallSpec(0)))
    lossy = dataclasses.replace(spec, calls=(CallSpec(0, source="nograd"), CallSpec(1), CallSpec(0)))
    got = plain_loop(functools.partial(build, lossy), batches(0), lr=LR, weight_decay=WD)
    worst, _, _ = bound(spec, 1, 0.0).worst(got, "lossy")
    assert worst > 100, worst


def _used(m: ModelSpec) -> set[int]:
    return {i for c in m.calls for i in (c.block, c.branch) if i is not None}


def _uses(m: ModelSpec, kind: str) -> bool:
    return any(m.blocks[i].kind == kind for i in _used(m))


def _reused_on_untracked_input(m: ModelSpec) -> bool:
    """A block called more than once, one of its calls on an input that needs no grad (the
    raw input, anything under no_grad, or h before anything made it need one)."""
    def untracked(k: int, c: CallSpec) -> bool:
        return c.source != "h" or (k == 0 and m.root != "in")
    return any(sum(i in (c.block, c.branch) for c in m.calls) > 1
               and any(i in (c.block, c.branch) and untracked(k, c) for k, c in enumerate(m.calls))
               for i in range(len(m.blocks)))


ELEMENTS = {
    "a block called on an input that needs no grad, and again": _reused_on_untracked_input,
    "a call under no_grad": lambda m: any(c.source == "nograd" for c in m.calls),
    "a branch": lambda m: any(c.branch is not None for c in m.calls),
    "a call without a residual after others": lambda m: any(not c.residual for c in m.calls[1:]),
    "an unused block": lambda m: len(_used(m)) < len(m.blocks),
    "a frozen weight": lambda m: any(b.frozen == "weight" for b in m.blocks),
    "a frozen block": lambda m: any(b.frozen == "all" for b in m.blocks),
    "a bias returned and added right away": lambda m: any(
        not c.defer and m.blocks[c.block].kind == "bias" for c in m.calls),
    "a bias returned and added at the end": lambda m: any(
        c.defer and m.blocks[c.block].kind == "bias" for c in m.calls),
    "a dict output": lambda m: _uses(m, "dict"),
    "a (out, None) output": lambda m: _uses(m, "tuple_none"),
    "a tied weight, both blocks used": lambda m: any(
        b.tie is not None and {i, b.tie} <= _used(m) for i, b in enumerate(m.blocks)),
    "a root parameter first": lambda m: m.root == "in",
    "a root parameter last": lambda m: m.root == "out",
} | ({"a mixture of experts": lambda m: _uses(m, "moe")} if WITH_MOE else {})


def test_the_strategy_draws_every_element():
    """Every element of the grammar is drawn (a strategy that silently lost one would test
    nothing of it): 300 draws, no training."""
    seen: set[str] = set()

    @settings(max_examples=300, phases=[Phase.generate], database=None)
    @given(model_specs().filter(trains_something))
    def draw(m):
        seen.update(name for name, has in ELEMENTS.items() if has(m))

    draw()
    assert seen == set(ELEMENTS), f"never drawn: {sorted(set(ELEMENTS) - seen)}"


def test_every_element_at_once_trains_at_world_size_1():
    spec = ModelSpec(
        blocks=(BlockSpec("bias", "weight"), BlockSpec("dict", tie=0), BlockSpec("tuple_none", "all"),
                BlockSpec("moe" if WITH_MOE else "tensor"), BlockSpec()),
        calls=(CallSpec(0, 1, "raw", True, True), CallSpec(0, None, "nograd"), CallSpec(2, 3, "h", False),
               CallSpec(0)),
        root="in")
    m = build(spec)
    assert m.blocks[1].lin.weight is m.blocks[0].lin.weight and not m.blocks[0].lin.weight.requires_grad
    assert "blocks[4]: Linear -> out (unused)" in describe(Case(spec))
    assert all(has(spec) for name, has in ELEMENTS.items() if name != "a root parameter last")
    with tempfile.TemporaryDirectory() as path:
        got = train_case(Case(spec, eval_after=True), 0, 1, path)
    check(Case(spec, eval_after=True), got, "every element ws1")
