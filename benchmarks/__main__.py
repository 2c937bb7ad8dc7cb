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
`--out` is on is the disk the I/O benchmarks measure. DeepSpeed's ops, which the peers
compile on first use, are built into `--out`/torch_extensions (`TORCH_EXTENSIONS_DIR`, unless
you set it): once per `--out`, announced before it starts, and never left locked by a killed
run ([Note: peer builds] in benchmarks/peer_ops.py). Under `--quick` a peer whose op is not
built yet is skipped with the reason (`--build-peers` builds them first).

`report.md` and `suite.json` are rewritten after each benchmark, so a run that is killed
keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks._common import busy, load_average
from benchmarks._report import render
from benchmarks.peer_ops import SKIP_ENV, stale_locks

# The order users read them in: disk, optimizers (Adam, then Lion and Adagrad), then whole
# training steps, then checkpoints.
BENCHMARKS = ["bench_io", "bench_adam", "bench_optimizers", "bench_train", "bench_checkpoint"]

# What --quick adds to a script's own --quick, so every plot has a line to draw: bench_io's
# quick grid is one block size, and "bandwidth vs block size" needs three. (Arguments after
# --extra come later on the command line, so they win.)
QUICK_ARGS = {"bench_io": ["--block-sizes", "256K,1M,4M"]}

# Per-benchmark wall-clock limits (seconds). --quick promises a few minutes in all (each
# benchmark about a minute on 2 quiet cores, docs/examples.md): 240 s is four times that,
# room for a busy machine, and a hung benchmark costs the run minutes, not ten.
TIMEOUT_QUICK_S = 240.0
TIMEOUT_FULL_S = 3600.0
PEER_BUILD_TIMEOUT_S = 1800.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="offload-bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every benchmark in its quick mode (a few minutes in all)")
    p.add_argument("--out", default="bench-results", help="directory for report.md, suite.json, the plots and logs")
    p.add_argument("--only", nargs="*", help=f"benchmark names to run (default: all of {BENCHMARKS})")
    p.add_argument("--timeout-s", type=float, default=None,
                   help=f"wall-clock limit per benchmark, seconds (default {TIMEOUT_QUICK_S:g} with --quick, "
                        f"{TIMEOUT_FULL_S:g} without)")
    p.add_argument("--build-peers", action="store_true",
                   help="first build the DeepSpeed ops the peers use (several minutes, once per --out); "
                        "without it, --quick skips a peer whose op is not built yet")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="arguments passed to every script (put last; use with --only)")
    args = p.parse_args(argv)
    timeout_s = args.timeout_s or (TIMEOUT_QUICK_S if args.quick else TIMEOUT_FULL_S)

    here = Path(__file__).resolve().parent
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in (args.only or []) if not (here / f"{n}.py").is_file()]
    if unknown:
        print(f"no such benchmark: {', '.join(unknown)} (have: {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    names = [n for n in (args.only or BENCHMARKS) if (here / f"{n}.py").is_file()]

    # [Note: peer builds] in benchmarks/peer_ops.py: DeepSpeed's ops build under --out.
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(out / "torch_extensions"))
    private_builds = env["TORCH_EXTENSIONS_DIR"] == str(out / "torch_extensions")
    if args.quick and not args.build_peers:
        env[SKIP_ENV] = "skip"
    else:
        env.pop(SKIP_ENV, None)

    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    t_suite = time.perf_counter()
    command = " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])])
    if args.build_peers:
        _clear_stale_locks(out, private_builds)
        cmd = [sys.executable, "-m", "benchmarks.peer_ops"]
        print(f"== {' '.join(cmd)}: building DeepSpeed's ops into {env['TORCH_EXTENSIONS_DIR']} "
              f"(first run only, several minutes)", flush=True)
        log, rc = _run(cmd, here.parent, PEER_BUILD_TIMEOUT_S, "peer_ops", env)
        (out / "peer_ops.log").write_text(log)
        if rc is None:
            print(f"  building the peers' ops timed out after {PEER_BUILD_TIMEOUT_S:g} s; the peers that "
                  f"need them are skipped with the reason", file=sys.stderr, flush=True)
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
        _clear_stale_locks(out, private_builds)
        t0 = time.perf_counter()
        scratch = tempfile.mkdtemp(prefix=f".scratch-{name}-", dir=out)
        try:
            log, rc = _run(cmd, here.parent, timeout_s, name, {**env, "TMPDIR": scratch})
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
        else:
            results[name] = json.loads(json_path.read_text())
            results[name]["_wall_s"] = round(time.perf_counter() - t0, 1)
            results[name]["_load"] = load
        # After each benchmark: a run killed later keeps what finished.
        pending = names[names.index(name) + 1:]
        suite, plots = _write(out, command, args.quick, t_suite, results, failures, pending)
        print(f"  wrote {out / 'report.md'} ({len(results) + len(failures)} of {len(names)} benchmarks)", flush=True)
    if not names:
        suite, plots = _write(out, command, args.quick, t_suite, results, failures, [])
    print(f"wrote {out / 'report.md'}, {out / 'suite.json'} and {len(plots)} plot(s) "
          f"in {suite['wall_s']:g} s" + (f"; failed: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


def _write(out: Path, command: str, quick: bool, t_suite: float, results: dict[str, Any],
           failures: dict[str, str], pending: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """report.md and suite.json as they stand (each replaced whole, never half-written)."""
    suite: dict[str, Any] = {
        "command": command,
        "quick": quick,
        "wall_s": round(time.perf_counter() - t_suite, 1),
        "results": results,
        "failures": failures,
        "pending": pending,
        "cores": load_average()["cores"],
    }
    report, plots = render(suite, out)
    suite["plots"] = plots
    for file_name, text in (("suite.json", json.dumps(suite, indent=2, default=str)), ("report.md", report)):
        tmp = out / f".{file_name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / file_name)
    return suite, plots


def _clear_stale_locks(out: Path, private: bool) -> None:
    """Removes torch's build locks in the suite's own extensions folder: the suite runs one
    benchmark at a time, so a lock there was left by a killed one ([Note: peer builds])."""
    if not private:
        return
    for lock in stale_locks(out / "torch_extensions"):
        print(f"  removing a stale build lock {lock} (left by a killed run)", flush=True)
        lock.unlink(missing_ok=True)


def _run(cmd: list[str], cwd: Path, timeout_s: float, name: str,
         env: dict[str, str]) -> tuple[str, Optional[int]]:
    """Run one benchmark in `env`, its stdout and stderr merged, echoed live; return (log,
    exit status, None when it was killed for `timeout_s`).

    The benchmark's output is a pipe, so its rounds arrive as `[progress] desc k/n` lines
    (benchmarks/_common.py `Progress`). On a terminal they drive one tqdm bar per benchmark
    (its total grows as each case announces its rounds); elsewhere (CI, a log file) they are
    echoed as the plain lines they are.
    """
    # A session of its own, so a timeout kills the benchmark and what it started (a peer's
    # compiler and ninja), not the benchmark alone.
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=1, start_new_session=True)
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this Popen started, led by proc
        except ProcessLookupError:
            pass

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
