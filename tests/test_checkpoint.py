"""Checkpoints: exact resume, re-sharding, crash safety, corruption, consolidation, errors.

Exactness: resuming must reproduce the uninterrupted run bit for bit (torch.equal), not
within a tolerance. Everything that decides the next steps is restored: masters, moments,
per-parameter step counts, scheduler, loss scaler, counters and RNG states (the training
loop below draws its batches from torch's global RNG and jitters the loss with python's and
numpy's, so an RNG not restored changes the data and the test fails). CPU kernels are
deterministic, so the two runs execute the same floating-point operations in the same order.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import offload
from offload.checkpoint import CheckpointCorruptError, consolidate
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig
from tests.conftest import TinyGPT, run_distributed
from tests.scripts import run_python

N = 3  # steps before and after the save
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_config(dtype: str = "fp32", tier: str = "cpu", nvme_path: str | None = None) -> Config:
    return Config(
        compute_device="cpu",
        optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.01),
        # fp16: a window of 2 makes the dynamic scale move during the run (state to restore)
        precision=PrecisionConfig(dtype=dtype, initial_scale_power=8, loss_scale_window=2, hysteresis=1),
        offload=OffloadConfig(optimizer_tier=tier, nvme_path=nvme_path),
        gradient_clipping=0.5,
    )


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def build(dtype="fp32", tier="cpu", nvme_path=None, seed=0, **model_kw):
    torch.manual_seed(seed)
    model = TinyGPT(**model_kw)
    return offload.initialize(model, make_config(dtype, tier, nvme_path), lr_scheduler=schedule)


def train(engine, steps: int, rank: int = 0, world_size: int = 1) -> None:
    for _ in range(steps):
        idx = torch.randint(0, 64, (8, 17))  # torch's global RNG: resume must restore it
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
        b = 8 // world_size
        jitter = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
        loss = engine(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]) * jitter
        engine.backward(loss)
        engine.step()


def summary(engine) -> dict:
    return {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.loss_scale,
        "lr": engine.get_lr(),
    }


def unit_states(engine) -> dict[str, dict]:
    out = {}
    for unit in engine.units:
        with engine.optimizer.unit_state(unit.index) as s:
            out[unit.name] = {k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in s.items()}
    return out


def assert_same_sd(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- tiers: the NVMe tier joins when it exists -------------------------------------------------

@pytest.fixture(params=["cpu", "nvme"])
def tier(request, tmp_path):
    return request.param, (str(tmp_path / "swap") if request.param == "nvme" else None)


# -- exact resume, world size 1 ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_resume_is_exact_world_size_1(tmp_path, dtype, tier):
    name, nvme = tier
    if nvme:
        os.makedirs(nvme, exist_ok=True)
    seed_all(1)
    straight = build(dtype, name, nvme)
    train(straight, 2 * N)
    want, want_info = straight.full_state_dict(), summary(straight)
    straight.close()

    seed_all(1)
    first = build(dtype, name, nvme)
    train(first, N)
    path = first.save_checkpoint(tmp_path / "ckpt", client_state={"batches_seen": N})
    assert os.path.basename(path) == f"global_step{first.global_steps}"
    first.close()

    seed_all(12345)  # a different RNG state and different weights: load must restore all
    second = build(dtype, name, nvme, seed=7)
    got_path, client = second.load_checkpoint(tmp_path / "ckpt")
    assert got_path == path and client == {"batches_seen": N}
    train(second, N)
    assert_same_sd(second.full_state_dict(), want)
    assert summary(second) == want_info
    if dtype == "fp16":
        assert want_info["loss_scale"] != 2.0**8  # the scaler state did matter


def test_nvme_save_with_a_budget_for_one_unit_falls_back_to_reading_in_turn(tmp_path, monkeypatch):
    """With the NVMe tier a save reads the next unit's state while this one is written. A
    pinned budget that holds one unit's working set cannot do that: the read ahead fails,
    and the save must go on one unit at a time (not fail, not deadlock) and be exact."""
    import re

    from offload.checkpoint import save as save_mod

    def engine(name: str, budget: int):
        import dataclasses

        torch.manual_seed(0)
        os.makedirs(tmp_path / name)
        cfg = make_config("fp32", "nvme", str(tmp_path / name))
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, pinned_budget_bytes=budget))
        return offload.initialize(TinyGPT(), cfg, lr_scheduler=schedule)

    with pytest.raises(ValueError, match=r"at least (\d+)") as info:
        engine("probe", 4096)
    budget = int(re.search(r"at least (\d+)", str(info.value)).group(1))  # one unit's working set
    seen = []

    class Spy(save_mod._UnitStates):
        def close_all(self) -> None:
            seen.append(self.ahead)
            super().close_all()

    monkeypatch.setattr(save_mod, "_UnitStates", Spy)
    first = engine("a", budget)
    seed_all(3)
    train(first, 2)
    want = unit_states(first)
    first.save_checkpoint(tmp_path / "ck")
    assert seen == [False]  # the read ahead did not fit, and the save went on without it
    second = engine("b", budget)
    second.load_checkpoint(tmp_path / "ck")
    got = unit_states(second)
    for name in want:
        for k in want[name]:
            assert (torch.equal(got[name][k], want[name][k]) if torch.is_tensor(want[name][k])
                    else got[name][k] == want[name][k]), (name, k)
    first.close()
    second.close()


@pytest.fixture
def swap(tmp_path) -> str:
    """A swap directory for an NVMe-tier engine."""
    d = tmp_path / "swap"
    d.mkdir()
    return str(d)


def _state_bytes(engine) -> int:
    return sum(lay.nbytes for lay in engine.optimizer.store.layouts)


@pytest.mark.parametrize("copy_to_swap", [None, True])
def test_nvme_load_reads_the_checkpoint_in_place_until_each_unit_is_rewritten(tmp_path, copy_to_swap, swap):
    """By default a same-world-size load leaves the optimizer state in the checkpoint's
    files (checksums verified) and writes nothing to the swap file; the first step moves
    each unit to its slot and lets go of the files. The checkpoint may be deleted right
    after the load, and a save before any step reads the state from where it lies. With
    copy_to_swap=True the whole state is written to the swap file during the load. Both
    resume exactly."""
    seed_all(1)
    straight = build("fp32", "nvme", swap)
    train(straight, 2 * N)
    want = straight.full_state_dict()
    straight.close()

    seed_all(1)
    first = build("fp32", "nvme", swap)
    train(first, N)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()

    seed_all(99)
    second = build("fp32", "nvme", swap, seed=7)
    units = sorted(u.index for u in second.units)
    written = second.nvme.stats.bytes_written
    second.load_checkpoint(tmp_path / "ckpt", copy_to_swap=copy_to_swap)
    second.nvme.staging.drain()
    load_written = second.nvme.stats.bytes_written - written
    store, held = second.optimizer.store, second.nvme.files
    if copy_to_swap:
        assert load_written == _state_bytes(second) and store.adopted() == [] and held.held() == []
    else:
        assert load_written == 0 and store.adopted() == units
        assert len(held.held()) == 1 and held.held()[0].startswith(str(tmp_path / "ckpt"))
    # Before any step, re-save the same tag: the save reads the state from the held files,
    # then swaps the new directory in and deletes the old one, the files being read.
    path = second.save_checkpoint(tmp_path / "ckpt")
    os.rename(tmp_path / "ckpt", tmp_path / "again")
    if not copy_to_swap:
        assert not os.path.exists(held.held()[0]) and store.adopted() == units
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    train(second, N)
    assert_same_sd(second.full_state_dict(), want)
    assert store.adopted() == [] and held.held() == []  # every unit rewritten: files let go
    second.close()

    torch.set_rng_state(rng[0]), random.setstate(rng[1]), np.random.set_state(rng[2])
    third = build("fp32", "nvme", swap, seed=8)
    third.load_checkpoint(tmp_path / "again", tag=os.path.basename(path))
    train(third, N)
    assert_same_sd(third.full_state_dict(), want)
    third.close()


def test_a_checkpoint_truncated_after_an_in_place_load_is_named_by_the_step(tmp_path, swap):
    """The checkpoint is verified by the load; a file truncated afterwards, while a unit is
    still read from it, fails the step with an error naming that file and the fix."""
    seed_all(1)
    first = build("fp32", "nvme", swap)
    train(first, 1)
    path = first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    second = build("fp32", "nvme", swap)
    second.load_checkpoint(tmp_path / "ckpt")
    shard = second.nvme.files.held()[0]
    assert shard.startswith(path)
    os.truncate(shard, 0)
    with pytest.raises(OSError, match=r"(?s)checkpoint file it was loaded from.*load the checkpoint again") as info:
        train(second, 1)
    assert info.value.filename == shard
    second.close()


def test_nvme_load_copies_a_checkpoint_on_another_filesystem(tmp_path, swap):
    """By default a checkpoint on another filesystem than the swap directory (here a tmpfs)
    is copied into the swap file during the load, never read during training; asked with
    copy_to_swap=False it is read in place (where O_DIRECT works there). Both resume
    exactly."""
    import warnings

    from offload.storage.io import probe_direct_io
    from tests.fsutil import mounted_tmpfs

    with mounted_tmpfs("64m") as mnt, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # buffered I/O where the tmpfs has no O_DIRECT
        seed_all(2)
        first = build("fp32", "nvme", swap)
        train(first, N)
        first.save_checkpoint(mnt)
        train(first, N)
        want = first.full_state_dict()
        first.close()
        second = build("fp32", "nvme", swap, seed=5)
        units = sorted(u.index for u in second.units)
        for copy_to_swap, adopted in ((None, []), (False, units if probe_direct_io(mnt) else [])):
            second.load_checkpoint(mnt, copy_to_swap=copy_to_swap)
            assert second.optimizer.store.adopted() == adopted
            train(second, N)
            assert_same_sd(second.full_state_dict(), want)
            assert second.nvme.files.held() == []
        second.close()
    with pytest.raises(TypeError, match="copy_to_swap"):
        build("fp32").load_checkpoint(tmp_path, copy_to_swap="yes")


# -- world size 2, and re-sharding 2 -> 1 -> 2 ---------------------------------------------------


WS2_CASES = ("fp32", "bf16", "fp32-nvme", "bf16-nvme")
"""dtype[-tier]: the tier defaults to cpu."""


def _build_case(case: str, ckdir: str, seed: int):
    dtype, _, tier = case.partition("-")
    swap = None
    if tier == "nvme":
        swap = os.path.join(ckdir, "swap")
        os.makedirs(swap, exist_ok=True)
    return build(dtype, tier or "cpu", swap, seed=seed)


def _ws2_phase(rank: int, world_size: int, phase: str, ckdir: str, dtypes=WS2_CASES) -> dict:
    out = {}
    for dtype in dtypes:
        d = os.path.join(ckdir, dtype)
        seed_all(1)
        engine = _build_case(dtype, ckdir, seed=0 if phase != "second" else 7)
        if phase == "straight":
            train(engine, 2 * N, rank, world_size)
        elif phase == "first":
            train(engine, N, rank, world_size)
            engine.save_checkpoint(d, client_state={"rank": rank})
            out[dtype + "/states"] = unit_states(engine)
        elif phase == "second":
            seed_all(99)
            _, client = engine.load_checkpoint(d)
            assert client == {"rank": rank}
            if "nvme" in dtype:  # same world size: the state is read in place
                out[dtype + "/adopted"] = len(engine.optimizer.store.adopted())
            train(engine, N, rank, world_size)
        elif phase == "load":
            engine.load_checkpoint(d)
            out[dtype + "/states"] = unit_states(engine)
            out["shard_numel"] = {u.name: u.layout.shard_numel for u in engine.units}
        out[dtype] = engine.full_state_dict()
        out[dtype + "/summary"] = summary(engine)
        engine.close()
    return out


@pytest.fixture(scope="module")
def ws2_checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ws2"))
    first = run_distributed(_ws2_phase, 2, "first", d, WS2_CASES)
    return d, first


def test_resume_is_exact_world_size_2(ws2_checkpoint):
    d, _ = ws2_checkpoint
    cases = WS2_CASES
    straight = run_distributed(_ws2_phase, 2, "straight", d, cases)[0]
    resumed = run_distributed(_ws2_phase, 2, "second", d, cases)
    for case in cases:
        assert_same_sd(resumed[0][case], straight[case])
        assert resumed[0][case + "/summary"] == straight[case + "/summary"]
        if "nvme" in case:
            assert resumed[0][case + "/adopted"] > 0 and resumed[1][case + "/adopted"] > 0


def _ws2_node_local(rank: int, world_size: int, root: str) -> dict:
    """Two 'nodes' on one machine: each rank works in its own directory (its node's disk),
    with LOCAL_RANK 0 (each the first rank of its node), and names the checkpoint
    directory relatively, as a script run on every node would."""
    node = os.path.join(root, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    seed_all(1)
    straight = build()
    train(straight, 2 * N, rank, world_size)
    want = straight.full_state_dict()
    straight.close()
    seed_all(1)
    first = build()
    train(first, N, rank, world_size)
    path = first.save_checkpoint("ckpt", client_state={"rank": rank})
    first.close()
    seed_all(12345)
    second = build(seed=7)
    got_path, client = second.load_checkpoint("ckpt")
    train(second, N, rank, world_size)
    got = second.full_state_dict()
    second.close()
    return {"path": path, "loaded": got_path, "client": client, "want": want, "got": got,
            "files": sorted(os.listdir(os.path.join(node, "ckpt", os.path.basename(path))))}


def test_node_local_checkpoint_directories_save_and_resume_exactly(tmp_path):
    """No shared filesystem: each node's directory gets its own ranks' files and the
    manifest, and the resume at the saving world size is exact ([Note: node-local
    checkpoints])."""
    r0, r1 = run_distributed(_ws2_node_local, 2, str(tmp_path))
    assert r0["client"] == {"rank": 0} and r1["client"] == {"rank": 1}
    assert r0["files"] == ["manifest.json", "rank00000.shards", "rank00000.state"], r0["files"]
    assert r1["files"] == ["manifest.json", "rank00001.shards", "rank00001.state"], r1["files"]
    for node in ("node0", "node1"):
        assert open(tmp_path / node / "ckpt" / "latest").read().strip() == "global_step3"
        assert not [n for n in os.listdir(tmp_path / node / "ckpt") if n.startswith(".")]
    assert_same_sd(r0["got"], r0["want"])
    # re-sharding needs every rank's files: one node's directory says so
    engine = build()
    with pytest.raises(FileNotFoundError, match=r"missing rank 1's shards file.*node-local"):
        engine.load_checkpoint(str(tmp_path / "node0" / "ckpt"))
    engine.close()


def _assert_prefix_equal(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Equal over the common length; beyond it (padding of one layout or the other) zero."""
    m = min(got.numel(), want.numel())
    assert torch.equal(got[:m], want[:m]), what
    assert not got[m:].any() and not want[m:].any(), what


@pytest.mark.parametrize("case", ["fp32", "fp32-nvme"])
def test_resume_across_world_sizes_2_to_1_to_2(ws2_checkpoint, tmp_path, case):
    """Re-sharding: with the NVMe tier the state is copied into the swap file (a load at
    another world size cannot read it in place)."""
    d, first = ws2_checkpoint
    # 2 -> 1: each unit's state is the two saved shards end to end (moments: the optimized
    # prefix, which the two ranks' moment shards tile).
    per_rank = [first[0][case + "/states"], first[1][case + "/states"]]
    seed_all(5)
    engine = _build_case(case, str(tmp_path), seed=3)
    _, client = engine.load_checkpoint(os.path.join(d, case))
    assert client == {"rank": 0}
    if "nvme" in case:
        assert engine.optimizer.store.adopted() == []
    for name, s in unit_states(engine).items():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            _assert_prefix_equal(s[k], torch.cat([r[name][k] for r in per_rank]), (name, k))
        assert s["slot_steps"] == per_rank[0][name]["slot_steps"] == per_rank[1][name]["slot_steps"]
    assert_same_sd(engine.full_state_dict(), first[0][case])
    assert summary(engine) == first[0][case + "/summary"]
    # train at world size 1 and save; 1 -> 2: each rank gets its slice of the flat unit.
    train(engine, N)
    engine.save_checkpoint(tmp_path / case, tag="from_one")
    flat = unit_states(engine)
    full = engine.full_state_dict()
    engine.close()
    results = run_distributed(_ws2_phase, 2, "load", str(tmp_path), (case,))
    for rank in (0, 1):
        for name, s in results[rank][case + "/states"].items():
            lo = rank * results[rank]["shard_numel"][name]
            for k in ("master", "exp_avg", "exp_avg_sq"):
                _assert_prefix_equal(s[k], flat[name][k][lo : lo + s[k].numel()], (rank, name, k))
            assert s["slot_steps"] == flat[name]["slot_steps"]
    assert_same_sd(results[0][case], full)


# -- crash safety: kill -9 a saving process -----------------------------------------------------

_SAVER = r"""
import os, sys, torch
sys.path.insert(0, {root!r})
from tests.test_checkpoint import build, train, seed_all
ckpt, out, stage, delay = sys.argv[1:5]
seed_all(1)
engine = build("fp32", d_model=64, n_layer=2)
train(engine, 2)
engine.save_checkpoint(ckpt, tag="a", client_state={{"step": 2}})
torch.save(engine.full_state_dict(), os.path.join(out, "a.pt"))
train(engine, 2)
# armed for save "b" only (read when the save reaches each point)
os.environ["OFFLOAD_CHECKPOINT_TEST_PAUSE_AT"] = stage
os.environ["OFFLOAD_CHECKPOINT_TEST_PAUSE_FILE"] = os.path.join(out, "paused")
os.environ["OFFLOAD_CHECKPOINT_TEST_IO_DELAY_S"] = delay
open(os.path.join(out, "b_started"), "w").close()
engine.save_checkpoint(ckpt, tag="b")
open(os.path.join(out, "b_saved"), "w").close()
"""


def _start_saver(tmp_path, stage="", delay_s=0.0):
    script = tmp_path / "saver.py"
    script.write_text(_SAVER.format(root=ROOT))
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ckpt), str(out), stage, str(delay_s)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    return proc, ckpt, out


