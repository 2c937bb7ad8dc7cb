"""How fast is the CPU Adam step, against the memory-bandwidth limit and its peers?

Contenders, interleaved per case (size x threads), all updating the same fp32 buffers so
that memory use stays at one set of states:
  roofline          the limit: the best of several C loops with exactly Adam's traffic
                    (read p, g, m, v; write p, m, v) — "roof: plain" and software prefetch
                    at four distances, "roof: prefetch N" — and of every fp32 contender
                    (never below one); the table's "roofline" row names the winner
  triad             STREAM triad a = b + s*c (12 B per element), the machine's bandwidth
  ours fp32         adam_step_flat, fp32 grads and moments
  ours bf16 g+out   bf16 gradients in, bf16 copy of the parameters out, same pass
  ours bf16 moments fp32 grads, bf16 exp_avg / exp_avg_sq
  ours bf16 all     bf16 gradients, moments and output (the engine's mixed-precision case)
  torch foreach     torch.optim.AdamW(foreach=True)
  torch fused       torch.optim.AdamW(fused=True)
  DeepSpeedCPUAdam  deepspeed.ops.adam.DeepSpeedCPUAdam (adamw_mode), when it builds here
  roofline 8bit     C loop with exactly the 8-bit step's traffic (read p, g and two uint8
                    code arrays; write p and the codes)
  ours 8bit         adam8bit_step_flat: fp32 grads, 8-bit moments (blockwise, 256 per scale)
  ours 8bit bf16 g+out  bf16 gradients in, bf16 copy of the parameters out, 8-bit moments
  bnb AdamW8bit     bitsandbytes.optim.AdamW8bit on the CPU, when installed (the same maps
                    and block size)
  torchao AdamW8bit torchao.optim.AdamW8bit on the CPU, when installed (the same maps and
                    block size; its step is torch.compile'd)

Every buffer is on transparent huge pages where the kernel grants them (madvise; the run
prints how many), for the roofline loops and the contenders alike.

Effective GB/s counts the bytes the update must move per parameter, reads plus writes,
not what an implementation happens to move: fp32 states 28 B (read p, g, m, v 16 B;
write p, m, v 12 B); bf16 grads + bf16 out 28 B (g is 2 B, the extra output 2 B); bf16
moments 20 B; bf16 grads, moments and output 20 B; 8-bit moments 16.03 B (p 8, g 4, codes
2 + 2, scales 2 x 2 x 4 / 256), also with bf16 grads + bf16 out. Torch and DeepSpeed count as
fp32, bitsandbytes and torchao as 8-bit. The 8-bit rows' "vs roofline" is against "roofline 8bit" (their
own mix of streams), the others' against "roofline". "vs limit per round" is the same
ratio taken inside each round, against that round's limit, with the median over rounds. Where
the machine's bandwidth changes from moment to moment, a ratio of medians can pair one
contender's fast phase with another's slow one; this ratio cannot.

    python benchmarks/bench_adam.py --quick           # 10M and 50M params, < 1 minute
    python benchmarks/bench_adam.py --json out.json   # 10M..500M, 1..N threads
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `offload` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (
    base_parser,
    interleave,
    na_reasons,
    peer_reason,
    machine_info,
    print_machine,
    print_table,
    ratio,
    timed,
    write_json,
)
from offload._native import C
from offload.optim import Moments8bit, adam8bit_step_flat, adam_isa, adam_step_flat
from offload.sizes import format_bytes

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01

# Bytes per parameter each contender must move (see the module docstring).
BYTES = {
    "roofline": 28,
    **{f"roof: {name}": 28 for name in C.roofline_adam_variants()},
    "triad": 12,
    "ours fp32": 28,
    "ours bf16 g+out": 28,
    "ours bf16 moments": 20,
    "ours bf16 all": 20,
    "torch foreach": 28,
    "torch fused": 28,
    "DeepSpeedCPUAdam": 28,
    "roofline 8bit": 16,
    "ours 8bit": 16 + 16 / 256,
    "ours 8bit bf16 g+out": 16 + 16 / 256,
    "bnb AdamW8bit": 16 + 16 / 256,
    "torchao AdamW8bit": 16 + 16 / 256,
}


def _load_deepspeed() -> tuple[Optional[type], str]:
    """DeepSpeedCPUAdam, or None and the reason it cannot run here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU: let DeepSpeed pick its CPU path
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        from benchmarks.peer_ops import prepare

        why = prepare("cpu_adam")  # built, announced, or dropped with the reason ([Note: peer builds])
        if why is not None:
            return None, why

        probe = torch.nn.Parameter(torch.zeros(64))
        probe.grad = torch.zeros(64)
        DeepSpeedCPUAdam([probe], lr=LR).step()  # JIT-builds the op on first use
        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # any failure (missing, build error) drops the peer
        return None, peer_reason(exc)


