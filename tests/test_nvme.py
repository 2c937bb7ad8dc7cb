"""The NVMe tier: parameter shards and optimizer states paged through swap files.

Parity: every parameter tier {device, cpu, nvme} x optimizer tier {cpu, nvme}, at world
sizes 1 and 2, trains to the same parameters as plain torch.optim.AdamW (within the bounds
measured as tests/parity.py explains) and, stronger, bit-identically to the
all-in-memory engine: the NVMe tiers move bytes, they never change the arithmetic. Then the
invariants: results unchanged with every I/O block delayed (nothing reads a slot before its
write completed), pinned staging within the budget for a model whose state is several times
the budget, clear errors at initialize, no swap file left after close.
"""

from __future__ import annotations

import errno
import functools
import gc
import os
import re
import shutil
import warnings

import pytest
import torch

import offload
import offload.storage.nvme
from offload.config import OffloadConfig
from offload.storage.optim_state import state_layout
from offload.storage.state_layout import ADAM_STATE, uniform_specs
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.fsutil import mounted_tmpfs
from tests.test_engine import MODELS, engine_train, fp32_bound, initial_state, lowp_bound, make_config

TIERS = [(p, o) for p in ("device", "cpu", "nvme") for o in ("cpu", "nvme")]
# (model, dtype): fp32 is compared with plain AdamW within its measured bound; bf16 on the edge model
# (frozen parameters, a parameter without gradient, a shared module) pins the parts of a
# shard the optimizer does not write, which an NVMe store writes whole.
CASES = [("gpt", "fp32"), ("edge", "bf16")]


def tier_config(path, param_tier="nvme", optimizer_tier="nvme", dtype="fp32", budget=1 << 30, **kw):
    uses = "nvme" in (param_tier, optimizer_tier)
    return make_config(
        dtype=dtype, gas=2, clip=0.05,
        offload=OffloadConfig(
            param_tier=param_tier, optimizer_tier=optimizer_tier,
            nvme_path=str(path) if uses else None, pinned_budget_bytes=budget,
        ),
        **kw,
    )


def swap_dir_is_gone(path) -> bool:
    return not os.path.exists(os.path.join(path, "offload-swap"))


