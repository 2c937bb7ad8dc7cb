"""Several live engines of one process on one nvme_path ([Note: one claim per process, one
name per engine] in offload/storage/swap_claim.py): a notebook cell run again on a rebuilt
model beside the first engine, and a DPO policy beside its frozen reference. Each engine has
its own swap files and trains exactly as it does alone; dropping one deletes its files only;
an exit without close() leaves nothing; a second process on the path is still refused."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import offload
from offload.config import OffloadConfig
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.parity import Fp32Bound
from tests.test_engine import LR, WD, make_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvme_config(path) -> offload.Config:
    return dataclasses.replace(make_config(), offload=OffloadConfig(
        param_tier="nvme", optimizer_tier="nvme", nvme_path=str(path), pinned_budget_bytes=1 << 22))


def _model(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(n_layer=2)


def _train(engine, batches, rank: int, world_size: int) -> None:
    for x, y in batches:
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()


def _swap_names(path) -> set[str]:
    """The swap directory's names, listed while every rank waits (they list each other's
    files: no rank may go on to make or delete files meanwhile)."""
    import torch.distributed as dist

    sync = dist.is_initialized() and dist.get_world_size() > 1
    if sync:
        dist.barrier()
    d = os.path.join(str(path), "offload-swap")
    names = set(os.listdir(d)) if os.path.isdir(d) else set()
    if sync:
        dist.barrier()
    return names


def _notebook(rank: int, world_size: int, path: str) -> dict:
    """Cell 1 builds and trains; cell 1 again builds a new model beside the live engine and
    trains it; the first trains on; then the first is dropped, the second closed."""
    batches = gpt_batches(5)
    first = offload.initialize(_model(0), nvme_config(path))
    _train(first, batches[:3], rank, world_size)
    second = offload.initialize(_model(1), nvme_config(path))  # the cell run again: a rebuilt model
    both = _swap_names(path)
    _train(second, batches[:3], rank, world_size)
    _train(first, batches[3:], rank, world_size)  # the first trains on beside it
    out = {"first": first.full_state_dict(), "second": second.full_state_dict(), "both": both}
    del first
    gc.collect()
    out["after_del"] = _swap_names(path)
    second.close()
    out["after_close"] = _swap_names(path)
    # alone, each on the same path in turn: what the shared runs must equal bit for bit
    alone = offload.initialize(_model(0), nvme_config(path))
    _train(alone, batches, rank, world_size)
    out["first_alone"] = alone.full_state_dict()
    alone.close()
    alone = offload.initialize(_model(1), nvme_config(path))
    _train(alone, batches[:3], rank, world_size)
    out["second_alone"] = alone.full_state_dict()
    alone.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_notebook_cell_run_again_on_a_rebuilt_model_beside_the_live_engine(world_size, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="offload"):
        runs = [_notebook(0, 1, str(tmp_path))] if world_size == 1 else run_distributed(_notebook, 2, str(tmp_path))
    if world_size == 1:  # the initialize line of the second engine says what the process holds
        assert "2 engines of this process are alive in" in caplog.text, caplog.text[-2000:]
    out = runs[0]
    ranks = range(world_size)
    for r in ranks:  # each rank's engines: their own files, both locks' owner the process
        mine = {n for n in out["both"] if n.startswith(f"rank{r}.")}
        assert {f"rank{r}.param.swap", f"rank{r}.param.e1.swap", f"rank{r}.lock"} <= mine, out["both"]
    assert {n for n in out["after_del"] if ".e1." not in n and not n.endswith(".lock")} == set(), \
        "dropping the first engine deletes its files"
    assert all(f"rank{r}.param.e1.swap" in out["after_del"] for r in ranks), "and only its own"
    assert out["after_close"] == set(), "the last engine's close removes the rest and the locks"
    for which in ("first", "second"):
        got, alone = out[which], out[f"{which}_alone"]
        assert got.keys() == alone.keys() and got
        for k in got:
            assert torch.equal(got[k], alone[k]), f"{which} {k}: sharing the path changed training"


def test_the_first_engine_differs_from_the_second_the_control(tmp_path):
    """The bit-identical check above can fail: the two models' weights are not alike."""
    out = _notebook(0, 1, str(tmp_path))
    assert any(not torch.equal(out["first"][k], out["second"][k]) for k in out["first"])


# -- a DPO policy beside its frozen reference, on one nvme_path ----------------------------------

BETA = 0.5


