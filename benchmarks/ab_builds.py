"""A/B two builds of offload's native kernels on one step, for kernel work.

Each build runs in a process of its own (one process cannot load two copies of the pybind11
module), on the same data from the same seed; the parent alternates them step by step, the
order flipped every round, and reports the median of the per-round time ratios A / B
(> 1: B is faster), which the VM's bandwidth phases move far less than either median alone.
At the end each process hashes its state, so the line also says whether the two builds
computed the same bits.

A build is a directory that holds an `offload` package with its own `_C` extension: a git
worktree built in place, or a copy of `offload/` with another `_C*.so` dropped in.

    python benchmarks/ab_builds.py --a . --b ../wt --kernel adam8bit --params 2 --threads 1
    python benchmarks/ab_builds.py --a . --b ../wt --kernel adam --params 50 --threads 2 --rounds 20
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time

KERNELS = ("adam", "adam8bit")


def _child(kernel: str, params_m: float, threads: int) -> None:
    """Step on command ('s' a step, printing its seconds; 'q' the state's hash, then exit)."""
    import torch

    n = int(params_m * 1e6)
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, threads=threads)
    if kernel == "adam8bit":
        from offload.optim.adam8bit import Moments8bit, adam8bit_step_flat

        state = list(Moments8bit.zeros(n))

        def step(t: int) -> None:
            adam8bit_step_flat(p, g, *state, step=t, **hyper)
    else:
        from offload.optim.functional import adam_step_flat

        state = [torch.zeros(n), torch.zeros(n)]

        def step(t: int) -> None:
            adam_step_flat(p, g, *state, step=t, **hyper)

    t = 0
    for line in sys.stdin:
        if line.strip() == "q":
            digest = hashlib.sha1()
            for x in [p, *state]:
                digest.update(x.numpy().tobytes())
            print(digest.hexdigest()[:16], flush=True)
            return
        t += 1
        t0 = time.perf_counter()
        step(t)
        print(time.perf_counter() - t0, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="directory holding build A's offload package")
    ap.add_argument("--b", required=True, help="directory holding build B's offload package")
    ap.add_argument("--kernel", choices=KERNELS, default="adam8bit")
    ap.add_argument("--params", type=float, default=2.0, help="parameters in millions")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5, help="rounds left out of the medians")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.kernel, args.params, args.threads)
        return 0
    if args.rounds <= args.warmup:
        ap.error(f"--rounds ({args.rounds}) must exceed --warmup ({args.warmup})")

    def start(path: str) -> subprocess.Popen:
        if not os.path.isdir(os.path.join(path, "offload")):
            ap.error(f"{path} holds no offload package")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--kernel", args.kernel,
               "--params", str(args.params), "--threads", str(args.threads), "--a", "", "--b", ""]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    procs = {"A": start(args.a), "B": start(args.b)}
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            proc = procs[name]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("s\n")
            proc.stdin.flush()
            times[name].append(float(proc.stdout.readline()))
    hashes = {}
    for name, proc in procs.items():
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("q\n")
        proc.stdin.flush()
        hashes[name] = proc.stdout.readline().strip()
        proc.wait()
    k, n = args.warmup, args.params * 1e6
    ta, tb = times["A"][k:], times["B"][k:]
    ratio = statistics.median(a / b for a, b in zip(ta, tb))
    print(f"{args.kernel}, {args.params:g}M params, {args.threads} thread(s), {len(ta)} rounds: "
          f"A {statistics.median(ta) * 1e9 / n:.3f} ns/param, B {statistics.median(tb) * 1e9 / n:.3f} ns/param; "
          f"A/B (median per round) {ratio:.3f}; same bits: {hashes['A'] == hashes['B']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
