"""`python -m offload.plan`: the planner's command line. Reads the machine and the model's
size from flags (sizes through `offload.sizes`: GB = 10**9, GiB = 2**30), prints the plan's
table or its JSON; exit status 0 when a placement fits, 1 when none does, 2 on bad flags."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, Optional, Sequence

import torch
from torch import nn

from offload.config import Config
from offload.dtypes import DTYPES
from offload.optim.kinds import MOMENT_FORMATS
from offload.plan.machine import DEFAULT_RESERVES, make_machine, mem_available_bytes
from offload.plan.measure import measure_profile
from offload.plan.planner import plan
from offload.plan.profile import (
    MachineProfile,
    cache_path,
    cached_profile,
    load_profile,
    save_profile,
    this_machine_cached,
)
from offload.plan.shapes import ModelShape, shape_from_dims, shape_from_hf_config
from offload.plan.sharding import compare_sharding
from offload.plan.stages import compare_stages
from offload.plan.tier_bytes import default_units
from offload.sizes import parse_bytes, parse_count
from offload.storage.swap import memory_backed

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m offload.plan",
        description="Bytes per tier (GPU, host, NVMe) for each placement of a model, and the "
                    "fastest placement that fits. Activations are not modelled: the reserves "
                    "hold them. Sizes: GB = 10**9 bytes, GiB = 2**30.")
    p.add_argument("--params", default=None, help="parameter count: 7e9, 7B, 350M (or give the "
                   "model's shape: --layers/--d-model/... or --hf-config)")
    p.add_argument("--trainable", default=None,
                   help="trainable parameters (default: all); the rest are frozen (no moments)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs per node (default: this machine's; 0 = compute on the CPU)")
    p.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 80GiB (default: this machine's)")
    p.add_argument("--cpu-mem", default=None, help="host memory per node, e.g. 512GiB (default: "
                   "this machine's MemAvailable)")
    p.add_argument("--nvme-free", default=None, help="free NVMe space per node, e.g. 2TiB "
                   "(default: none, unless --nvme-path)")
    p.add_argument("--nvme-path", default=None, help="measure free space of this directory")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks in the job (default: --gpus, or 1); more than --gpus means several nodes")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes in the job: world size = nodes x ranks per node (--ranks-per-node, else --gpus)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks on one node (default: --gpus; on the CPU, 1 with --nodes)")
    p.add_argument("--sharding", action="store_true",
                   help="compare full sharding, hpZ and HSDP on these nodes (host memory per node, "
                        "bytes within and across nodes) and recommend one (offload.plan.sharding)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="compute dtype")
    p.add_argument("--moments", default="fp32", choices=list(MOMENT_FORMATS), help="optimizer state dtype (8bit: Adam's blockwise 8-bit moments)")
    p.add_argument("--units", type=int, default=None,
                   help="units (transformer blocks) to lay the count out in (default: one per ~200M)")
    p.add_argument("--pinned-budget", default="1GiB", help="pinned staging budget for NVMe tiers")
    p.add_argument("--gpu-reserve", default=DEFAULT_RESERVES["gpu"],
                   help="per GPU, held back for activations and the CUDA context: '20%%' or a size")
    p.add_argument("--cpu-reserve", default=DEFAULT_RESERVES["cpu"], help="per node: '10%%' or a size")
    p.add_argument("--nvme-reserve", default=DEFAULT_RESERVES["nvme"], help="per node: '5%%' or a size")
    p.add_argument("--stages", action="store_true",
                   help="compare ZeRO stages 3, 2 and 1 and recommend one (offload.plan.stages)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    t = p.add_argument_group("step time (offload/plan/step_time.py): a machine profile and the model's shape")
    t.add_argument("--measure", action="store_true",
                   help="measure this machine's profile (under a minute), cache it, print it")
    t.add_argument("--quick", action="store_true", help="with --measure: small sizes (seconds, rougher)")
    t.add_argument("--profile", default=None, metavar="FILE",
                   help="use this machine profile (JSON from --measure, e.g. another machine's) "
                        "instead of this machine's cached one")
    t.add_argument("--profile-out", default=None, metavar="FILE",
                   help="with --measure: also write the profile here")
    t.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size the NVMe figures are measured at")
    t.add_argument("--layers", type=int, default=None, help="transformer blocks (one unit each)")
    t.add_argument("--d-model", type=int, default=None, help="model width")
    t.add_argument("--heads", type=int, default=None, help="attention heads (default d_model / 64)")
    t.add_argument("--vocab", type=int, default=50304, help="vocabulary size")
    t.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 x d_model)")
    t.add_argument("--untied", action="store_true", help="the LM head does not share the embedding")
    t.add_argument("--hf-config", default=None, metavar="FILE", help="a transformers config.json for the shape")
    t.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, or the config's)")
    t.add_argument("--batch", type=int, default=1, help="micro-batch size per rank")
    t.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--recompute", action="store_true", help="activation checkpointing per block")
    return p


def _shape(args: argparse.Namespace) -> Optional[ModelShape]:
    """The model's shape from --hf-config or --layers/--d-model, else None."""
    if args.hf_config:
        return shape_from_hf_config(args.hf_config, seq=args.seq, batch=args.batch,
                                    recompute=args.recompute, accumulation=args.accumulation)
    if args.layers is None and args.d_model is None:
        return None
    if args.layers is None or args.d_model is None:
        raise ValueError("a shape needs both --layers and --d-model (or --hf-config FILE)")
    seq = args.seq or 2048
    return shape_from_dims(layers=args.layers, d_model=args.d_model, heads=args.heads or max(1, args.d_model // 64),
                           vocab=args.vocab, seq=seq, batch=args.batch, ffn=args.ffn, tied=not args.untied,
                           recompute=args.recompute, accumulation=args.accumulation, positions=seq)


def _profile(args: argparse.Namespace) -> Optional[MachineProfile]:
    """--profile FILE; else --measure (measured now, cached); else this machine's cached
    profile when its fingerprint matches; else None (no step times)."""
    if args.profile:
        return load_profile(args.profile)
    measure = lambda: measure_profile(nvme_path=args.nvme_path, block_size=args.block_size,  # noqa: E731
                                      quick=args.quick)
    if args.measure:
        return cached_profile(measure, args.nvme_path, refresh=True)
    return this_machine_cached(args.nvme_path)


def _param_count(text: str, flag: str) -> int:
    try:
        return parse_count(text)
    except ValueError:
        raise ValueError(f"{flag}: cannot read {text!r} as a parameter count; write e.g. 7e9, "
                         "7B or 350M") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        gpus = args.gpus
        gpu_mem = args.gpu_mem
        if gpus is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpu_mem is not None and not gpus:
            # Planning for the CPU with a GPU size given would report GPU figures for a run
            # that has none: say so rather than guess how many GPUs were meant.
            raise ValueError(f"--gpu-mem {gpu_mem} needs --gpus N (N > 0): "
                             + ("this machine has no GPU to count" if args.gpus is None
                                else "--gpus 0 plans for the CPU, which has no GPU memory"))
        if gpus and gpu_mem is None:
            if not torch.cuda.is_available():
                raise ValueError("--gpus > 0 needs --gpu-mem (no GPU on this machine to measure)")
            gpu_mem = torch.cuda.get_device_properties(0).total_memory
        cpu_mem = args.cpu_mem if args.cpu_mem is not None else mem_available_bytes()
        nvme = args.nvme_free
        if nvme is None and args.nvme_path:
            if not os.path.isdir(args.nvme_path):
                state = "is not a directory" if os.path.exists(args.nvme_path) else "does not exist"
                raise ValueError(f"--nvme-path {args.nvme_path} {state}: point it at a directory on the disk "
                                 "to plan for (its free space is measured), or give --nvme-free BYTES")
            nvme = shutil.disk_usage(args.nvme_path).free
            on_memory = memory_backed(args.nvme_path, "--nvme-path")
            if on_memory is not None:
                print(f"warning: {on_memory}", file=sys.stderr)
        per_node, world = _ranks(args, gpus)
        machine = make_machine(gpus=gpus, gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme_free=nvme,
                               world_size=world, ranks_per_node=per_node, gpu_reserve=args.gpu_reserve,
                               cpu_reserve=args.cpu_reserve, nvme_reserve=args.nvme_reserve)
        cfg = Config.from_dict({"offload": {"pinned_budget_bytes": parse_bytes(args.pinned_budget)},
                                "precision": {"dtype": args.dtype},
                                "optimizer": {"moments_dtype": args.moments}})
        profile = _profile(args)
        if args.measure:
            if args.profile_out:
                save_profile(profile, args.profile_out)  # type: ignore[arg-type]
            print(profile.describe() if profile else "")  # noqa: T201
            print(f"cached: {cache_path()}")
            if args.params is None and args.layers is None and args.hf_config is None:
                return 0
        shape = _shape(args)
        if args.params is None and shape is None:
            raise ValueError("give --params N, or the model's shape (--layers and --d-model, or --hf-config)")
        count = _param_count(args.params, "--params") if args.params is not None else shape.params  # type: ignore[union-attr]
        what: Any = count
        kw: dict[str, Any] = {"units": args.units, "profile": profile}
        if shape is not None:
            if args.params is not None and abs(shape.params - count) > 0.05 * count:
                raise ValueError(f"--params {args.params} differs from the shape's {shape.params:,} "
                                 "parameters by more than 5%; give one of them")
            what, kw = shape, {"profile": profile}
        if args.trainable is not None:
            what = _frozen_split_model(count, _param_count(args.trainable, "--trainable"), args.units)
            kw = {"profile": profile}
        if args.stages and args.sharding:
            raise ValueError("--stages and --sharding are two comparisons; ask for one (hybrid "
                             "sharding runs at stage 3)")
        compare = compare_stages if args.stages else compare_sharding if args.sharding else plan
        result: Any = compare(what, machine=machine, config=cfg, **kw)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    if shape is not None and profile is None and not args.json:
        print("no machine profile for this machine: measure one (python -m offload.plan --measure "
              "[--nvme-path DIR]) or give --profile FILE for step times")
    return 0 if result.recommended is not None else 1


def _ranks(args: argparse.Namespace, gpus: int) -> tuple[Optional[int], Optional[int]]:
    """(ranks per node, world size) from --nodes / --ranks-per-node / --world-size."""
    per_node = args.ranks_per_node
    if per_node is not None and per_node < 1:
        raise ValueError(f"--ranks-per-node {per_node}: a node runs at least one rank")
    if args.nodes is None:
        return per_node, args.world_size
    if args.nodes < 1:
        raise ValueError(f"--nodes {args.nodes}: a job has at least one node")
    per_node = per_node or gpus or 1
    if args.world_size is not None and args.world_size != args.nodes * per_node:
        raise ValueError(f"--world-size {args.world_size} differs from --nodes {args.nodes} x "
                         f"{per_node} ranks per node; give one of them")
    return per_node, args.nodes * per_node


def _frozen_split_model(params: int, trainable: int, units: Optional[int]) -> nn.Module:
    """A meta-device stand-in with `trainable` of `params` parameters trainable, spread
    evenly over the units (fine-tuning with frozen layers)."""
    if not 0 <= trainable <= params:
        raise ValueError(f"--trainable {trainable} must be between 0 and --params {params}")
    n = units or default_units(params)
    with torch.device("meta"):
        blocks = nn.ModuleList()
        for i in range(n):
            blk = nn.Module()
            t = trainable // n + (1 if i < trainable % n else 0)
            f = (params - trainable) // n + (1 if i < (params - trainable) % n else 0)
            if t:
                blk.w = nn.Parameter(torch.empty(t))
            if f:
                blk.frozen = nn.Parameter(torch.empty(f), requires_grad=False)
            blocks.append(blk)
        root = nn.Module()
        root.blocks = blocks
    return root
