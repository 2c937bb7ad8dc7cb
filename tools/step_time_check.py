"""Predicted against measured, on this machine: interleaved rounds of (measure the machine
profile, run bench_train's engine contenders with that profile), at each size; prints per
contender and size the median of predicted / measured over the rounds, and whether the
placement the planner ranks fastest is the measured fastest.

    python tools/step_time_check.py --rounds 3 --repeats 3 --out /tmp/check

Each round's benchmark is bracketed by two profiles, one measured right before it and one
right after: on a machine shared with other work the load moves within minutes, and a
profile measured in a lull predicts a step measured in a rush too fast (a held-out round
here: 0.61-0.69 with the profile before alone). The prediction compared is the mean of the
two profiles' predictions (`--no-bracket`: the profile before alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = {
    "quick": ["--quick"],
    "mid": ["--layers", "4", "--d-model", "384", "--heads", "6", "--vocab", "8192", "--seq", "128", "--batch", "8"],
}


def _bracketed(rows: list[dict], result: dict, after_path: str) -> list[dict]:
    """`rows` (predicted from the profile before) with each prediction the mean of it and
    the one the profile after gives for the same contender."""
    import types

    sys.path.insert(0, ROOT)
    from benchmarks.predicted import predict_rows
    from offload.plan.profile import load_profile

    measured = {r["contender"]: r["measured_ms"] / 1e3 for r in rows}
    later = {r["contender"]: r for r in predict_rows(measured, types.SimpleNamespace(**result["args"]),
                                                      load_profile(after_path), False)}
    out = []
    for r in rows:
        b = later.get(r["contender"])
        if r["predicted_ms"] is not None and b is not None and b["predicted_ms"] is not None:
            pred = (r["predicted_ms"] + b["predicted_ms"]) / 2
            r = {**r, "predicted_ms": pred, "pred_over_meas": pred / r["measured_ms"]}
        out.append(r)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="bench_train's interleaved rounds per run")
    p.add_argument("--sizes", default="quick,mid")
    p.add_argument("--out", required=True, help="folder for the profiles and the JSON of each run")
    p.add_argument("--no-bracket", action="store_true", help="predict from the profile before the benchmark only")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    nvme = os.path.join(args.out, "nvme")
    os.makedirs(nvme, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": ROOT}
    ratios: dict[tuple[str, str], list[float]] = {}
    ranked: dict[str, list[tuple[str, str]]] = {}
    for r in range(args.rounds):
        for size in args.sizes.split(","):
            prof = os.path.join(args.out, f"profile-{size}-{r}.json")
            subprocess.run([sys.executable, "-m", "offload.plan", "--measure", "--nvme-path", nvme,
                            "--profile-out", prof], check=True, env=env, stdout=subprocess.DEVNULL)
            out = os.path.join(args.out, f"bench-{size}-{r}.json")
            subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), *SIZES[size],
                            "--no-deepspeed", "--no-fsdp2", "--no-lora", "--nvme-path", nvme,
                            "--repeats", str(args.repeats), "--plan-profile", prof, "--json", out],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            with open(out) as f:
                result = json.load(f)
            rows = result["predicted"]
            if not args.no_bracket:
                after = os.path.join(args.out, f"profile-{size}-{r}-after.json")
                subprocess.run([sys.executable, "-m", "offload.plan", "--measure", "--nvme-path", nvme,
                                "--profile-out", after], check=True, env=env, stdout=subprocess.DEVNULL)
                rows = _bracketed(rows, result, after)
            for row in rows:
                if row["pred_over_meas"] is not None:
                    ratios.setdefault((size, row["contender"]), []).append(row["pred_over_meas"])
            timed = [x for x in rows if x["predicted_ms"] is not None]
            best_pred = min(timed, key=lambda x: x["predicted_ms"])["contender"]
            best_meas = min(timed, key=lambda x: x["measured_ms"])["contender"]
            ranked.setdefault(size, []).append((best_pred, best_meas))
            print(f"round {r} {size}: " + ", ".join(f"{x['contender']} {x['predicted_ms']:.0f}/{x['measured_ms']:.0f} ms"
                                                   for x in timed), flush=True)
    print("\nsize   contender             median pred/meas  rounds")
    for (size, name), v in sorted(ratios.items()):
        print(f"{size:6} {name:21} {statistics.median(v):16.3f}  {', '.join(f'{x:.2f}' for x in v)}")
    for size, pairs in ranked.items():
        print(f"{size}: predicted fastest vs measured fastest per round: {pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
