"""The memory planner: how many bytes each tier needs for each placement, and which to use.

    python -m offload.plan --params 7e9 --gpus 8 --gpu-mem 80GiB --cpu-mem 1TiB --nvme-free 4TiB
    plan(model)                      # a model (may be built on the meta device)
    plan(7e9, machine=Machine(...))  # a parameter count

A placement is (where the low-precision parameter shards live, where the fp32 master and
Adam moments live): params `device` / `cpu` / `nvme` x optimizer `cpu` / `nvme`. For each,
the planner computes the bytes the engine holds between steps in each tier (GPU, host, NVMe)
per rank and per node (`offload.plan.tier_bytes`, [Note: the figures are the engine's]),
whether that fits the machine (`offload.plan.machine`) after its reserves, and recommends
the fastest placement that fits.

What is *not* modelled: activations (they are the user's: batch, sequence length,
checkpointing), the CUDA context and allocator fragmentation, the user's data pipeline.
The reserves (`Machine.*_reserve_bytes`) stand for them; the working set of gathered
parameters and gradient buffers during forward/backward is reported as an estimate.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from offload.config import Config, load_config
from offload.config.sections import OptimizerTier, ParamTier
from offload.dtypes import DTYPES, MOMENT_DTYPES
from offload.optim.kinds import MOMENT_FORMATS, OptimizerArg, state_specs
from offload.optim.sharded import transient_grad_shards
from offload.runtime.device_split import device_units
from offload.plan.machine import Machine, format_size, machine_from_system, make_machine
from offload.plan.profile import MachineProfile, this_machine_cached
from offload.plan.shapes import ModelShape, shape_from_model
from offload.plan.step_time import StepPrediction, StepSettings, predict_step
from offload.plan.update_split import (NOMINAL_CPU_ELEMS_PER_S, NOMINAL_DEVICE_ELEMS_PER_S, DeviceSplit,
                                       SplitRates, split_compute_s, split_for_plan)
from offload.plan.tier_bytes import (
    TierBytes,
    disk_bytes_per_step,
    rank_bytes,
    spec_from_count,
    spec_from_counts,
    spec_from_model,
    working_bytes,
)
from offload.sizes import format_bytes, format_count, parse_count
from offload.storage.placement import Placement, choose_placement, unit_bytes
from offload.storage.tier_kind import TierKind
from offload.units.collectives import ProcessGroupInfo

__all__ = ["PlacementEstimate", "Plan", "plan", "resolve_placement", "PLACEMENTS"]

logger = logging.getLogger("offload")

PLACEMENTS: tuple[tuple[ParamTier, OptimizerTier], ...] = (
    ("device", "cpu"),
    ("cpu", "cpu"),
    ("nvme", "cpu"),
    ("device", "nvme"),
    ("cpu", "nvme"),
    ("nvme", "nvme"),
)
"""Every (param_tier, optimizer_tier), fastest first. [Note: placement order]