def _logp(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.gather(F.log_softmax(logits.float(), -1), -1, y.unsqueeze(-1)).squeeze(-1).sum(-1)


def _dpo_batches(n: int):
    out = gpt_batches(2 * n)
    return [(out[2 * i], out[2 * i + 1]) for i in range(n)]  # (chosen, rejected)


def _dpo_loss(pi_c, pi_r, ref_c, ref_r) -> torch.Tensor:
    return -F.logsigmoid(BETA * ((pi_c - ref_c) - (pi_r - ref_r))).mean()


def _dpo_engines(policy_path, ref_path, steps: int = 4) -> dict:
    policy = offload.initialize(_model(0), nvme_config(policy_path))
    reference = offload.initialize(_model(0), nvme_config(ref_path))  # frozen: never stepped
    for (xc, yc), (xr, yr) in _dpo_batches(steps):
        with torch.no_grad():
            ref_c, ref_r = _logp(reference(xc), yc), _logp(reference(xr), yr)
        loss = _dpo_loss(_logp(policy(xc), yc), _logp(policy(xr), yr), ref_c, ref_r)
        policy.backward(loss)
        policy.step()
    out = {"policy": policy.full_state_dict(), "reference": reference.full_state_dict()}
    policy.close()
    reference.close()
    return out


def _dpo_plain(dtype: torch.dtype = torch.float32, fused: bool = False, reference: bool = True) -> dict:
    """Plain PyTorch's DPO loop (`reference=False`: the reference term lost, the control)."""
    policy, ref = _model(0).to(dtype), _model(0).to(dtype)
    ref.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=WD, fused=fused or None,
                            foreach=False if not fused else None)
    for (xc, yc), (xr, yr) in _dpo_batches(4):
        ref_c, ref_r = (_logp(ref(xc), yc), _logp(ref(xr), yr)) if reference else (torch.zeros(()),) * 2
        loss = _dpo_loss(_logp(policy(xc), yc), _logp(policy(xr), yr), ref_c, ref_r)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in policy.state_dict().items()}


@pytest.fixture(scope="module")
def dpo_bound() -> Fp32Bound:
    """Per tensor: 8 x the largest distance of torch's for-loop and fused AdamW (fp32) from a
    float64 run of the same DPO loop ([Note: derived tolerances] in tests/parity.py)."""
    return Fp32Bound(_dpo_plain(torch.float64), {"torch for-loop AdamW": _dpo_plain(),
                                                 "torch fused AdamW": _dpo_plain(fused=True)})


def test_a_dpo_policy_beside_its_frozen_reference_on_one_nvme_path(tmp_path, dpo_bound):
    for d in ("a", "p", "r"):
        (tmp_path / d).mkdir()
    shared = _dpo_engines(tmp_path / "a", tmp_path / "a")
    apart = _dpo_engines(tmp_path / "p", tmp_path / "r")
    assert not os.listdir(tmp_path / "a"), "both engines' files and locks are gone at close()"
    for k, v in shared["policy"].items():
        assert torch.equal(v, apart["policy"][k]), f"{k}: the shared path changed the policy's training"
    start = _model(0).state_dict()
    for k, v in shared["reference"].items():
        assert torch.equal(v, start[k]), f"{k}: the frozen reference moved"
    dpo_bound.check(shared["policy"], "DPO policy beside its reference on one nvme_path")


def test_the_dpo_negative_control_lands_far_outside_the_bound(dpo_bound):
    """A policy trained with the reference term lost (what engines overwriting each other's
    swap files could make of it) fails the same bound by orders of magnitude."""
    worst, _, _ = dpo_bound.worst(_dpo_plain(reference=False))
    assert worst > 100, worst


# -- exits and other processes -----------------------------------------------------------------

_TWO_ENGINES_EXIT = """
import sys, offload
from tests.test_shared_nvme_path import _model, _train, nvme_config
from tests.conftest import gpt_batches
a = offload.initialize(_model(0), nvme_config(sys.argv[1]))
b = offload.initialize(_model(1), nvme_config(sys.argv[1]))
_train(a, gpt_batches(1), 0, 1)
_train(b, gpt_batches(1), 0, 1)
print("trained", flush=True)
"""  # ends without close(): both engines drained at exit


def test_an_exit_without_close_leaves_no_files_of_either_engine(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _TWO_ENGINES_EXIT, str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]
    assert _swap_names(tmp_path) == set() and not os.path.exists(tmp_path / "offload-swap")


_HOLD = """
import sys, time, offload
from tests.test_shared_nvme_path import _model, nvme_config
engine = offload.initialize(_model(0), nvme_config(sys.argv[1]))
print("ready", flush=True)
time.sleep(120)
"""


def test_a_second_process_on_the_path_is_still_refused(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(RuntimeError, match=r"in use by another live run \(pid=\d+"):
            offload.initialize(_model(1), nvme_config(tmp_path))
        assert any(n.startswith("rank0.") and n.endswith(".swap") for n in _swap_names(tmp_path)), \
            "the refused engine deleted nothing of the live run's"
    finally:
        proc.kill()
        proc.wait()
