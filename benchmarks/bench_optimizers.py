"""How fast are the native Lion and Adagrad steps, against the bandwidth limit and their peers?

Contenders, interleaved per case (size x threads) in one run, each optimizer on its own
state buffer so that memory holds one set of states per optimizer:
  roofline                C loop with exactly a one-state optimizer's traffic (read p, g, s;
                          write p, s), threaded and chunked like our kernels
  lion ours fp32          lion_step_flat, fp32 gradient and momentum
  lion ours bf16 g+out    bf16 gradient in, bf16 copy of the parameters out, same pass
  lion ours bf16 state    fp32 gradient, bf16 momentum
  lion torch foreach      Lion in torch._foreach ops, written here: torch has no Lion (this is
                          lion-pytorch's foreach formulation: lerp, sign, add)
  DeepSpeedCPULion        deepspeed.ops.lion.DeepSpeedCPULion, when it builds here
  adagrad ours fp32 / bf16 g+out / bf16 state   adagrad_step_flat, as for Lion
  adagrad torch foreach   torch.optim.Adagrad(foreach=True)
  adagrad torch fused     torch.optim.Adagrad(fused=True)
  DeepSpeedCPUAdagrad     deepspeed.ops.adagrad.DeepSpeedCPUAdagrad, when it builds here

Bytes per parameter count what the update must move, reads plus writes: fp32 20 B (read p,
g, s 12 B; write p, s 8 B); bf16 gradient + bf16 output 20 B (g is 2 B, the extra output
2 B); bf16 state 16 B. Peers count as fp32. "vs roofline" is the row's GB/s over the
roofline loop's GB/s (the same measured bandwidth, at each row's own bytes); "vs best peer"
is the row's params/s over the fastest peer's of the same optimizer in the same case.

    python benchmarks/bench_optimizers.py --quick           # 10M and 50M params, about a minute
    python benchmarks/bench_optimizers.py --json out.json   # 10M..200M, 1..N threads
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `offload` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (
    base_parser,
    interleave,
    machine_info,
    na_reasons,
    peer_reason,
    print_machine,
    print_table,
    ratio,
    timed,
    write_json,
)
from benchmarks.bench_adam import _mem_available_bytes, settle, thread_counts
from offload._native import C
from offload.optim import adam_isa, adagrad_step_flat, lion_step_flat
from offload.sizes import format_bytes

LION = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
ADAGRAD = dict(lr=1e-2, lr_decay=0.0, weight_decay=0.01, eps=1e-10)

BYTES = {"roofline": 20}
for _opt in ("lion", "adagrad"):
    BYTES.update({f"{_opt} ours fp32": 20, f"{_opt} ours bf16 g+out": 20,
                  f"{_opt} ours bf16 state": 16, f"{_opt} torch foreach": 20})
BYTES.update({"adagrad torch fused": 20, "DeepSpeedCPULion": 20, "DeepSpeedCPUAdagrad": 20})
PEERS = {"lion": ("lion torch foreach", "DeepSpeedCPULion"),
         "adagrad": ("adagrad torch foreach", "adagrad torch fused", "DeepSpeedCPUAdagrad")}


def _load_deepspeed(module: str, name: str, **kw) -> tuple[Optional[type], str]:
    """A DeepSpeed CPU optimizer class, or None and the reason it cannot run here (its op is
    JIT-built on first use: that can take a minute, or fail)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU: let DeepSpeed pick its CPU path
    try:
        import importlib

        cls = getattr(importlib.import_module(module), name)
        from benchmarks.peer_ops import prepare

        why = prepare("cpu_" + module.rsplit(".", 1)[-1])  # cpu_lion, cpu_adagrad ([Note: peer builds])
        if why is not None:
            return None, why
        probe = torch.nn.Parameter(torch.zeros(64))
        probe.grad = torch.zeros(64)
        cls([probe], **kw).step()
        return cls, ""
    except Exception as exc:  # any failure (missing, build error) drops the peer
        return None, peer_reason(exc)


