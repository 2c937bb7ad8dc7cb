"""Train a GPT-style model with offload: sizes, tiers, precision, accumulation, checkpoints.

The model is built from flags (no weights are downloaded); the data is synthetic random
tokens unless --data names a text file (read as bytes: vocab 256). One process:

    python examples/train_gpt.py --layers 4 --d-model 256 --heads 4 --steps 20

Several processes (one node, or many: torchrun sets RANK/WORLD_SIZE/MASTER_ADDR and the
engine starts the process group from them):

    torchrun --nproc-per-node 2 examples/train_gpt.py --layers 4 --d-model 256 --heads 4

Tiers: --param-tier device|cpu|nvme, --optimizer-tier cpu|nvme (--nvme-path DIR), or
--placement auto to let the memory planner choose for this machine. Checkpoints:
--save-dir DIR --save-every N (a line per save with its size; --keep-last N removes older
ones once a newer one is complete), and --resume to continue from DIR's latest checkpoint.
Ctrl-C or SIGTERM ends the run with one line (the step, the cleanup, the last complete
checkpoint and the command to resume) and exit status 130 / 143; --debug (or
OFFLOAD_DEBUG=1) adds the traceback.
Rank 0 shows step, loss, tokens/s, the bytes the engine holds per tier and the learning rate:
a tqdm bar when stdout is a terminal, else one line every --log-every steps
(examples/progress.py); at the end, the peak resident memory of the process against the
planner's host figure. Sizes take the same forms in every flag (1GiB, 1.2GB, 512MiB, bytes:
offload.sizes.parse_bytes). A bad flag value the engine checks (a --nvme-path that cannot be
created or written, a budget too small for one unit, a full disk) is one line, `error: ...`,
and exit status 2.

A model larger than this machine's memory (docs/examples.md, "A model larger than RAM"):

    python examples/train_gpt.py --size 4b --precision bf16 --init-on-meta \\
        --param-tier nvme --optimizer-tier nvme --nvme-path /work/bigrun/swap \\
        --pinned-budget 1200000000 --batch 1 --seq 32 --steps 3 --rss-budget 19GiB

(or examples/larger_than_ram.sh, which also runs the plain-PyTorch baseline).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Iterator, Optional

import torch
from torch import nn

try:  # run from a checkout without installing: the repository root holds `offload`
    import offload
except ImportError:  # pragma: no cover - depends on how the example is launched
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import offload
# The model is offload's own GPT (offload/models/gpt.py), the one the tests and benchmarks
# train; this script turns on GPT-2's qkv bias and, from flags, checkpointing and fp32 matmuls.
from offload.models.gpt import GPT, GPT_PRESETS
from offload.sizes import GiB, format_bytes

from cli import add_tier_flags, engine_errors, interruptions, make_swap_dir, size_arg  # examples/cli.py
from progress import Progress  # examples/progress.py


# -- data -----------------------------------------------------------------------------------


def batches(args: argparse.Namespace, rank: int, start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(idx, targets) micro-batches for this rank from optimizer step `start_step` on.

    Each micro-batch is drawn from a generator seeded by (seed, step, micro-batch, rank),
    so a resumed run sees exactly the batches the uninterrupted run would have."""
    text: Optional[torch.Tensor] = None
    if args.data:
        with open(args.data, "rb") as f:
            text = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        if text.numel() < args.seq + 2:
            raise ValueError(f"--data {args.data}: {text.numel()} bytes, need at least --seq + 2")
    step = start_step
    while True:
        for micro in range(args.accum):
            g = torch.Generator().manual_seed(((args.seed * 1_000_003 + step) * 1009 + micro) * 131 + rank)
            if text is None:
                chunk = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            else:
                starts = torch.randint(0, text.numel() - args.seq - 1, (args.batch,), generator=g)
                chunk = torch.stack([text[s : s + args.seq + 1] for s in starts.tolist()])
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        step += 1


# -- the schedule ---------------------------------------------------------------------------