Parameters: device > cpu > nvme; optimizer: cpu > nvme. Across the two, the order follows
the per-step traffic on the slowest link, the disk (DESIGN.md, "Numbers to design for"):
optimizer states on NVMe move 12 B read + 12 B written per parameter per step, parameters
on NVMe 2 B per gather (forward and backward) + 2 B written, so params-on-NVMe with the
optimizer in memory (about 6 B/param of disk traffic) beats any optimizer-on-NVMe placement
(24-30 B/param). Without NVMe, params on the host cost PCIe copies (2 B per gather) that
device-resident shards do not."""

_REASONS = {
    ("device", "cpu"): "parameter shards stay in GPU memory (no host-to-device copy per gather) "
                       "and the optimizer runs from host memory (no disk traffic)",
    ("cpu", "cpu"): "everything stays in memory (no disk traffic); parameter shards are "
                    "copied from pinned host memory at each gather",
    ("nvme", "cpu"): "optimizer states stay in host memory; only parameter shards are paged "
                     "through NVMe (about {disk} B/param of disk traffic per step)",
    ("device", "nvme"): "parameter shards fit in GPU memory; optimizer states are paged "
                        "through NVMe ({disk} B/param of disk traffic per step)",
    ("cpu", "nvme"): "parameter shards fit in host memory; optimizer states are paged "
                     "through NVMe ({disk} B/param of disk traffic per step)",
    ("nvme", "nvme"): "only NVMe holds the training state; everything is paged through it "
                      "(about {disk} B/param of disk traffic per step)",
}


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementEstimate:
    param_tier: ParamTier
    optimizer_tier: OptimizerTier
    per_rank: TierBytes
    """The largest rank's bytes per tier between steps (ranks differ only by padding)."""
    per_node: TierBytes
    """The fullest node's bytes per tier: the sum over its ranks."""
    working_device_bytes: int
    """Estimated extra compute-device bytes per rank during forward/backward (no activations)."""
    disk_bytes_per_step: int
    """Per rank: bytes read + written on NVMe per optimizer step (see PLACEMENTS)."""
    fits: bool
    problems: tuple[str, ...]
    """Why it does not fit (or cannot run), one line per tier."""
    predicted: Optional[StepPrediction] = None
    """The step-time model's step (offload/plan/step_time.py), given a machine profile and
    the model's shape; None without them."""

    @property
    def name(self) -> str:
        return f"{self.param_tier}/{self.optimizer_tier}"


