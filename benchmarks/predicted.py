"""The planner's predicted step beside the measured one, for bench_train's engine contenders
(offload/plan/step_time.py, docs/plan.md "How fast").

Each engine contender is a placement with settings (prefetch and keep budgets, the pinned
budget, where its updates run); `predict_rows` predicts its step from a machine profile and
the benchmark model's shape, and `predicted_table` prints the two side by side with their
ratio (predicted / measured: 1.0 = exact, the target is within 0.85 .. 1.15 on the CPU).
The torch, FSDP2 and DeepSpeed rows are not the engine: they get no prediction.
"""

from __future__ import annotations

from typing import Optional

from offload.plan.profile import MachineProfile
from offload.plan.shapes import ModelShape, shape_from_dims
from offload.plan.step_time import StepSettings, predict_step

__all__ = ["CONTENDER_PLACEMENTS", "bench_shape", "contender_settings", "predict_rows"]

CONTENDER_PLACEMENTS = {
    "engine": ("cpu", "cpu"),
    "engine_stage2": ("device", "cpu"),
    "engine_worker_on": ("cpu", "cpu"),
    "engine_worker_off": ("cpu", "cpu"),
    "engine_unguarded": ("cpu", "cpu"),
    "engine_nvme_opt": ("cpu", "nvme"),
    "engine_nvme_all": ("nvme", "nvme"),
    "engine_nvme_all_nopf": ("nvme", "nvme"),
}
"""bench_train's engine contenders and their (param_tier, optimizer_tier)."""


def bench_shape(args) -> ModelShape:
    """bench_train's GPT (qkv bias, tied head, learned positions) at its flags."""
    return shape_from_dims(layers=args.layers, d_model=args.d_model, heads=args.heads, vocab=args.vocab,
                           seq=args.seq, batch=args.batch, positions=args.seq)


def contender_settings(name: str, args, on_gpu: bool) -> Optional[StepSettings]:
    """The step-time model's settings for contender `name` as bench_train builds it."""
    if name not in CONTENDER_PLACEMENTS:
        return None
    pt, ot = CONTENDER_PLACEMENTS[name]
    prefetch = name != "engine_nvme_all_nopf"
    guard_off = name == "engine_unguarded"
    in_backward = prefetch and guard_off and args.clip <= 0 and args.dtype != "fp16"
    worker = name == "engine_worker_on" or (name != "engine_worker_off" and on_gpu)
    return StepSettings(param_tier=pt, optimizer_tier=ot, dtype=args.dtype, moments="fp32", on_gpu=on_gpu,
                        prefetch_bytes=(args.prefetch_mb << 20) if prefetch else 0,
                        keep_bytes=(args.keep_mb << 20) if prefetch else 0,
                        pinned_budget_bytes=args.pinned_budget_mb << 20, updates_in_backward=in_backward,
                        worker=worker)


def predict_rows(measured_s: dict[str, float], args, profile: MachineProfile, on_gpu: bool) -> list[dict]:
    """One row per engine contender measured: predicted and measured step (ms), their ratio,
    the predicted binding resource."""
    shape = bench_shape(args)
    rows = []
    for name, t in measured_s.items():
        s = contender_settings(name, args, on_gpu)
        if s is None:
            continue
        try:
            pr = predict_step(shape, profile, s)
        except ValueError as e:  # the profile lacks a figure this placement needs
            rows.append({"contender": name, "placement": f"{s.param_tier}/{s.optimizer_tier}",
                         "predicted_ms": None, "measured_ms": t * 1e3, "pred_over_meas": None,
                         "bound_by": f"not predicted: {e}"})
            continue
        rows.append({"contender": name, "placement": pr.placement, "predicted_ms": pr.step_s * 1e3,
                     "measured_ms": t * 1e3, "pred_over_meas": pr.step_s / t, "bound_by": pr.bound_text()})
    return rows
