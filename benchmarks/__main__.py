"""`python -m benchmarks` (or `offload-bench`): run every benchmark, write one report.

Each benchmark script answers one question and follows the same convention (--quick,
--json PATH). This runner calls them as subprocesses (so one crashing peer cannot take the
suite down, and each starts with a clean allocator and page cache state), collects their
JSON, and writes a Markdown report (tables + PNG plots when matplotlib is installed) and
one combined JSON file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._report import render

# The order users read them in: disk, optimizer, then whole training steps, then checkpoints.
BENCHMARKS = ["bench_io", "bench_adam", "bench_train", "bench_checkpoint"]

# What --quick adds to a script's own --quick, so every plot has a line to draw: bench_io's
# quick grid is one block size, and "bandwidth vs block size" needs three. (Arguments after
# --extra come later on the command line, so they win.)
QUICK_ARGS = {"bench_io": ["--block-sizes", "256K,1M,4M"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="offload-bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every benchmark in its quick mode (a few minutes in all)")
    p.add_argument("--out", default="bench-results", help="directory for report.md, suite.json, the plots and logs")
    p.add_argument("--only", nargs="*", help=f"benchmark names to run (default: all of {BENCHMARKS})")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="wall-clock limit per benchmark, seconds (default 600 with --quick, 3600 without)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="arguments passed to every script (put last; use with --only)")
    args = p.parse_args(argv)
    timeout_s = args.timeout_s or (600.0 if args.quick else 3600.0)

    here = Path(__file__).resolve().parent
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in (args.only or []) if not (here / f"{n}.py").is_file()]
    if unknown:
        print(f"no such benchmark: {', '.join(unknown)} (have: {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    names = [n for n in (args.only or BENCHMARKS) if (here / f"{n}.py").is_file()]

    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    t_suite = time.perf_counter()
    for name in names:
        json_path = out / f"{name}.json"
        json_path.unlink(missing_ok=True)  # a stale result must not pass for this run's
        cmd = [sys.executable, "-m", f"benchmarks.{name}", "--json", str(json_path)]
        if args.quick:
            cmd += ["--quick", *QUICK_ARGS.get(name, [])]
        cmd += args.extra
        print(f"== {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=here.parent, text=True, capture_output=True, timeout=timeout_s)
            log, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            log = _text(exc.stdout) + _text(exc.stderr) + f"\n[suite] killed after {timeout_s:g} s\n"
            rc = None
        (out / f"{name}.log").write_text(log)
        print(log if rc != 0 else proc.stdout, end="", flush=True)
        if rc != 0 or not json_path.is_file():
            tail = (log.strip().splitlines() or ["no output"])[-1]
            failures[name] = (f"timed out after {timeout_s:g} s" if rc is None else f"exit {rc}: {tail}")
            print(f"  {name} failed: {failures[name]} (log: {out / f'{name}.log'})", file=sys.stderr)
            continue
        results[name] = json.loads(json_path.read_text())
        results[name]["_wall_s"] = round(time.perf_counter() - t0, 1)

    suite = {
        "command": " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - t_suite, 1),
        "results": results,
        "failures": failures,
    }
    report, plots = render(suite, out)
    suite["plots"] = plots
    (out / "suite.json").write_text(json.dumps(suite, indent=2, default=str))
    (out / "report.md").write_text(report)
    print(f"wrote {out / 'report.md'}, {out / 'suite.json'} and {len(plots)} plot(s) "
          f"in {suite['wall_s']:g} s" + (f"; failed: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


if __name__ == "__main__":
    sys.exit(main())
