"""`tools/gpu_check.sh`: the one command for a GPU machine (issue #30).

Phases, each a subprocess under its own timeout (and never past the whole run's budget), so
one that hangs or dies leaves the others' results:

  build         pip install --no-build-isolation --no-deps -e .  (offline: rebuilds offload._C
                for the Python and torch there)
  env           the GPU, torch, cores; the measured bf16 matmul rate and pinned copy bandwidth
  cuda_tests    pytest -m cuda (counts from its JUnit XML)
  races         tests/test_cuda_races.py: side-stream copies slowed with torch.cuda._sleep,
                bits unchanged (the delay-injection probe), compute_device auto, dropout
                under activation offload
  practicality  tools/gpu_bench.py practicality: ~1.3B GPT at 8 x 1024 tokens, plain PyTorch
                vs offload with parameters on the device, in host memory and on NVMe (the
                optimizer on the CPU)
  scale         tools/gpu_bench.py scale: a GPT of ~2x the GPU's memory in training state,
                model TFLOP/s against the matmul rate
  sanitizer     the prefetch and race tests under TORCH_CUDA_SANITIZER=1

The table is printed last; with $OUT set (or --out), gpu_check.json and gpu_check.log are
written there. `--dry-run` runs the same phases on the CPU at tiny sizes (the build phase
checks the build's inputs and that offload._C imports instead of rebuilding), so the script
is known to work before a GPU run: tests/test_gpu_check.py runs it.

    tools/gpu_check.sh                       # on the GPU machine, at most ~8 minutes
    tools/gpu_check.sh --dry-run             # here, on the CPU
    tools/gpu_check.sh --phases build,env,scale --budget 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> default timeout (s) on a GPU; dry runs use DRY_TIMEOUT for every phase.
PHASES: dict[str, int] = {
    "build": 150,
    "env": 45,
    "cuda_tests": 120,
    "races": 45,
    "practicality": 150,
    "scale": 200,
    "sanitizer": 60,
}
DRY_TIMEOUT = 300
SANITIZED = ["tests/test_prefetch.py", "tests/test_cuda_races.py"]


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.monotonic()
        self.out = args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-")
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="gpu_check-work-")
        self.log_path = os.path.join(self.out, "gpu_check.log")
        self.log = open(self.log_path, "a")
        self.results: dict[str, Any] = {"dry_run": args.dry_run, "phases": {}}

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def note(self, msg: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S')} +{time.monotonic() - self.start:5.0f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def sh(self, name: str, cmd: list[str], env: Optional[dict] = None) -> dict[str, Any]:
        """Run one phase's command under min(its timeout, the budget left); output to the
        log (and its tail to the console)."""
        limit = DRY_TIMEOUT if self.args.dry_run else self.args.timeouts.get(name, PHASES[name])
        limit = max(5.0, min(limit, self.left()))
        self.note(f"{name}: {' '.join(cmd)} (timeout {limit:.0f} s)")
        t0 = time.monotonic()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=limit)
            rc, text = p.returncode, p.stdout
        except subprocess.TimeoutExpired as exc:
            rc = "timeout"
            text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        self.log.write(f"----- {name} output -----\n{text}\n")
        self.log.flush()
        tail = "\n".join(text.rstrip().splitlines()[-self.args.tail:])
        if tail and (rc != 0 or self.args.verbose):
            print(tail, flush=True)
        return {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}

    def record(self, name: str, rec: dict[str, Any]) -> None:
        rec["ok"] = rec.get("rc") == 0 and not rec.get("failed")
        self.results["phases"][name] = rec
        self.note(f"{name}: {'ok' if rec['ok'] else 'FAILED'} ({rec.get('seconds')} s)")
        self.save()

    def save(self) -> None:
        path = os.path.join(self.out, "gpu_check.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(path + ".tmp", path)


def py() -> str:
    return sys.executable


def phase_build(run: Run) -> dict[str, Any]:
    if run.args.dry_run:
        # No rebuild here (CI built the extension in its isolated build environment, which
        # is gone): the extension must import, and what the offline rebuild needs is listed.
        code = ("import importlib.util as u, shutil, offload._C as c; print('extension:', c.__file__); "
                "print('offline build inputs:', {m: bool(u.find_spec(m)) for m in "
                "('setuptools', 'wheel', 'pybind11')}, {t: bool(shutil.which(t)) for t in ('cmake', 'ninja')})")
        return run.sh("build", [py(), "-c", code])
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4)}
    rec = run.sh("build", [py(), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", "."], env)
    if rec["rc"] == 0:  # the extension that loads is the one just built
        check = run.sh("build", [py(), "-c", "import offload._C as c; print(c.__file__)"])
        rec["rc"] = check["rc"]
    return rec


def pytest_counts(xml_path: str) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return counts
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    failed_names = []
    for s in suites:
        tests = int(s.get("tests", 0))
        f, e, sk = int(s.get("failures", 0)), int(s.get("errors", 0)), int(s.get("skipped", 0))
        counts["failed"] += f
        counts["errors"] += e
        counts["skipped"] += sk
        counts["passed"] += tests - f - e - sk
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed_names.append(f"{case.get('classname')}::{case.get('name')}")
    counts["failed_tests"] = failed_names  # type: ignore[assignment]
    return counts


def phase_pytest(run: Run, name: str, paths: list[str], env: Optional[dict] = None) -> dict[str, Any]:
    xml = os.path.join(run.work, f"{name}.xml")
    cmd = [py(), "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "-o", "addopts=-ra", "--timeout=120", *paths]
    rec = run.sh(name, cmd, env)
    rec.update(pytest_counts(xml))
    if rec["rc"] == 5:  # nothing collected/selected is a failure of this check, not a pass
        rec["failed"] = "no tests ran"
    return rec


def phase_bench(run: Run, name: str, extra: list[str]) -> dict[str, Any]:
    out = os.path.join(run.work, f"{name}.json")
    cmd = [py(), "tools/gpu_bench.py", name, "--json", out, *extra]
    if run.args.dry_run:
        cmd.append("--dry-run")
    if run.args.nvme_path:
        cmd += ["--nvme-path", run.args.nvme_path]
    rec = run.sh(name, cmd)
    try:
        with open(out) as f:
            rec["data"] = json.load(f)
    except (OSError, json.JSONDecodeError):
        rec["data"] = {}
    return rec


def run_phase(run: Run, name: str) -> dict[str, Any]:
    if name == "build":
        return phase_build(run)
    if name == "env":
        return phase_bench(run, "env", [])
    if name == "cuda_tests":
        # The dry run checks the phase's plumbing (pytest -m cuda, its JUnit counts) on two files:
        # collecting every test module takes most of its time, and the suite collects them anyway.
        paths = ["tests/test_cuda_races.py", "tests/test_prefetch.py"] if run.args.dry_run else ["tests"]
        return phase_pytest(run, "cuda_tests", paths)
    if name == "races":
        return phase_pytest(run, "races", ["tests/test_cuda_races.py"])
    if name == "sanitizer":
        return phase_pytest(run, "sanitizer", SANITIZED, {"TORCH_CUDA_SANITIZER": "1"})
    if name == "practicality":
        return phase_bench(run, "practicality", ["--tiers", run.args.tiers, "--warmup", "1"])
    if name == "scale":
        trace = os.path.join(run.out, "scale_trace.json")
        return phase_bench(run, "scale", ["--mult", str(run.args.mult), "--trace", trace, "--warmup", "1"])
    raise ValueError(name)


# -- the table ----------------------------------------------------------------------------------


def _gib(b: Any) -> str:
    return f"{b / 2**30:.2f}" if isinstance(b, (int, float)) else "-"


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _split(r: dict[str, Any]) -> str:
    """'8/25': the units whose optimizer state is on the GPU (the update split), or '-'."""
    sp = r.get("split")
    return f"{sp['device_units']}/{sp['units']}" if isinstance(sp, dict) else "-"


def update_share(stats: Any) -> str:
    """The optimizer update's share of the last step (the engine's timeline figures): on a
    model that leaves no GPU memory for optimizer state the update runs on the CPU and is
    what bounds the step."""
    if not isinstance(stats, dict) or not stats.get("step_s"):
        return ""
    step, upd = stats["step_s"], stats.get("optimizer_s", 0.0)
    return (f"update {upd:.3f} s of the last step's {step:.3f} s ({100 * upd / step:.1f} %): "
            f"{stats.get('optimizer_in_backward_s', 0.0):.3f} s under backward, "
            f"{stats.get('optimizer_wait_s', 0.0):.3f} s waited for in step()")


def table(results: dict[str, Any]) -> str:
    lines = []
    ph = results["phases"]
    env = ph.get("env", {}).get("data", {})
    lines.append(f"device: {env.get('device', '?')}  torch {env.get('torch', '?')}  cuda {env.get('cuda_runtime')}  "
                 f"cores {env.get('cores')}  host {env.get('host_mem_gib')} GiB  simd {env.get('simd')}")
    mm = env.get("matmul", {})
    cp = env.get("copies", {})
    lines.append(f"measured: {mm.get('dtype', '?')} matmul {_f(mm.get('tflops'))} TFLOP/s (n={mm.get('n')}); "
                 f"pinned H2D {_f(cp.get('h2d_GBps'))} GB/s, D2H {_f(cp.get('d2h_GBps'))} GB/s")
    lines.append("")
    lines.append(f"{'phase':<13} {'result':<8} {'s':>6}  detail")
    for name, rec in ph.items():
        detail = ""
        if "passed" in rec:
            detail = (f"{rec['passed']} passed, {rec['failed']} failed, {rec['errors']} errors, "
                      f"{rec['skipped']} skipped")
            if rec.get("failed_tests"):
                detail += "; " + ", ".join(t.split("::")[-1] for t in rec["failed_tests"][:6])
        elif rec.get("rc") not in (0, None):
            detail = f"rc {rec.get('rc')}"
        lines.append(f"{name:<13} {'ok' if rec.get('ok') else 'FAILED':<8} {_f(rec.get('seconds')):>6}  {detail}")
    for name in ("practicality", "scale"):
        data = ph.get(name, {}).get("data", {})
        rows = data.get("contenders")
        if not rows:
            continue
        lines.append("")
        lines.append(f"{name}: {data.get('params', 0) / 1e9:.2f}B params, {data.get('n_layer')} x {data.get('d_model')}, "
                     f"{data.get('batch')} x {data.get('seq')} tokens, rounds {data.get('rounds_done')}"
                     + (f", {data.get('training_state_over_gpu', 0):.2f}x GPU memory in training state, "
                        f"placement {data.get('placement')}" if name == "scale" else ""))
        lines.append(f"  {'contender':<30} {'step ms':>9} {'practical':>9} {'stall %':>8} {'dev GiB':>8} "
                     f"{'host GiB':>8} {'plan dev':>8} {'plan host':>9} {'peak GPU':>8} {'split':>7} {'pred ms':>8}")
        for cname, r in rows.items():
            if cname.startswith("_") or not isinstance(r, dict):
                continue
            mem, plan = r.get("memory_bytes", {}), r.get("planner", {})
            plan = plan if isinstance(plan, dict) else {}
            lines.append(f"  {cname:<30} {_f(r.get('step_ms')):>9} {_f(r.get('practicality'), '{:.3f}'):>9} "
                         f"{_f(r.get('stall_pct')):>8} {_gib(mem.get('device')):>8} {_gib(mem.get('host')):>8} "
                         f"{_gib(plan.get('device')):>8} {_gib(plan.get('host')):>9} "
                         f"{_gib(r.get('gpu_peak_allocated_bytes')):>8} {_split(r):>7} "
                         f"{_f((r.get('split') or {}).get('predicted_step_ms')):>8}")
            share = update_share(r.get("last_step_stats"))
            if share:
                moments = (data.get("placement") or [None])[0] if name == "scale" else None
                lines.append(f"    {share}" + (f" ({moments} moments)" if moments else ""))
        lines.append(f"  GPU max reserved {_gib(rows.get('_gpu_max_reserved_bytes'))} GiB, "
                     f"host RSS {_gib(rows.get('_host_rss_bytes'))} GiB")
        if name == "scale" and "model_tflops" in rows:
            lines.append(f"  model {rows['model_tflops']:.1f} TFLOP/s = {100 * rows['of_matmul']:.1f} % of the "
                         f"measured matmul rate ({rows['matmul_tflops']:.1f})")
        for cname, why in (data.get("failed") or {}).items():
            lines.append(f"  {cname}: FAILED {why}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="offload's one-command GPU check")
    p.add_argument("--dry-run", action="store_true", help="the same phases on the CPU at tiny sizes")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {','.join(PHASES)}")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 8 minutes)")
    p.add_argument("--timeout", action="append", default=[], metavar="PHASE=S", help="one phase's timeout")
    p.add_argument("--tiers", default="device/cpu,cpu/cpu,nvme/cpu,device/cpu@on,device/cpu@off,device/cpu@on*4,"
                                      "device/cpu+auto,device/device",
                   help="practicality's offload contenders: param_tier/optimizer_tier[+auto|+N][@on|@off][*G] "
                        "(tools/gpu_bench.py --help)")
    p.add_argument("--mult", type=float, default=2.0, help="scale: training state / GPU memory")
    p.add_argument("--nvme-path", default=None, help="directory for the NVMe tiers (default: under $TMPDIR)")
    p.add_argument("--out", default=None, help="where gpu_check.json/.log go (default: $OUT, or a temp dir)")
    p.add_argument("--tail", type=int, default=40, help="lines of a failed phase's output to print")
    p.add_argument("--verbose", action="store_true", help="print every phase's output tail")
    args = p.parse_args(argv)
    args.timeouts = {k: float(v) for k, v in (t.split("=", 1) for t in args.timeout)}
    phases = [x for x in args.phases.split(",") if x]
    unknown = [x for x in phases if x not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {unknown}; known: {list(PHASES)}")
    run = Run(args)
    run.note(f"out: {run.out}; phases: {phases}; budget {args.budget:.0f} s; dry run: {args.dry_run}")
    for name in phases:
        if run.left() < 5:
            run.record(name, {"rc": "no time left", "seconds": 0})
            continue
        try:
            rec = run_phase(run, name)
        except Exception as exc:  # the check itself failing is a result too
            rec = {"rc": f"{type(exc).__name__}: {exc}", "seconds": 0}
        run.record(name, rec)
        if name == "build" and not rec.get("ok"):
            run.note("build failed: the remaining phases would test a stale extension; stopping")
            break
    text = table(run.results)
    run.results["table"] = text
    run.save()
    print("\n" + "=" * 100 + "\n" + text, flush=True)
    return 0 if all(r.get("ok") for r in run.results["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