# -- parity ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def baselines():
    return {
        case: engine_train(case[0], tier_config(None, "cpu", "cpu", case[1]))[0] for case in CASES
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("param_tier,optimizer_tier", TIERS)
def test_every_tier_combination_matches_adamw_world_size_1(
    param_tier, optimizer_tier, case, baselines, tmp_path
):
    model, dtype = case
    sd, info = engine_train(model, tier_config(tmp_path, param_tier, optimizer_tier, dtype))
    for k, v in baselines[case].items():
        assert torch.equal(sd[k], v), k
    if dtype == "fp32":
        fp32_bound(model, 2, 0.05).check(sd, f"{model} params {param_tier} optimizer {optimizer_tier}")
    assert swap_dir_is_gone(tmp_path)
    if "nvme" in (param_tier, optimizer_tier):
        assert info["memory"]["nvme"] > 0


def test_bf16_gpt_on_nvme_follows_the_reference(tmp_path):
    sd, _ = engine_train("gpt", tier_config(tmp_path, dtype="bf16"))
    lowp_bound("gpt", "bf16", 2, 0.05).check(sd, "bf16 gpt on nvme")


def test_fp16_overflow_skip_on_nvme_matches_memory(tmp_path):
    base, info0 = engine_train("gpt", tier_config(None, "cpu", "cpu", "fp16"), overflow_at=(3,))
    sd, info = engine_train("gpt", tier_config(tmp_path, dtype="fp16"), overflow_at=(3,))
    assert info["skipped"] == info0["skipped"] == 1
    for k in base:
        assert torch.equal(sd[k], base[k]), k


def test_meta_init_streams_units_to_nvme(tmp_path):
    # offload.init builds on meta; initialize materialises block by block and writes each
    # unit's state to NVMe as soon as its values are complete.
    cfg = tier_config(tmp_path, dtype="bf16")
    torch.manual_seed(0)
    with offload.init(cfg):
        model = TinyGPT()
    engine = offload.initialize(model, cfg)
    assert all(st.master is None for st in engine.states)
    sd, plain = engine.full_state_dict(), initial_state("gpt")
    for k in plain:
        assert torch.equal(sd[k], plain[k]), k
    engine.close()


def _ws2_tiers(rank: int, world_size: int, path: str):
    out = {}
    for case in CASES:
        out[(case, "cpu", "cpu")] = engine_train(case[0], tier_config(path, "cpu", "cpu", case[1]), rank, world_size)[0]
        for p, o in TIERS:
            if "nvme" in (p, o):
                out[(case, p, o)] = engine_train(case[0], tier_config(path, p, o, case[1]), rank, world_size)[0]
    return out


def test_every_tier_combination_matches_adamw_world_size_2(tmp_path):
    rank0, rank1 = run_distributed(_ws2_tiers, 2, str(tmp_path))
    assert all(v == {} for v in rank1.values())  # full_state_dict lands on rank 0
    for (case, p, o), sd in rank0.items():
        base = rank0[(case, "cpu", "cpu")]
        for k in base:
            assert torch.equal(sd[k], base[k]), (case, p, o, k)
        if case[1] == "fp32":
            fp32_bound(case[0], 2, 0.05).check(sd, f"ws2 {case[0]} params {p} optimizer {o}")
    assert swap_dir_is_gone(tmp_path)


# -- invariants ------------------------------------------------------------------------------


_VIOLATIONS: list = []


class _SlowAIO(offload.storage.nvme.AIOHandle):
    """Every block waits on its worker before it is issued, so writes stay in flight long
    enough for any read (or write) of the same bytes submitted without waiting for them to
    be caught: each submission is checked against the writes still in flight and an overlap
    is recorded in _VIOLATIONS. (The delay alone would not show it: this engine issues a
    worker's blocks in order, so an unordered read often still sees the new bytes.) A buffer
    reused before its write finished shows as wrong results instead."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, inject_delay_s=0.004)
        self._writes: list = []

    def pread(self, buf, path, offset=0, *, name=None):
        self._check("pread", buf, path, offset)
        return super().pread(buf, path, offset, name=name)

    def pwrite(self, buf, path, offset=0, *, name=None):
        self._check("pwrite", buf, path, offset)
        req = super().pwrite(buf, path, offset, name=name)
        self._writes.append((os.fspath(path), offset, buf.nbytes, req))
        return req

    def _check(self, op, buf, path, offset):
        self._writes = [w for w in self._writes if not w[3].done()]
        for p, o, n, _ in self._writes:
            if p == os.fspath(path) and o < offset + buf.nbytes and offset < o + n:
                _VIOLATIONS.append((op, os.path.basename(p), offset))


@pytest.fixture
def slow_io(monkeypatch):
    _VIOLATIONS.clear()
    monkeypatch.setattr(offload.storage.nvme, "AIOHandle", _SlowAIO)
    yield
    assert not _VIOLATIONS, f"submitted while a write of the same bytes was in flight: {_VIOLATIONS[:5]}"


def test_results_unchanged_with_io_delays(tmp_path, baselines, request):
    # A budget of two units' working sets: buffers are reused while writes are in flight.
    budget = 2 * _needed_bytes(tmp_path, MODELS["edge"]())
    request.getfixturevalue("slow_io")
    sd, _ = engine_train("edge", tier_config(tmp_path, dtype="bf16", budget=budget))
    for k, v in baselines[("edge", "bf16")].items():
        assert torch.equal(sd[k], v), k


def test_nvme_tier_fetch_waits_for_the_write_in_flight(tmp_path, slow_io):
    from offload.storage.nvme import NVMeContext
    from offload.storage.nvme_tier import NVMeTier

    ctx = NVMeContext(str(tmp_path), 0, budget_bytes=1 << 20, block_size=4096, queue_depth=4, threads=2)
    ctx.aio.close()
    ctx.aio = _SlowAIO(4096, 4, 2)
    try:
        tier = NVMeTier(ctx, [("a", 8192, torch.bfloat16), ("b", 2048, torch.float32)])
        assert tier.view("a") is None and "a" in tier and tier.bytes_allocated() == 16384 + 8192
        with pytest.raises(RuntimeError, match="never written"):
            tier.fetch("a", torch.empty(8192, dtype=torch.bfloat16))
        first = torch.randn(8192).bfloat16()
        second = torch.randn(8192).bfloat16()
        tier.store("a", first)  # staged (an unaligned tensor); not waited for
        h = tier.store("a", second)  # ordered after the first write
        out = torch.empty(8192, dtype=torch.bfloat16)
        tier.fetch("a", out).wait()  # waits for the write before reading
        assert torch.equal(out, second) and h.done()
        with pytest.raises(ValueError, match="must match"):
            tier.store("b", torch.zeros(2048, dtype=torch.bfloat16))
    finally:
        ctx.close()
    assert swap_dir_is_gone(tmp_path)


def test_optimizer_state_read_waits_for_the_write_in_flight(tmp_path, slow_io):
    from offload.storage.nvme import NVMeContext
    from offload.storage.optim_state import NVMeOptimizerStates

    ctx = NVMeContext(str(tmp_path), 0, budget_bytes=1 << 20, block_size=4096, queue_depth=4, threads=2)
    ctx.aio.close()
    ctx.aio = _SlowAIO(4096, 4, 2)
    try:
        states = NVMeOptimizerStates(ctx, [(4096, 3000), (2048, 0)])
        with pytest.raises(RuntimeError, match="never written"):
            with states.open(0):
                pass
        for round_ in range(3):
            master = torch.randn(4096)
            states.initialize(0, master)  # write in flight
            with states.open(0, write=True) as t:  # reads after it
                assert torch.equal(t.master, master) and not t.exp_avg.any()
                t.exp_avg.fill_(float(round_ + 1))
            with states.open(0) as t:  # reads after the write-back
                assert torch.equal(t.master, master)
                assert torch.equal(t.exp_avg, torch.full((3000,), float(round_ + 1)))
        ctx.staging.drain()
        assert ctx.staging.pool.bytes_in_use == 0
    finally:
        ctx.close()
    assert swap_dir_is_gone(tmp_path)


def _needed_bytes(path, model) -> int:
    with pytest.raises(ValueError, match=r"pinned_budget_bytes=4096 is too small for one unit") as e:
        offload.initialize(model, tier_config(path, dtype="bf16", budget=4096))
    return int(re.search(r"needs (\d+) bytes", str(e.value)).group(1))


def test_pinned_use_stays_within_a_budget_several_times_smaller_than_the_state(tmp_path):
    make = lambda: TinyGPT(d_model=64, n_layer=6)  # noqa: E731
    torch.manual_seed(0)
    budget = _needed_bytes(tmp_path, make())  # exactly one unit's working set
    assert swap_dir_is_gone(tmp_path)
    cfg = tier_config(tmp_path, dtype="bf16", budget=budget)
    torch.manual_seed(0)
    engine = offload.initialize(make(), cfg)
    state_bytes = engine.optimizer_states.bytes_on_disk()
    assert state_bytes > 4 * budget, (state_bytes, budget)
    ref_cfg = tier_config(None, "cpu", "cpu", dtype="bf16")
    torch.manual_seed(0)
    ref = offload.initialize(make(), ref_cfg)
    for x, y in gpt_batches(4):
        for e in (engine, ref):
            e.backward(e(x, y))
            e.step()
    pool = engine.nvme.staging.pool
    assert 0 < pool.peak_bytes_in_use <= budget and pool.bytes_reserved <= budget
    a, b = engine.full_state_dict(), ref.full_state_dict()
    for k in b:
        assert torch.equal(a[k], b[k]), k
    engine.close()
    assert swap_dir_is_gone(tmp_path)


def test_unit_state_round_trip_on_the_nvme_optimizer_tier(tmp_path, slow_io):
    # Slow I/O: the read right after load_unit_state's write-through must wait for it.
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), tier_config(tmp_path, "cpu", "nvme", dtype="bf16"))
    torch.manual_seed(0)
    ref = offload.initialize(TinyGPT(), tier_config(None, "cpu", "cpu", dtype="bf16"))
    x, y = gpt_batches(1)[0]
    for e in (engine, ref):
        e.backward(e(x, y))
        e.step()
    opt, staging = engine.optimizer, engine.nvme.staging
    assert all(st.master is None and st.exp_avg is None for st in engine.states)
    for st in engine.states:
        i = st.unit.index
        staging.drain()
        with opt.unit_state(i) as s, ref.optimizer.unit_state(i) as r:
            assert staging.pool.bytes_in_use > 0  # read into a pooled buffer
            for name in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(s[name], r[name]), (i, name)
            assert s["slot_steps"] == r["slot_steps"]
        assert staging.pool.bytes_in_use == 0  # and released on exit
    index = engine.states[-1].unit.index
    with opt.unit_state(index) as s:
        saved = {k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in s.items()}
    before = engine.full_state_dict()
    opt.load_unit_state(index, dict(saved, master=saved["master"] + 1.0, exp_avg=saved["exp_avg"] * 2))
    with opt.unit_state(index) as s:  # written through to the swap file
        assert torch.equal(s["master"], saved["master"] + 1.0)
        assert torch.equal(s["exp_avg"], saved["exp_avg"] * 2)
        assert torch.equal(s["exp_avg_sq"], saved["exp_avg_sq"])
    after = engine.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "parameters republished"
    with pytest.raises(ValueError, match="saved shape"):
        opt.load_unit_state(index, dict(saved, exp_avg=saved["exp_avg"][:-1]))
    engine.close()
    ref.close()


def test_memory_bytes_counts_swap_files_and_the_pinned_pool(tmp_path):
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), tier_config(tmp_path, dtype="bf16"))
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    mem = engine.memory_bytes()
    swap = os.path.join(tmp_path, "offload-swap")
    on_disk = sum(os.path.getsize(os.path.join(swap, f)) for f in os.listdir(swap) if f.endswith(".swap"))
    assert mem["nvme"] == on_disk > 0
    assert mem["pinned"] == engine.nvme.staging.pool.bytes_reserved > 0
    # host: only the fp32 gradient shards (master, moments and parameters are on disk)
    assert mem["host"] == sum(st.grad.numel() * 4 for st in engine.states)
    stats = engine.io_stats()
    assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0
    engine.close()


# -- errors at initialize ----------------------------------------------------------------------


def test_missing_nvme_path_is_created_as_deepspeed_creates_its_swap_folder(tmp_path, caplog):
    # its parent must exist (a missing one is a mistyped mount point: tests/test_user_warnings.py)
    missing = tmp_path / "swap"
    with caplog.at_level("INFO", logger="offload.storage.swap"):
        engine = offload.initialize(TinyGPT(), tier_config(missing))
    assert missing.is_dir() and f"created offload.nvme_path {missing}" in caplog.text
    engine.close()


def test_nvme_path_on_tmpfs_warns_that_the_disk_is_memory(tmp_path):
    """A swap directory on tmpfs took RAM with no word said (issue #36)."""
    from offload.storage.swap import MEMORY_FILESYSTEMS, MemoryBackedSwapWarning, filesystem_type
    with mounted_tmpfs("64m") as mnt:
        assert filesystem_type(mnt) == "tmpfs" and filesystem_type(os.path.join(mnt, "a", "b")) == "tmpfs"
        with pytest.warns(MemoryBackedSwapWarning) as caught:
            offload.initialize(TinyGPT(), tier_config(mnt)).close()
        assert len(caught) == 1
        assert str(caught[0].message).startswith(
            f"offload.nvme_path {mnt!r} is on a tmpfs filesystem, which keeps its files in host memory")
    if filesystem_type(str(tmp_path)) not in MEMORY_FILESYSTEMS:  # pytest's tmp dir on a disk
        with warnings.catch_warnings():
            warnings.simplefilter("error", MemoryBackedSwapWarning)
            offload.initialize(TinyGPT(), tier_config(tmp_path)).close()


def test_nvme_path_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "swap"  # under a file: ENOTDIR
    with pytest.raises(OSError, match=r"offload.nvme_path .*cannot be created \(ENOTDIR"):
        offload.initialize(TinyGPT(), tier_config(bad))


def test_read_only_nvme_path_is_a_clear_error():
    with mounted_tmpfs("1m", read_only=True) as ro:
        with pytest.raises(OSError, match="is not writable \\(EROFS") as e:
            offload.initialize(TinyGPT(), tier_config(ro))
        assert e.value.errno == errno.EROFS


def test_disk_too_small_names_the_numbers():
    with mounted_tmpfs("256k") as small:
        with pytest.raises(OSError, match=r"not enough free space for the swap files.*needs .*bytes.*free") as e:
            offload.initialize(TinyGPT(d_model=64), tier_config(small))
        assert e.value.errno == errno.ENOSPC
        assert not os.listdir(small), "nothing created"


def test_budget_too_small_names_the_bytes_needed(tmp_path):
    needed = _needed_bytes(tmp_path, TinyGPT())
    assert needed % 4096 == 0 and needed > 4096
    assert swap_dir_is_gone(tmp_path)


# -- clean exit and stale files ------------------------------------------------------------------


def test_swap_files_removed_by_close_with_and_finalizer(tmp_path):
    engine = offload.initialize(TinyGPT(), tier_config(tmp_path))
    assert not swap_dir_is_gone(tmp_path)
    engine.close()
    engine.close()  # idempotent
    assert swap_dir_is_gone(tmp_path)
    with offload.initialize(TinyGPT(), tier_config(tmp_path)) as engine:
        x, y = gpt_batches(1)[0]
        engine.backward(engine(x, y))
        engine.step()
    assert swap_dir_is_gone(tmp_path)
    engine = offload.initialize(TinyGPT(), tier_config(tmp_path))
    del engine
    gc.collect()
    assert swap_dir_is_gone(tmp_path)


def test_stale_swap_file_of_a_crashed_run_is_not_read(tmp_path, baselines):
    swap = tmp_path / "offload-swap"
    swap.mkdir()
    (swap / "rank0.optim.swap").write_bytes(b"\xff" * (1 << 20))  # no live lock holds it
    (swap / "rank0.param.swap").write_bytes(b"\xff" * (1 << 20))
    sd, _ = engine_train("gpt", tier_config(tmp_path))
    for k, v in baselines[("gpt", "fp32")].items():
        assert torch.equal(sd[k], v), k
    assert swap_dir_is_gone(tmp_path)


def _train_gpt_with_hook(cfg, hook_module: str, hook) -> dict:
    """engine_train("gpt", cfg), with `hook(micro_batch_index)` run in a forward pre-hook of
    `hook_module` (the same weights, batches and order as engine_train)."""
    torch.manual_seed(0)
    m = MODELS["gpt"]()
    engine = offload.initialize(m, cfg)
    step = [0]
    m.get_submodule(hook_module).register_forward_pre_hook(lambda *_: hook(step[0]))
    for x, y in gpt_batches(20):
        engine.backward(engine(x, y))
        engine.step()
        step[0] += 1
    sd = engine.full_state_dict()
    engine.close()
    return sd


def test_swap_files_deleted_or_replaced_mid_step_lose_nothing(tmp_path, baselines, caplog):
    """Another program deletes both swap files in the middle of a step's forward (after
    blocks.0's shard was read, before blocks.1's), and later replaces them with files of its
    own: training goes on through the held descriptors bit for bit, the warning names each
    file once, and close() deletes neither foreign file ([Note: held swap file])."""
    swap = tmp_path / "offload-swap"
    names = ("rank0.param.swap", "rank0.optim.swap")

    def meddle(i: int) -> None:
        if i == 5:
            for n in names:
                os.unlink(swap / n)
        if i == 11:
            for n in names:
                (swap / n).write_bytes(b"not offload's")

    with caplog.at_level("WARNING", logger="offload"):
        sd = _train_gpt_with_hook(tier_config(tmp_path), "blocks.1", meddle)
    for k, v in baselines[("gpt", "fp32")].items():
        assert torch.equal(sd[k], v), k
    warned = [r.getMessage() for r in caplog.records if "deleted or replaced" in r.getMessage()]
    assert len(warned) == 2 and all(any(n in w for w in warned) for n in names), warned
    for n in names:  # the foreign files are not offload's to delete
        assert (swap / n).read_bytes() == b"not offload's"


_CRASH_SCRIPT = """
import os, signal, sys
from offload.storage.swap import SwapDirectory
from tests.conftest import TinyGPT
from tests.test_nvme import tier_config
import offload
if sys.argv[2] == "engine":
    engine = offload.initialize(TinyGPT(d_model=64), tier_config(sys.argv[1]))
else:  # ranks of a larger run: their locks and swap files, as their engines would leave them
    dirs = [SwapDirectory(sys.argv[1], int(r)) for r in sys.argv[2].split(",")]
    for d in dirs:
        d.create("optim", [1 << 16])
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _crash(path: str, who: str) -> None:
    """A real process that sets up its swap files under `path` and dies by SIGKILL."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, path, who], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root}, cwd=root, timeout=120)
    assert proc.returncode == -9 and "ready" in proc.stdout, proc.stderr[-3000:]


def test_restart_after_kill_9_on_a_disk_the_stale_files_fill(tmp_path):
    """A run killed by SIGKILL leaves its swap files (more than half the disk here): the
    next run on the same nvme_path must count them as space it is about to free, delete
    them, and start (not fail its free-space check with ENOSPC)."""
    probe = offload.initialize(TinyGPT(d_model=64), tier_config(tmp_path))
    need = probe.memory_bytes()["nvme"]
    probe.close()
    size_kib = (need * 3 // 2) // 1024 + 64  # room for one run's files, not for two
    with mounted_tmpfs(f"{size_kib}k") as disk:
        _crash(disk, "engine")
        stale = os.listdir(os.path.join(disk, "offload-swap"))
        assert "rank0.optim.swap" in stale and "rank0.param.swap" in stale
        assert shutil.disk_usage(disk).free < need  # the stale files leave too little
        engine = offload.initialize(TinyGPT(d_model=64), tier_config(disk))
        x, y = gpt_batches(1)[0]
        engine.backward(engine(x, y))
        engine.step()
        engine.close()
        assert swap_dir_is_gone(disk)


def test_a_smaller_restart_removes_the_stale_files_of_every_dead_rank(tmp_path):
    """World size 2 crashed, world size 1 restarts: rank 1's files go too (its lock is
    free); the files of a rank whose run is alive stay."""
    from offload.storage.swap import SwapDirectory

    live = SwapDirectory(str(tmp_path), 3)  # a live run's rank 3 (this process holds its lock)
    live.create("optim", [4096])
    _crash(str(tmp_path), "1,2")
    swap = tmp_path / "offload-swap"
    assert {"rank1.optim.swap", "rank2.optim.swap", "rank3.optim.swap"} <= set(os.listdir(swap))
    engine = offload.initialize(TinyGPT(), tier_config(tmp_path))
    left = set(os.listdir(swap))
    assert "rank1.optim.swap" not in left and "rank2.optim.swap" not in left, left
    assert "rank1.lock" not in left and "rank3.optim.swap" in left and "rank3.lock" in left, left
    engine.close()
    live.close()
    assert swap_dir_is_gone(tmp_path)


def test_an_engine_dropped_without_close_is_released(tmp_path):
    """The hooks on a model the user keeps do not keep its engine alive: dropping the
    engine frees its swap files and lock, and a new engine on the same nvme_path starts."""
    import weakref

    model = TinyGPT()
    engine = offload.initialize(model, tier_config(tmp_path))
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None, "something still holds the engine"
    assert swap_dir_is_gone(tmp_path)
    assert not model._forward_pre_hooks and not model._forward_hooks  # its hooks went with it
    again = offload.initialize(TinyGPT(), tier_config(tmp_path))
    again.backward(again(x, y))
    again.step()
    again.close()


def test_an_io_error_fails_its_step_and_a_checkpoint_load_recovers(tmp_path):
    """A real EFBIG (RLIMIT_FSIZE, as `ulimit -f`) fails the swap writes of one step: the
    error is raised once, by the step that hit it; afterwards forward, step and save say
    that state was lost and what to do (not the old I/O error again); load_checkpoint
    restores a consistent state and training goes on exactly as from that checkpoint."""
    import resource
    import signal

    from offload.engine import EngineState

    batches = gpt_batches(10)

    def train(engine, part):
        for x, y in part:
            engine.backward(engine(x, y))
            engine.step()

    os.makedirs(tmp_path / "a")
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), tier_config(tmp_path / "a"))
    train(engine, batches[:4])
    ckpt = engine.save_checkpoint(str(tmp_path / "ck"))
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(OSError) as failed:
            train(engine, batches[4:6])  # and the first forward after it, where a write surfaces
            train(engine, batches[6:7])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert failed.value.errno == errno.EFBIG and "rank0." in str(failed.value)
    x, y = batches[6]
    for what, call in (("the model's forward", lambda: engine(x, y)), ("engine.step", engine.step),
                       ("engine.save_checkpoint", lambda: engine.save_checkpoint(str(tmp_path / "ck2")))):
        with pytest.raises(RuntimeError, match=f"{re.escape(what)}: an earlier optimizer step or backward failed part-way "
                           r"\(OSError: \[Errno 27\].*load_checkpoint"):
            call()
    assert engine.state is EngineState.FAILED
    path, _ = engine.load_checkpoint(str(tmp_path / "ck"))
    assert path == ckpt and engine.state is EngineState.READY
    train(engine, batches[4:])
    got = engine.full_state_dict()
    engine.close()

    os.makedirs(tmp_path / "b")
    torch.manual_seed(1)
    fresh = offload.initialize(TinyGPT(), tier_config(tmp_path / "b"))
    fresh.load_checkpoint(str(tmp_path / "ck"))
    train(fresh, batches[4:])
    want = fresh.full_state_dict()
    fresh.close()
    for k in want:
        assert torch.equal(got[k], want[k]), k


_SIGNAL_SCRIPT = """
import signal, sys, time
import offload
from tests.conftest import TinyGPT, gpt_batches
from tests.test_nvme import tier_config
# as a process started from a terminal: the default dispositions (a parent such as nohup or
# a CI runner may have left SIGHUP ignored, and an ignored signal is left alone)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
if sys.argv[2] == "own-handler":
    signal.signal(signal.SIGTERM, lambda *a: (print("own handler", flush=True), sys.exit(0)))
engine = offload.initialize(TinyGPT(), tier_config(sys.argv[1]))
x, y = gpt_batches(1)[0]
engine.backward(engine(x, y))
engine.step()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig,handler", [("SIGTERM", "default"), ("SIGHUP", "default"), ("SIGTERM", "own-handler")])
def test_a_signal_that_ends_the_run_leaves_no_swap_file_or_lock(tmp_path, sig, handler):
    """torchrun sends SIGTERM to the surviving ranks when one fails; a closed terminal sends
    SIGHUP. The process still dies of the signal (same exit status), and its swap files and
    lock are gone. A SIGTERM handler of the user's own is kept, not replaced."""
    import signal as signal_mod
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _SIGNAL_SCRIPT, str(tmp_path), handler],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        assert os.path.exists(tmp_path / "offload-swap" / "rank0.optim.swap")
        proc.send_signal(getattr(signal_mod, sig))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()  # ours, started above
    if handler == "default":
        assert proc.returncode == -getattr(signal_mod, sig), err[-3000:]
    else:
        assert proc.returncode == 0 and "own handler" in out, err[-3000:]
    assert swap_dir_is_gone(tmp_path), os.listdir(tmp_path / "offload-swap")