def lr_lambda(args: argparse.Namespace):
    """Linear warmup over --warmup steps, then cosine decay to --min-lr-ratio x lr at --steps."""

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# -- sizes and memory -------------------------------------------------------------------------
# Sizes on the command line are read by offload.sizes.parse_bytes: GB = 10**9 bytes, GiB = 2**30.


def peak_rss_bytes() -> int:
    """The process's peak resident set: /proc/self/status VmHWM (the kernel's high-water
    mark, what `/usr/bin/time -v` reports as its maximum resident set size), else
    getrusage's ru_maxrss (KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _size(n: float) -> str:
    """offload.sizes.format_bytes, with two decimals from 1 GiB up (0.01 GiB is 10 MiB, the
    precision a memory figure needs) and one below."""
    return format_bytes(n, digits=2 if n >= GiB else 1)


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--size", choices=sorted(GPT_PRESETS), default=None,
                   help="a preset for --layers/--d-model/--heads (offload.models.gpt.GPT_PRESETS): " +
                        ", ".join(f"{k} = {v[0]} x {v[1]} ({v[2]} heads)" for k, v in GPT_PRESETS.items()))
    m.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4)")
    m.add_argument("--d-model", type=int, default=None, help="width (default 256)")
    m.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    m.add_argument("--vocab", type=int, default=8192, help="vocabulary size (256 with --data)")
    m.add_argument("--seq", type=int, default=128, help="sequence length, tokens")
    m.add_argument("--checkpoint-activations", action="store_true",
                   help="torch.utils.checkpoint each block (less activation memory, more compute)")
    m.add_argument("--init-on-meta", action="store_true",
                   help="build the model inside offload.init: straight into its shards, for "
                        "models larger than one process's memory")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=20,
                   help="optimizer steps (total, across resumes); the LR schedule spans them, so "
                        "--resume refuses a different value")
    t.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many optimizer steps (the schedule still spans --steps; "
                        "resume later with the same --steps)")
    t.add_argument("--batch", type=int, default=8, help="micro-batch size per rank")
    t.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=2, help="linear warmup steps")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, x lr")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    t.add_argument("--moments", choices=["fp32", "bf16"], default="fp32",
                   help="Adam moments' dtype (bf16: 4 B/param less state, on disk or in memory)")
    t.add_argument("--clip", type=float, default=1.0, help="global-norm clipping; 0 = off")
    t.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on a GPU, fp32 on the CPU (CPU bf16 matmuls are slow "
                        "without AMX: ~40x slower than fp32 on an AVX2 machine)")
    t.add_argument("--cpu-matmul", choices=["auto", "fp32", "native"], default="auto",
                   help="bf16/fp16 on the CPU: compute each Linear's products in fp32 (auto, "
                        "fp32) or with torch's low-precision kernels (native); see [Note: CPU "
                        "bf16 matmuls] in offload/models/gpt.py")
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    t.add_argument("--data", default=None, help="a text file to train on (bytes; sets --vocab 256)")
    o = p.add_argument_group("tiers")
    add_tier_flags(o, placement=True)
    o.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="compute device (auto: cuda when available)")
    c = p.add_argument_group("checkpoints and output")
    c.add_argument("--save-dir", default=None, help="checkpoint directory")
    c.add_argument("--save-every", type=int, default=0, help="optimizer steps between checkpoints")
    c.add_argument("--keep-last", type=int, default=None,
                   help="keep only the newest N complete checkpoints in --save-dir (older ones are "
                        "removed after each save completes); default: keep all")
    c.add_argument("--debug", action="store_true", help="print the traceback of an interruption")
    c.add_argument("--resume", action="store_true", help="continue from --save-dir's latest checkpoint")
    c.add_argument("--log-every", type=int, default=1,
                   help="steps between progress lines when stdout is not a terminal")
    c.add_argument("--json", default=None, help="write the final figures to this JSON file (rank 0)")
    c.add_argument("--rss-budget", type=size_arg, default=None,
                   help="host memory budget for this process, e.g. 20GiB (GiB = 2**30 bytes, "
                        "GB = 10**9): the run fails (exit 3) if its peak resident set exceeded it")
    args = p.parse_args(argv)
    preset = GPT_PRESETS[args.size] if args.size else (4, 256, 4)
    for name, value in zip(("layers", "d_model", "heads"), preset):
        if getattr(args, name) is None:
            setattr(args, name, value)  # an explicit flag wins over the preset
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    args.rss_budget_bytes = args.rss_budget
    if args.data:
        args.vocab = 256
    if args.precision == "auto":
        on_gpu = args.device != "cpu" and torch.cuda.is_available()
        args.precision = "bf16" if on_gpu else "fp32"
    if args.keep_last is not None and args.keep_last < 1:
        p.error(f"--keep-last {args.keep_last} must be at least 1 (the newest checkpoint is always kept)")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        p.error(f"--stop-after {args.stop_after} must be between 1 and --steps {args.steps}")
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir (where the checkpoints are)")
    return args


def make_config(args: argparse.Namespace) -> offload.Config:
    offload_section = {"nvme_path": args.nvme_path, "pinned_budget_bytes": args.pinned_budget,
                       "placement": args.placement, "ram_budget_bytes": args.ram_budget}
    if args.placement == "manual":
        offload_section.update(param_tier=args.param_tier, optimizer_tier=args.optimizer_tier)
    return offload.Config.from_dict({
        "offload": offload_section,
        "optimizer": {"lr": args.lr, "weight_decay": args.weight_decay, "betas": [0.9, 0.95],
                      "moments_dtype": args.moments},
        "precision": {"dtype": args.precision},
        "gradient_clipping": args.clip,
        "gradient_accumulation_steps": args.accum,
        "train_micro_batch_size_per_gpu": args.batch,
        "compute_device": args.device,
    })


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"


def _schedule(args: argparse.Namespace) -> dict:
    """What lr_lambda's schedule depends on: saved with each checkpoint, checked on resume."""
    return {"steps": args.steps, "warmup": args.warmup, "lr": args.lr,
            "min_lr_ratio": args.min_lr_ratio}


