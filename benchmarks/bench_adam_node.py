"""A node's aggregate CPU Adam rate: R ranks on one node, each updating its own shard with
the engine's default thread budget, against one rank with every core (issue #35).

Under ZeRO a node's R ranks each own 1/R of the optimizer state and reach the update at
about the same time, so what the node delivers is the sum of their rates while they run
together. Each rank here is a process of its own (as under torchrun) with
LOCAL_WORLD_SIZE=R, so `offload.optim.threads.resolve_threads(0)` gives it the cores in its
affinity divided by R; the ranks start their timed steps together (a barrier), and the
node's rate is the whole model's parameters over the slowest rank's time. The same model
is run by one rank with all the cores, and by R ranks that each take every core (the
oversubscription the default budget avoids), interleaved, medians of --repeats.

    python benchmarks/bench_adam_node.py --params 50 --ranks 1 2
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from statistics import median
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `offload` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import base_parser, machine_info, print_machine, print_table, write_json

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _rank(rank: int, ranks: int, n: int, steps: int, threads: int, barrier: Any, out: Any) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks)
    import torch

    from offload.optim import adam_step_flat
    from offload.optim.threads import resolve_threads

    use = threads or resolve_threads(0)
    torch.set_num_threads(use)
    shard = n // ranks + (1 if rank < n % ranks else 0)
    p, g = torch.randn(shard), torch.randn(shard) * 1e-3
    m, v = torch.zeros(shard), torch.full((shard,), 1e-6)

    def step(k: int) -> None:
        adam_step_flat(p, g, m, v, step=k, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                       weight_decay=WD, threads=use)

    step(1)  # warm-up: pages touched, thread pool started
    barrier.wait()
    t0 = time.perf_counter()
    for k in range(steps):
        step(k + 2)
    out.put((rank, use, time.perf_counter() - t0))


def node_rate(n: int, ranks: int, steps: int, threads: int, start_method: str = "spawn") -> tuple[float, int]:
    """(parameters updated per second by the node, threads per rank) for one run; each rank
    a fresh process (`spawn`), or forked from a server that imported offload already."""
    ctx = mp.get_context(start_method)
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ranks, n, steps, threads, barrier, out)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a rank exited {proc.exitcode}")
    slowest = max(t for _, _, t in results)
    return n * steps / slowest, results[0][1]


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=50, help="model parameters, in millions")
    p.add_argument("--ranks", type=int, nargs="*", default=[1, 2], help="ranks on the node")
    p.add_argument("--steps", type=int, default=10, help="timed steps per rank and run")
    args = p.parse_args()
    info = machine_info()
    print_machine(info)
    cores = len(os.sched_getaffinity(0))
    n = int(args.params * 1e6)
    repeats = args.repeats or (3 if args.quick else 5)
    cases = []
    for ranks in args.ranks:
        cases.append((ranks, 0, "default budget"))  # cores / LOCAL_WORLD_SIZE each
        if ranks > 1:
            cases.append((ranks, cores, "every core each"))
    samples: dict[tuple, list[float]] = {c: [] for c in cases}
    per_rank: dict[tuple, int] = {}
    for i in range(repeats):  # interleaved: each round runs every case once
        for case in cases:
            rate, used = node_rate(n, case[0], args.steps, case[1])
            samples[case].append(rate)
            per_rank[case] = used
        print(f"[progress] round {i + 1}/{repeats}", file=sys.stderr)
    base = median(samples[(1, 0, "default budget")]) if (1, 0, "default budget") in samples else None
    rows = []
    for case in cases:
        rate = median(samples[case])
        rows.append({"ranks": case[0], "threads/rank": per_rank[case], "budget": case[2],
                     "Mparam/s": rate / 1e6, "GB/s": rate * 28 / 1e9,
                     "vs 1 rank": rate / base if base else float("nan")})
    print(f"node: {cores} cores, {args.params:g}M parameters split over the ranks, "
          f"{args.steps} steps, medians of {repeats}")
    print_table(rows)
    write_json(args.json, {"machine": info, "rows": rows, "params": n, "cores": cores})


if __name__ == "__main__":
    main()
