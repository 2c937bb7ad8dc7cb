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
engine holds per tier (a tqdm bar when tqdm is installed and stderr is a terminal).
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


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

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
                 checkpoint_activations: bool = False) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"--d-model {d_model} must be a multiple of --heads {n_head}")
        self.wte = Embedding(vocab, d_model)
        self.wpe = Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.checkpoint_activations = checkpoint_activations

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


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--d-model", type=int, default=256)
    m.add_argument("--heads", type=int, default=4)
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
    t.add_argument("--clip", type=float, default=1.0, help="global-norm clipping; 0 = off")
    t.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on a GPU, fp32 on the CPU (CPU bf16 matmuls are slow "
                        "without AMX: ~40x slower than fp32 on an AVX2 machine)")
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
    args = p.parse_args(argv)
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
        "optimizer": {"lr": args.lr, "weight_decay": args.weight_decay, "betas": [0.9, 0.95]},
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
    build = lambda: GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq,  # noqa: E731
                        args.checkpoint_activations)
    if args.init_on_meta:
        with offload.init(config):
            model = build()
    else:
        model = build()
    n_params = sum(p.numel() for p in model.parameters())
    engine = offload.initialize(
        model, config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args)))
    del model  # the engine holds the shards; the original parameters can go
    rank, world = engine.rank, engine.world_size
    cfg = engine.config  # with placement auto: the tiers the planner chose

    start = 0
    if args.resume:
        if not hasattr(engine, "load_checkpoint"):
            raise SystemExit("--resume: this offload build has no engine.load_checkpoint")
        path, client = engine.load_checkpoint(args.save_dir)
        start = int((client or {}).get("step", engine.global_steps))
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)
    if args.save_dir and args.save_every and not hasattr(engine, "save_checkpoint"):
        raise SystemExit("--save-dir/--save-every: this offload build has no engine.save_checkpoint")

    if rank == 0:
        print(f"GPT {n_params / 1e6:.2f}M parameters ({args.layers} layers, d_model "
              f"{args.d_model}, vocab {args.vocab}, seq {args.seq}); world size {world}; "
              f"{args.precision}; params on {cfg.offload.param_tier}, optimizer on "
              f"{cfg.offload.optimizer_tier}; device {engine.device}", flush=True)

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
    t_run = time.perf_counter()
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(args.accum):
            x, y = next(data)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        loss_value = total / args.accum
        dt = time.perf_counter() - t0
        tok_s = tokens_per_step / dt
        done = step + 1
        if args.save_dir and args.save_every and (done % args.save_every == 0 or done == args.steps):
            engine.save_checkpoint(args.save_dir, client_state={"step": done})
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            mem = engine.memory_bytes()
            tiers = " ".join(f"{k} {_mib(v)}" for k, v in mem.items())  # device host [pinned] nvme
            line = (f"step {done}/{args.steps} loss {loss_value:.4f} tok/s {tok_s:,.0f} "
                    f"lr {engine.get_lr()[0]:.2e} mem {tiers}")
            if bar is not None:
                bar.set_postfix_str(line.split(" ", 2)[2])
                bar.update(done - bar.n)
            else:
                print(line, flush=True)
    if bar is not None:
        bar.close()
    result = {"params": n_params, "world_size": world, "steps": args.steps, "start_step": start,
              "final_loss": loss_value, "tokens_per_s": tok_s,
              "seconds": time.perf_counter() - t_run, "memory": engine.memory_bytes(),
              "param_tier": cfg.offload.param_tier, "optimizer_tier": cfg.offload.optimizer_tier}
    if rank == 0:
        print("done: " + json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    engine.close()
    return result


if __name__ == "__main__":
    main()
