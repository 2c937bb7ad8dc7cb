"""Train a GPT-style model with offload: sizes, tiers, precision, accumulation, checkpoints.

The model is built from flags (no weights are downloaded); the data is synthetic random
tokens unless --data names a text file (read as bytes: vocab 256). One process:

    python examples/train_gpt.py --layers 4 --d-model 256 --heads 4 --steps 20

Several processes (one node, or many: torchrun sets RANK/WORLD_SIZE/MASTER_ADDR and the
engine starts the process group from them):

    torchrun --nproc-per-node 2 examples/train_gpt.py --layers 4 --d-model 256 --heads 4

Tiers: --param-tier device|cpu|nvme, --optimizer-tier cpu|nvme (--nvme-path DIR), or
--placement auto to let the memory planner choose for this machine. Checkpoints:
--save-dir DIR --save-every N, and --resume to continue from DIR's latest checkpoint.
Every --log-every steps rank 0 prints step, loss, tokens/s, learning rate and the bytes the
engine holds per tier (a tqdm bar when tqdm is installed and stderr is a terminal); at the
end, the peak resident memory of the process against the planner's host figure.

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
import torch.nn.functional as F
from torch import nn

try:  # run from a checkout without installing: the repository root holds `offload`
    import offload
except ImportError:  # pragma: no cover - depends on how the example is launched
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import offload


# -- the model ------------------------------------------------------------------------------


class _Fp32Matmul(torch.autograd.Function):
    """y = x @ w.T + b for low-precision x, w, b, with the products computed in fp32.

    [Note: CPU bf16 matmuls] Without AMX / AVX512-BF16, torch's bf16 GEMMs on the CPU fall
    back to slow kernels, and how slow depends on the layout: on this 2-core AVX2 EPYC, for
    x (32 x 3072) and w (12288 x 3072), the forward x @ w.T takes 0.46 s in bf16 vs 0.20 s in
    fp32, and the backward's dy @ w 17 s vs 0.13 s. Upcasting the operands of each product
    (a transient fp32 copy of one weight, at most 4 x d_model^2 x 4 bytes) keeps bf16 training
    at fp32 speed. Only the low-precision x and w are saved for backward (as F.linear saves
    them), so no fp32 copy outlives its product; parameters, gradients and everything the
    engine stores stay in the compute dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        with torch.autocast("cpu", enabled=False):  # under autocast: the product stays fp32
            y = F.linear(x.float(), w.float(), None if b is None else b.float())
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        with torch.autocast("cpu", enabled=False):
            dy32 = dy.float()
            if ctx.needs_input_grad[0]:
                dx = (dy32 @ w.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = (dy32.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy32.reshape(-1, dy.shape[-1]).sum(0).to(w.dtype)
        return dx, dw, db, None


class Linear(nn.Linear):
    """nn.Linear whose product runs in fp32 when `fp32_matmul` is set and the layer computes
    in bf16/fp16 on the CPU — low-precision input, or under `torch.autocast("cpu")` (plain
    PyTorch mixed precision) — see [Note: CPU bf16 matmuls]; otherwise exactly nn.Linear.
    The output has the dtype nn.Linear would give (the input's, or autocast's)."""

    fp32_matmul = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_matmul and x.device.type == "cpu":
            if torch.is_autocast_enabled("cpu"):
                return _Fp32Matmul.apply(x, self.weight, self.bias, torch.get_autocast_dtype("cpu"))
            if x.dtype in (torch.bfloat16, torch.float16):
                return _Fp32Matmul.apply(x, self.weight, self.bias, x.dtype)
        return super().forward(x)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = Linear(d_model, 3 * d_model)
        self.proj = Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = Linear(d_model, 4 * d_model)
        self.out = Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Embedding(nn.Embedding):
    """GPT-2's initialisation (normal, std 0.02) as reset_parameters, so offload.init
    replays it when the model is built on the meta device."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class GPT(nn.Module):
    """Token + position embeddings, `n_layer` blocks (each one offload unit), final norm,
    LM head tied to the token embedding. forward(idx, targets) -> mean cross-entropy."""

    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, seq: int,
                 checkpoint_activations: bool = False, fp32_matmul: bool = False) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"--d-model {d_model} must be a multiple of --heads {n_head}")
        self.wte = Embedding(vocab, d_model)
        self.wpe = Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.checkpoint_activations = checkpoint_activations
        for m in self.modules():
            if isinstance(m, Linear):
                m.fp32_matmul = fp32_matmul

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            if self.checkpoint_activations and self.training:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


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

# --size presets: (layers, d_model, heads). Parameters ~ 12 x layers x d_model^2 + (vocab +
# seq) x d_model; at the default vocab 8192 these land on their names. "4b" is deep and
# thin on purpose: a unit (one block) holds 79M parameters, so with both tiers on NVMe one
# unit's working set in the staging pool (fp32 master + 2 moments + bf16 shard, 14 B/param)
# is 1.1 GB, and a 2.2 GB pool overlaps one unit's reads with the previous one's writes.
SIZES = {
    "tiny": (2, 64, 2),
    "125m": (12, 768, 12),
    "500m": (18, 1536, 12),
    "1b": (20, 2048, 16),
    "4b": (52, 2560, 20),
    "7b": (32, 4096, 32),
}


def parse_bytes(text: str) -> int:
    """'20GiB', '1.5G', '512MiB', '1e9' -> bytes (binary units for K/M/G/T, with or without 'iB')."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    for suffix, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if t.endswith(suffix):
            return int(float(t[:-1]) * mult)
    return int(float(t))


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


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="a preset for --layers/--d-model/--heads: " +
                        ", ".join(f"{k} = {v[0]} x {v[1]} ({v[2]} heads)" for k, v in SIZES.items()))
    m.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4)")
    m.add_argument("--d-model", type=int, default=None, help="width (default 256)")
    m.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    m.add_argument("--vocab", type=int, default=8192)
    m.add_argument("--seq", type=int, default=128)
    m.add_argument("--checkpoint-activations", action="store_true",
                   help="torch.utils.checkpoint each block (less activation memory, more compute)")
    m.add_argument("--init-on-meta", action="store_true",
                   help="build the model inside offload.init: straight into its shards, for "
                        "models larger than one process's memory")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=20, help="optimizer steps (total, across resumes)")
    t.add_argument("--batch", type=int, default=8, help="micro-batch size per rank")
    t.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=2, help="linear warmup steps")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, x lr")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--moments", choices=["fp32", "bf16"], default="fp32",
                   help="Adam moments' dtype (bf16: 4 B/param less state, on disk or in memory)")
    t.add_argument("--clip", type=float, default=1.0, help="global-norm clipping; 0 = off")
    t.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on a GPU, fp32 on the CPU (CPU bf16 matmuls are slow "
                        "without AMX: ~40x slower than fp32 on an AVX2 machine)")
    t.add_argument("--cpu-matmul", choices=["auto", "fp32", "native"], default="auto",
                   help="bf16/fp16 on the CPU: compute each Linear's products in fp32 (auto, "
                        "fp32) or with torch's low-precision kernels (native); see [Note: CPU "
                        "bf16 matmuls]")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data", default=None, help="a text file to train on (bytes; sets --vocab 256)")
    o = p.add_argument_group("tiers")
    o.add_argument("--param-tier", choices=["device", "cpu", "nvme"], default="cpu")
    o.add_argument("--optimizer-tier", choices=["cpu", "nvme"], default="cpu")
    o.add_argument("--placement", choices=["manual", "auto"], default="manual",
                   help="auto: the memory planner picks the tiers for this machine")
    o.add_argument("--nvme-path", default=None, help="directory for swap files (nvme tiers)")
    o.add_argument("--pinned-budget", type=int, default=1 << 30, help="pinned staging bytes (nvme)")
    o.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    c = p.add_argument_group("checkpoints and output")
    c.add_argument("--save-dir", default=None)
    c.add_argument("--save-every", type=int, default=0, help="optimizer steps between checkpoints")
    c.add_argument("--resume", action="store_true", help="continue from --save-dir's latest checkpoint")
    c.add_argument("--log-every", type=int, default=1)
    c.add_argument("--json", default=None, help="write the final figures to this JSON file (rank 0)")
    c.add_argument("--rss-budget", default=None,
                   help="host memory budget for this process, e.g. 20GiB: the run fails (exit 3) "
                        "if its peak resident set exceeded it")
    args = p.parse_args(argv)
    preset = SIZES[args.size] if args.size else (4, 256, 4)
    for name, value in zip(("layers", "d_model", "heads"), preset):
        if getattr(args, name) is None:
            setattr(args, name, value)  # an explicit flag wins over the preset
    args.rss_budget_bytes = parse_bytes(args.rss_budget) if args.rss_budget else None
    if args.nvme_path and "nvme" in (args.param_tier, args.optimizer_tier, args.placement.replace("auto", "nvme")):
        os.makedirs(args.nvme_path, exist_ok=True)  # the engine checks the disk behind it
    if args.data:
        args.vocab = 256
    if args.precision == "auto":
        on_gpu = args.device != "cpu" and torch.cuda.is_available()
        args.precision = "bf16" if on_gpu else "fp32"
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir (where the checkpoints are)")
    return args


