"""A two-rank run that ends without `engine.close()` exits cleanly (issue #32).

[Note: collective tensors at exit] (offload/units/collectives.py): gloo's threads release a
collective's tensors after its waiter woke; during interpreter shutdown that release aborts
the process (SIGABRT, "terminate called without an active exception"). So the exit path
drains every engine that was not closed: `offload.runtime.lifecycle.drain_at_exit` registers
a per-engine finalizer that calls the public `engine.drain()` at exit.

The regression this pins: the exit hook once probed `getattr(engine, "prefetcher", None)`,
an attribute that had moved, so it silently drained nothing and the abort came back in 1 of
12 runs — too rare for a short soak to catch reliably (a launch takes seconds here). So the
test checks the cause deterministically: each rank's script records that `drain` ran at exit
(with the hook broken, no rank records it and the test fails every time), and every rank
exits 0 over a few launches (the symptom).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHES = 2

SCRIPT = r"""
import os, sys, torch, offload
from offload.config import Config, OptimizerConfig
from offload.engine import Engine
from tests.conftest import TinyGPT, gpt_batches

marker = sys.argv[1]
real_drain = Engine.drain

def drain(self):
    real_drain(self)
    with open(marker, "a") as f:  # the exit path reached the engine's drain
        f.write("drained\n")

Engine.drain = drain
torch.manual_seed(0)
engine = offload.initialize(TinyGPT(n_layer=3), Config(compute_device="cpu", optimizer=OptimizerConfig(lr=2e-3)))
r, n = engine.rank, engine.world_size
for x, y in gpt_batches(2):
    b = x.shape[0] // n
    engine.backward(engine(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]))
    engine.step()
# the next iteration's first gathers are in flight; the script ends without close()
"""


def _launch(tmp: str, i: int) -> list[tuple[subprocess.Popen, str]]:
    port = free_port()
    out = []
    for rank in range(2):
        marker = os.path.join(tmp, f"launch{i}-rank{rank}")
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2"}
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, marker], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out.append((proc, marker))
    return out


def test_two_ranks_ending_without_close_drain_at_exit_and_exit_cleanly(tmp_path):
    launches = [_launch(str(tmp_path), i) for i in range(LAUNCHES)]  # all at once: the wait overlaps
    for i, procs in enumerate(launches):
        for proc, marker in procs:
            try:
                _, err = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            assert proc.returncode == 0, f"launch {i}: a rank exited {proc.returncode}\n{err[-3000:]}"
            assert os.path.exists(marker), (
                f"launch {i}: engine.drain() did not run at exit (the exit hook drains nothing)\n{err[-2000:]}")
