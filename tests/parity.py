"""Parity with plain PyTorch, judged by bounds measured in the same test.

[Note: derived tolerances]
A fixed tolerance sits at the noise floor of the machine it was tuned on and breaks on the
next one (1e-5 passed on one AMD CPU and failed by 16 % on an Intel Xeon and on a newer AMD:
summation order in MKL's GEMMs differs between CPUs). So every comparison here measures its
own noise floor, on this machine, in this run, and states its bound as a multiple of it.

fp32 (`Fp32Bound`). The truth is the plain loop run in float64 (same model, seed, batches,
optimizer arithmetic in double). Each fp32 run - the engine, torch's for-loop AdamW, torch's
fused AdamW, and the same loop with each batch split in two micro-batches - is one
realisation of fp32 rounding noise carried through the same training dynamics; so per
tensor, the engine's distance from the truth is of the same order as the references'.
  noise[t] = max over the fp32 references of max |ref[t] - truth[t]|
  bound[t] = FP32_MULTIPLE x max(noise[t], one fp32 ulp at the tensor's scale)
Adam does amplify rounding noise: where |g| is near eps (a key bias, whose true gradient is
0, is all rounding noise) m / (sqrt(v) + eps) turns last-bit differences into lr-sized
steps. The measured noise carries that amplification for exactly the tensors it hits, which
a single relative tolerance cannot. The multiple: over every fp32 comparison in the suite,
the engine's distance was at most ~4x the largest reference distance (the world-size-2
runs, which sum two half-batch gradients in another order); 8 leaves a factor 2 for other
CPUs. A real bug (a missed micro-batch, a wrong scale, a stale shard) moves weights by
O(lr) per step, thousands of times the noise: the negative controls assert > 100x the bound.

bf16 / fp16 (`TrajectoryBound`). Low-precision compute rounds activations and gradients to
8 (bf16) or 11 (fp16) mantissa bits; two correct runs that round differently drift apart by
a few per cent of the path. The metric is the distance between whole trajectories,
||got - ref|| / ||ref - init||, and the noise is the same metric between the reference and
the same loop with each batch split in 2 and in 4 micro-batches (other roundings of the same
arithmetic). Measured: the engine's distance was at most ~1x that noise; the bound is
LOWP_MULTIPLE (3) times it; a run with a missed micro-batch lands at > 10x the bound.

Each check returns its margin (the worst distance / bound) and records it, so the suite's
closing summary can say by how much every comparison passed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

FP32_MULTIPLE = 8.0
"""bound / measured fp32 noise, per tensor (see the note)."""
LOWP_MULTIPLE = 3.0
"""bound / measured low-precision trajectory noise (see the note)."""
FP32_ULP = 2.0**-23
"""The spacing of fp32 numbers in [1, 2): a distance below one ulp at a tensor's scale is
not noise that a multiple of anything should have to cover."""


@dataclass(frozen=True)
class Margin:
    """One comparison's outcome: `what` passed (or failed) at distance / bound = `ratio`."""

    what: str
    ratio: float
    worst: str


MARGINS: list[Margin] = []
"""Every check of this process, in order (reported by tests/conftest.py at the end)."""


# -- the plain PyTorch loop --------------------------------------------------------------------