class Buffers:
    """The states of one size, shared by the contenders of each optimizer."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        # Filled, not just allocated: every page is touched here, outside the timed regions.
        self.p = torch.randn(n, generator=gen)
        self.g = torch.randn(n, generator=gen) * 1e-3
        self.m = torch.zeros(n)  # Lion's momentum
        self.s = torch.full((n,), 1e-6)  # Adagrad's sum of squares
        self.g_bf16 = self.g.to(torch.bfloat16)
        self.m_bf16 = self.m.to(torch.bfloat16)
        self.s_bf16 = self.s.to(torch.bfloat16)
        self.out_bf16 = torch.zeros(n, dtype=torch.bfloat16)
        self.roof_s = torch.zeros(n)
        self.step = 0

    @staticmethod
    def bytes_needed(n: int) -> int:
        return n * (4 * 5 + 2 * 4)


def _torch_lion_foreach(params, grads, exp_avgs, lr, beta1, beta2, weight_decay) -> None:
    """Lion in torch's multi-tensor ops, as lion-pytorch's foreach variant computes it."""
    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    updates = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(updates)
    torch._foreach_add_(params, updates, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)


def make_contenders(buf: Buffers, threads: int, ds: dict[str, Optional[type]]) -> dict[str, Callable[[], float]]:
    n = buf.p.numel()
    param = torch.nn.Parameter(buf.p, requires_grad=True)
    param.grad = buf.g
    beta1, beta2 = LION["betas"]

    def lion(grad, m, out=None):
        return lambda: timed(lambda: lion_step_flat(
            buf.p, grad, m, lr=LION["lr"], beta1=beta1, beta2=beta2,
            weight_decay=LION["weight_decay"], out_lowp=out, threads=threads))

    def adagrad(grad, s, out=None):
        def run() -> float:
            buf.step += 1
            return timed(lambda: adagrad_step_flat(
                buf.p, grad, s, step=buf.step, out_lowp=out, threads=threads, **ADAGRAD))

        return run

    def torch_adagrad(**kw):
        opt = torch.optim.Adagrad([param], **ADAGRAD, **kw)
        opt.state[param] = {"step": torch.tensor(0.0), "sum": buf.s}  # share our state buffer
        return lambda: timed(opt.step)

    contenders: dict[str, Callable[[], float]] = {
        "roofline": lambda: timed(lambda: C.roofline_one_state(
            buf.p.data_ptr(), buf.g.data_ptr(), buf.roof_s.data_ptr(), n, threads)),
        "lion ours fp32": lion(buf.g, buf.m),
        "lion ours bf16 g+out": lion(buf.g_bf16, buf.m, buf.out_bf16),
        "lion ours bf16 state": lion(buf.g, buf.m_bf16),
        "lion torch foreach": lambda: timed(lambda: _torch_lion_foreach(
            [buf.p], [buf.g], [buf.m], LION["lr"], beta1, beta2, LION["weight_decay"])),
        "adagrad ours fp32": adagrad(buf.g, buf.s),
        "adagrad ours bf16 g+out": adagrad(buf.g_bf16, buf.s, buf.out_bf16),
        "adagrad ours bf16 state": adagrad(buf.g, buf.s_bf16),
        "adagrad torch foreach": torch_adagrad(foreach=True),
        "adagrad torch fused": torch_adagrad(fused=True),
    }
    if ds.get("DeepSpeedCPULion") is not None:
        opt = ds["DeepSpeedCPULion"]([param], lr=LION["lr"], betas=LION["betas"],
                                     weight_decay=LION["weight_decay"])
        # Our momentum buffer; DeepSpeed also allocates an unused exp_avg_sq: give it nothing.
        opt.state[param] = {"step": 0, "exp_avg": buf.m, "exp_avg_sq": torch.empty(0)}
        contenders["DeepSpeedCPULion"] = lambda: timed(opt.step)
    if ds.get("DeepSpeedCPUAdagrad") is not None:
        ada = ds["DeepSpeedCPUAdagrad"]([param], lr=ADAGRAD["lr"], eps=ADAGRAD["eps"],
                                        weight_decay=ADAGRAD["weight_decay"])
        ada.state[param] = {"step": 0, "exp_avg_sq": buf.s}
        contenders["DeepSpeedCPUAdagrad"] = lambda: timed(ada.step)
    return contenders


def rows_of_case(size_m: float, threads: int, n: int, med: dict[str, float]) -> list[dict]:
    per_s = {k: n / t for k, t in med.items()}
    roof_gb_s = per_s.get("roofline", float("nan")) * BYTES["roofline"]
    rows = []
    for name, t in med.items():
        opt = name.split()[0].lower().replace("deepspeedcpu", "")
        peers = {p: per_s[p] for p in PEERS.get(opt, ()) if p in per_s}
        best = max(peers, key=peers.get) if peers else None
        rows.append({
            "params_M": size_m,
            "threads": threads,
            "contender": name,
            "B/param": BYTES[name],
            "ms": t * 1e3,
            "Mparam/s": per_s[name] / 1e6,
            "GB/s": per_s[name] * BYTES[name] / 1e9,
            "best peer": best or "-",
            "vs roofline": ratio(per_s[name] * BYTES[name], roof_gb_s),
            "vs best peer": ratio(per_s[name], peers[best]) if best else float("nan"),
        })
    return rows


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="*", help="parameter counts in millions")
    p.add_argument("--threads", type=int, nargs="*", help="thread counts (default 1..N)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's CPU Lion and Adagrad")
    args = p.parse_args()

    info = machine_info()
    info["kernel_isa"] = adam_isa()
    print_machine(info)
    max_threads = len(os.sched_getaffinity(0))
    sizes_m = args.sizes or ([10, 50] if args.quick else [10, 50, 100, 200])
    threads_list = args.threads or thread_counts(max_threads, args.quick)
    repeats = args.repeats or 5
    ds: dict[str, Optional[type]] = {}
    missing: dict[str, str] = {}
    for module, name, kw in (("deepspeed.ops.lion", "DeepSpeedCPULion", {}),
                             ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad", {})):
        if args.no_deepspeed:
            ds[name], missing[name] = None, "deepspeed: skipped (--no-deepspeed)"
            continue
        ds[name], why = _load_deepspeed(module, name, **kw)
        if why:
            missing[name] = why
            print(f"  [{name}] dropped: {why}")

    rows = []
    for size_m in sizes_m:
        n = int(size_m * 1e6)
        avail = _mem_available_bytes()
        if avail is not None and Buffers.bytes_needed(n) > 0.8 * avail:
            print(f"  [{size_m:g}M params] skipped: needs {format_bytes(Buffers.bytes_needed(n))}, "
                  f"{format_bytes(avail)} available")
            continue
        buf = Buffers(n)
        for threads in threads_list:
            torch.set_num_threads(threads)  # torch's and DeepSpeed's OpenMP pools
            contenders = {k: settle(f) for k, f in make_contenders(buf, threads, ds).items()}
            for fn in contenders.values():
                fn()  # warm-up: thread pools started, code and TLB warm
            samples = interleave(contenders, repeats, desc=f"lion+adagrad {size_m:g}M params, {threads} threads")
            med = {k: s.median for k, s in samples.items() if s.values}
            rows += rows_of_case(size_m, threads, n, med)
        del buf
    torch.set_num_threads(max_threads)

    ratio_peers = {"vs roofline": "roofline"}
    print("Lion's torch peer is written here (torch has no Lion): lion-pytorch's foreach ops")
    print("vs roofline: the row's GB/s (its own bytes per parameter) / the roofline's GB/s")
    print_table(rows, na=na_reasons(ratio_peers, missing))
    if missing:
        print("peers missing: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    targets = check_targets(rows, max(threads_list))
    for line in targets:
        print(line)
    write_json(args.json, {"machine": info, "rows": rows, "targets": targets,
                           "peers_missing": missing, "ratio_peers": ratio_peers})


def check_targets(rows: list[dict], threads: int) -> list[str]:
    """The issue's targets, per size and optimizer, at the largest thread count (same run):
    each native fp32 kernel >= 0.97 of its roofline and >= 1.03x the best peer."""
    out = []
    for size in sorted({r["params_M"] for r in rows}):
        get = {r["contender"]: r for r in rows if r["params_M"] == size and r["threads"] == threads}
        checks = []
        for opt in ("lion", "adagrad"):
            ours = get.get(f"{opt} ours fp32")
            if ours is None:
                continue
            line = f"{opt} {ours['vs roofline']:.3f} of roofline (>= 0.97)"
            if ours["best peer"] != "-":
                line += f", {ours['vs best peer']:.2f}x {ours['best peer']} (>= 1.03)"
            checks.append(line)
        if checks:
            out.append(f"targets @ {size:g}M params, {threads} threads: " + "; ".join(checks))
    return out


if __name__ == "__main__":
    main()