def make_config(args: argparse.Namespace) -> offload.Config:
    offload_section = {"nvme_path": args.nvme_path, "pinned_budget_bytes": args.pinned_budget,
                       "placement": args.placement}
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


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    config = make_config(args)
    torch.manual_seed(args.seed)
    fp32_matmul = args.cpu_matmul != "native" and args.precision in ("bf16", "fp16")
    build = lambda: GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq,  # noqa: E731
                        args.checkpoint_activations, fp32_matmul)
    t_init = time.perf_counter()
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
        path, client = engine.load_checkpoint(args.save_dir)
        start = int((client or {}).get("step", engine.global_steps))
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)

    if rank == 0:
        print(f"GPT {n_params / 1e6:.2f}M parameters ({args.layers} layers, d_model "
              f"{args.d_model}, vocab {args.vocab}, seq {args.seq}); world size {world}; "
              f"{args.precision}; params on {cfg.offload.param_tier}, optimizer on "
              f"{cfg.offload.optimizer_tier}; device {engine.device}", flush=True)
        if planned is not None:
            print(f"initialized in {init_s:.1f} s; planner, per rank: host {_gib(planned['host'])} "
                  f"+ pinned {_gib(planned['pinned'])}, nvme {_gib(planned['nvme'])}, work "
                  f"{_gib(planned['work'])}; peak RSS so far {_gib(peak_rss_bytes())}", flush=True)

    bar = None
    if rank == 0 and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
        except ImportError:
            bar = None

    engine.train()
    data = batches(args, rank, start)
    tokens_per_step = args.batch * args.seq * args.accum * world
    loss_value = float("nan")
    tok_s = 0.0
    step_s: list[float] = []
    io_per_step: list[int] = []
    io_wait_s: list[float] = []
    t_run = time.perf_counter()
    for step in range(start, args.steps):
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
        if args.save_dir and args.save_every and (done % args.save_every == 0 or done == args.steps):
            engine.save_checkpoint(args.save_dir, client_state={"step": done})
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            mem = engine.memory_bytes()
            tiers = " ".join(f"{k} {_mib(v)}" for k, v in mem.items())  # device host [pinned] nvme
            line = (f"step {done}/{args.steps} loss {loss_value:.4f} tok/s {_rate(tok_s)} "
                    f"lr {engine.get_lr()[0]:.2e} mem {tiers}")
            if io_per_step[-1]:
                line += (f" | {dt:.1f} s, NVMe {io_per_step[-1] / 1e9:.1f} GB, "
                         f"waited {io_wait_s[-1]:.1f} s")
            if bar is not None:
                bar.set_postfix_str(line.split(" ", 2)[2])
                bar.update(done - bar.n)
            else:
                print(line, flush=True)
    if bar is not None:
        bar.close()
    memory = engine.memory_bytes()
    peak = peak_rss_bytes()
    result = {"params": n_params, "world_size": world, "steps": args.steps, "start_step": start,
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
        print(f"peak RSS {_gib(peak)} exceeded --rss-budget {_gib(args.rss_budget_bytes)}", file=sys.stderr)
        raise SystemExit(3)
    return result


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
    return {**est.per_rank.as_dict(), "work": est.working_device_bytes,
            "disk_bytes_per_step": est.disk_bytes_per_step}


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _summary(r: dict, tokens_per_step: int) -> None:
    """The end-of-run figures: state per tier, time per step, I/O, peak RSS vs plan/budget."""
    mem = r["memory"]
    state = mem["host"] + mem["device"] + mem["nvme"]  # pinned is staging, not state
    print(f"training state: {state / 1e9:.1f} GB ({state / r['params']:.1f} B/param): host "
          f"{_gib(mem['host'])}, device {_gib(mem['device'])}, nvme {_gib(mem['nvme'])}; "
          f"pinned staging {_gib(mem.get('pinned', 0))}")
    steps = r["step_s"]
    if steps:
        import statistics

        later = steps[1:] or steps  # the first step also fills the pipeline and caches
        t = statistics.median(later)
        io = statistics.median(r["io_bytes_per_step"][1:] or r["io_bytes_per_step"])
        print(f"init {r['init_s']:.1f} s; step times {', '.join(f'{s:.1f}' for s in steps)} s; "
              f"median after the first {t:.1f} s = {_rate(tokens_per_step / t)} tokens/s; "
              f"NVMe I/O {io / 1e9:.1f} GB/step ({io / r['params']:.1f} B/param, "
              f"{io / t / 1e9:.2f} GB/s)")
    line = f"peak RSS {_gib(r['peak_rss_bytes'])}"
    if r["planned"]:
        p = r["planned"]
        line += (f"; planner: host {_gib(p['host'])} + pinned {_gib(p['pinned'])} + work "
                 f"{_gib(p['work'])} = {_gib(p['host'] + p['pinned'] + p['work'])}")
    if r["rss_budget_bytes"]:
        ok = r["peak_rss_bytes"] <= r["rss_budget_bytes"]
        line += f"; budget {_gib(r['rss_budget_bytes'])}: {'within' if ok else 'EXCEEDED'}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