def test_a_close_that_cannot_delete_its_files_says_so_and_releases_the_lock(tmp_path):
    """chattr +i on the swap directory (a real EPERM on unlink): close() names the files it
    could not delete, yet releases the lock; the next run deletes the leftovers."""
    import fcntl
    import subprocess

    engine = offload.initialize(TinyGPT(), tier_config(tmp_path))
    swap = tmp_path / "offload-swap"
    r = subprocess.run(["chattr", "+i", str(swap)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i is not possible here ({r.stderr.strip()}): needs root on ext4/xfs")
    try:
        with pytest.raises(OSError, match=r"could not delete .*rank0\.param\.swap.*the lock is released"):
            engine.close()
        fd = os.open(swap / "rank0.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: raises if still held
        finally:
            os.close(fd)
    finally:
        subprocess.run(["chattr", "-i", str(swap)], check=True)
    engine.close()  # idempotent
    again = offload.initialize(TinyGPT(), tier_config(tmp_path))
    again.close()
    assert swap_dir_is_gone(tmp_path)


def test_a_relative_nvme_path_survives_a_chdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("swap")
    engine = offload.initialize(TinyGPT(), tier_config("swap"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
    assert swap_dir_is_gone(tmp_path / "swap")


def test_a_timeline_path_in_a_missing_directory_fails_at_initialize(tmp_path, caplog):
    from offload.config import TimelineConfig

    bad = tmp_path / "no" / "such" / "trace.json"
    cfg = make_config(timeline=TimelineConfig(enabled=True, path=str(bad)))
    with pytest.raises(FileNotFoundError, match=r"timeline.path .*trace\.json.*does not exist; create it"):
        offload.initialize(TinyGPT(), cfg)
    # a directory that goes away mid-run: the step stands, the trace stops, one warning
    (tmp_path / "gone").mkdir()
    cfg = make_config(timeline=TimelineConfig(enabled=True, path=str(tmp_path / "gone" / "t.json")))
    engine = offload.initialize(TinyGPT(), cfg)
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    shutil.rmtree(tmp_path / "gone")
    with caplog.at_level("WARNING", logger="offload"):
        for _ in range(2):
            engine.backward(engine(x, y))
            engine.step()
    assert engine.global_steps == 3
    assert sum("could not be written" in r.getMessage() for r in caplog.records) == 1


def test_a_model_whose_nvme_engine_was_closed_says_how_to_get_its_weights_back(tmp_path):
    """With param_tier='nvme' the closed engine took the weights with it: the model's
    forward and a new initialize say so and how to restore them; the recipe works."""
    model = TinyGPT()
    engine = offload.initialize(model, tier_config(tmp_path, "nvme", "cpu"))
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    sd = engine.full_state_dict()
    engine.close()
    with pytest.raises(RuntimeError, match=r"belong to an offload engine that was closed.*to_empty"):
        model(x, y)
    with pytest.raises(ValueError, match=r"hold no data: an offload engine that kept them on NVMe was closed"):
        offload.initialize(model, tier_config(tmp_path, "cpu", "cpu"))
    model.to_empty(device="cpu")
    model.load_state_dict(sd)
    assert model.lm_head.weight is model.wte.weight
    again = offload.initialize(model, tier_config(tmp_path, "cpu", "cpu"))
    assert all(torch.equal(v, sd[k]) for k, v in again.full_state_dict().items())
    again.close()


# -- layout -----------------------------------------------------------------------------------


def test_state_layout_puts_each_tensor_on_a_page_and_moves_in_whole_pages():
    lay = state_layout(2048, 1000, uniform_specs(ADAM_STATE, torch.float32))
    assert (lay.exp_avg_offset, lay.exp_avg_sq_offset, lay.nbytes) == (8192, 12288, 16384)
    lay = state_layout(4096, 0, uniform_specs(ADAM_STATE, torch.bfloat16))
    assert (lay.exp_avg_offset, lay.exp_avg_sq_offset, lay.nbytes) == (16384, 16384, 16384)
    with pytest.raises(ValueError):
        state_layout(-1, 0)


def test_held_files_read_a_deleted_file_and_close_with_the_last_reference(tmp_path):
    """[Note: held files]: a held file reads through its descriptor (O_DIRECT) after it was
    deleted and after a new file took its name; the last release closes the descriptor
    (on the closer thread), and only then are its blocks freed."""
    from offload.storage.io import AIOHandle, aligned_empty
    from offload.storage.nvme import HeldFiles

    path = str(tmp_path / "shard.bin")
    data = aligned_empty(1 << 20)
    data.random_(0, 255)
    with AIOHandle() as aio:
        aio.pwrite(data, path, 0).wait()
        held = HeldFiles()
        held.hold(path)
        held.hold(path)
        os.unlink(path)
        aio.pwrite(torch.zeros_like(data), path, 0).wait()  # another file, same name
        got = aligned_empty(1 << 20)
        req = aio.pread(got, held.read_path(path), 0)
        req.wait()
        assert torch.equal(got, data) and req.direct
        fd = int(held.read_path(path).rsplit("/", 1)[1])
        held.release(path)
        assert held.held() == [path] and os.path.exists(f"/proc/self/fd/{fd}")
        target = os.readlink(f"/proc/self/fd/{fd}")
        held.release(path)
        held.settle()
        assert held.held() == []
        assert not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}") != target
        with pytest.raises(KeyError):
            held.read_path(path)
        held.close()