def _resume(engine, args: argparse.Namespace) -> tuple[str, int]:
    """Load --save-dir's latest checkpoint; (its path, the step to continue from).

    The schedule is a function of --steps (and --warmup, --lr, --min-lr-ratio): resuming
    with other values would silently bend the LR curve mid-run, so that is refused with both
    values named; --stop-after ends a run early without changing the schedule."""
    path, client = engine.load_checkpoint(args.save_dir)
    client = client or {}
    saved = client.get("schedule")
    if saved is not None and saved != _schedule(args):
        flags = ", ".join(f"--{k.replace('_', '-')} {saved[k]} (this run: {v})"
                          for k, v in _schedule(args).items() if saved.get(k) != v)
        raise ValueError(f"{path} was trained on an LR schedule with {flags}; resume with the "
                         "checkpoint's values (--stop-after ends a run earlier), or start a new "
                         "run in another --save-dir")
    return path, int(client.get("step", engine.global_steps))


def _uses_nvme(args: argparse.Namespace) -> bool:
    return args.placement == "auto" or "nvme" in (args.param_tier, args.optimizer_tier)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    with engine_errors():  # the engine's checks at the door: `error: ...`, exit 2
        if args.nvme_path and _uses_nvme(args):
            make_swap_dir(args.nvme_path, "--nvme-path")  # created here, checked by the engine
        elif args.nvme_path:
            print(f"note: --nvme-path {args.nvme_path} is not used: no tier is on NVMe (add --param-tier nvme "
                  "and/or --optimizer-tier nvme, or --placement auto)", file=sys.stderr, flush=True)
        config = make_config(args)
    torch.manual_seed(args.seed)
    fp32_matmul = args.cpu_matmul != "native" and args.precision in ("bf16", "fp16")
    build = lambda: GPT(  # noqa: E731
        args.vocab, args.d_model, args.layers, args.heads, args.seq, qkv_bias=True,  # GPT-2's
        checkpoint="nonreentrant" if args.checkpoint_activations else "", fp32_matmul=fp32_matmul)
    t_init = time.perf_counter()
    with engine_errors():
        if args.init_on_meta:
            with offload.init(config):
                model = build()
        else:
            model = build()
        n_params = sum(p.numel() for p in model.parameters())
        engine = offload.initialize(
            model, config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args)))
    init_s = time.perf_counter() - t_init
    planned = _planned(model, engine)
    del model  # the engine holds the shards; the original parameters can go
    rank, world = engine.rank, engine.world_size
    cfg = engine.config  # with placement auto: the tiers the planner chose

    start = 0
    if args.resume:
        with engine_errors():
            try:
                path, start = _resume(engine, args)
            except BaseException:
                engine.close()  # no swap files left behind by a refused resume
                raise
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)

    if rank == 0:
        print(f"GPT {n_params / 1e6:.2f}M parameters ({args.layers} layers, d_model "
              f"{args.d_model}, vocab {args.vocab}, seq {args.seq}); world size {world}; "
              f"{args.precision}; params on {cfg.offload.param_tier}, optimizer on "
              f"{cfg.offload.optimizer_tier}; device {engine.device}", flush=True)
        if engine.placement.mixed or cfg.offload.ram_budget_bytes:
            print(f"kept in RAM instead of NVMe ({_size(cfg.offload.ram_budget_bytes or 0)} budget): "
                  f"{engine.placement.describe()}", flush=True)
        if planned is not None:
            print(f"initialized in {init_s:.1f} s; planner, per rank: host {_size(planned['host'])} "
                  f"+ pinned {_size(planned['pinned'])}, nvme {_size(planned['nvme'])}, work "
                  f"{_size(planned['work'])}; peak RSS so far {_size(peak_rss_bytes())}", flush=True)

    end = min(args.steps, args.stop_after) if args.stop_after is not None else args.steps
    progress = Progress(args.steps, initial=start, every=args.log_every) if rank == 0 else None

    engine.train()
    data = batches(args, rank, start)
    tokens_per_step = args.batch * args.seq * args.accum * world
    step_s: list[float] = []
    io_per_step: list[int] = []
    io_wait_s: list[float] = []
    t_run = time.perf_counter()
    at = [start]  # the optimizer steps completed, for an interruption's line
    with interruptions(lambda sig: _interrupted(engine, args, at[0], sig, progress), debug=args.debug):
        loss_value, tok_s = _train(engine, args, data, start, end, at, progress, tokens_per_step,
                                   step_s, io_per_step, io_wait_s)
    if progress is not None:
        progress.close()
    memory = engine.memory_bytes()
    peak = peak_rss_bytes()
    result = {"params": n_params, "world_size": world, "steps": end, "schedule_steps": args.steps,
              "start_step": start,
              "final_loss": loss_value, "tokens_per_s": tok_s,
              "seconds": time.perf_counter() - t_run, "memory": memory,
              "param_tier": cfg.offload.param_tier, "optimizer_tier": cfg.offload.optimizer_tier,
              "init_s": round(init_s, 2), "step_s": [round(t, 3) for t in step_s],
              "io_bytes_per_step": io_per_step, "io_wait_s": [round(t, 3) for t in io_wait_s],
              "peak_rss_bytes": peak, "planned": planned,
              "rss_budget_bytes": args.rss_budget_bytes}
    if rank == 0:
        _summary(result, tokens_per_step)
        print("done: " + json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    engine.close()
    if args.rss_budget_bytes is not None and peak > args.rss_budget_bytes:
        print(f"peak RSS {_size(peak)} exceeded --rss-budget {_size(args.rss_budget_bytes)}", file=sys.stderr)
        raise SystemExit(3)
    return result


def _train(engine, args: argparse.Namespace, data, start: int, end: int, at: list, progress,
           tokens_per_step: int, step_s: list, io_per_step: list, io_wait_s: list) -> tuple[float, float]:
    """The training loop: steps start..end; `at[0]` follows the steps completed."""
    loss_value, tok_s = float("nan"), 0.0
    for step in range(start, end):
        t0 = time.perf_counter()
        io0 = engine.io_stats()
        total = 0.0
        for _ in range(args.accum):
            x, y = next(data)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        loss_value = total / args.accum
        dt = time.perf_counter() - t0
        io1 = engine.io_stats()
        step_s.append(dt)
        io_per_step.append(int(io1["bytes_read"] - io0["bytes_read"] + io1["bytes_written"] - io0["bytes_written"]))
        io_wait_s.append(io1["wait_s"] - io0["wait_s"])
        tok_s = tokens_per_step / dt
        done = step + 1
        at[0] = done
        if args.save_dir and args.save_every and (done % args.save_every == 0 or done == end):
            _save(engine, args, done)
        if progress is not None:
            mem = engine.memory_bytes()
            tiers = " ".join(f"{k} {_mib(v)}" for k, v in mem.items())  # device host [pinned] nvme
            # Most important first: a bar too wide for the terminal drops fields from the end.
            fields = [f"loss {loss_value:.4f}", f"tok/s {_rate(tok_s)}", f"mem {tiers}",
                      f"lr {engine.get_lr()[0]:.2e}"]
            if io_per_step[-1]:
                fields.append(f"| {dt:.1f} s, NVMe {io_per_step[-1] / 1e9:.1f} GB, "
                              f"waited {io_wait_s[-1]:.1f} s")
            progress.update(done, fields)
    return loss_value, tok_s


def _save(engine, args: argparse.Namespace, done: int) -> None:
    """A checkpoint at step `done`, a line saying where, how big and how long, and (with
    --keep-last) the older ones removed now that this one is complete."""
    from offload.checkpoint.retention import checkpoint_bytes, prune

    t0 = time.perf_counter()
    path = engine.save_checkpoint(args.save_dir, client_state={"step": done, "schedule": _schedule(args)})
    if engine.rank != 0:
        return
    line = f"saved {path} ({_size(checkpoint_bytes(path))} in {time.perf_counter() - t0:.1f} s)"
    if args.keep_last:
        removed = prune(args.save_dir, args.keep_last)
        if removed:
            line += f"; removed {', '.join(removed)} (--keep-last {args.keep_last})"
    print(line, flush=True)


def _interrupted(engine, args: argparse.Namespace, done: int, sig: str, progress) -> str:
    """Clean up after Ctrl-C / SIGTERM and say where the run stands (rank 0's line)."""
    from offload.checkpoint.retention import latest_tag

    if progress is not None:
        progress.close()
    rank = engine.rank
    try:
        engine.close()  # swap files deleted, I/O workers stopped
        cleaned = "engine closed, swap files removed" if args.nvme_path else "engine closed"
    except Exception as exc:  # noqa: BLE001 - reported in the line; exiting anyway
        cleaned = f"cleanup failed ({type(exc).__name__}: {exc})"
    if rank != 0:
        return ""
    tag = latest_tag(args.save_dir) if args.save_dir else None
    if tag is not None:
        ckpt = (f"last complete checkpoint {os.path.join(args.save_dir, tag)}; resume with the same "
                f"command plus --resume")
    elif args.save_dir:
        ckpt = "no checkpoint was completed yet (nothing to resume)"
    else:
        ckpt = "no checkpoints (--save-dir DIR --save-every N keeps progress)"
    return f"interrupted ({sig}) after {done} of {args.steps} steps: {cleaned}; {ckpt}"


def _planned(model: nn.Module, engine) -> Optional[dict]:
    """The memory planner's figures for this model and the placement the engine runs
    (per rank), to print next to what the process measured; None if the planner fails."""
    try:
        from offload.plan import make_machine, plan

        cfg = engine.config
        # Room everywhere: only the bytes of the placement the engine runs are wanted.
        gpus = 1 if engine.device.type == "cuda" else 0
        machine = make_machine(gpus=gpus, gpu_mem=(1 << 50) if gpus else None, cpu_mem=1 << 50,
                               nvme_free=1 << 50, world_size=engine.world_size, ranks_per_node=1)
        est = plan(model, machine=machine, config=cfg).estimate(
            cfg.offload.param_tier, cfg.offload.optimizer_tier)
    except Exception as exc:  # the figures are a report, not a reason to stop training
        print(f"(planner figures unavailable: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    out = {**est.per_rank.as_dict(), "work": est.working_device_bytes,
           "disk_bytes_per_step": est.disk_bytes_per_step}
    # The planner's figures have every unit on its tier: move the units kept in RAM.
    host, disk = _kept_in_ram(engine)
    out["host"] += host
    out["nvme"] -= disk
    return out


def _kept_in_ram(engine) -> tuple[int, int]:
    """(host bytes, swap-file bytes) of the units `offload.ram_budget_bytes` kept in RAM
    instead of on NVMe (a swap-file slot spans whole 4 KiB pages per tensor)."""
    from offload.sizes import align_up

    off, placement, host, disk = engine.config.offload, engine.placement, 0, 0
    for i, (unit, st) in enumerate(zip(engine.units, engine.states)):
        if off.param_tier == "nvme" and not placement.param_on_nvme[i]:
            host += unit.layout.shard_numel * engine.dtype.itemsize
            disk += align_up(unit.layout.shard_numel * engine.dtype.itemsize)
        if off.optimizer_tier == "nvme" and not placement.state_on_nvme[i]:
            sizes = [t.numel() * t.element_size()
                     for t in (st.master, *(st.moments or {}).values()) if t is not None]
            host += sum(sizes)
            disk += sum(align_up(b) for b in sizes)
    return host, disk


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _summary(r: dict, tokens_per_step: int) -> None:
    """The end-of-run figures: state per tier, time per step, I/O, peak RSS vs plan/budget.

    Every byte figure is this rank's (memory_bytes, io_stats, RSS), so per-parameter figures
    divide by this rank's share of the parameters (params / world size), not the total."""
    mem = r["memory"]
    state = mem["host"] + mem["device"] + mem["nvme"]  # pinned is staging, not state
    rank_params = r["params"] / r["world_size"]
    print(f"training state per rank: {state / 1e9:.1f} GB ({state / rank_params:.1f} B/param): host "
          f"{_size(mem['host'])}, device {_size(mem['device'])}, nvme {_size(mem['nvme'])}; "
          f"pinned staging {_size(mem.get('pinned', 0))}")
    steps = r["step_s"]
    if steps:
        import statistics

        later = steps[1:] or steps  # the first step also fills the pipeline and caches
        t = statistics.median(later)
        io = statistics.median(r["io_bytes_per_step"][1:] or r["io_bytes_per_step"])
        print(f"init {r['init_s']:.1f} s; step times {', '.join(f'{s:.1f}' for s in steps)} s; "
              f"median after the first {t:.1f} s = {_rate(tokens_per_step / t)} tokens/s; "
              f"NVMe I/O per rank {io / 1e9:.1f} GB/step ({io / rank_params:.1f} B/param, "
              f"{io / t / 1e9:.2f} GB/s)")
    line = f"peak RSS {_size(r['peak_rss_bytes'])}"
    if r["planned"]:
        p = r["planned"]
        line += (f"; planner: host {_size(p['host'])} + pinned {_size(p['pinned'])} + work "
                 f"{_size(p['work'])} = {_size(p['host'] + p['pinned'] + p['work'])}")
    if r["rss_budget_bytes"]:
        ok = r["peak_rss_bytes"] <= r["rss_budget_bytes"]
        line += f"; budget {_size(r['rss_budget_bytes'])}: {'within' if ok else 'EXCEEDED'}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