def _wait_for(path, proc, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"saver exited early: {proc.stdout.read().decode()[-3000:]}")
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def _check_previous_loads(ckpt, out, expect_b_dir: bool):
    assert open(ckpt / "latest").read().strip() == "a"
    assert os.path.isdir(ckpt / "b") == expect_b_dir
    engine = build("fp32", d_model=64, n_layer=2, seed=9)
    path, client = engine.load_checkpoint(ckpt)
    assert os.path.basename(path) == "a" and client == {"step": 2}
    assert_same_sd(engine.full_state_dict(), torch.load(out / "a.pt"))
    # the next save removes what the killed one left behind
    engine.save_checkpoint(ckpt, tag="c")
    assert not [n for n in os.listdir(ckpt) if n.startswith(".")]
    assert open(ckpt / "latest").read().strip() == "c"
    engine.close()


@pytest.mark.parametrize("stage", ["shards", "rename", "latest"])
def test_kill_9_at_each_stage_of_a_save_keeps_the_previous_checkpoint(tmp_path, stage):
    # 'shards': first unit written, the rest not; 'rename': every file and the manifest
    # written and fsynced, the directory not yet renamed; 'latest': renamed, `latest` not
    # yet moved. In every case `latest` still names "a" and "a" loads exactly.
    proc, ckpt, out = _start_saver(tmp_path, stage=stage)
    try:
        _wait_for(out / "paused", proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not os.path.exists(out / "b_saved")
    if stage != "latest":
        assert [n for n in os.listdir(ckpt) if n.startswith(".tmp-b-")]
    _check_previous_loads(ckpt, out, expect_b_dir=stage == "latest")
    if stage == "latest":  # "b" was complete before the kill: it loads by its tag
        engine = build("fp32", d_model=64, n_layer=2, seed=9)
        path, _ = engine.load_checkpoint(ckpt, tag="b")
        assert engine.global_steps == 4
        engine.close()


def test_kill_9_mid_write_keeps_the_previous_checkpoint(tmp_path):
    # Every I/O block waits 0.5 s in the I/O engine: save "b" takes seconds, and the kill
    # lands 0.5 s after it started, while its shards are being written.
    proc, ckpt, out = _start_saver(tmp_path, delay_s=0.5)
    try:
        _wait_for(out / "b_started", proc, timeout_s=300)
        time.sleep(0.5)
        assert proc.poll() is None and not os.path.exists(out / "b_saved"), "save finished too fast"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [n for n in os.listdir(ckpt) if n.startswith(".tmp-b-")]  # killed mid-save
    _check_previous_loads(ckpt, out, expect_b_dir=False)


# -- corruption and torn checkpoints are detected -------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    seed_all(1)
    engine = build("bf16")
    train(engine, 2)
    path = engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    sd = engine.full_state_dict()
    engine.close()
    return tmp_path / "ckpt", path, sd


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_flipped_byte_in_a_shard_file_is_detected_and_named(saved):
    ckdir, path, _ = saved
    shards = os.path.join(path, "rank00000.shards")
    _flip_byte(shards, os.path.getsize(shards) // 2 + 123)
    engine = build("bf16")
    with pytest.raises(CheckpointCorruptError, match=r"rank00000\.shards.*checksum mismatch"):
        engine.load_checkpoint(ckdir)


def test_torn_checkpoints_are_detected(saved):
    ckdir, path, _ = saved
    engine = build("bf16")
    state = os.path.join(path, "rank00000.state")
    _flip_byte(state, 100)
    with pytest.raises(CheckpointCorruptError, match=r"rank00000\.state.*corrupt"):
        engine.load_checkpoint(ckdir)
    shards = os.path.join(path, "rank00000.shards")
    os.truncate(shards, os.path.getsize(shards) - 4096)
    with pytest.raises(CheckpointCorruptError, match=r"rank00000\.shards.*bytes, the manifest says"):
        engine.load_checkpoint(ckdir)
    os.unlink(os.path.join(path, "manifest.json"))
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json.*is missing"):
        engine.load_checkpoint(ckdir, tag="t")


def _edit_manifest(path, edit, rechecksum: bool = False) -> None:
    """Rewrite `path`'s manifest.json as `edit(manifest)` leaves it (valid JSON); with
    `rechecksum`, its checksum made to match again (a careful hand edit)."""
    import json

    from offload.checkpoint import manifest

    file = os.path.join(path, "manifest.json")
    with open(file) as f:
        data = json.load(f)
    data = edit(data) or data
    if rechecksum:
        data[manifest.CHECKSUM_KEY] = manifest._canonical_crc(data)
    with open(file, "w") as f:
        json.dump(data, f)


def _cut(key: str):
    def edit(m):
        m["model"][key] = m["model"][key][:-1]
    return edit


# Damage that still parses as JSON (issue #43, item 4); each was an IndexError, KeyError,
# TypeError or "a different model" from inside the loader before the manifest had a checksum.
MANIFEST_DAMAGE = {
    "a digit changed": lambda m: m["model"]["units"][1]["slots"][0].__setitem__(
        "offset", m["model"]["units"][1]["slots"][0]["offset"] + 10),
    "world size changed": lambda m: m.__setitem__("world_size", 2),
    "a key renamed": lambda m: m.__setitem__("rankz", m.pop("ranks")),
    "the units list cut short": _cut("units"),
    "the state-dict list cut short": _cut("state_dict"),
    "a number as a string": lambda m: m.__setitem__("chunk_bytes", str(m["chunk_bytes"])),
    "a tensor record emptied": lambda m: m["ranks"][0]["shards"]["tensors"].__setitem__(0, {}),
    "the checksum removed": lambda m: m.pop("manifest_crc32"),
    "a list for the manifest": lambda m: [m],
}


@pytest.mark.parametrize("kind", MANIFEST_DAMAGE)
def test_a_damaged_manifest_is_named(saved, kind):
    ckdir, path, _ = saved
    _edit_manifest(path, MANIFEST_DAMAGE[kind])
    engine = build("bf16")
    before = engine.full_state_dict()
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json.*(damaged|not an offload)"):
        engine.load_checkpoint(ckdir)
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json"):
        consolidate(str(path), str(ckdir / "out.pt"))
    after = engine.full_state_dict()  # nothing loaded: the engine is as it was
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()


@pytest.mark.parametrize("kind", ["a key renamed", "the units list cut short", "a tensor record emptied",
                                  "a number as a string"])
def test_manifest_fields_are_checked_without_the_checksum(saved, kind):
    """A manifest whose checksum matches its damage (or a version-2 one, which has none):
    the fields the loader indexes are checked on their own."""
    ckdir, path, _ = saved
    _edit_manifest(path, MANIFEST_DAMAGE[kind], rechecksum=True)
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json.* is damaged: .*"):
        build("bf16").load_checkpoint(ckdir)


def test_a_version_2_manifest_without_a_checksum_still_loads(saved):
    ckdir, path, sd = saved
    def as_version_2(m):
        del m["manifest_crc32"]
        m["version"] = 2

    _edit_manifest(path, as_version_2)
    engine = build("bf16")
    engine.load_checkpoint(ckdir)
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    engine.close()


@pytest.mark.parametrize("content", [b"", b"\n", b"\xff\xfe\x00", b"../t", b"nope", b"t\nt"])
def test_a_damaged_latest_is_named(saved, content):
    ckdir, _, _ = saved
    with open(ckdir / "latest", "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointCorruptError, match=r"latest' is damaged.*tags present as tag=.*\['t'\]"):
        build("bf16").load_checkpoint(ckdir)


def test_missing_rank_file_is_named(saved):
    ckdir, path, _ = saved
    os.unlink(os.path.join(path, "rank00000.shards"))
    with pytest.raises(FileNotFoundError, match=r"missing rank 0's shards file 'rank00000\.shards'"):
        build("bf16").load_checkpoint(ckdir)


# -- consolidation ---------------------------------------------------------------------------------


def test_consolidated_safetensors_load_into_a_plain_module(saved, tmp_path):
    from safetensors.torch import load_file

    ckdir, path, sd = saved
    out = consolidate(str(ckdir), str(tmp_path / "single"))
    assert [os.path.basename(p) for p in out] == ["model.safetensors"]
    plain = TinyGPT()
    missing = plain.load_state_dict(load_file(out[0]), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    assert_same_sd({k: v.float() for k, v in plain.state_dict().items()}, sd)
    assert plain.lm_head.weight is plain.wte.weight  # tied stays tied in the plain module


def test_consolidate_cli_shards_with_an_index(saved, tmp_path):
    import json

    from safetensors.torch import load_file

    ckdir, path, sd = saved
    proc = run_python(
        ["-m", "offload.checkpoint", "consolidate", path, str(tmp_path / "out"), "--max-shard-size", "20KB"],
        cwd=ROOT, env=os.environ, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for f in files:
        part = load_file(str(tmp_path / "out" / f))
        assert os.path.getsize(tmp_path / "out" / f) < 20_000 + 4096 or len(part) == 1
        merged.update(part)
    assert set(merged) == set(index["weight_map"]) == set(sd)
    for k in sd:
        assert torch.equal(merged[k], sd[k]), k
    bad = run_python(
        ["-m", "offload.checkpoint", "consolidate", str(tmp_path / "nope"), "x"],
        cwd=ROOT, env=os.environ, timeout=120,
    )
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def test_a_failed_consolidation_leaves_no_file_and_keeps_the_old_one(saved, tmp_path):
    """A shard file corrupted in the middle fails consolidation part-way through writing:
    no half-written (zero-filled) model file may appear, and a good one already in the
    output directory stays as it was; single file and sharded alike."""
    ckdir, path, _ = saved
    good = {}
    for name, size in (("single", "10GB"), ("sharded", "20KB")):
        out = consolidate(str(ckdir), str(tmp_path / name), max_shard_size=size)
        good[name] = {p: open(p, "rb").read() for p in out}
    from offload.checkpoint import manifest

    # a byte of the last unit's master (what consolidation reads), so the error comes
    # after the earlier units' weights were written
    rank0 = manifest.read(path)["ranks"][0]["shards"]
    last = max((r for r in rank0["tensors"] if r["name"] == "master"), key=lambda r: r["offset"])
    _flip_byte(os.path.join(path, rank0["file"]), last["offset"] + 8)
    for name, size in (("single", "10GB"), ("sharded", "20KB")):
        with pytest.raises(CheckpointCorruptError, match=r"rank00000\.shards"):
            consolidate(str(ckdir), str(tmp_path / name), max_shard_size=size, overwrite=True)
        left = sorted(os.listdir(tmp_path / name))
        assert left == sorted(os.path.basename(p) for p in good[name]), left  # no temporaries
        for p, data in good[name].items():
            assert open(p, "rb").read() == data, p
    with pytest.raises(CheckpointCorruptError):
        consolidate(str(ckdir), str(tmp_path / "fresh"))
    assert os.listdir(tmp_path / "fresh") == []  # nothing that looks like a model


def test_consolidate_refuses_a_non_empty_output_unless_overwrite(saved, tmp_path):
    """An existing non-empty OUT is refused with the fix named (CLI: exit 1, nothing
    touched); --overwrite replaces it whole: a stale shard of an earlier split does not
    survive beside the new single file, and no staging directory is left behind."""
    from safetensors.torch import load_file

    ckdir, path, sd = saved
    out = tmp_path / "out"
    consolidate(str(ckdir), str(out), max_shard_size="20KB")
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    assert len(before) > 2
    with pytest.raises(FileExistsError, match=r"exists and is not empty .*--overwrite"):
        consolidate(str(ckdir), str(out))
    cli = ["-m", "offload.checkpoint", "consolidate", path, str(out)]
    bad = run_python(cli, cwd=ROOT, env=os.environ, timeout=120)
    assert bad.returncode == 1 and "--overwrite" in bad.stderr, bad.stderr
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # untouched
    ok = run_python(cli + ["--overwrite"], cwd=ROOT, env=os.environ, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert os.listdir(out) == ["model.safetensors"]  # the old split's files are gone
    assert ok.stdout.split() == [str(out / "model.safetensors")]
    assert [f for f in os.listdir(tmp_path) if f.startswith("out")] == ["out"]  # no staging/old dir
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    (tmp_path / "empty").mkdir()  # an existing empty directory is fine without --overwrite
    assert [os.path.basename(p) for p in consolidate(str(ckdir), str(tmp_path / "empty"))] == \
        ["model.safetensors"]


def test_consolidated_world_size_2_checkpoint_equals_full_state_dict(ws2_checkpoint, tmp_path):
    from safetensors.torch import load_file

    d, first = ws2_checkpoint
    for dtype in ("fp32", "bf16"):
        out = consolidate(os.path.join(d, dtype), str(tmp_path / dtype))
        got = load_file(out[0])
        want = first[0][dtype]
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


# -- errors ----------------------------------------------------------------------------------------


def test_load_errors_name_the_problem(saved, tmp_path):
    ckdir, path, _ = saved
    engine = build("bf16")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"tag 'nope' not found.*\['t'\]"):
        engine.load_checkpoint(ckdir, tag="nope")
    os.unlink(ckdir / "latest")
    with pytest.raises(FileNotFoundError, match=r"no 'latest' file; pass one of the tags present: \['t'\]"):
        engine.load_checkpoint(ckdir)
    other = build("bf16", d_model=48)
    with pytest.raises(ValueError, match=r"parameter 'wte\.weight' has shape \(64, 32\) in the checkpoint and \(64, 48\)"):
        other.load_checkpoint(ckdir, tag="t")
    deeper = build("bf16", n_layer=3)
    with pytest.raises(ValueError, match=r"'blocks\.2\..*' .*is not in it"):
        deeper.load_checkpoint(ckdir, tag="t")
    with pytest.raises(ValueError, match="tag"):
        engine.save_checkpoint(tmp_path / "x", tag="../up")


def test_save_mid_accumulation_is_refused(tmp_path):
    import dataclasses

    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), dataclasses.replace(make_config(), gradient_accumulation_steps=2))
    idx = torch.randint(0, 64, (8, 17))
    engine.backward(engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    engine.step()
    with pytest.raises(RuntimeError, match="accumulation boundary"):
        engine.save_checkpoint(tmp_path / "c")


def test_read_only_directory_is_a_clear_error():
    from tests.fsutil import mounted_tmpfs

    engine = build()
    with mounted_tmpfs("1m", read_only=True) as d:
        with pytest.raises(OSError, match="cannot create a checkpoint in") as info:
            engine.save_checkpoint(os.path.join(d, "ckpt"))
        assert info.value.errno in (30, 13)  # EROFS (EACCES when not root)


def test_disk_full_during_save_keeps_the_previous_checkpoint():
    from tests.fsutil import mounted_tmpfs

    seed_all(1)
    engine = build("fp32", d_model=64)
    train(engine, 1)
    with mounted_tmpfs("2m") as d:
        ck = os.path.join(d, "ckpt")
        engine.save_checkpoint(ck, tag="a")  # ~1.3 MB: fits once, not twice
        want = engine.full_state_dict()
        train(engine, 1)
        with pytest.raises(OSError, match="No space left on device") as info:
            engine.save_checkpoint(ck, tag="b")
        assert info.value.errno == 28
        assert open(os.path.join(ck, "latest")).read().strip() == "a"
        assert os.listdir(ck) == ["a", "latest"] or sorted(os.listdir(ck)) == ["a", "latest"]
        fresh = build("fp32", d_model=64, seed=3)
        fresh.load_checkpoint(ck)
        assert_same_sd(fresh.full_state_dict(), want)


def test_crc32c_check_value_and_kernels_agree():
    from offload._native import C

    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert C.crc32c(data.data_ptr(), 9) == 0xE3069283  # the CRC-32C check value
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=g)
    # around the fast kernel's 3 x 8 KiB lanes too (24576 bytes per round)
    for n in (0, 1, 7, 8, 9, 4096, 24_575, 24_576, 24_577, 49_160, 100_003):
        fast = C.crc32c(x.data_ptr(), n)
        assert fast == C.crc32c(x.data_ptr(), n, 0, True), n  # SSE4.2 == portable
        # continuing a running CRC equals one pass
        assert C.crc32c(x.data_ptr() + n // 2, n - n // 2, C.crc32c(x.data_ptr(), n // 2)) == fast