def _load_bnb() -> tuple[Optional[type], str]:
    """bitsandbytes' AdamW8bit, or None and the reason it cannot run on the CPU here."""
    try:
        from bitsandbytes.optim import AdamW8bit

        probe = torch.nn.Parameter(torch.zeros(4096))
        probe.grad = torch.zeros(4096)
        AdamW8bit([probe], lr=LR).step()
        return AdamW8bit, ""
    except Exception as exc:  # missing, or no CPU backend in this version
        return None, peer_reason(exc)


def _load_torchao() -> tuple[Optional[type], str]:
    """torchao's AdamW8bit, or None and the reason it cannot run on the CPU here."""
    try:
        from torchao.optim import AdamW8bit

        probe = torch.nn.Parameter(torch.zeros(4096))  # torchao quantises from 4096 elements
        probe.grad = torch.zeros(4096)
        AdamW8bit([probe], lr=LR).step()  # compiles its step on first use
        return AdamW8bit, ""
    except Exception as exc:  # missing, or no CPU path in this version
        return None, peer_reason(exc)


HUGE_PAGE = 2 << 20


def huge_empty(n: int, dtype: torch.dtype, keep: list) -> torch.Tensor:
    """An uninitialised tensor of n elements on anonymous memory advised for transparent huge
    pages (fewer TLB misses over a stream of hundreds of MB); the mapping goes in `keep`,
    which must outlive the tensor."""
    nbytes = max(1, n * torch.empty(0, dtype=dtype).element_size())
    mm = mmap.mmap(-1, (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE,
                   flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory gets no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    keep.append(mm)
    return torch.frombuffer(mm, dtype=dtype, count=n)


def _proc_bytes(path: str, key: str) -> Optional[int]:
    """A `key: N kB` line of a /proc file, in bytes; None when there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def huge_page_bytes() -> Optional[int]:
    """Anonymous memory of this process on transparent huge pages, None if unknown."""
    return _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages")


class Buffers:
    """One set of states, shared by every contender of a size (memory is the constraint),
    on huge pages where granted (`huge_empty`)."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self._maps: list = []

        def filled(dtype: torch.dtype, src: torch.Tensor) -> torch.Tensor:
            # Filled, not just allocated: the first touch of each page must happen here,
            # outside any timed region.
            t = huge_empty(n, dtype, self._maps)
            t.copy_(src)
            return t

        self.p = filled(torch.float32, torch.randn(n, generator=gen))
        self.g = filled(torch.float32, torch.randn(n, generator=gen) * 1e-3)
        self.m = filled(torch.float32, torch.zeros(()))
        self.v = filled(torch.float32, torch.full((), 1e-6))
        self.g_bf16 = filled(torch.bfloat16, self.g)
        self.m_bf16 = filled(torch.bfloat16, self.m)
        self.v_bf16 = filled(torch.bfloat16, self.v)
        self.out_bf16 = filled(torch.bfloat16, torch.zeros(()))
        self.triad_a = filled(torch.float32, torch.zeros(()))
        self.moments8 = Moments8bit.zeros(n)
        self.roof_cm = filled(torch.uint8, torch.zeros((), dtype=torch.uint8))
        self.roof_cv = filled(torch.uint8, torch.zeros((), dtype=torch.uint8))
        self.step = 0

    @staticmethod
    def bytes_needed(n: int) -> int:
        return n * (4 * 5 + 2 * 4 + 4)


def make_contenders(buf: Buffers, threads: int, ds_cls: Optional[type],
                    bnb_cls: Optional[type] = None,
                    torchao_cls: Optional[type] = None) -> dict[str, Callable[[], float]]:
    n = buf.p.numel()
    param = torch.nn.Parameter(buf.p, requires_grad=True)
    param.grad = buf.g

    def ours(grad, m, v, out=None):
        def run() -> float:
            buf.step += 1
            return timed(
                lambda: adam_step_flat(
                    buf.p, grad, m, v, step=buf.step, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                    eps=EPS, weight_decay=WD, out_lowp=out, threads=threads,
                )
            )

        return run

    def ours8(grad, out=None):
        def run() -> float:
            buf.step += 1
            return timed(
                lambda: adam8bit_step_flat(
                    buf.p, grad, *buf.moments8, step=buf.step, lr=LR, beta1=BETAS[0],
                    beta2=BETAS[1], eps=EPS, weight_decay=WD, out_lowp=out, threads=threads,
                )
            )

        return run

    def torch_opt(**kw):
        opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        # Share our moment buffers instead of allocating a second set.
        opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": buf.m, "exp_avg_sq": buf.v}
        return lambda: timed(opt.step)

    def roof(variant: int) -> Callable[[], float]:
        return lambda: timed(lambda: C.roofline_adam(buf.p.data_ptr(), buf.g.data_ptr(), buf.m.data_ptr(),
                                                     buf.v.data_ptr(), n, threads, variant))

    contenders: dict[str, Callable[[], float]] = {
        **{f"roof: {name}": roof(i) for i, name in enumerate(C.roofline_adam_variants())},
        "triad": lambda: timed(
            lambda: C.roofline_triad(buf.triad_a.data_ptr(), buf.p.data_ptr(), buf.g.data_ptr(),
                                     0.5, n, threads)
        ),
        "ours fp32": ours(buf.g, buf.m, buf.v),
        "ours bf16 g+out": ours(buf.g_bf16, buf.m, buf.v, buf.out_bf16),
        "ours bf16 moments": ours(buf.g, buf.m_bf16, buf.v_bf16),
        "ours bf16 all": ours(buf.g_bf16, buf.m_bf16, buf.v_bf16, buf.out_bf16),
        "torch foreach": torch_opt(foreach=True),
        "torch fused": torch_opt(fused=True),
        "roofline 8bit": lambda: timed(
            lambda: C.roofline_adam8bit(buf.p.data_ptr(), buf.g.data_ptr(), buf.roof_cm.data_ptr(),
                                        buf.roof_cv.data_ptr(), n, threads)
        ),
        "ours 8bit": ours8(buf.g),
        "ours 8bit bf16 g+out": ours8(buf.g_bf16, buf.out_bf16),
    }
    if bnb_cls is not None:
        # Its own 8-bit state (2 B/param): created by the warm-up step, outside the timings.
        bnb = bnb_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        contenders["bnb AdamW8bit"] = lambda: timed(bnb.step)
    if torchao_cls is not None:
        # Its own 8-bit state (OptimState8bit, block 256, the same dynamic maps), likewise.
        tao = torchao_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        contenders["torchao AdamW8bit"] = lambda: timed(tao.step)
    if ds_cls is not None:
        ds = ds_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        ds.state[param] = {"step": 0, "exp_avg": buf.m, "exp_avg_sq": buf.v}
        contenders["DeepSpeedCPUAdam"] = lambda: timed(ds.step)
    return contenders


def roof_of(med: dict[str, float]) -> tuple[str, float]:
    """The roofline of one case: the fastest of the roofline loops and of the contenders that
    move Adam's fp32 bytes (28 B/param), as a time per step, and which one it was ([Note: a
    limit that is the limit] in csrc/adam/adam.cpp): a contender faster than every loop
    raises the limit to its own speed."""
    candidates = {k: t for k, t in med.items()
                  if k.startswith("roof: ") or (BYTES.get(k) == 28 and k != "roofline")}
    best = min(candidates, key=candidates.__getitem__)
    return best.removeprefix("roof: "), candidates[best]


def per_round_vs_limit(samples: dict[str, list[float]], name: str) -> float:
    """`name`'s GB/s over the limit's in the same round, the median over rounds: the ratio the
    VM's bandwidth phases move least (a phase that lasts a round lifts the contender and the
    limit together), where the ratio of medians can pair one contender's fast phase with
    another's slow one. `samples`: each contender's step times, one per round, in round
    order. The limit of a round is `roof_of` over that round's times (the 8-bit rows:
    "roofline 8bit", their own traffic)."""
    rounds = min(len(v) for v in samples.values())
    ratios = []
    for r in range(rounds):
        times = {k: v[r] for k, v in samples.items()}
        if "8bit" in name:
            limit_gb_s = BYTES["roofline 8bit"] / times["roofline 8bit"]
        else:
            limit_gb_s = BYTES["roofline"] / roof_of(times)[1]
        ratios.append(BYTES[name] / times[name] / limit_gb_s)
    return statistics.median(ratios) if ratios else float("nan")


def settle(fn: Callable[[], float]) -> Callable[[], float]:
    # torch's OpenMP workers spin for a while after a parallel region; let them park so
    # they do not steal cores from the next contender's timed run.
    def run() -> float:
        time.sleep(0.01)
        return fn()

    return run


def thread_counts(max_threads: int, quick: bool) -> list[int]:
    counts = sorted({1, max_threads} | {t for t in (2, 4, 8, 16, 32, 64) if t < max_threads})
    return counts if not quick else sorted({1, max_threads})


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="*", help="parameter counts in millions")
    p.add_argument("--threads", type=int, nargs="*", help="thread counts (default 1..N)")
    args = p.parse_args()

    info = machine_info()
    info["adam_isa"] = adam_isa()
    print_machine(info)
    max_threads = len(os.sched_getaffinity(0))
    sizes_m = args.sizes or ([10, 50] if args.quick else [10, 50, 100, 200, 500])
    threads_list = args.threads or thread_counts(max_threads, args.quick)
    # Five rounds even when quick: on shared machines three medians still wander by 2x.
    repeats = args.repeats or 5
    ds_cls, ds_reason = _load_deepspeed()
    if ds_cls is None:
        print(f"  [DeepSpeedCPUAdam] dropped: {ds_reason}")
    bnb_cls, bnb_reason = _load_bnb()
    if bnb_cls is None:
        print(f"  [bnb AdamW8bit] dropped: {bnb_reason}")
    torchao_cls, torchao_reason = _load_torchao()
    if torchao_cls is None:
        print(f"  [torchao AdamW8bit] dropped: {torchao_reason}")

    rows: list[dict] = []
    limits: list[dict] = []
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
            contenders = {k: settle(f) for k, f in make_contenders(buf, threads, ds_cls, bnb_cls,
                                                                         torchao_cls).items()}
            for fn in contenders.values():
                fn()  # warm-up: thread pools started, code and TLB warm
            samples = interleave(contenders, repeats, desc=f"adam {size_m:g}M params, {threads} threads")
            med = {k: s.median for k, s in samples.items() if s.values}
            roof_name, med["roofline"] = roof_of(med)
            per_s = {k: n / t for k, t in med.items()}
            limits.append({"params_M": size_m, "threads": threads, "limit": roof_name,
                           **{k: round(per_s[k] * 28 / 1e9, 1) for k in med if k.startswith("roof: ")}})
            # The roofline moves 28 B per parameter (fp32 traffic). A contender that moves
            # fewer bytes (bf16 moments: 20 B) has a higher limit in params/s, so each row is
            # compared in GB/s: its bytes/s over the roofline's, the share of the bandwidth
            # limit it reached, never a bf16 row against fp32's params/s.
            # 8-bit rows against the loop with their own traffic (uint8 streams, no v).
            roof_gb_s = per_s.get("roofline", float("nan")) * BYTES["roofline"]
            roof8_gb_s = per_s.get("roofline 8bit", float("nan")) * BYTES["roofline 8bit"]
            for name, t in med.items():
                if name.startswith("roof: "):
                    continue  # folded into the roofline row, which names the winner
                rows.append(
                    {
                        "params_M": size_m,
                        "threads": threads,
                        "contender": name,
                        "B/param": BYTES[name],
                        "ms": t * 1e3,
                        "Mparam/s": per_s[name] / 1e6,
                        "GB/s": per_s[name] * BYTES[name] / 1e9,
                        "vs roofline": ratio(per_s[name] * BYTES[name],
                                             roof8_gb_s if "8bit" in name else roof_gb_s),
                        "vs limit per round": round(per_round_vs_limit(
                            {k: v.values for k, v in samples.items() if v.values}, name), 3)
                        if name != "roofline" and name in samples else None,
                        "vs DeepSpeed": ratio(per_s[name], per_s.get("DeepSpeedCPUAdam", float("nan"))),
                        "vs torch fused": ratio(per_s[name], per_s.get("torch fused", float("nan"))),
                    }
                )
        del buf
    torch.set_num_threads(max_threads)

    missing = {"DeepSpeedCPUAdam": ds_reason} if ds_reason else {}
    if bnb_reason:
        missing["bnb AdamW8bit"] = bnb_reason
    if torchao_reason:
        missing["torchao AdamW8bit"] = torchao_reason
    ratio_peers = {"vs roofline": "roofline", "vs DeepSpeed": "DeepSpeedCPUAdam",
                   "vs torch fused": "torch fused"}
    huge = huge_page_bytes()
    print(f"buffers on transparent huge pages: {format_bytes(huge) if huge is not None else 'unknown'}")
    print("vs roofline: the row's GB/s (its own bytes per parameter) / the roofline's GB/s; "
          "roofline: the best loop or contender of the case (its 'limit' column); vs limit per round: "
          "the same ratio taken within each round against that round's best, the median over rounds "
          "(steadier where the machine's bandwidth changes from moment to moment)")
    print_table(rows, na=na_reasons(ratio_peers, missing))
    print("the roofline of each case, and the GB/s of each loop it was the best of:")
    print_table(limits)
    targets = _check_targets(rows, max(threads_list))
    for line in targets:
        print(line)
    write_json(args.json, {"machine": info, "rows": rows, "targets": targets, "limits": limits,
                           "huge_page_bytes": huge,
                           "deepspeed_dropped": ds_reason or None,
                           "peers_missing": missing, "ratio_peers": ratio_peers})


def _check_targets(rows: list[dict], threads: int) -> list[str]:
    """The issue's targets, per size, at the largest thread count (same run)."""
    out = []
    for size in sorted({r["params_M"] for r in rows}):
        get = {r["contender"]: r for r in rows if r["params_M"] == size and r["threads"] == threads}
        if "ours fp32" not in get:
            continue
        fp32 = get["ours fp32"]
        checks = [f"fp32 {fp32['vs roofline']:.3f} of roofline, {fp32['vs limit per round']:.3f} "
                  "per round (target >= 0.97)"]
        if "DeepSpeedCPUAdam" in get:
            checks.append(f"fp32 {fp32['vs DeepSpeed']:.3f}x DeepSpeed (>= 1.03)")
            checks.append(f"bf16 moments {get['ours bf16 moments']['vs DeepSpeed']:.3f}x DeepSpeed (>= 1.4)")
            if "ours 8bit" in get:
                checks.append(f"8-bit moments {get['ours 8bit']['vs DeepSpeed']:.3f}x DeepSpeed (>= 1.5)")
        if "ours 8bit" in get:
            checks.append(f"8-bit {get['ours 8bit']['vs roofline']:.3f} of its roofline, "
                          f"{get['ours 8bit']['vs limit per round']:.3f} per round (>= 0.9)")
        cost = get["ours bf16 g+out"]["ms"] / fp32["ms"] - 1
        checks.append(f"bf16 grads+out cost {cost * 100:+.1f} % over fp32 (<= +10 %)")
        out.append(f"targets @ {size:g}M params, {threads} threads: " + "; ".join(checks))
    return out


def _mem_available_bytes() -> Optional[int]:
    return _proc_bytes("/proc/meminfo", "MemAvailable")


if __name__ == "__main__":
    main()
