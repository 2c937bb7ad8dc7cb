"""`offload.integrations.accelerate.prepare` against the same loop on plain Accelerate (CPU).

The loop is Accelerate's own idiom: `accelerator.accumulate(model)`, `accelerator.backward`,
`accelerator.clip_grad_norm_` at the window's end, `optimizer.step()`, `scheduler.step()`,
`optimizer.zero_grad()`; a tiny Llama from a config, 14 micro-batches of 2 per rank (Accelerate
shards the dataloader; at world size 2 the data is twice as long), gradient_accumulation_steps=2
(the last window one micro-batch short: Accelerate ends it at the dataloader's end), clipping at
0.5 (active: the norms are ~1). Only `prepare` differs.

Bounds ([Note: derived tolerances] in tests/parity.py): the truth is plain Accelerate with the
model in float64, the fp32 references plain Accelerate with torch's for-loop and fused AdamW;
final weights within `Fp32Bound`, the logged gradient norms within 8x the references' largest
distance per window. Negative control: the plain loop without accumulation (each micro-batch
its own step, the bug of windows counted differently) lands > 100x outside. World sizes 1
and 2 (real processes; Accelerate sets up gloo itself). At world size 1 the loop also steps a
LambdaLR schedule (at 2 plain Accelerate steps a schedule once per process per step, the
DeepSpeed plugin once per step: the engine does the latter, docs/accelerate.md).
Also: `save_state` mid-run and `load_state` into a fresh engine continue to the same weights
bit for bit; `get_state_dict`/`unwrap_model`; each refusal names Accelerate and the fix.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.conftest import run_distributed
from tests.parity import FP32_MULTIPLE, FP32_ULP, Fp32Bound
from tests.test_hf_trainer import tiny_model

accelerate = pytest.importorskip("accelerate", reason="the Accelerate route needs accelerate (the hf extra)")
pytest.importorskip("transformers", reason="the loop trains a transformers Llama built from a config")

LR, WD, CLIP, GAS, N, SEQ = 1e-2, 0.1, 0.5, 2, 14, 16


def loader(world_size: int) -> Any:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (N * world_size, SEQ), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


def run(variant: str, world_size: int = 1, gas: int = GAS, save_at: int = 0, resume: str = "",
        outdir: str = "", load: bool = True) -> dict[str, Any]:
    """One loop in this process (a rank at world size 2); its final weights and norms."""
    from offload.integrations.accelerate import prepare

    acc = accelerate.Accelerator(gradient_accumulation_steps=gas, cpu=True)
    model = tiny_model("llama", torch.float64 if variant == "truth" else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD,
                            **({"fused": True} if variant == "fused" else {"foreach": False}))
    objs: list[Any] = [loader(world_size)]
    if world_size == 1:
        objs.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    if variant == "offload":
        prepared = prepare(acc, model, opt, *objs, config={"compute_device": "cpu", "gradient_clipping": CLIP})
    else:
        prepared = acc.prepare(model, opt, *objs)
    model, opt, data = prepared[:3]
    sched = prepared[3] if len(prepared) > 3 else None
    if resume:
        if load:
            acc.load_state(resume)
        data = acc.skip_first_batches(data, save_at * gas)
    norms, windows = [], save_at if resume else 0
    for (x,) in data:
        with acc.accumulate(model):
            acc.backward(model(input_ids=x, labels=x).loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            windows += 1
            if save_at and not resume and windows == save_at:
                acc.save_state(outdir)
    if variant == "offload":
        assert acc.unwrap_model(model) is model  # not wrapped (plain Accelerate's is DDP at world size 2)
    weights = {k: v.detach().to(torch.float64 if variant == "truth" else torch.float32, copy=True)
               for k, v in acc.get_state_dict(model).items()}
    if variant == "offload":
        acc._offload_engine.close()
    return {"weights": weights, "norms": norms}


VARIANTS = ("truth", "plain", "fused", "offload")


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out = {v: run(v, world_size) for v in VARIANTS}
    out["control"] = run("plain", world_size, gas=1)
    return out


def check(runs: dict[str, Any], what: str) -> None:
    bound = Fp32Bound(runs["truth"]["weights"], {v: runs[v]["weights"] for v in ("plain", "fused")})
    bound.check(runs["offload"]["weights"], f"Accelerate + offload {what}")
    truth = runs["truth"]["norms"]
    assert len(truth) == 4 and all(len(runs[v]["norms"]) == 4 for v in VARIANTS)
    for i, t in enumerate(truth):
        noise = max(max(abs(runs[v]["norms"][i] - t) for v in ("plain", "fused")), FP32_ULP * t)
        assert abs(runs["offload"]["norms"][i] - t) <= FP32_MULTIPLE * noise, (what, i, runs["offload"]["norms"], truth)
    worst, _, _ = bound.worst(runs["control"]["weights"], "control")
    assert worst > 100, f"{what}: the negative control is only {worst:.3g}x the bound"


def test_the_loop_matches_plain_accelerate_world_size_1() -> None:
    check(_all(0, 1), "world size 1")


def test_the_loop_matches_plain_accelerate_world_size_2() -> None:
    for rank, runs in enumerate(run_distributed(_all, 2, init_group=False)):
        check(runs, f"world size 2, rank {rank}")


def _without_cpu_flag(rank: int, world_size: int) -> str:
    from offload.integrations.accelerate import prepare

    acc = accelerate.Accelerator()  # no cpu=True: on a machine without GPUs Accelerate sees one process
    try:
        prepare(acc, tiny_model("llama"), config={"compute_device": "cpu"})
    except ValueError as exc:
        return str(exc)
    return "prepared"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only launch (a GPU machine distributes by itself)")
def test_a_launch_accelerate_does_not_see_is_refused_before_training() -> None:
    """torchrun, 2 processes, Accelerator() without cpu=True: each rank would train on all
    of the data while the engine averaged their gradients."""
    for msg in run_distributed(_without_cpu_flag, 2, init_group=False):
        assert "an Accelerator of 1 process(es) in a launch of 2" in msg and "Accelerator(cpu=True)" in msg, msg


def test_save_state_and_load_state_continue_bit_for_bit(tmp_path) -> None:
    whole = run("offload", save_at=2, outdir=str(tmp_path / "state"))
    assert os.path.isfile(tmp_path / "state" / "latest")  # the engine's checkpoint, beside Accelerate's
    resumed = run("offload", save_at=2, resume=str(tmp_path / "state"))
    for k, v in whole["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k
    assert resumed["norms"] == whole["norms"][2:]
    # Negative control: the same continuation without load_state ends elsewhere.
    unloaded = run("offload", save_at=2, resume=str(tmp_path / "state"), load=False)["weights"]
    assert not torch.equal(unloaded["model.norm.weight"], whole["weights"]["model.norm.weight"])


def test_calls_that_cannot_work_name_accelerate_and_the_fix() -> None:
    from offload.config import ConfigError
    from offload.integrations.accelerate import prepare

    def fresh(**kw: Any) -> tuple[Any, Any, Any]:
        acc = accelerate.Accelerator(cpu=True, **kw)
        model = tiny_model("llama")
        return acc, model, torch.optim.AdamW(model.parameters(), lr=LR)

    acc, model, opt = fresh(gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        prepare(acc, model, opt, config={"compute_device": "cpu", "gradient_accumulation_steps": 4})
    acc, model, opt = fresh()
    model, opt = prepare(acc, model, opt, config={"compute_device": "cpu", "gradient_clipping": 1.0})
    try:
        with pytest.raises(ValueError, match=r"(?s)accelerator.clip_grad_norm_\(max_norm=0.5\).*under "
                           r"offload.integrations.accelerate.prepare\n  fix: set gradient_clipping: 0.5"):
            acc.clip_grad_norm_(model.parameters(), 0.5)
        with pytest.raises(RuntimeError, match=r"optimizer.state_dict\(\).*\n  fix: save with accelerator.save_state"):
            opt.state_dict()
        with pytest.raises(ValueError, match="a second model on one Accelerator"):
            prepare(acc, tiny_model("gpt2"), config={"compute_device": "cpu"})
    finally:
        acc._offload_engine.close()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # Accelerate keeps one precision per process
    try:
        acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        with pytest.raises(ValueError, match=r"mixed_precision='bf16'.*\n  fix: use Accelerator\(mixed_precision='no'\)"):
            prepare(acc, tiny_model("llama"), config={"compute_device": "cpu"})
    finally:
        AcceleratorState._reset_state()
