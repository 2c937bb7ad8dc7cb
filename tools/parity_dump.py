"""Bit-identical A/B of training results across a refactor.

    python tools/parity_dump.py dump OUT.pt      # train every scenario, save the weights
    python tools/parity_dump.py compare A.pt B.pt

`dump` runs the engine parity scenarios of tests/test_engine.py at world sizes 1 and 2,
and the same GPT with its parameters and optimizer states on NVMe (bf16, prefetch and the
optimizer in backward on, then off), and saves each run's consolidated fp32 weights and
counters. `compare` says, per scenario, whether two dumps are bit-identical, and exits 1 on
the first difference (with the tensor and its largest difference). Run `dump` at the commit
before a change (in a `git worktree`) and after it: a restructuring that claims "behaviour
unchanged" must compare equal.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _nvme_config(path: str, prefetch: bool) -> Any:
    from tests.test_engine import make_config

    from dataclasses import replace

    cfg = make_config(dtype="bf16", gas=2)
    return replace(
        cfg,
        offload=replace(cfg.offload, param_tier="nvme", optimizer_tier="nvme", nvme_path=path,
                        pinned_budget_bytes=1 << 22),
        prefetch=replace(cfg.prefetch, optimizer_in_backward=prefetch,
                         prefetch_bytes=(1 << 22) if prefetch else 0),
    )


def _run_all(rank: int, world_size: int, nvme_dir: str) -> dict[str, Any]:
    from tests.test_engine import SCENARIOS, engine_train, run_scenario

    out: dict[str, Any] = {}
    for name in SCENARIOS:
        sd, info = run_scenario(name, rank, world_size)
        out[name] = (sd, {k: v for k, v in info.items() if k != "memory"})
    for prefetch in (True, False):
        name = f"gpt_bf16_nvme_prefetch_{prefetch}"
        sd, info = engine_train("gpt", _nvme_config(nvme_dir, prefetch), rank, world_size)
        out[name] = (sd, {k: v for k, v in info.items() if k != "memory"})
    return out


def dump(path: str) -> None:
    from tests.conftest import run_distributed

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir="/tmp") as nvme:
        result = {"ws1": _run_all(0, 1, nvme)}
        result["ws2"] = run_distributed(_run_all, 2, nvme)[0]
    torch.save(result, path)
    print(f"wrote {path}: {sum(len(v) for v in result.values())} runs")


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    bad = 0
    for ws in a:
        for name, (sd_a, info_a) in a[ws].items():
            sd_b, info_b = b[ws][name]
            diff = []
            for k, t in sd_a.items():
                if not torch.equal(t, sd_b[k]):
                    d = (t.double() - sd_b[k].double()).abs().max().item()
                    diff.append(f"{k} (max |diff| {d:.3e})")
            if _counters(info_a, info_b) != info_b:
                diff.append(f"counters {info_a} != {info_b}")
            print(f"{ws} {name}: {'identical' if not diff else 'DIFFERS: ' + ', '.join(diff[:3])}")
            bad += bool(diff)
    print(f"{bad} run(s) differ")
    return 1 if bad else 0


def _counters(a: dict, b: dict) -> dict:
    """`a` with the gradient norms that `a` did not report (None: an older engine reported
    the norm only with clipping on) taken from `b`: a norm reported where none was is not
    a change of training; a different norm is."""
    out = dict(a)
    if isinstance(a.get("norms"), list) and isinstance(b.get("norms"), list):
        out["norms"] = [y if x is None else x for x, y in zip(a["norms"], b["norms"])]
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