def plain_loop(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float,
    weight_decay: float,
    gas: int = 1,
    clip: float = 0.0,
    master_dtype: torch.dtype = torch.float32,
    compute_dtype: Optional[torch.dtype] = None,
    fused: bool = False,
    split: int = 1,
    scales: Optional[Callable[[int], float]] = None,
    skip: Iterable[int] = (),
    groups: Optional[Callable[[nn.Module], Any]] = None,
    opt_cls: type = torch.optim.AdamW,
    scheduler: Optional[Callable[[Any], Any]] = None,
    before_forward: Optional[Callable[[nn.Module, int], None]] = None,
    moments_dtype: Optional[torch.dtype] = None,
    norms: Optional[list[float]] = None,
) -> dict[str, torch.Tensor]:
    """Train `make_model()` with a torch optimizer as a user would, and return its state dict.

    The master weights are `master_dtype` (float64 for the truth). With `compute_dtype`
    (bf16/fp16) a low-precision copy made from the master at each step's first micro-batch
    runs forward and backward; its gradients, cast up and unscaled by `scales(step)`, are
    applied to the master. `split` cuts each micro-batch into that many equal chunks whose
    losses are summed (the same mean, rounded differently). Steps in `skip` are dropped as an
    overflow would drop them. `before_forward(model, micro_batch_index)` may change the
    model between micro-batches (a route). With `moments_dtype` the optimizer's moments are
    rounded to it after every step, as a store that keeps them in that dtype would. With
    `norms`, the global gradient norm of every applied step (before clipping, what
    `clip_grad_norm_` returns) is appended to it."""
    master = make_model().to(master_dtype)
    params = groups(master) if groups else master.parameters()
    opt = opt_cls(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {"foreach": False}))
    sched = scheduler(opt) if scheduler else None
    compute = copy.deepcopy(master).to(compute_dtype) if compute_dtype is not None else master
    skip = set(skip)
    step = 0
    for i, (x, y) in enumerate(batches):
        if compute is not master and i % gas == 0:
            with torch.no_grad():
                for pc, pm in zip(compute.parameters(), master.parameters()):
                    pc.copy_(pm)
        if before_forward is not None:
            before_forward(compute, i)
        scale = scales(step) if scales else 1.0
        n = x.shape[0] // split
        for s in range(split):
            loss = compute(x[s * n : (s + 1) * n], y[s * n : (s + 1) * n])
            (loss * (scale / (gas * split))).backward()
        if (i + 1) % gas:
            continue
        if compute is not master:
            for pc, pm in zip(compute.parameters(), master.parameters()):
                pm.grad = None if pc.grad is None else pc.grad.to(master_dtype) / scale
                pc.grad = None
        if step not in skip:
            if clip:
                total = torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
            elif norms is not None:
                total = torch.nn.utils.get_total_norm([p.grad for p in master.parameters() if p.grad is not None])
            if norms is not None:
                norms.append(float(total))
            opt.step()
            if moments_dtype is not None:
                for state in opt.state.values():
                    for name in ("exp_avg", "exp_avg_sq"):
                        state[name].copy_(state[name].to(moments_dtype))
            if sched is not None:
                sched.step()
        opt.zero_grad()
        step += 1
    return master.state_dict()


# -- fp32: per tensor, against a float64 truth -------------------------------------------------


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


class Fp32Bound:
    """Per-tensor bounds for an fp32 run, measured from `truth` (a float64 run) and fp32
    references of the same loop (see [Note: derived tolerances])."""

    def __init__(self, truth: Mapping[str, torch.Tensor], references: Mapping[str, Mapping[str, torch.Tensor]],
                 multiple: float = FP32_MULTIPLE, truth_name: str = "float64 truth") -> None:
        self.truth = dict(truth)
        self.truth_name = truth_name
        self.multiple = multiple
        self.sources = ", ".join(references)
        self.noise: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        for k, t in self.truth.items():
            if not t.is_floating_point():
                continue
            noise = max(_max_abs(ref[k], t) for ref in references.values())
            ulp = FP32_ULP * float(t.abs().max()) if t.numel() else 0.0
            self.noise[k] = noise
            self.bound[k] = multiple * max(noise, ulp)

    @classmethod
    def measure(cls, run: Callable[..., Mapping[str, torch.Tensor]], multiple: float = FP32_MULTIPLE) -> "Fp32Bound":
        """`run(**overrides)` is the plain loop; it is run in float64 and as three fp32
        references: torch's for-loop AdamW, its fused AdamW, and the batch split in two."""
        truth = run(master_dtype=torch.float64)
        refs = {
            "torch for-loop AdamW": run(),
            "torch fused AdamW": run(fused=True),
            "batch split in 2": run(split=2),
        }
        return cls(truth, refs, multiple)

    def worst(self, got: Mapping[str, torch.Tensor], what: str = "run") -> tuple[float, str, list[str]]:
        """(the largest distance / bound over the tensors, its tensor, a line per tensor
        outside its bound) for a run `got` of the same loop."""
        rows, worst_k, worst = [], "", -1.0
        for k, bound in self.bound.items():
            err = _max_abs(got[k], self.truth[k])
            ratio = err / bound if bound > 0 else (0.0 if err == 0 else math.inf)
            if ratio > worst:
                worst_k, worst = k, ratio
            if ratio > 1:
                scale = float(self.truth[k].abs().max())
                rows.append(
                    f"  {k}: max |{what} - {self.truth_name}| = {err:.3g} ({err / scale if scale else 0:.3g} of "
                    f"max |truth| {scale:.3g}) > bound {bound:.3g} = {self.multiple:g} x {bound / self.multiple:.3g}"
                )
        return max(worst, 0.0), worst_k, rows

    def check(self, got: Mapping[str, torch.Tensor], what: str) -> float:
        """Assert every tensor of `got` is within its bound; return (and record) the margin."""
        assert list(got) == list(self.truth), f"{what}: keys differ from the reference's"
        for k, t in self.truth.items():
            if not t.is_floating_point():
                assert torch.equal(got[k], t), f"{what}: {k} (not floating point) differs"
        worst, worst_k, rows = self.worst(got, what)
        MARGINS.append(Margin(what, worst, worst_k))
        assert not rows, (
            f"{what}: {len(rows)} tensor(s) outside the fp32 bound\n" + "\n".join(rows)
            + f"\n  bound per tensor = {self.multiple:g} x the largest distance from the {self.truth_name} of: "
            f"{self.sources} (or one fp32 ulp at the tensor's scale); see [Note: derived tolerances] "
            "in tests/parity.py"
        )
        return worst


