"""Soak test for a clean exit of 2-rank gloo runs (issue 15, [Note: collective tensors at
exit] in offload/units/collectives.py): launch a minimal 2-process training script under torchrun
N times, ending with engine.close() and without it, and count the runs that did not exit 0
(the abort this guards against was SIGABRT, "terminate called without an active exception",
at interpreter exit). Too slow for the default suite (seconds per launch):

    python tools/exit_soak.py --runs 100          # 100 with close(), 100 without

Exit status 0 when every run exited cleanly, 1 otherwise (the failing runs' stderr tails are
printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys, torch, offload
from offload.config import Config, OptimizerConfig
from tests.conftest import TinyGPT, gpt_batches
torch.manual_seed(0)
engine = offload.initialize(TinyGPT(), Config(compute_device="cpu", optimizer=OptimizerConfig(lr=2e-3)))
r, n = engine.rank, engine.world_size
for x, y in gpt_batches(3):
    b = x.shape[0] // n
    engine.backward(engine(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]))
    engine.step()
if sys.argv[1] == "close":
    engine.close()
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="launches per mode (default 100)")
    parser.add_argument("--modes", default="close,noclose", help="comma list of close, noclose")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        for mode in args.modes.split(","):
            bad = []
            t0 = time.monotonic()
            for i in range(args.runs):
                proc = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     script, mode], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                )
                if proc.returncode != 0:
                    bad.append((i, proc.returncode, proc.stderr[-1500:]))
            print(f"{mode}: {args.runs - len(bad)}/{args.runs} clean exits, {len(bad)} failed "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
            for i, rc, err in bad[:3]:
                print(f"--- run {i} exit {rc}:\n{err}")
            failed += len(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
