"""`python -m benchmarks` (or `offload-bench`): run every benchmark, write one report.

Each benchmark script answers one question and follows the same convention (--quick,
--json PATH). This runner calls them as subprocesses (so one crashing peer cannot take the
suite down, and each starts with a clean allocator and page cache state), collects their
JSON, and writes a Markdown report (tables + PNG plots when matplotlib is installed) and
one combined JSON file.

Nothing is left outside `--out`: each benchmark runs with TMPDIR set to a scratch folder
of its own under `--out`, removed when it ends (killed or not). Its test files, checkpoints
and swap files (the benchmarks' default directories are in the temp dir), and what
libraries put in the temp dir (torch's inductor cache folder), all go there, so the disk
`--out` is on is the disk the I/O benchmarks measure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks._common import busy, load_average
from benchmarks._report import render

# The order users read them in: disk, optimizers (Adam, then Lion and Adagrad), then whole
# training steps, then checkpoints.
BENCHMARKS = ["bench_io", "bench_adam", "bench_optimizers", "bench_train", "bench_checkpoint"]

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
        load_before = load_average()
        if busy(load_before):
            print(f"  warning: the machine is busy before {name}: 1-min load average "
                  f"{load_before['load_avg'][0]:g} > 0.5 x {load_before['cores']} cores; "
                  f"its figures may be off (rerun on a quiet machine)", flush=True)
        t0 = time.perf_counter()
        scratch = tempfile.mkdtemp(prefix=f".scratch-{name}-", dir=out)
        try:
            log, rc = _run(cmd, here.parent, timeout_s, name, {**os.environ, "TMPDIR": scratch})
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        load = {"before": load_before, "after": load_average(), "busy_before": busy(load_before)}
        (out / f"{name}.log").write_text(log)
        if rc != 0:
            print(log, end="", flush=True)
        if rc != 0 or not json_path.is_file():
            tail = (log.strip().splitlines() or ["no output"])[-1]
            failures[name] = (f"timed out after {timeout_s:g} s" if rc is None else f"exit {rc}: {tail}")
            print(f"  {name} failed: {failures[name]} (log: {out / f'{name}.log'})", file=sys.stderr)
            continue
        results[name] = json.loads(json_path.read_text())
        results[name]["_wall_s"] = round(time.perf_counter() - t0, 1)
        results[name]["_load"] = load

    suite = {
        "command": " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - t_suite, 1),
        "results": results,
        "failures": failures,
        "cores": load_average()["cores"],
    }
    report, plots = render(suite, out)
    suite["plots"] = plots
    (out / "suite.json").write_text(json.dumps(suite, indent=2, default=str))
    (out / "report.md").write_text(report)
    print(f"wrote {out / 'report.md'}, {out / 'suite.json'} and {len(plots)} plot(s) "
          f"in {suite['wall_s']:g} s" + (f"; failed: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


def _run(cmd: list[str], cwd: Path, timeout_s: float, name: str,
         env: dict[str, str]) -> tuple[str, Optional[int]]:
    """Run one benchmark in `env`, its stdout and stderr merged, echoed live; return (log,
    exit status, None when it was killed for `timeout_s`).

    The benchmark's output is a pipe, so its rounds arrive as `[progress] desc k/n` lines
    (benchmarks/_common.py `Progress`). On a terminal they drive one tqdm bar per benchmark
    (its total grows as each case announces its rounds); elsewhere (CI, a log file) they are
    echoed as the plain lines they are.
    """
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=1)
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    bar = _Bar(name) if sys.stdout.isatty() else None
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if bar is not None and line.startswith("[progress] "):
                bar.update(line)
            elif bar is not None:
                bar.write(line.rstrip("\n"))
            else:
                print(line, end="", flush=True)
        proc.wait()
    finally:
        timer.cancel()
        if bar is not None:
            bar.close()
    log = "".join(lines)
    if killed.is_set():
        return log + f"\n[suite] killed after {timeout_s:g} s\n", None
    return log, proc.returncode


class _Bar:
    """One tqdm bar per benchmark over all its rounds, fed by its `[progress]` lines."""

    def __init__(self, name: str) -> None:
        from tqdm import tqdm

        self.tqdm = tqdm
        self.bar = tqdm(total=0, desc=name, unit="round", dynamic_ncols=True)
        self.seen: set[str] = set()

    def update(self, line: str) -> None:
        desc, _, count = line[len("[progress] "):].rstrip().rpartition(" ")
        done, _, total = count.partition("/")
        if desc not in self.seen:  # a new case: its rounds join the bar's total
            self.seen.add(desc)
            self.bar.total += int(total)
        self.bar.set_postfix_str(desc, refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        self.tqdm.write(text)

    def close(self) -> None:
        self.bar.close()


if __name__ == "__main__":
    sys.exit(main())
