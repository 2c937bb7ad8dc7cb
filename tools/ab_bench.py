"""Interleaved A/B of the quick benchmarks between two checkouts (a refactor's "no slowdown").

    python tools/ab_bench.py BASE_DIR NEW_DIR [--rounds 5] [--out /tmp/ab]
    python tools/ab_bench.py BASE_DIR NEW_DIR --only bench_train \
        --train-args="--layers 12 --d-model 768 --heads 12 --vocab 50304 --seq 128 --batch 2 \
                      --no-deepspeed --no-fsdp2 --no-lora --no-nvme"   # a 134M GPT

Runs `python -m benchmarks.bench_train --quick --no-deepspeed --no-fsdp2` and
`python -m benchmarks.bench_adam --quick`, alternating BASE and NEW (B, N, N, B, B, N...
so neither always runs first), each in its own checkout (PYTHONPATH=DIR; the native
extension must be built or copied there). Prints, per row of each benchmark (contender,
and size/threads for the Adam one), the median over rounds of BASE and NEW and NEW/BASE.
Contenders that do not run offload code (plain torch, the roofline) change only by noise:
their ratios show how large the noise is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shlex
import subprocess
import sys
from typing import Optional

BENCHES = {
    "bench_train": (["-m", "benchmarks.bench_train", "--quick", "--no-deepspeed", "--no-fsdp2"],
                    ("contender",), "step_ms"),
    "bench_adam": (["-m", "benchmarks.bench_adam", "--quick"], ("params_M", "threads", "contender"), "ms"),
}


def run(checkout: str, bench: str, out: str, override: Optional[list[str]] = None) -> dict:
    args = BENCHES[bench][0] if override is None else ["-m", f"benchmarks.{bench}", *override]
    env = {**os.environ, "PYTHONPATH": checkout}
    proc = subprocess.run([sys.executable, *args, "--json", out], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{bench} in {checkout} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="/tmp/ab")
    p.add_argument("--only", choices=sorted(BENCHES), default=None, help="run one benchmark only")
    p.add_argument("--train-args", default=None,
                   help="bench_train's arguments instead of the quick ones (one string)")
    args = p.parse_args()
    benches = {k: v for k, v in BENCHES.items() if args.only in (None, k)}
    train_args = None if args.train_args is None else shlex.split(args.train_args)
    os.makedirs(args.out, exist_ok=True)
    samples: dict[tuple, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for bench, (_, key, metric) in benches.items():
            for which in order:
                data = run(getattr(args, which), bench, os.path.join(args.out, f"{bench}-{which}-{r}.json"),
                           train_args if bench == "bench_train" else None)
                for row in data["rows"]:
                    if row.get(metric) is None:
                        continue
                    k = (bench,) + tuple(row[c] for c in key)
                    samples.setdefault(k, {"base": [], "new": []})[which].append(float(row[metric]))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{'benchmark / row':<60} {'base':>10} {'new':>10} {'new/base':>9}")
    for k, v in sorted(samples.items(), key=lambda kv: str(kv[0])):
        if not v["base"] or not v["new"]:
            continue
        b, n = statistics.median(v["base"]), statistics.median(v["new"])
        print(f"{' / '.join(str(x) for x in k):<60} {b:>10.3f} {n:>10.3f} {n / b:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
