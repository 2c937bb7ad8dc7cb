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
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The order users read them in: disk, optimizer, then whole training steps.
BENCHMARKS = ["bench_io", "bench_adam", "bench_train", "bench_checkpoint"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="offload-bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every benchmark in its quick mode")
    p.add_argument("--out", default="bench-results", help="directory for report.md, suite.json, plots")
    p.add_argument("--only", nargs="*", help="benchmark names to run (default: all present)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to every script")
    args = p.parse_args(argv)

    here = Path(__file__).resolve().parent
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in (args.only or BENCHMARKS) if (here / f"{n}.py").is_file()]
    if not names:
        print(f"no benchmarks found among {args.only or BENCHMARKS}", file=sys.stderr)
        return 2

    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    for name in names:
        json_path = out / f"{name}.json"
        cmd = [sys.executable, "-m", f"benchmarks.{name}", "--json", str(json_path), *args.extra]
        if args.quick:
            cmd.append("--quick")
        print(f"== {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=here.parent, text=True, capture_output=True)
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0 or not json_path.is_file():
            failures[name] = f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"  {name} failed: {failures[name]}", file=sys.stderr)
            continue
        results[name] = json.loads(json_path.read_text())
        results[name]["_wall_s"] = round(time.perf_counter() - t0, 1)

    suite = {"quick": args.quick, "results": results, "failures": failures}
    (out / "suite.json").write_text(json.dumps(suite, indent=2, default=str))
    (out / "report.md").write_text(_report(suite, out))
    print(f"wrote {out / 'report.md'} and {out / 'suite.json'}")
    return 1 if failures else 0


def _report(suite: dict[str, Any], out: Path) -> str:
    lines = ["# offload benchmark report", ""]
    machine = next((r.get("machine") for r in suite["results"].values() if r.get("machine")), None)
    if machine:
        lines += ["Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()), ""]
    for name, result in suite["results"].items():
        lines += [f"## {name}", ""]
        rows = result.get("rows") or []
        if rows:
            cols = list(rows[0].keys())
            lines.append("| " + " | ".join(cols) + " |")
            lines.append("|" + "---|" * len(cols))
            for r in rows:
                lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
            lines.append("")
        plot = _plot(name, result, out)
        if plot:
            lines += [f"![{name}]({plot})", ""]
    for name, why in suite["failures"].items():
        lines += [f"## {name}: failed", "", f"    {why}", ""]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


def _plot(name: str, result: dict[str, Any], out: Path) -> str | None:
    """A bar chart of the benchmark's declared headline metric, one bar per row."""
    spec = result.get("plot")  # {"x": column, "y": column, "group": column (optional), "title": ...}
    rows = result.get("rows") or []
    if not spec or not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    groups: dict[str, list[tuple[Any, float]]] = {}
    for r in rows:
        y = r.get(spec["y"])
        if isinstance(y, (int, float)) and y == y:
            groups.setdefault(str(r.get(spec.get("group", ""), "")), []).append((r.get(spec["x"]), float(y)))
    for g, pts in groups.items():
        ax.plot([str(x) for x, _ in pts], [y for _, y in pts], marker="o", label=g or None)
    ax.set_xlabel(spec["x"])
    ax.set_ylabel(spec["y"])
    ax.set_title(spec.get("title", name))
    if len(groups) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


if __name__ == "__main__":
    sys.exit(main())
