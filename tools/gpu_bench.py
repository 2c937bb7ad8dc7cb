"""The measuring phases of `tools/gpu_check.sh`: one phase per call, results as JSON.

    python tools/gpu_bench.py env          --json OUT.json [--dry-run]
    python tools/gpu_bench.py practicality --json OUT.json [--dry-run] [--model 1.3b]
    python tools/gpu_bench.py scale        --json OUT.json [--dry-run] [--mult 2.0]

- env: the device, torch, the cores, the measured bf16 matmul rate (8192^3 products, median of
  events-timed repeats on random data) and pinned host<->device copy bandwidth.
- practicality: a GPT (1.3b: 24 x 2048, vocab 50304) on 8 x 1024 tokens; plain PyTorch (fp32
  parameters, bf16 autocast, fused AdamW, all on the GPU) against offload with parameters on
  the device / in pinned host memory / on NVMe and the optimizer on the CPU (`--tiers`),
  rounds interleaved, medians. practicality = plain step time / offload step time.
  With each: stall share (engine.step_stats()), host RSS, the GPU's max reserved memory, the
  engine's memory_bytes() and the planner's figure for the same model and config.
- scale: a GPT whose training state (16 B per parameter: fp32 master, two fp32 moments, bf16
  parameter and gradient) is `--mult` x the GPU's memory, trained with offload; model
  TFLOP/s (6 N + 12 L d S per token, N counting the tied LM head once as a product) against
  the matmul rate measured in the same process.

The JSON is rewritten after every measured round, so a phase killed by its timeout still
leaves what it measured. `--dry-run` runs every phase on the CPU at tiny sizes.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

GIB = 1 << 30

# (n_layer, d_model, n_head, vocab): the practicality model (~1.31B parameters).
MODELS = {
    "tiny": (2, 64, 2, 256),
    "1.3b": (24, 2048, 16, 50304),
}


class Results:
    """The phase's JSON, rewritten on every update so a killed phase keeps what it had."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, **kv: Any) -> None:
        self.data.update(kv)
        self.flush()

    def flush(self) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _proc_kib(path: str, key: str) -> int:
    """A `key: N kB` line of a /proc file, in bytes (0 when absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def host_rss_bytes() -> int:
    return _proc_kib("/proc/self/status", "VmRSS")


def host_mem_available() -> int:
    return _proc_kib("/proc/meminfo", "MemAvailable")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, dry: bool) -> dict[str, Any]:
    """Measured TFLOP/s of a square product in the compute dtype (bf16 on a GPU, fp32 on the
    CPU in a dry run), random data, median of repeats after warm-up."""
    n, dtype, reps = (8192, torch.bfloat16, 20) if device.type == "cuda" else (256, torch.float32, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(reps + 3):
        sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            a @ b
            dt = time.perf_counter() - t0
        if i >= 3:
            times.append(dt)
    med = statistics.median(times)
    del a, b
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "tflops": 2 * n**3 / med / 1e12}


def copy_rates(device: torch.device) -> dict[str, Any]:
    """Pinned host <-> device copy bandwidth (GB/s), 1 GiB, median of 5."""
    if device.type != "cuda":
        return {}
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GIB, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"h2d_GBps": (dev, host), "d2h_GBps": (host, dev)}.items():
        ts = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        out[name] = GIB / statistics.median(ts[1:]) / 1e9
    del host, dev
    return out


def compute_device(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a machine without a GPU")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


# -- env ------------------------------------------------------------------------------------


def phase_env(args: argparse.Namespace, res: Results) -> None:
    import platform

    device = compute_device(args.dry_run)
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda, "cores": len(os.sched_getaffinity(0)),
        "host_mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu_mem_gib=round(p.total_memory / GIB, 1), sms=p.multi_processor_count)
    from offload._native import cpu_features

    info["simd"] = ",".join(k for k, v in cpu_features().items() if v) or "none"
    import shutil
    import subprocess

    usage = shutil.disk_usage(args.nvme_path)
    try:
        fs = subprocess.run(["df", "-T", args.nvme_path], capture_output=True, text=True).stdout.splitlines()[1].split()
        info["nvme_fs"] = f"{fs[1]} on {fs[0]}"
    except (OSError, IndexError):
        info["nvme_fs"] = "unknown"
    info["nvme_free_gib"] = round(usage.free / GIB, 1)
    res.put(**info)
    res.put(matmul=matmul_rate(device, args.dry_run))
    res.put(copies=copy_rates(device))
    log(json.dumps(res.data))


# -- the models and the contenders ------------------------------------------------------------


def model_flops_per_token(n_layer: int, d: int, vocab: int, seq: int) -> float:
    """6 x (block parameters + the LM head's product) + attention's 12 L d S (PaLM's MFU
    convention: the causal mask's halving is not subtracted)."""
    block = n_layer * (12 * d * d + 13 * d)
    return 6 * (block + vocab * d) + 12 * n_layer * d * seq


def make_gpt(n_layer: int, d: int, heads: int, vocab: int, seq: int, meta: bool = False):
    from offload.models.gpt import GPT

    if meta:
        with torch.device("meta"):
            return GPT(vocab, d, n_layer, heads, seq, qkv_bias=True)
    return GPT(vocab, d, n_layer, heads, seq, qkv_bias=True)


DEFAULT_TIERS = ("device/cpu,cpu/cpu,nvme/cpu,device/cpu@on,device/cpu@off,device/cpu@on*4,"
                 "device/cpu+auto,device/device")
"""practicality's contenders: the tiers at the defaults, then the update during backward on the
worker and on autograd's thread, and on the worker with 4 micro-batches per step; the update
split the planner sizes, and every unit's optimizer state on the GPU."""


def engine_config(device: torch.device, param_tier: str, optimizer_tier: str, nvme_path: Optional[str],
                  moments: str = "fp32", timeline: bool = True, pinned_gib: float = 4.0, worker: str = "auto",
                  device_units: Optional[int] = None, gas: int = 1):
    from offload.config import (
        Config, OffloadConfig, OptimizerConfig, PrecisionConfig, PrefetchConfig, TimelineConfig,
    )

    return Config(
        compute_device=device.type,
        optimizer=OptimizerConfig(lr=1e-4, moments_dtype=moments),
        precision=PrecisionConfig(dtype="bf16"),
        offload=OffloadConfig(param_tier=param_tier, optimizer_tier=optimizer_tier, nvme_path=nvme_path,
                              pinned_budget_bytes=int(pinned_gib * GIB), optimizer_device_units=device_units),
        timeline=TimelineConfig(enabled=timeline),
        prefetch=PrefetchConfig(optimizer_worker=worker),
        gradient_accumulation_steps=gas,
        # A named worker (on/off) runs the updates during backward: that needs the non-finite
        # guard off (docs/prefetch.md); "auto" keeps the defaults (the guard on, updates at step()).
        nonfinite_loss="skip" if worker == "auto" else "off",
    )


def planner_figure(meta_model, cfg, device: torch.device, param_tier: str, optimizer_tier: str) -> dict:
    from offload.plan.machine import make_machine
    from offload.plan.planner import plan

    gpu_mem = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    machine = make_machine(gpus=1 if device.type == "cuda" else 0, gpu_mem=gpu_mem,
                           cpu_mem=host_mem_available(), nvme_free=None if cfg.offload.nvme_path is None
                           else _free(cfg.offload.nvme_path))
    # optimizer_tier "device": every unit's state on the device, counted by the (param, cpu) row
    est = plan(meta_model, machine=machine, config=cfg).estimate(
        param_tier, "cpu" if optimizer_tier == "device" else optimizer_tier)
    return est.per_rank.as_dict()


def planned_split(meta_model, cfg, device: torch.device, batch_tokens: int) -> tuple[Optional[int], Optional[float], str]:
    """The update split the planner sizes for this machine (offload/plan/update_split.py): the
    count of units, its predicted step (s), and how it was chosen. On the CPU (dry run) there is
    no GPU to size from: half the units, said so."""
    from offload.plan.machine import make_machine
    from offload.plan.planner import plan
    from offload.plan.shapes import shape_from_model

    gpu_mem = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    machine = make_machine(gpus=1 if device.type == "cuda" else 0, gpu_mem=gpu_mem, cpu_mem=host_mem_available())
    shape = shape_from_model(meta_model, tokens=batch_tokens)
    p = plan(shape, machine=machine, config=cfg)
    if p.device_split is not None:
        return p.device_split.units, p.device_split.step_s, p._device_split_line()
    n = len(shape.units)
    return max(1, n // 2), None, f"no GPU to size the split from (dry run): half of the {n} units"


def _free(path: str) -> int:
    import shutil

    os.makedirs(path, exist_ok=True)
    return shutil.disk_usage(path).free


class Contender:
    def __init__(self, name: str, step: Callable[[], float], stats: Callable[[], Optional[dict]],
                 memory: Callable[[], dict], close: Callable[[], None]) -> None:
        self.name, self.step, self.stats, self.memory, self.close = name, step, stats, memory, close
        self.times: list[float] = []
        self.stall: list[float] = []
        self.gas = 1
        """Micro-batches per optimizer step (the same batch each time)."""


def torch_contender(base, batch, device: torch.device, gas: int = 1) -> Contender:
    """Plain PyTorch: fp32 parameters on the device, bf16 autocast, fused AdamW; `gas`
    micro-batches (the same batch) per optimizer step."""
    m = copy.deepcopy(base).to(device)
    try:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
    x, y = (t.to(device) for t in batch)

    def step() -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(gas):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = m(x, y)
            (loss / gas).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    def close() -> None:
        nonlocal m, opt
        m = opt = None

    c = Contender("torch" if gas == 1 else f"torch_gas{gas}", step, lambda: None, lambda: {}, close)
    c.gas = gas
    return c


def engine_contender(name: str, base, batch, device: torch.device, param_tier: str, optimizer_tier: str,
                     nvme_root: str, moments: str = "fp32", meta_model=None, worker: str = "auto",
                     split: str = "", split_model=None, gas: int = 1) -> Contender:
    """`split`: the update split ("" none; "auto" the planner's; a count of units)."""
    import offload

    nvme = os.path.join(nvme_root, name) if "nvme" in (param_tier, optimizer_tier) else None
    if nvme:
        os.makedirs(nvme, exist_ok=True)
    cfg = engine_config(device, param_tier, optimizer_tier, nvme, moments, worker=worker, gas=gas)
    units, predicted, how = None, None, ""
    if split == "auto":
        units, predicted, how = planned_split(split_model, cfg, device, batch[0].numel() * gas)
    elif split:
        units, how = int(split), "given"
    if units is not None:
        cfg = engine_config(device, param_tier, optimizer_tier, nvme, moments, worker=worker, gas=gas,
                            device_units=units)
        log(f"{name}: {units} unit(s)' optimizer state on the device ({how})")
    engine = offload.initialize(copy.deepcopy(base) if meta_model is None else base, cfg)
    c = wrap_engine(name, engine, cfg, (param_tier, optimizer_tier), batch, device, gas)
    c.split = {"device_units": sum(st.on_device for st in engine.states), "units": len(engine.states),
               "predicted_step_ms": None if predicted is None else 1e3 * predicted, "how": how}
    return c


def wrap_engine(name: str, engine, cfg, tiers: tuple[str, str], batch, device: torch.device,
                gas: int = 1) -> Contender:
    """An engine as a contender: one timed optimizer step per call (`gas` micro-batches of the
    same batch, synchronised)."""
    x, y = batch

    def step() -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(gas):
            engine.backward(engine(x, y))
            engine.step()
        sync(device)
        return time.perf_counter() - t0

    c = Contender(name, step, engine.step_stats, engine.memory_bytes, engine.close)
    c.engine, c.cfg, c.tiers, c.gas = engine, cfg, tiers, gas
    return c


def summarise(c: Contender, device: torch.device, meta_model, torch_ms: Optional[float]) -> dict:
    row: dict[str, Any] = {"steps": len(c.times), "gas": c.gas}
    if c.times:
        row["step_ms"] = 1e3 * statistics.median(c.times)
        row["step_ms_all"] = [round(1e3 * t, 1) for t in c.times]
        if torch_ms and not c.name.startswith("torch"):
            row["practicality"] = torch_ms / row["step_ms"]
    if c.stall:
        row["stall_pct"] = 100 * statistics.median(c.stall)
    if hasattr(c, "gpu_peak"):
        row["gpu_peak_allocated_bytes"] = c.gpu_peak
    st = c.stats()
    if st:
        row["last_step_stats"] = st
    mem = c.memory()
    if mem:
        row["memory_bytes"] = mem
    if hasattr(c, "split"):
        row["split"] = c.split
    if hasattr(c, "engine") and meta_model is not None:
        try:
            row["planner"] = planner_figure(meta_model, c.cfg, device, *c.tiers)
        except Exception as exc:  # the table says why, the run goes on
            row["planner"] = f"{type(exc).__name__}: {exc}"
    return row


def run_rounds(contenders: list[Contender], rounds: int, res: Results, key: str, device: torch.device,
               meta_model, extra: Callable[[dict], None] = lambda rows: None) -> None:
    """Interleaved rounds (A B C, A B C, ...); the table is rewritten after each round."""
    for r in range(rounds):
        for c in contenders:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t = c.step()
            c.times.append(t)
            if device.type == "cuda":  # this contender's own peak (the process holds every contender)
                c.gpu_peak = max(getattr(c, "gpu_peak", 0), torch.cuda.max_memory_allocated(device))
            st = c.stats()
            if st and st.get("step_s"):
                c.stall.append(st["stall_s"] / st["step_s"])
            log(f"round {r + 1}/{rounds} {c.name}: {1e3 * t:.1f} ms")
        # practicality against plain PyTorch with as many micro-batches per step
        torch_ms = {c.gas: 1e3 * statistics.median(c.times) for c in contenders if c.name.startswith("torch")}
        rows = {c.name: summarise(c, device, meta_model, torch_ms.get(c.gas)) for c in contenders}
        if device.type == "cuda":
            rows["_gpu_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        rows["_host_rss_bytes"] = host_rss_bytes()
        extra(rows)
        res.put(**{key: rows, "rounds_done": r + 1})


def phase_practicality(args: argparse.Namespace, res: Results) -> None:
    from offload.models.gpt import gpt_batches

    device = compute_device(args.dry_run)
    name = "tiny" if args.dry_run else args.model
    n_layer, d, heads, vocab = MODELS[name]
    seq, bsz = (64, 2) if args.dry_run else (args.seq, args.batch)
    res.put(model=name, n_layer=n_layer, d_model=d, vocab=vocab, seq=seq, batch=bsz)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    base = make_gpt(n_layer, d, heads, vocab, seq)
    meta = make_gpt(n_layer, d, heads, vocab, seq, meta=True)
    res.put(params=sum(p.numel() for p in base.parameters()), build_s=time.perf_counter() - t0)
    batch = gpt_batches(1, batch=bsz, seq=seq, vocab=vocab)[0]
    contenders = []
    setups: list[tuple[str, Callable[[], Contender]]] = [("torch", lambda: torch_contender(base, batch, device))]
    gases = {1}
    for spec in (t for t in args.tiers.split(",") if t):
        # param_tier/optimizer_tier, optionally +auto|+N: the update split (the planner's, or the
        # first N units' optimizer state on the device); @on|@off: prefetch.optimizer_worker (default
        # auto; a named one runs the updates during backward); *G: G micro-batches per step
        spec, _, g = spec.partition("*")
        gas = int(g or 1)
        tiers, _, worker = spec.partition("@")
        tiers, _, split = tiers.partition("+")
        pt, ot = tiers.split("/")
        nm = (f"offload_{pt}_{ot}" + (f"_split_{split}" if split else "") + (f"_worker_{worker}" if worker else "")
              + (f"_gas{gas}" if gas > 1 else ""))
        if gas not in gases:
            gases.add(gas)
            setups.append((f"torch_gas{gas}", lambda gas=gas: torch_contender(base, batch, device, gas)))
        setups.append((nm, lambda pt=pt, ot=ot, nm=nm, w=worker or "auto", gas=gas, sp=split: engine_contender(
            nm, base, batch, device, pt, ot, args.nvme_path, worker=w, gas=gas, split=sp, split_model=meta)))
    failed = {}
    for nm, setup in setups:
        t0 = time.perf_counter()
        try:
            c = setup()
            for _ in range(args.warmup):
                c.step()
            contenders.append(c)
            log(f"{nm}: ready in {time.perf_counter() - t0:.1f} s")
        except Exception as exc:  # a contender that fails is reported, the others still run
            import traceback

            traceback.print_exc()
            failed[nm] = f"{type(exc).__name__}: {str(exc)[:300]}"
        res.put(failed=failed)
        gc.collect()
    run_rounds(contenders, args.rounds, res, "contenders", device, meta)
    for c in contenders:
        c.close()
    if failed:
        raise SystemExit(f"contenders failed: {failed}")


def phase_scale(args: argparse.Namespace, res: Results) -> None:
    """A GPT whose 16 B/param training state is `mult` x the GPU's memory, with offload."""
    from offload.models.gpt import gpt_batches

    import offload

    device = compute_device(args.dry_run)
    gpu_mem = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else 2 << 20
    d, heads, vocab = (2560, 20, 50304) if not args.dry_run else (64, 2, 256)
    seq, bsz = (64, 2) if args.dry_run else (args.seq, args.batch)
    per_layer = 12 * d * d + 13 * d
    target = args.mult * gpu_mem / 16
    n_layer = max(2, round((target - vocab * d) / per_layer))
    if not args.dry_run:
        d, heads = 5120, 40  # wider blocks keep the matmuls large at this size
        per_layer = 12 * d * d + 13 * d
        n_layer = max(2, round((target - vocab * d) / per_layer))
    meta = make_gpt(n_layer, d, heads, vocab, seq, meta=True)
    n = sum(p.numel() for p in meta.parameters())
    # Place it the way the planner says is fastest on this machine (bf16 moments if fp32 do not fit).
    from offload.plan.machine import make_machine
    from offload.plan.planner import plan

    machine = make_machine(gpus=1 if device.type == "cuda" else 0,
                           gpu_mem=gpu_mem if device.type == "cuda" else None,
                           cpu_mem=host_mem_available(), nvme_free=_free(args.nvme_path))
    chosen = None
    for moments in ("fp32", "bf16", "8bit"):
        cfg = engine_config(device, "cpu", "cpu", os.path.join(args.nvme_path, "scale"), moments)
        p = plan(meta, machine=machine, config=cfg)
        if p.recommended is not None:
            chosen = (moments, p.recommended.param_tier, p.recommended.optimizer_tier)
            break
    res.put(params=n, n_layer=n_layer, d_model=d, vocab=vocab, seq=seq, batch=bsz,
            training_state_over_gpu=16 * n / gpu_mem, placement=chosen)
    if chosen is None:
        raise SystemExit(f"the planner finds no placement for {n / 1e9:.1f}B parameters on this machine")
    moments, pt, ot = chosen
    log(f"scale: {n / 1e9:.2f}B params ({16 * n / gpu_mem:.2f}x GPU memory), {pt}/{ot}, moments {moments}")
    cfg = engine_config(device, pt, ot, os.path.join(args.nvme_path, "scale") if "nvme" in (pt, ot) else None,
                        moments)
    with torch.device("cpu"):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with offload.init(cfg):
            model = make_gpt(n_layer, d, heads, vocab, seq)
        engine = offload.initialize(model, cfg)
    res.put(init_s=time.perf_counter() - t0)
    log(f"scale: initialised in {time.perf_counter() - t0:.1f} s")
    batch = gpt_batches(1, batch=bsz, seq=seq, vocab=vocab)[0]
    c = wrap_engine("offload", engine, cfg, (pt, ot), batch, device)
    for _ in range(args.warmup):
        log(f"scale: warm-up step {c.step():.2f} s")
    rate = matmul_rate(device, args.dry_run)
    flops = model_flops_per_token(n_layer, d, vocab, seq) * seq * bsz

    def extra(rows: dict) -> None:
        ms = rows["offload"].get("step_ms")
        rows["matmul_tflops"] = rate["tflops"]
        if ms:
            rows["model_tflops"] = flops / (ms / 1e3) / 1e12
            rows["of_matmul"] = rows["model_tflops"] / rate["tflops"]

    run_rounds([c], args.rounds, res, "contenders", device, meta, extra)
    if args.trace:
        engine.timeline.write(args.trace)
    engine.close()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["env", "practicality", "scale"])
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="on the CPU, at tiny sizes")
    p.add_argument("--model", default="1.3b", choices=sorted(MODELS))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tiers", default=DEFAULT_TIERS,
                   help="offload contenders as param_tier/optimizer_tier[+auto|+N][@on|@off][*G], comma-"
                        "separated: +auto/+N the update split (the planner's, or the first N units' "
                        "optimizer state on the device); @on/@off runs the updates during backward on the "
                        "optimizer worker or on autograd's thread (the non-finite guard off; default: the "
                        "defaults); *G: G micro-batches per step, against plain PyTorch with as many")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mult", type=float, default=2.0, help="scale: training state / GPU memory")
    p.add_argument("--nvme-path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "offload-gpu-check"))
    p.add_argument("--trace", default=None, help="scale: write the engine's timeline (Chrome trace) here")
    args = p.parse_args(argv)
    os.makedirs(args.nvme_path, exist_ok=True)
    res = Results(args.json)
    {"env": phase_env, "practicality": phase_practicality, "scale": phase_scale}[args.phase](args, res)


if __name__ == "__main__":
    main()
