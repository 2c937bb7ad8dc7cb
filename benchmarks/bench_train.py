"""End-to-end training step: the engine vs plain PyTorch, FSDP2 CPU offload, DeepSpeed ZeRO-3.

Question: what does partitioned training with CPU offload cost per step, against plain
PyTorch training of the same model (fused AdamW) and against the other offload engines,
when compute runs on this machine (the CPU, or a GPU if one is present)?

Contenders (same GPT model and batches, one training step per sample, interleaved):
- torch:     plain model, torch.optim.AdamW(fused=True) (foreach where fused is missing)
- engine:    offload.initialize(model, Config(...)): ZeRO-3 units, fp32 master + Adam in
             CPU memory (world size 1)
- fsdp2:     torch.distributed.fsdp.fully_shard per block + root, CPUOffloadPolicy,
             torch.optim.AdamW over the sharded params
- deepspeed: deepspeed.initialize, ZeRO stage 3, offload_param + offload_optimizer to cpu
A contender that cannot run here is dropped with its reason printed.

    python benchmarks/bench_train.py --quick
    python benchmarks/bench_train.py --layers 8 --d-model 512 --seq 256 --batch 8
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import (  # noqa: E402
    base_parser,
    interleave,
    machine_info,
    print_machine,
    print_table,
    ratio,
    write_json,
)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        with torch.no_grad():
            self.wte.weight.normal_(std=0.02)
            self.wpe.weight.normal_(std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _mb(n) -> float | None:
    return None if n is None else n / 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _ensure_group(device: torch.device) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def build_contenders(args, make_model, batch, device) -> tuple[dict[str, Callable[[], float]], dict[str, dict]]:
    contenders: dict[str, Callable[[], float]] = {}
    memory: dict[str, dict] = {}
    x, y = batch
    lr = 1e-4

    def timed_step(model_call: Callable[[], torch.Tensor], backward, step) -> Callable[[], float]:
        def run() -> float:
            _sync(device)
            t0 = time.perf_counter()
            loss = model_call()
            backward(loss)
            step()
            _sync(device)
            return time.perf_counter() - t0

        return run

    def add(name: str, setup: Callable[[], tuple[Callable[[], float], dict]]) -> None:
        try:
            fn, mem = setup()
            fn()  # warm-up step outside the timings (allocations, JIT, first traces)
            contenders[name] = fn
            memory[name] = mem
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            print(f"  [{name}] dropped: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    def torch_setup():
        m = make_model().to(device)
        try:
            opt = torch.optim.AdamW(m.parameters(), lr=lr, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW(m.parameters(), lr=lr, foreach=True)
        xd, yd = x.to(device), y.to(device)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        fn = timed_step(lambda: m(xd, yd), lambda l: l.backward(), step)
        fn()  # materialise optimizer state before measuring memory
        mem = {"device": _bytes(list(m.parameters()) + [s for st in opt.state.values() for s in st.values()]), "host": 0}
        return fn, mem

    def engine_setup():
        import offload
        from offload.config import Config, OptimizerConfig, PrecisionConfig

        cfg = Config(
            compute_device=device.type,
            optimizer=OptimizerConfig(lr=lr),
            precision=PrecisionConfig(dtype=args.dtype),
        )
        engine = offload.initialize(make_model(), cfg)
        fn = timed_step(lambda: engine(x, y), engine.backward, engine.step)
        return fn, engine.memory_bytes

    def fsdp2_setup():
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        _ensure_group(device)
        m = make_model().to(device)
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for blk in m.blocks:
            fully_shard(blk, offload_policy=policy)
        fully_shard(m, offload_policy=policy)
        opt = torch.optim.AdamW(m.parameters(), lr=lr, foreach=True)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        fn = timed_step(lambda: m(x.to(device), y.to(device)), lambda l: l.backward(), step)
        fn()
        states = [s for st in opt.state.values() for s in st.values() if isinstance(s, torch.Tensor)]
        local = [getattr(t, "_local_tensor", t) for t in list(m.parameters()) + states]
        return fn, {"device": 0, "host": _bytes(local)}

    def deepspeed_setup():
        import logging

        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        _ensure_group(device)
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        ds_cfg = {
            "train_micro_batch_size_per_gpu": x.shape[0],
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"},
            },
            "bf16": {"enabled": args.dtype == "bf16"},
            "fp16": {"enabled": args.dtype == "fp16"},
            "wall_clock_breakdown": False,
        }
        eng, *_ = deepspeed.initialize(model=make_model(), model_parameters=None, config=ds_cfg)
        eng.optimizer  # noqa: B018
        fn = timed_step(lambda: eng(x.to(eng.device), y.to(eng.device)), eng.backward, eng.step)
        return fn, {"device": None, "host": None, "nvme": None}  # not exposed by DeepSpeed here

    add("torch", torch_setup)
    add("engine", engine_setup)
    if not args.no_fsdp2:
        add("fsdp2", fsdp2_setup)
    if not args.no_deepspeed:
        add("deepspeed", deepspeed_setup)
    return contenders, memory


def main() -> None:
    # The peers call collectives under names torch 2.13 deprecates; one line each per call.
    warnings.filterwarnings("ignore", category=FutureWarning)
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--no-fsdp2", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.layers, args.d_model, args.heads, args.vocab, args.seq, args.batch = 2, 256, 4, 4096, 128, 4
    repeats = args.repeats or (5 if args.quick else 7)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    info = machine_info()
    print_machine(info)

    def make_model() -> GPT:
        torch.manual_seed(0)
        return GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq)

    n_params = sum(p.numel() for p in make_model().parameters())
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    tokens = args.batch * args.seq
    print(
        f"model: GPT {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, "
        f"{n_params / 1e6:.1f} M params; batch {args.batch} x seq {args.seq} = {tokens} tokens; "
        f"{args.dtype} compute on {device}; {repeats} interleaved rounds"
    )
    from offload.optim import functional

    adam_impl = getattr(functional.adam_step_flat, "__name__", "?")
    print(f"engine's Adam: offload.optim.adam_step_flat -> {adam_impl}")

    contenders, memory = build_contenders(args, make_model, batch, device)
    samples = interleave(contenders, repeats)
    med = {k: s.median for k, s in samples.items() if s.values}
    rows = []
    for name, t in med.items():
        mem = memory[name]() if callable(memory[name]) else memory[name]
        rows.append(
            {
                "contender": name,
                "step_ms": t * 1e3,
                "tokens_per_s": tokens / t,
                "device_MB": _mb(mem.get("device", 0)),
                "host_MB": _mb(mem.get("host", 0)),
                "nvme_MB": _mb(mem.get("nvme", 0)),
                "vs_torch": ratio(t, med.get("torch", float("nan"))),
                "vs_fsdp2": ratio(t, med.get("fsdp2", float("nan"))),
                "vs_deepspeed": ratio(t, med.get("deepspeed", float("nan"))),
            }
        )
    print("step time ratios: >1 = slower than the peer; memory: state the contender holds "
          "(params, grads, optimizer; engine: memory_bytes())")
    print_table(rows)
    write_json(args.json, {"machine": info, "args": vars(args), "n_params": n_params, "rows": rows})
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
