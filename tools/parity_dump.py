"""Bit-identical A/B of training results across a refactor.

    python tools/parity_dump.py dump OUT.pt      # train every scenario, save the results
    python tools/parity_dump.py compare A.pt B.pt

`dump` runs, at world sizes 1, 2 and 4: the engine parity scenarios of tests/test_engine.py
(fp32, bf16, fp16 with a forced overflow; accumulation; clipping; activation checkpoints),
the GPT at ZeRO stages 1 and 2, with transient gradient shards (the non-finite guard off,
updates in backward), with two backward passes per step, on the device tier of a CPU run,
and with its parameters and optimizer states on NVMe (bf16, prefetch and the optimizer in
backward on, then off). Per run it saves the consolidated fp32 weights, every rank's
sharded optimizer state (masters, moments, step counts) and the step reports (skips, global
steps, loss scale, gradient norms, learning rates). `compare` says, per run, whether two
dumps are bit-identical, and exits 1 if any differs (naming the tensor and its largest
difference). Run `dump` at the commit before a change (in a `git worktree`) and after it: a
restructuring that claims "behaviour unchanged" must compare equal.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _nvme_config(path: str, prefetch: bool) -> Any:
    from tests.test_engine import make_config

    cfg = make_config(dtype="bf16", gas=2)
    return replace(
        cfg,
        offload=replace(cfg.offload, param_tier="nvme", optimizer_tier="nvme", nvme_path=path,
                        pinned_budget_bytes=1 << 22),
        prefetch=replace(cfg.prefetch, optimizer_in_backward=prefetch,
                         prefetch_bytes=(1 << 22) if prefetch else 0),
    )


def _extra_configs(nvme_dir: str) -> dict[str, tuple[str, Any, int]]:
    """name -> (model, config, backward passes per step)."""
    from tests.test_engine import make_config

    out: dict[str, tuple[str, Any, int]] = {}
    for stage in (1, 2):
        out[f"gpt_bf16_clip_gas_stage{stage}"] = ("gpt", make_config(dtype="bf16", gas=2, clip=0.05, zero_stage=stage), 1)
        out[f"gpt_fp32_stage{stage}"] = ("gpt", make_config(zero_stage=stage), 1)
    out["gpt_fp32_transient"] = ("gpt", make_config(nonfinite_loss="off"), 1)
    out["gpt_bf16_transient"] = ("gpt", make_config(dtype="bf16", nonfinite_loss="off"), 1)
    out["gpt_fp32_two_passes"] = ("gpt", make_config(), 2)
    cfg = make_config(dtype="bf16", gas=2, clip=0.05)
    out["gpt_bf16_device_tier"] = ("gpt", replace(cfg, offload=replace(cfg.offload, param_tier="device")), 1)
    for prefetch in (True, False):
        out[f"gpt_bf16_nvme_prefetch_{prefetch}"] = ("gpt", _nvme_config(nvme_dir, prefetch), 1)
    return out


def _local(v: Any) -> Any:
    if hasattr(v, "to_local"):
        return v.to_local().clone()
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _local(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_local(x) for x in v)
    return v


def _train(model: str, cfg: Any, rank: int, world_size: int, passes: int = 1,
           overflow_at: tuple[int, ...] = ()) -> tuple[dict, dict, dict]:
    import offload
    from tests.test_engine import MODELS, batches_for

    torch.manual_seed(0)
    engine = offload.initialize(MODELS[model](), cfg)
    norms, lrs = [], []
    for i, (x, y) in enumerate(batches_for(model)):
        n = x.shape[0] // world_size
        xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        k = xs.shape[0] // passes
        for j in range(passes):  # a loss in parts, each part's backward as soon as it is ready
            loss = engine(xs[j * k : (j + 1) * k], ys[j * k : (j + 1) * k]) / passes
            if i in overflow_at:
                loss = loss * float("inf")
            engine.backward(loss)
        engine.step()
        norms.append(engine.last_grad_norm)
        lrs.append(engine.get_lr())
    info = {"skipped": engine.skipped_steps, "global_steps": engine.global_steps,
            "loss_scale": engine.loss_scale, "norms": norms, "lr": lrs}
    optim = _local(engine.sharded_optimizer_state_dict())
    sd = engine.full_state_dict()
    engine.close()
    return sd, optim, info


def _run_all(rank: int, world_size: int, nvme_dir: str) -> dict[str, Any]:
    from tests.test_engine import SCENARIOS, make_config

    out: dict[str, Any] = {}
    for name, sc in SCENARIOS.items():
        out[name] = _train(sc["model"], make_config(**sc["cfg"]), rank, world_size,
                           overflow_at=sc.get("overflow_at", ()))
    for name, (model, cfg, passes) in _extra_configs(nvme_dir).items():
        out[name] = _train(model, cfg, rank, world_size, passes)
    return out


def dump(path: str) -> None:
    from tests.conftest import run_distributed

    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as nvme:
        result["ws1"] = {name: [run] for name, run in _run_all(0, 1, nvme).items()}
        for ws in (2, 4):
            ranks = run_distributed(_run_all, ws, nvme)
            result[f"ws{ws}"] = {name: [r[name] for r in ranks] for name in ranks[0]}
    torch.save(result, path)
    print(f"wrote {path}: {sum(len(v) for v in result.values())} runs")


def _diff(a: Any, b: Any, where: str, out: list[str]) -> None:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{where} (shape or dtype)")
        elif not torch.equal(a, b):
            d = (a.double() - b.double()).abs().max().item()
            out.append(f"{where} (max |diff| {d:.3e})")
    elif isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            out.append(f"{where} (keys)")
        else:
            for k in a:
                _diff(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            out.append(f"{where} (length)")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                _diff(x, y, f"{where}[{i}]", out)
    elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        out.append(f"{where} ({a!r} != {b!r})")


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    bad = 0
    for ws in a:
        for name, ranks_a in a[ws].items():
            diff: list[str] = []
            if name not in b.get(ws, {}):
                diff.append("missing in the second dump")
            else:
                for r, (run_a, run_b) in enumerate(zip(ranks_a, b[ws][name])):
                    for part, x, y in zip(("weights", "optimizer", "report"), run_a, run_b):
                        _diff(x, y, f"rank{r}.{part}", diff)
            print(f"{ws} {name}: {'identical' if not diff else 'DIFFERS: ' + ', '.join(diff[:3])}")
            bad += bool(diff)
    print(f"{bad} run(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