# -- low precision: whole trajectories ---------------------------------------------------------


def trajectory_error(sd: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor],
                     init: Mapping[str, torch.Tensor]) -> float:
    """||sd - ref|| / ||ref - init|| over all tensors: the distance between two runs as a
    fraction of the distance the reference moved."""
    num = sum(float((sd[k].double() - ref[k].double()).pow(2).sum()) for k in ref)
    den = sum(float((ref[k].double() - init[k].double()).pow(2).sum()) for k in ref)
    return math.sqrt(num / den)


class TrajectoryBound:
    """A bound on the trajectory distance from `ref`, measured as the same distance of
    `variants` (other valid roundings of the same loop) from it."""

    def __init__(self, ref: Mapping[str, torch.Tensor], variants: Mapping[str, Mapping[str, torch.Tensor]],
                 init: Mapping[str, torch.Tensor], multiple: float = LOWP_MULTIPLE) -> None:
        self.ref, self.init, self.multiple = dict(ref), dict(init), multiple
        self.sources = ", ".join(variants)
        self.noise = max(trajectory_error(v, ref, init) for v in variants.values())
        self.bound = multiple * self.noise

    @classmethod
    def measure(cls, run: Callable[..., Mapping[str, torch.Tensor]], init: Mapping[str, torch.Tensor],
                multiple: float = LOWP_MULTIPLE) -> "TrajectoryBound":
        """`run(**overrides)` is the low-precision plain loop: the reference as it is, and the
        noise from the same loop with each batch split in 2 and in 4."""
        ref = run()
        return cls(ref, {"batch split in 2": run(split=2), "batch split in 4": run(split=4)}, init, multiple)

    def ratio(self, got: Mapping[str, torch.Tensor]) -> float:
        """The trajectory distance of `got` from the reference / the bound."""
        return trajectory_error(got, self.ref, self.init) / self.bound

    def check(self, got: Mapping[str, torch.Tensor], what: str) -> float:
        assert list(got) == list(self.ref), f"{what}: keys differ from the reference's"
        ratio = self.ratio(got)
        err = ratio * self.bound
        MARGINS.append(Margin(what, ratio, "trajectory"))
        assert ratio <= 1, (
            f"{what}: trajectory distance ||{what} - ref|| / ||ref - init|| = {err:.4g} > bound "
            f"{self.bound:.4g} = {self.multiple:g} x {self.noise:.4g}, the largest distance of the "
            f"reference from: {self.sources}; see [Note: derived tolerances] in tests/parity.py"
        )
        return ratio
