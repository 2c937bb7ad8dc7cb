"""End-to-end training step: the engine vs plain PyTorch, FSDP2 CPU offload, DeepSpeed ZeRO-3,
and the engine's NVMe tiers vs its in-memory step and DeepSpeed's ZeRO-Infinity NVMe offload.

Question: what does partitioned training with CPU (or NVMe) offload cost per step, against
plain PyTorch training of the same model (fused AdamW) and against the other offload
engines, when compute runs on this machine (the CPU, or a GPU if one is present)?

Contenders (same GPT model and batches, one training step per sample, interleaved):
- torch:     plain model, torch.optim.AdamW(fused=True) (foreach where fused is missing);
             fp32 parameters, the forward under torch.autocast at --dtype bf16 (and fp16 with
             a GradScaler on CUDA), so both sides compute in the same dtype (TorchPrecision)
- engine:    offload.initialize(model, Config(...)): ZeRO-3 units, fp32 master + Adam in
             CPU memory (world size 1)
- engine_nvme_opt: the same with offload.optimizer_tier='nvme' (master + moments in a swap
             file under --nvme-path, streamed through the pinned pool each step)
- engine_nvme_all: parameters on NVMe too (offload.param_tier='nvme')
- engine_nvme_all_nopf (with --compare-prefetch): the same with prefetch, kept units and
             the optimizer in backward all off (every fetch on demand, the update in step())
- fsdp2:     torch.distributed.fsdp.fully_shard per block + root, CPUOffloadPolicy,
             torch.optim.AdamW over the sharded params
- deepspeed: deepspeed.initialize, ZeRO stage 3, offload_param + offload_optimizer to cpu
- deepspeed_nvme: the same with offload_param and offload_optimizer on nvme (ZeRO-Infinity)
- engine_worker_on / engine_worker_off (with --compare-worker): the engine row with
             prefetch.optimizer_worker forced on / off (the updates during backward on a
             thread of their own, or on autograd's; "auto", the engine row, is off on the CPU)
- engine_unguarded (with --compare-guard): the engine row with nonfinite_loss off: its
             updates run during backward with no non-finite check (the engine row's guard
             runs them at step(): offload/runtime/optimizer_step.py)
- engine_stage2: offload at ZeRO stage 2 (zero_stage=2: parameters whole and resident on the
             compute device, optimizer state on the CPU: ZeRO-Offload); at world size 1 on
             the CPU it is the `engine` row (every unit is aliased to its shard)
- deepspeed_stage2: DeepSpeed's ZeRO-Offload (stage 2, offload_optimizer cpu)
- torch_lora / engine_lora (with peft installed; --no-lora skips them): the same model with
             PEFT LoRA (r=8 on qkv, proj, fc, out), a plain peft loop against the engine; the
             engine's memory is what frozen parameters cost (their shard only)
A contender that cannot run here is dropped with its reason printed.

For the NVMe contenders the table adds the bytes moved per step (engine.io_stats()), the
disk bandwidth that amounts to over the step time, the time the step waited for I/O, and
that bandwidth as a share of the disk's sequential peak, measured in the same run with
offload.storage.io (benchmarks/disk_floor.py: a file created fresh under --nvme-path,
--peak-mb of it, default 1 GiB (256 MiB with --quick), O_DIRECT overwrites and reads).

A second table, "the step at the disk's speed" (issue #21), one row per NVMe contender:
read_MiB / write_MiB per step (the engines: engine.io_stats(); deepspeed_nvme: the
process's /proc/self/io read_bytes / write_bytes deltas over the step, column io_source),
the disk's read/write GB/s, floor_ms = read_bytes / read_bw + write_bytes / write_bw (the
conservative floor: reads and writes not overlapping), floor_max_ms = max() of the two (the
floor if they overlapped fully; the probe's `overlap`, 1.0 = shared bandwidth .. 2.0 = full
duplex, says which is nearer on this disk), in_memory_ms = the `engine` row's median step,
bound_ms = max(floor_ms, in_memory_ms) and step_over_bound = step_ms / bound_ms (1.0 = the
step runs at its bound; the JSON rows carry every field).

For every engine contender it adds what `engine.step_stats()` measured (offload/runtime/timeline.py):
stall_ms (the engine's thread blocked on NVMe I/O of any kind, on host-to-device copies,
and in collectives), stall_pct of the step, opt_overlap_pct (share of the optimizer's time that ran during
backward) and, for NVMe, io_hidden_pct (1 - exposed I/O wait / the time the step's bytes
take at the disk's measured peak: how much of the transfer time the schedule hid behind
compute). --timeline PREFIX writes each engine contender's last step as a Chrome/Perfetto
trace, PREFIX-<contender>.json.

    python benchmarks/bench_train.py --quick
    python benchmarks/bench_train.py --layers 8 --d-model 512 --seq 256 --batch 8
    python benchmarks/bench_train.py --quick --nvme-path /mnt/nvme/bench --no-fsdp2
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import (  # noqa: E402
    base_parser,
    interleave,
    machine_info,
    na_reasons,
    peer_reason,
    print_machine,
    print_table,
    ratio,
    write_json,
)
# The model the tests and examples train too (offload/models/gpt.py), with GPT-2's qkv bias.
from offload.models.gpt import GPT, gpt_batches  # noqa: E402
from offload.sizes import MiB  # noqa: E402
from benchmarks.disk_floor import floor_fields  # noqa: E402
from benchmarks.scratch import Scratch  # noqa: E402


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


def _mib(n) -> float | None:
    return None if n is None else n / MiB


@dataclass(frozen=True)
class TorchPrecision:
    """How the plain-PyTorch contenders (torch, torch_lora) compute at --dtype: fp32
    parameters and AdamW, the forward under `torch.autocast` at the engine's compute dtype
    (torch's own mixed precision: the comparison an engine user would make), fp16 with a
    GradScaler. Without it a GPU run timed an fp32 PyTorch step against a bf16 engine step,
    which flattered the engine (issue #30). `torch_precision` picks it."""

    device_type: str
    dtype: Optional[torch.dtype]
    """autocast's dtype; None: no autocast (everything in fp32)."""
    grad_scaler: bool
    """Scale the loss with a torch.amp.GradScaler (fp16 on CUDA)."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the contender's forward runs in: none at all when `dtype` is None
        (the fp32 step exactly as before)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def describe(self) -> str:
        if self.dtype is None:
            return "fp32 compute (no autocast)"
        name = str(self.dtype).replace("torch.", "")
        return f"{name} autocast on {self.device_type}" + (" + GradScaler" if self.grad_scaler else "")


def torch_precision(dtype: str, device: torch.device) -> TorchPrecision:
    """The plain-PyTorch contenders' precision for `--dtype` on `device`. CUDA: bf16 / fp16
    under autocast (fp16 with a GradScaler). The CPU: bf16 under autocast too; fp16 and fp32
    stay fp32 without autocast, as every CPU figure in docs/results.md was measured
    (fp32), and CPU fp16 autocast is not the comparison anyone trains with."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if device.type == "cuda" and low is not None:
        return TorchPrecision(device_type="cuda", dtype=low, grad_scaler=low == torch.float16)
    if device.type == "cpu" and low == torch.bfloat16:
        return TorchPrecision(device_type="cpu", dtype=low, grad_scaler=False)
    return TorchPrecision(device_type=device.type, dtype=None, grad_scaler=False)


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


# The second table (the NVMe rows); every row of the JSON carries the fields after step_ms.
NVME_COLUMNS = ["contender", "step_ms", "io_source", "read_MiB", "write_MiB", "disk_read_GBps", "disk_write_GBps",
                "floor_ms", "floor_max_ms", "in_memory_ms", "bound_ms", "step_over_bound"]


def disk_peak(path: str, nbytes: int, block_size: int, queue_depth: int, threads: int, rounds: int = 3) -> dict:
    """The disk's sequential O_DIRECT bandwidth under `path` (benchmarks/disk_floor.py)."""
    from benchmarks.disk_floor import disk_bandwidth

    return disk_bandwidth(path, nbytes, block_size, queue_depth, threads, rounds)


def build_contenders(args, make_model, batch, device,
                     scratch: Scratch) -> tuple[dict[str, Callable[[], float]], dict[str, dict]]:
    contenders: dict[str, Callable[[], float]] = {}
    memory: dict[str, dict] = {}
    io: dict[str, dict] = {}
    """name -> {"source": "io_stats" | "/proc/self/io", "per_step": [(bytes, wait_s, read, written), ...]}
    for NVMe (wait_s None where not measured: DeepSpeed)."""
    sched: dict[str, list[dict]] = {}
    """name -> engine.step_stats() of every measured step, for engine contenders."""
    dropped: dict[str, str] = {}
    """name -> why that contender is not in the table (a flag, or its setup failed)."""
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
            dropped[name] = peer_reason(exc)
            print(f"  [{name}] dropped: {dropped[name]}")

    amp = torch_precision(args.dtype, device)

    def torch_step(m: torch.nn.Module, opt: torch.optim.Optimizer, clip: float):
        """(forward, backward, step) of a plain-PyTorch contender at `amp`'s precision."""
        xd, yd = x.to(device), y.to(device)
        scaler = torch.amp.GradScaler(device.type) if amp.grad_scaler else None

        def forward() -> torch.Tensor:
            with amp.autocast():
                return m(xd, yd)

        def backward(loss: torch.Tensor) -> None:
            (loss if scaler is None else scaler.scale(loss)).backward()

        def step() -> None:
            if scaler is not None and clip:
                scaler.unscale_(opt)  # clip the true gradients
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)

        return forward, backward, step

    def torch_setup():
        m = make_model().to(device)
        try:
            opt = torch.optim.AdamW(m.parameters(), lr=lr, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW(m.parameters(), lr=lr, foreach=True)
        fn = timed_step(*torch_step(m, opt, args.clip))
        fn()  # materialise optimizer state before measuring memory
        mem = {"device": _bytes(list(m.parameters()) + [s for st in opt.state.values() for s in st.values()]), "host": 0}
        return fn, mem

    def lora(m):
        import peft

        return peft.get_peft_model(m, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                      target_modules=["qkv", "proj", "fc", "out"]))

    def torch_lora_setup():
        m = lora(make_model()).to(device)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr, foreach=True)
        fn = timed_step(*torch_step(m, opt, 0.0))
        fn()
        mem = {"device": _bytes(list(m.parameters()) + [s for st in opt.state.values() for s in st.values()]),
               "host": 0}
        return fn, mem

    def engine_setup(
        param_tier: str = "cpu", optimizer_tier: str = "cpu", name: str = "engine", prefetch: bool = True,
        stage: int = 3, wrap=None, worker: str = "auto", guard: str = "skip",
    ):
        import offload
        from offload.config import (
            AIOConfig, Config, OffloadConfig, OptimizerConfig, PrecisionConfig, PrefetchConfig, TimelineConfig,
        )

        nvme = "nvme" in (param_tier, optimizer_tier)
        path = os.path.join(args.nvme_path, name) if nvme else None
        if path:
            scratch.makedirs(path)  # empty once the engine closes: removed at exit
        cfg = Config(
            compute_device=device.type,
            optimizer=OptimizerConfig(lr=lr),
            precision=PrecisionConfig(dtype=args.dtype),
            offload=OffloadConfig(
                param_tier=param_tier, optimizer_tier=optimizer_tier, nvme_path=path,
                pinned_budget_bytes=args.pinned_budget_mb << 20,
            ),
            aio=AIOConfig(block_size=args.block_size, queue_depth=args.queue_depth, threads=args.io_threads),
            gradient_clipping=args.clip,
            prefetch=(
                PrefetchConfig(prefetch_bytes=args.prefetch_mb << 20, keep_bytes=args.keep_mb << 20,
                               optimizer_worker=worker)
                if prefetch else PrefetchConfig(prefetch_bytes=0, keep_bytes=0, optimizer_in_backward=False)
            ),
            timeline=TimelineConfig(enabled=bool(args.timeline)),
            zero_stage=stage,
            nonfinite_loss=guard,
        )
        engine = offload.initialize(make_model() if wrap is None else wrap(make_model()), cfg)
        engine.bench_name = name
        engines.append(engine)
        step_fn = timed_step(lambda: engine(x, y), engine.backward, engine.step)
        rec = io[name] = {"per_step": [], "source": "io_stats"} if nvme else None
        steps = sched[name] = []

        def fn() -> float:
            a = engine.io_stats()
            t = step_fn()
            b = engine.io_stats()
            steps.append(engine.step_stats())
            if rec is not None:
                rd, wr = b["bytes_read"] - a["bytes_read"], b["bytes_written"] - a["bytes_written"]
                rec["per_step"].append((rd + wr, b["wait_s"] - a["wait_s"], rd, wr))
            return t

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
            if args.clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        fn = timed_step(lambda: m(x.to(device), y.to(device)), lambda l: l.backward(), step)
        fn()
        states = [s for st in opt.state.values() for s in st.values() if isinstance(s, torch.Tensor)]
        local = [getattr(t, "_local_tensor", t) for t in list(m.parameters()) + states]
        return fn, {"device": 0, "host": _bytes(local)}

    def deepspeed_setup(nvme: bool = False, stage: int = 3):
        import logging

        import deepspeed

        from benchmarks.peer_ops import PeerNotReady, prepare

        # The ops this contender builds on first use ([Note: peer builds]): its optimizer, the
        # CPU collectives, and the AIO op for NVMe. Dropped with the reason, or announced.
        ops = ["cpu_adam"] + (["deepspeed_shm_comm"] if device.type == "cpu" else []) + (["async_io"] if nvme else [])
        for op in ops:
            why = prepare(op)
            if why is not None:
                raise PeerNotReady(why)
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        _ensure_group(device)
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        if nvme:
            path = scratch.makedirs(os.path.join(args.nvme_path, "deepspeed"))
            offload_param = {"device": "nvme", "nvme_path": path, "pin_memory": device.type == "cuda"}
            offload_optimizer = {"device": "nvme", "nvme_path": path, "pin_memory": device.type == "cuda"}
        else:
            offload_param = {"device": "cpu"}
            offload_optimizer = {"device": "cpu"}
        ds_cfg = {
            "train_micro_batch_size_per_gpu": x.shape[0],
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": offload_param,
                "offload_optimizer": offload_optimizer,
            } if stage == 3 else {"stage": stage, "offload_optimizer": offload_optimizer},
            "aio": {
                "block_size": args.block_size, "queue_depth": args.queue_depth,
                "intra_op_parallelism": args.io_threads, "single_submit": False,
                "overlap_events": True,
            },
            "bf16": {"enabled": args.dtype == "bf16"},
            "fp16": {"enabled": args.dtype == "fp16"},
            "wall_clock_breakdown": False,
            "gradient_clipping": args.clip,
        }
        eng, *_ = deepspeed.initialize(model=make_model(), model_parameters=None, config=ds_cfg)
        eng.optimizer  # noqa: B018
        fn = timed_step(lambda: eng(x.to(eng.device), y.to(eng.device)), eng.backward, eng.step)
        if nvme:  # no io_stats(): the bytes this process made the block layer move per step
            from benchmarks.disk_floor import proc_io

            rec = io["deepspeed_nvme"] = {"per_step": [], "source": "/proc/self/io"}
            step_fn = fn

            def fn() -> float:
                a = proc_io()
                t = step_fn()
                b = proc_io()
                if a and b:
                    rec["per_step"].append((b[0] - a[0] + b[1] - a[1], None, b[0] - a[0], b[1] - a[1]))
                return t
        return fn, {"device": None, "host": None, "nvme": None}  # not exposed by DeepSpeed here

    engines: list = []
    add("torch", torch_setup)
    add("engine", engine_setup)
    add("engine_stage2", lambda: engine_setup("device", "cpu", "engine_stage2", stage=2))
    if args.compare_worker:  # the optimizer worker on and off against "auto" (the engine row)
        add("engine_worker_on", lambda: engine_setup(name="engine_worker_on", worker="on"))
        add("engine_worker_off", lambda: engine_setup(name="engine_worker_off", worker="off"))
    else:
        dropped["engine_worker_on"] = dropped["engine_worker_off"] = "skipped (no --compare-worker)"
    if args.compare_guard:  # the non-finite guard off: updates during backward, unguarded
        add("engine_unguarded", lambda: engine_setup(name="engine_unguarded", guard="off"))
    else:
        dropped["engine_unguarded"] = "skipped (no --compare-guard)"
    if not args.no_nvme:
        add("engine_nvme_opt", lambda: engine_setup("cpu", "nvme", "engine_nvme_opt"))
        add("engine_nvme_all", lambda: engine_setup("nvme", "nvme", "engine_nvme_all"))
        if args.compare_prefetch:
            add("engine_nvme_all_nopf", lambda: engine_setup("nvme", "nvme", "engine_nvme_all_nopf", prefetch=False))
    else:
        for name in ("engine_nvme_opt", "engine_nvme_all", "deepspeed_nvme"):
            dropped[name] = "skipped (--no-nvme)"
    if not args.compare_prefetch:
        dropped["engine_nvme_all_nopf"] = "skipped (no --compare-prefetch)"
    if not args.no_lora:
        add("torch_lora", torch_lora_setup)
        add("engine_lora", lambda: engine_setup(name="engine_lora", wrap=lora))
    else:
        dropped["torch_lora"] = dropped["engine_lora"] = "skipped (--no-lora)"
    if not args.no_fsdp2:
        add("fsdp2", fsdp2_setup)
    else:
        dropped["fsdp2"] = "skipped (--no-fsdp2)"
    if not args.no_deepspeed:
        add("deepspeed", deepspeed_setup)
        add("deepspeed_stage2", lambda: deepspeed_setup(stage=2))
        if not args.no_nvme:
            add("deepspeed_nvme", lambda: deepspeed_setup(nvme=True))
    else:
        dropped.setdefault("deepspeed", "skipped (--no-deepspeed)")
        dropped.setdefault("deepspeed_stage2", "skipped (--no-deepspeed)")
        dropped.setdefault("deepspeed_nvme", "skipped (--no-deepspeed)")
    for rec in io.values():
        if rec is not None:
            rec["per_step"].clear()  # the warm-up step is not a sample
    for steps in sched.values():
        steps.clear()
    return contenders, memory, {k: v for k, v in io.items() if v is not None}, engines, sched, dropped


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
    p.add_argument("--no-lora", action="store_true", help="skip the PEFT LoRA rows")
    p.add_argument("--no-nvme", action="store_true", help="skip the NVMe contenders")
    p.add_argument("--nvme-path", "--dir", dest="nvme_path", default=None,
                   help="directory for swap files, on the disk to measure (not a tmpfs); default: a "
                   "fresh folder in the temp dir ($TMPDIR or /tmp; `python -m benchmarks` points TMPDIR "
                   "under its --out). Either way the folders made for them are removed at exit")
    p.add_argument("--pinned-budget-mb", type=int, default=1024,
                   help="offload.pinned_budget_bytes in MiB (the config default)")
    p.add_argument("--block-size", type=int, default=1 << 20, help="aio block size (bytes)")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--peak-mb", type=int, default=None, help="file size for the disk peak (MiB)")
    p.add_argument("--clip", type=float, default=0.0,
                   help="gradient clipping (every contender); > 0 defers the engine's update to step()")
    p.add_argument("--prefetch-mb", type=int, default=256, help="prefetch.prefetch_bytes in MiB")
    p.add_argument("--keep-mb", type=int, default=256, help="prefetch.keep_bytes in MiB")
    p.add_argument("--compare-prefetch", action="store_true",
                   help="add engine_nvme_all_nopf: NVMe tiers with prefetch/keep/optimizer-in-backward off")
    p.add_argument("--compare-worker", action="store_true",
                   help="add engine_worker_on / engine_worker_off: prefetch.optimizer_worker forced on and off")
    p.add_argument("--compare-guard", action="store_true",
                   help="add engine_unguarded: nonfinite_loss off (the updates during backward, "
                        "no non-finite check) against the engine row's guard")
    p.add_argument("--plan-profile", default=None, metavar="FILE",
                   help="the machine profile the predicted steps use (default: this machine's cached "
                        "profile, measured first if there is none: python -m offload.plan --measure)")
    p.add_argument("--no-predict", action="store_true", help="skip the predicted-vs-measured table")
    p.add_argument("--timeline", default=None, metavar="PREFIX",
                   help="record the engines' timelines; write PREFIX-<contender>.json (Chrome trace)")
    args = p.parse_args()
    if args.quick:
        args.layers, args.d_model, args.heads, args.vocab, args.seq, args.batch = 2, 256, 4, 4096, 128, 4
    repeats = args.repeats or (5 if args.quick else 7)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    # Nothing left in the temp dir (issue #36): the swap folders this run makes go at exit,
    # and torch's inductor cache folder (made in the temp dir the first time anything imports
    # torch._dynamo: fused AdamW, FSDP2; nothing here compiles) goes in this run's own folder.
    scratch = Scratch(prefix="offload-bench-train-")
    atexit.register(scratch.close)  # at exit, whether the run got to its end or not
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(scratch.default(), "inductor"))
    if not args.no_nvme:
        args.nvme_path = scratch.makedirs(args.nvme_path or os.path.join(scratch.default(), "nvme"))
    info = machine_info(None if args.no_nvme else args.nvme_path)
    print_machine(info)

    def make_model() -> GPT:
        torch.manual_seed(0)
        return GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq, qkv_bias=True)

    n_params = sum(p.numel() for p in make_model().parameters())
    batch = gpt_batches(1, args.batch, args.seq, args.vocab, seed=0)[0]
    tokens = args.batch * args.seq
    print(
        f"model: GPT {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, "
        f"{n_params / 1e6:.1f} M params; batch {args.batch} x seq {args.seq} = {tokens} tokens; "
        f"{args.dtype} compute on {device}; {repeats} interleaved rounds"
    )
    from offload.optim import adam_isa

    print(f"engine's Adam: offload.optim.adam_step_flat, native {adam_isa()} kernel; plain PyTorch "
          f"(torch, torch_lora): fp32 parameters, {torch_precision(args.dtype, device).describe()}")

    contenders, memory, io, engines, sched, dropped = build_contenders(args, make_model, batch, device, scratch)
    peak = None
    if io:
        peak_bytes = (args.peak_mb or (256 if args.quick else 1024)) << 20
        peak = disk_peak(args.nvme_path, peak_bytes, args.block_size, args.queue_depth, args.io_threads)
        print(f"disk peak (offload.storage.io, {peak_bytes >> 20} MiB file created fresh, sequential "
              f"{'O_DIRECT' if peak['direct'] else 'BUFFERED (O_DIRECT refused: page cache, not the disk)'} "
              f"under {args.nvme_path}): write {peak['write_GBps']:.2f} GB/s (first write, allocating: "
              f"{peak['write_alloc_GBps']:.2f}, with an fsync: {peak['write_fsync_GBps']:.2f}), read {peak['read_GBps']:.2f} GB/s; read+write together "
              f"{peak['mixed_GBps']:.2f} GB/s, overlap {peak['overlap']:.2f} (1 = shared bandwidth, 2 = full duplex)")
    samples = interleave(contenders, repeats, desc="train step")
    med = {k: s.median for k, s in samples.items() if s.values}
    rows = []
    import statistics

    for name, t in med.items():
        mem = memory[name]() if callable(memory[name]) else memory[name]
        row = {
            "contender": name,
            "step_ms": t * 1e3,
            "tokens_per_s": tokens / t,
            "device_MiB": _mib(mem.get("device", 0)),
            "host_MiB": _mib(mem.get("host", 0)),
            "pinned_MiB": _mib(mem.get("pinned", 0)),
            "nvme_MiB": _mib(mem.get("nvme", 0)),
            "io_MiB_per_step": None,
            "io_wait_ms": None,
            "disk_GBps": None,
            "stall_ms": None,
            "stall_pct": None,
            "opt_overlap_pct": None,
            "io_hidden_pct": None,
        }
        if name in io and io[name]["per_step"]:
            moved = statistics.median(m[0] for m in io[name]["per_step"])
            waits = [m[1] for m in io[name]["per_step"] if m[1] is not None]
            row.update(io_MiB_per_step=_mib(moved), io_wait_ms=statistics.median(waits) * 1e3 if waits else None,
                       disk_GBps=moved / t / 1e9)
        if sched.get(name):
            st = [s for s in sched[name] if s is not None]
            stall = statistics.median(s["stall_s"] for s in st)
            row.update(
                stall_ms=stall * 1e3,
                stall_pct=100.0 * statistics.median(s["stall_fraction"] for s in st),
                opt_overlap_pct=100.0 * statistics.median(
                    s["optimizer_in_backward_s"] / s["optimizer_s"] if s["optimizer_s"] else 0.0 for s in st
                ),
            )
            if name in io and io[name]["per_step"] and peak:
                serial = moved / (1e9 * 0.5 * (peak["read_GBps"] + peak["write_GBps"]))
                exposed = statistics.median(s["io_wait_s"] for s in st)
                row["io_hidden_pct"] = max(0.0, 100.0 * (1.0 - exposed / serial)) if serial > 0 else None
        # [Note: ratio direction] in benchmarks/_common.py: the peer's step time / this
        # row's, so >1 means this row's contender is faster than the peer.
        row.update(
            vs_engine=ratio(med.get("engine", float("nan")), t),
            vs_torch=ratio(med.get("torch", float("nan")), t),
            vs_fsdp2=ratio(med.get("fsdp2", float("nan")), t),
            vs_deepspeed=ratio(med.get("deepspeed", float("nan")), t),
            vs_deepspeed_nvme=ratio(med.get("deepspeed_nvme", float("nan")), t),
            vs_engine_nvme_all_nopf=ratio(med.get("engine_nvme_all_nopf", float("nan")), t),
            pct_of_disk_peak=(
                100.0 * row["disk_GBps"] / (0.5 * (peak["read_GBps"] + peak["write_GBps"]))
                if row["disk_GBps"] is not None and peak else None
            ),
        )
        row.update(dict.fromkeys(NVME_COLUMNS[2:]))  # issue #21: the step at the disk's speed
        if name in io and io[name]["per_step"]:
            per = io[name]["per_step"]
            row.update(io_source=io[name]["source"], disk_read_GBps=peak and peak["read_GBps"],
                       disk_write_GBps=peak and peak["write_GBps"])
            row.update(floor_fields(t, statistics.median(m[2] for m in per), statistics.median(m[3] for m in per),
                                    peak, med.get("engine")))
        rows.append(row)
    print("step time ratios: the peer's step time / this row's (>1 = this row is faster); memory: state the contender holds "
          "(params, grads, optimizer; engine: memory_bytes()); disk_GBps: bytes the NVMe tiers "
          "moved per step / step time; pct_of_disk_peak: of the mean of read and write peak")
    print("stall: the engine's thread blocked on I/O, copies and collectives (engine.step_stats()); "
          "opt_overlap_pct: optimizer time that ran during backward; io_hidden_pct: 1 - exposed "
          "I/O wait / (bytes moved at the disk's peak)")
    ratio_peers = {"vs_engine": "engine", "vs_torch": "torch", "vs_fsdp2": "fsdp2",
                   "vs_deepspeed": "deepspeed", "vs_deepspeed_nvme": "deepspeed_nvme",
                   "vs_engine_nvme_all_nopf": "engine_nvme_all_nopf"}
    missing = {k: v for k, v in dropped.items() if k not in med}
    for name, why in missing.items():
        print(f"  not run: {name}: {why}")
    step_columns = [c for c in rows[0] if c not in NVME_COLUMNS[2:]] if rows else []
    print_table(rows, step_columns or None, na=na_reasons(ratio_peers, missing))
    nvme_rows = [r for r in rows if r["io_source"]]
    if nvme_rows:
        print("\nthe step at the disk's speed: read/write_MiB per step (io_source); floor_ms = bytes read / "
              "disk_read_GBps + bytes written / disk_write_GBps (reads and writes not overlapping; floor_max_ms: "
              f"max() of the two, if they overlapped fully; this disk's overlap: {peak['overlap']:.2f}, 1 = none, "
              "2 = full); bound_ms = max(floor_ms, in_memory_ms = the engine row's step); step_over_bound = "
              "step_ms / bound_ms" if peak else "\nNVMe bytes per step (no disk probe: no floor)")
        if peak and not peak["direct"]:
            print(f"  WARNING: {args.nvme_path} refused O_DIRECT: the bandwidths are the page cache's, the floor is not the disk's")
        print_table(nvme_rows, NVME_COLUMNS)
    predicted = []
    if not args.no_predict:
        predicted = _predicted(args, med, device)
    if args.timeline:
        for e in engines:
            path = f"{args.timeline}-{e.bench_name}.json"
            e.timeline.write(path)
            print(f"timeline of {e.bench_name}'s last {len(e.timeline.steps)} steps: {path}")
    for e in engines:
        e.close()  # the engine's swap files go
    # DeepSpeed leaves its swap files behind: remove the directory this script made for it.
    # (The engines' folders, empty now, and the rest of the scratch go at exit.)
    import shutil

    if args.nvme_path:
        shutil.rmtree(os.path.join(args.nvme_path, "deepspeed"), ignore_errors=True)
    write_json(args.json, {
        "machine": info, "args": vars(args), "n_params": n_params, "disk_peak": peak, "rows": rows,
        "torch_precision": torch_precision(args.dtype, device).describe(),
        "peers_missing": missing, "ratio_peers": ratio_peers, "predicted": predicted,
        "plot": {"x": "contender", "y": "step_ms", "title": "training step time"},
        # The report prints the rows as this script does: the step table, then the step at
        # the disk's speed for the rows that moved NVMe bytes (benchmarks/_report.py).
        "tables": [{"title": "Training step", "columns": step_columns},
                   {"title": "The step at the disk's speed (rows with NVMe traffic)", "columns": NVME_COLUMNS,
                    "rows_with": "io_source"}],
    })
    if dist.is_initialized():
        dist.destroy_process_group()


def _predicted(args, med: dict, device: torch.device) -> list[dict]:
    """The planner's predicted step beside each engine contender's measured median
    (benchmarks/predicted.py), printed and returned for the JSON."""
    from benchmarks.predicted import predict_rows
    from offload.plan.measure import measure_profile
    from offload.plan.profile import cached_profile, load_profile

    nvme = None if args.no_nvme else args.nvme_path
    if args.plan_profile:
        profile = load_profile(args.plan_profile)
    else:
        profile = cached_profile(lambda: measure_profile(nvme_path=nvme, block_size=args.block_size), nvme)
    rows = predict_rows(med, args, profile, device.type == "cuda")
    print(f"\npredicted vs measured (offload.plan step-time model, profile {profile.fingerprint} measured "
          f"{profile.measured_at}); pred_over_meas 1.0 = exact")
    if rows:
        print_table(rows, list(rows[0]))
    return rows


if __name__ == "__main__":
    main()