@dataclass(frozen=True)
class Plan:
    params: int
    trainable_params: int
    dtype: str
    moments: str
    machine: Machine
    estimates: tuple[PlacementEstimate, ...]
    """One per placement, fastest first."""
    recommended: Optional[PlacementEstimate]
    reason: str
    hints: tuple[str, ...] = ()
    """When nothing fits: the cheaper options that would fit, each with its figures."""
    ram_budget_bytes: int = 0
    """With an NVMe tier recommended: the host memory per rank left over after it, for
    units kept in RAM (`offload.ram_budget_bytes`); 0 without."""
    split: Optional[Placement] = None
    """Which units that budget keeps in RAM (offload/storage/placement.py)."""
    split_disk_bytes_per_step: int = 0
    """The recommended placement's disk bytes per step with `split` applied."""
    activation_bytes: int = 0
    """Per rank, the activations modelled from the model's shape (0 without one), counted in
    each placement's `working_device_bytes`."""
    shape: Optional[str] = None
    """The model's shape, in words, when one was given."""
    device_split: Optional[DeviceSplit] = None
    """On a GPU, with no split in the config: how many units' optimizer state the recommended
    placement puts on the GPU (offload/plan/update_split.py)."""
    split_basis: str = ""
    """Where the split's rates and compute came from, in words."""
    recompute_frees_bytes: int = 0
    """Activation bytes per rank that `activation_checkpointing` would free (0: it is on, or no shape)."""
    units_more_with_recompute: int = 0

    def estimate(self, param_tier: str, optimizer_tier: str) -> PlacementEstimate:
        for e in self.estimates:
            if (e.param_tier, e.optimizer_tier) == (param_tier, optimizer_tier):
                return e
        raise KeyError(f"no placement {param_tier}/{optimizer_tier}")

    def config_snippet(self) -> dict[str, Any]:
        if self.recommended is None:
            return {}
        out: dict[str, Union[str, int]] = {"param_tier": self.recommended.param_tier,
               "optimizer_tier": self.recommended.optimizer_tier}
        if self.ram_budget_bytes:
            out["ram_budget_bytes"] = self.ram_budget_bytes
        if self.device_split is not None and self.device_split.units:
            out["optimizer_device_units"] = self.device_split.units
        if self.moments != "fp32":
            return {"offload": out, "optimizer": {"moments_dtype": self.moments}}
        return {"offload": out}

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": self.params, "trainable_params": self.trainable_params,
            "dtype": self.dtype, "moments": self.moments, "machine": asdict(self.machine),
            "placements": [
                {"param_tier": e.param_tier, "optimizer_tier": e.optimizer_tier,
                 "per_rank": e.per_rank.as_dict(), "per_node": e.per_node.as_dict(),
                 "working_device_bytes": e.working_device_bytes,
                 "disk_bytes_per_step": e.disk_bytes_per_step, "fits": e.fits,
                 "problems": list(e.problems),
                 "predicted": None if e.predicted is None else e.predicted.to_dict()}
                for e in self.estimates
            ],
            "recommended": None if self.recommended is None else self.recommended.name,
            "reason": self.reason,
            "hints": list(self.hints),
            "ram_budget_bytes": self.ram_budget_bytes,
            "activation_bytes": self.activation_bytes, "shape": self.shape,
            "device_split": None if self.device_split is None else asdict(self.device_split),
            "recompute_frees_bytes": self.recompute_frees_bytes,
            "split": None if self.split is None else {
                "param_on_nvme": list(self.split.param_on_nvme),
                "state_on_nvme": list(self.split.state_on_nvme),
                "disk_bytes_per_step": self.split_disk_bytes_per_step},
        }

    def __str__(self) -> str:
        m = self.machine
        gpu_word = "GPU" if m.gpus_per_node else "device"
        gpu_reserve = f"GPU {format_size(m.gpu_reserve_bytes)} per GPU, " if m.gpus_per_node else ""
        nvme_reserve = ("" if m.nvme_free_bytes is None
                        else f", NVMe {format_size(m.nvme_reserve_bytes)} per node")
        lines = [
            f"offload memory plan: {format_count(self.params)} parameters "
            f"({format_count(self.trainable_params)} trainable), {self.dtype} compute, "
            f"{self.moments} Adam moments",
            f"machine: {m.describe()}",
            f"reserved (not planned into): {gpu_reserve}host {format_size(m.cpu_reserve_bytes)} "
            f"per node{nvme_reserve}",
            self._bytes_per_param_line(),
            ("activations are the model's and are NOT modelled: the reserves must hold them "
             "(and the CUDA context); " if self.shape is None else
             f"shape: {self.shape}; activations {format_size(self.activation_bytes)} per rank (modelled "
             "from the shape, counted in work/rank); ")
            + "'work' is the engine's gathered parameters and gradient "
            "buffers during forward/backward (estimate); 'pinned' is the NVMe staging budget; "
            + ("host/node includes it." if m.gpus_per_node else "host/node includes it and every rank's work; "
               "no GPU: the compute device is host memory, the 'device' tier's bytes are in host/rank."),
            "",
        ]
        timed = any(e.predicted is not None for e in self.estimates)
        head = ["params", "optimizer", *([f"{gpu_word}/rank"] if m.gpus_per_node else []), "work/rank", "host/rank",
                "pinned/rank", "nvme/rank", "host/node", "nvme/node", "disk/step"]
        head += ["step", "tokens/s", "bound by"] if timed else []
        head += ["fits"]
        rows = []
        for e in self.estimates:
            gpu, r, n = m.gpus_per_node, e.per_rank, e.per_node  # no GPU: device bytes are host bytes (_problems)
            sizes = ((r.device,) if gpu else ()) + (e.working_device_bytes, r.host + (0 if gpu else r.device), r.pinned, r.nvme,
                     n.host_total + (0 if gpu else n.device + e.working_device_bytes * m.local_ranks), n.nvme, e.disk_bytes_per_step)
            times = []
            if timed:
                pr = e.predicted
                times = (["-", "-", "not predicted"] if pr is None else
                         [_seconds(pr.step_s), f"{pr.tokens_per_s:,.0f}", pr.bound_text()])
            rows.append([e.param_tier, e.optimizer_tier, *map(format_size, sizes), *times,
                         "yes" if e.fits else "no: " + "; ".join(e.problems)])
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head) - 1)]
        fmt_row = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]  # noqa: E731
        lines.append(fmt_row(head))
        lines.extend(fmt_row(r) for r in rows)
        lines.append("")
        if self.recommended is None:
            lines.append(f"no placement fits: {self.reason}")
            lines.extend(f"try: {h}" for h in self.hints)
        else:
            lines.append(f"recommended: params {self.recommended.param_tier}, optimizer "
                         f"{self.recommended.optimizer_tier} -- {self.reason}")
            if self.split is not None:
                lines.append(
                    f"host memory left over: {format_size(self.ram_budget_bytes)} per rank, kept "
                    f"for units in RAM instead of NVMe ({self.split.describe()}): disk/step "
                    f"{format_size(self.recommended.disk_bytes_per_step)} -> "
                    f"{format_size(self.split_disk_bytes_per_step)}")
            if self.device_split is not None:
                lines.append(self._device_split_line())
            lines.append(f"config: {json.dumps(self.config_snippet())}")
        return "\n".join(lines)

    def _device_split_line(self) -> str:
        """The update split the planner sized ([Note: the split rule] in offload/plan/update_split.py)."""
        d = self.device_split
        assert d is not None
        text = (f"update split: the first {d.units} unit(s)' optimizer state on the GPU "
                f"({format_size(d.bytes)} of {format_size(d.room_bytes)} left), step ~{d.step_s:.3g} s "
                f"vs {d.all_cpu_step_s:.3g} s with every update on the CPU "
                f"({self.split_basis})")
        if self.recompute_frees_bytes:
            text += (f"; activation recompute (activation_checkpointing) would free "
                     f"{format_size(self.recompute_frees_bytes)} per rank"
                     + (f": room for {self.units_more_with_recompute} unit(s) more" if self.units_more_with_recompute
                        else ", which the split does not need (it is bound by time, not memory)"))
        return text

    def _bytes_per_param_line(self) -> str:
        """The training state per trainable parameter, next to the usual "16 B per parameter"
        (2 B bf16 params + 2 B bf16 grads + 12 B fp32 master and moments), which assumes
        low-precision gradients: the engine reduces and keeps gradient shards in fp32."""
        p = DTYPES[self.dtype].itemsize
        m = 2 * MOMENT_DTYPES[self.moments].itemsize if self.moments in MOMENT_DTYPES else 2 + 8 / 256
        total = p + 4 + m + 4
        return (f"per trainable parameter: {p} B {self.dtype} parameter + 4 B fp32 master + "
                f"{m:g} B {self.moments} moments + 4 B gradient shard = {total:g} B, divided over "
                f"{self.machine.world_size} rank(s); gradient shards are kept in fp32 (4 B, not "
                f"the {p} B the usual '16 B per parameter' figure counts)"
                + ("; an fp32 parameter shard in host memory with the optimizer there is the "
                   "master itself (4 B less)" if p == 4 else "")
                + f"; a frozen parameter: its {p} B parameter only")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def plan(
    model_or_params: Union[nn.Module, ModelShape, int, float, str],
    *,
    machine: Optional[Machine] = None,
    config: Any = None,
    optimizer: OptimizerArg = None,
    dtype: Optional[str] = None,
    moments: Optional[str] = None,
    units: Optional[int] = None,
    placements: Sequence[tuple[ParamTier, OptimizerTier]] = PLACEMENTS,
    profile: Optional[MachineProfile] = None,
    tokens: Optional[int] = None,
) -> Plan:
    """Bytes per tier for each placement of `model_or_params` on `machine`, and the fastest
    placement that fits.

    model_or_params: an `nn.Module` (built on any device, the meta device included: only
        shapes are read; frozen parameters get no moments; `config.unit_modules` and
        `optimizer` groups are honoured as `initialize` would) or a parameter count.
    machine: a `Machine` (see `make_machine`); None = this machine as it is now, world size 1.
    config: an `offload.Config` / dict / path; dtype, moments, pinned budget and unit policy
        come from it, unless `dtype` ('fp32'/'bf16'/'fp16') or `moments` ('fp32'/'bf16'/'8bit')
        override them.
    units: for a bare count, how many equal units to lay it out in (default
        `offload.plan.tier_bytes.default_units`). A `ModelShape` (offload/plan/shapes.py)
        lays out its own units.
    profile: a machine profile (offload/plan/profile.py). With it and the model's shape (a
        `ModelShape`, or a module with `tokens` per step), each placement gets a predicted
        step (offload/plan/step_time.py) and the recommendation is the fastest predicted
        placement that fits, instead of the fixed order of `PLACEMENTS`.
    """
    cfg = load_config(config)
    dtype = dtype or cfg.precision.dtype
    moments = moments or cfg.optimizer.moments_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype = {dtype!r}; allowed: {', '.join(DTYPES)}")
    if moments not in MOMENT_FORMATS:
        raise ValueError(f"moments = {moments!r}; allowed: {', '.join(MOMENT_FORMATS)}")
    p_bytes = DTYPES[dtype].itemsize
    if machine is None:
        machine = machine_from_system(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"), 1)
    ws = machine.world_size
    shape: Optional[ModelShape] = None
    if isinstance(model_or_params, ModelShape):
        shape = model_or_params
        spec = spec_from_counts([u.params for u in shape.units], ws, state_specs(cfg.optimizer.type, moments))
    elif isinstance(model_or_params, nn.Module):
        spec = spec_from_model(model_or_params, cfg, optimizer, ws, p_bytes, moments)
        if tokens is not None:
            shape = shape_from_model(model_or_params, tokens=tokens, unit_modules=tuple(cfg.unit_modules),
                                     leaf_modules=tuple(cfg.leaf_modules))
    else:
        count = parse_count(model_or_params)
        if count < 1:
            raise ValueError(f"a model needs at least one parameter, got {model_or_params!r}")
        spec = spec_from_count(count, ws, units, state_specs(cfg.optimizer.type, moments))
    on_gpu = machine.gpus_per_node > 0
    # The units whose optimizer state the config puts on the compute device (the engine's choice
    # from the same sizes: offload/runtime/device_split.py), whatever the tiers of the others.
    on_device = device_units(cfg, unit_bytes([u.layout for u in spec.units], p_bytes, spec.states, ws)[1],
                             [u.name for u in spec.units])
    # With the model's shape, its activations (offload/plan/shapes.py) join the working set.
    activation_bytes = int(shape.activation_elems() * p_bytes) if shape is not None else 0

    estimates = []
    for pt, ot in placements:
        per_rank = TierBytes()
        transient = transient_grad_shards(cfg, on_gpu)
        rank_list = [rank_bytes(spec, r, pt, ot, p_bytes=p_bytes, on_gpu=on_gpu,
                                pinned_budget_bytes=cfg.offload.pinned_budget_bytes,
                                transient_grads=transient, stage=cfg.zero_stage, world_size=ws,
                                device_units=on_device)
                     for r in range(ws)]
        for rb in rank_list:
            per_rank = per_rank.max(rb)
        per_node = TierBytes()
        for start in range(0, ws, machine.local_ranks):
            node = TierBytes()
            for rb in rank_list[start : start + machine.local_ranks]:
                node = node + rb
            per_node = per_node.max(node)
        work = working_bytes(spec, pt, p_bytes=p_bytes, on_gpu=on_gpu, world_size=ws,
                             prefetch_bytes=cfg.prefetch.prefetch_bytes,
                             keep_bytes=cfg.prefetch.keep_bytes, stage=cfg.zero_stage)
        if transient:  # the fp32 gradient shards of the units between reduce and update
            work += 2 * max((u.layout.shard_master_numel(0) * 4 for u in spec.units), default=0)
        work += activation_bytes
        disk = disk_bytes_per_step(spec, pt, ot, p_bytes=p_bytes, world_size=ws)
        problems = _problems(machine, per_rank, per_node, work, pt, ot)
        predicted = None
        if shape is not None and profile is not None:
            settings = replace(StepSettings.from_config(cfg, pt, ot, on_gpu=on_gpu, world_size=ws),
                               dtype=dtype, moments=moments)
            try:
                predicted = predict_step(shape, profile, settings)
            except ValueError as exc:  # the profile lacks a figure this placement needs
                logger.debug("no step-time prediction for %s/%s: %s", pt, ot, exc)
        estimates.append(PlacementEstimate(pt, ot, per_rank, per_node, work, disk,
                                           not problems, tuple(problems), predicted))
    if any(e.predicted is not None for e in estimates):
        # Fastest predicted first; placements the profile cannot time keep their fixed order after.
        estimates.sort(key=lambda e: (e.predicted is None, e.predicted.step_s if e.predicted else 0.0))
    fitting = [e for e in estimates if e.fits]
    if fitting:
        best = fitting[0]
        slower = [e.name for e in estimates[: estimates.index(best)]]
        per_param = best.disk_bytes_per_step * ws / max(1, spec.trainable_params)
        reason = _REASONS[(best.param_tier, best.optimizer_tier)].format(disk=f"{per_param:.3g}")
        if best.predicted is not None:
            pr = best.predicted
            reason = (f"fastest predicted step that fits: {_seconds(pr.step_s)} ({pr.tokens_per_s:,.0f} "
                      f"tokens/s), bound by {pr.bound_text()}; " + reason)
        if slower:
            reason += f"; faster placements do not fit ({', '.join(slower)})"
    else:
        best = None
        last = estimates[-1] if estimates else None
        reason = ("even the smallest placement needs more than the machine has: "
                  + "; ".join(last.problems) if last else "no placements given")
    if not on_gpu:  # a CPU run: the "device" tier is host memory, there is no GPU memory
        reason = reason.replace("GPU memory", "device memory (host memory: compute is on the CPU)")
    hints: tuple[str, ...] = ()
    if best is None:
        hints = _cheaper_options(model_or_params, machine, cfg, optimizer, dtype, moments, units,
                                 placements, estimates)
    budget, split, split_disk = 0, None, 0
    if best is not None and _on_disk(best.param_tier, best.optimizer_tier):
        budget, split, split_disk = _ram_split(spec, best, machine, p_bytes)
    frees = 0
    if shape is not None and not shape.recompute:
        frees = int((shape.activation_elems() - replace(shape, recompute=True).activation_elems()) * p_bytes)
    device_split, more, basis = None, 0, ""
    if best is not None and on_gpu and not on_device:
        room = (machine.gpu_mem_bytes or 0) - machine.gpu_reserve_bytes - best.per_rank.device \
            - best.working_device_bytes
        compute_s, basis = split_compute_s(best.predicted.backward_s if best.predicted else None, shape,
                                           spec.params, cfg.logging.tokens_per_step)
        rates = SplitRates(cpu_elems_per_s=profile.optimizer_rate(moments) if profile else NOMINAL_CPU_ELEMS_PER_S,
                           device_elems_per_s=NOMINAL_DEVICE_ELEMS_PER_S, compute_s=compute_s,
                           measured=profile is not None)
        device_split, more = split_for_plan(spec, best.param_tier, room, p_bytes, ws, rates, frees)
    return Plan(spec.params, spec.trainable_params, dtype, moments, machine, tuple(estimates),
                best, reason, hints, budget, split, split_disk, activation_bytes,
                None if shape is None else shape.source, device_split, basis, frees, more)


def _on_disk(*tiers: str) -> bool:
    """Whether any of these tiers (config names) keeps its bytes in swap files."""
    return any(TierKind.of(t).spec.on_disk for t in tiers)


def _ram_split(spec: Any, best: PlacementEstimate, m: Machine,
               p_bytes: int) -> tuple[int, Optional[Placement], int]:
    """The host memory per rank the recommended NVMe placement leaves over (after the
    reserves; a CPU run's device memory and working sets are host memory too), which
    units it keeps in RAM (`choose_placement`, the engine's own choice from the same
    sizes) and the disk bytes per step that leaves."""
    host_cap = m.cpu_mem_bytes - m.cpu_reserve_bytes
    need = best.per_node.host_total
    if not m.gpus_per_node:
        need += best.per_node.device + best.working_device_bytes * m.local_ranks
    budget = max(0, (host_cap - need) // max(1, m.local_ranks))
    if budget == 0:
        return 0, None, 0
    param_bytes, state_bytes = unit_bytes([u.layout for u in spec.units], p_bytes, spec.states,
                                          m.world_size)
    param_tier, state_tier = TierKind.of(best.param_tier), TierKind.of(best.optimizer_tier)
    split = choose_placement(param_bytes, state_bytes, param_tier, state_tier, budget)
    every = Placement.uniform(len(spec.units), param_tier, state_tier)
    saved = every.nvme_traffic(param_bytes, state_bytes) - split.nvme_traffic(param_bytes, state_bytes)
    kept = split.kept_bytes(param_bytes, state_bytes, param_tier, state_tier)
    if kept == 0:
        return 0, None, 0  # no unit fits in what is left
    return kept, split, max(0, best.disk_bytes_per_step - saved)


def _cheaper_options(model_or_params: Any, machine: Machine, cfg: Config, optimizer: OptimizerArg,
                     dtype: str, moments: str, units: Optional[int],
                     placements: Sequence[tuple[ParamTier, OptimizerTier]],
                     estimates: list[PlacementEstimate]) -> tuple[str, ...]:
    """What would fit when nothing does, cheapest change first, each with its figures:
    bf16 Adam moments (4 B/param less), else 8-bit ones, then NVMe when none was given."""
    out = []
    smaller = {"fp32": ("bf16", "8bit"), "bf16": ("8bit",)}.get(moments, ())
    for alt_moments in smaller:
        if alt_moments == "8bit" and cfg.optimizer.type not in ("Adam", "AdamW"):
            continue
        alt = plan(model_or_params, machine=machine, config=cfg, optimizer=optimizer, dtype=dtype,
                   moments=alt_moments, units=units, placements=placements)
        if alt.recommended is not None:
            what = ("bf16 Adam moments (--moments bf16; config optimizer.moments_dtype='bf16'; "
                    "4 B/param less)" if alt_moments == "bf16" else
                    "8-bit Adam moments (--moments 8bit; config optimizer.moments_dtype='8bit'; "
                    f"{8 if moments == 'fp32' else 4} - 2.03 B/param)")
            out.append(f"{what}: params {alt.recommended.param_tier}, optimizer "
                       f"{alt.recommended.optimizer_tier} fits, {_figures(alt.recommended, machine)}")
            break
    if machine.nvme_free_bytes is None:
        for e in estimates:  # the fastest placement whose only problem is the missing disk
            if e.problems and all(p.startswith("no NVMe") for p in e.problems):
                out.append(f"NVMe (--nvme-free SIZE or --nvme-path DIR; config offload.nvme_path): "
                           f"params {e.param_tier}, optimizer {e.optimizer_tier} fits with "
                           f"{format_size(e.per_node.nvme)} of NVMe per node plus its reserve, "
                           f"{_figures(e, machine)}")
                break
    return tuple(out)


def _figures(e: PlacementEstimate, m: Machine) -> str:
    host = e.per_node.host_total if m.gpus_per_node else (
        e.per_node.host_total + e.per_node.device + e.working_device_bytes * m.local_ranks)
    gpu = (f"GPU {format_size(e.per_rank.device + e.working_device_bytes)} per rank of "
           f"{format_size((m.gpu_mem_bytes or 0) - m.gpu_reserve_bytes)}, " if m.gpus_per_node else "")
    nvme = f", NVMe {format_size(e.per_node.nvme)} per node" if e.per_node.nvme else ""
    return (f"{gpu}host {format_size(host)} per node of "
            f"{format_size(m.cpu_mem_bytes - m.cpu_reserve_bytes)}{nvme}")


def _over(tier: str, need: int, cap: int) -> str:
    """'tier NEED > CAP', with as many digits as it takes for the two figures to differ:
    one decimal usually, up to exact bytes ('host 1.0 TiB > 1.0 TiB' read false)."""
    for digits in (1, 3, 6):
        a, b = format_bytes(need, digits=digits), format_bytes(cap, digits=digits)
        if a != b:
            return f"{tier} {a} > {b}"
    return f"{tier} {need:,} B > {cap:,} B"


def _problems(m: Machine, rank: TierBytes, node: TierBytes, work: int, pt: str, ot: str) -> list[str]:
    out = []
    if _on_disk(pt, ot):
        if m.nvme_free_bytes is None:
            out.append("no NVMe (give --nvme-free / set offload.nvme_path)")
        elif node.nvme > m.nvme_free_bytes - m.nvme_reserve_bytes:
            nvme_cap = m.nvme_free_bytes - m.nvme_reserve_bytes
            out.append(_over("NVMe", node.nvme, nvme_cap))
    if m.gpus_per_node:
        gpu_cap = (m.gpu_mem_bytes or 0) - m.gpu_reserve_bytes
        if rank.device + work > gpu_cap:
            out.append(_over("GPU", rank.device + work, gpu_cap))
        host_need = node.host_total
    else:
        # A CPU run: device memory is host memory, and every local rank has a working set.
        host_need = node.host_total + node.device + work * m.local_ranks
    host_cap = m.cpu_mem_bytes - m.cpu_reserve_bytes
    if host_need > host_cap:
        out.append(_over("host", host_need, host_cap))
    return out


# --------------------------------------------------------------------------------------
# placement: "auto" (called by Engine.__init__)
# --------------------------------------------------------------------------------------


def resolve_placement(model: nn.Module, config: Config, optimizer: OptimizerArg, pg: ProcessGroupInfo,
                      device: torch.device) -> tuple[Config, Plan]:
    """`config` with param_tier / optimizer_tier chosen by the planner for this machine.

    Every rank measures its machine (free GPU memory, MemAvailable, free NVMe space) and the
    ranks agree on the minimum of each, so all choose the same placement. Raises
    `MemoryError` with the figures when nothing fits."""
    machine = machine_from_system(config, device, pg.world_size)
    if pg.world_size > 1:
        from offload.units.collectives import all_reduce_host

        values = [machine.gpu_mem_bytes or 0, machine.cpu_mem_bytes,
                  -1 if machine.nvme_free_bytes is None else machine.nvme_free_bytes]
        t = torch.tensor([-float(v) for v in values], dtype=torch.float64)
        gpu, cpu, nvme = (int(-v) for v in all_reduce_host(t, "max", pg, device).tolist())
        machine = make_machine(gpus=machine.gpus_per_node, gpu_mem=gpu or None, cpu_mem=cpu,
                               nvme_free=None if nvme < 0 else nvme, world_size=pg.world_size,
                               ranks_per_node=machine.local_ranks)
    # With the tokens per step and this machine's cached profile, rank by predicted step
    # (every rank reads the same file on one node; ranks of other nodes may differ: they
    # then agree only on the memory, so time ranks only on one node).
    profile = this_machine_cached(config.offload.nvme_path) if machine.nodes == 1 else None
    tokens = config.logging.tokens_per_step
    result = plan(model, machine=machine, config=config, optimizer=optimizer, profile=profile,
                  tokens=tokens if profile is not None else None)
    if result.recommended is None:
        raise MemoryError(f"offload.placement='auto': {result.reason}\n{result}")
    best = result.recommended
    offload_cfg = replace(config.offload, param_tier=best.param_tier, optimizer_tier=best.optimizer_tier,
                          placement="manual", ram_budget_bytes=result.ram_budget_bytes or None,
                          optimizer_device_units=(result.device_split.units or None)
                          if result.device_split is not None else None)
    if pg.rank == 0:
        logger.info("offload.placement='auto' chose params=%s, optimizer=%s: %s "
                    "(per rank: device %s, host %s, nvme %s; machine: %s)",
                    best.param_tier, best.optimizer_tier, result.reason,
                    format_size(best.per_rank.device), format_size(best.per_rank.host),
                    format_size(best.per_rank.nvme), machine.describe())
        if result.device_split is not None:
            logger.info("offload.placement='auto': %s", result._device_split_line())
        if result.split is not None:
            logger.info("offload.placement='auto' keeps %s of host memory per rank for units in "
                        "RAM: %s", format_size(result.ram_budget_bytes), result.split.describe())
    return replace(config, offload=offload_cfg), result


