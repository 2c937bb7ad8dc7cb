"""The memory planner's figures are the engine's, and it recommends the right placement.

The backbone: for several models (tied and untied TinyGPT, frozen parameters, param groups),
dtypes, moment dtypes and parameter tiers, `plan(...)`'s bytes per tier equal what
`Engine.memory_bytes()` reports after a training step, exactly (world size 1 in process,
world size 2 in two real processes: the largest rank and the node's sum). The planner is
given a copy of the model built on the meta device, so it never reads a value.
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
import re

import pytest
import torch
from torch import nn

import offload
import offload.plan.cli as cli_mod
import offload.plan.machine as machine_mod
import offload.plan.planner as plan_mod
from offload.config import Config, ConfigError, OffloadConfig
from offload.plan import Machine, make_machine, plan
from offload.sizes import parse_bytes, parse_count
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.scripts import run_python

GiB, TiB = 1 << 30, 1 << 40


def cpu_machine(world_size: int = 1) -> Machine:
    return make_machine(gpus=0, cpu_mem="64GiB", world_size=world_size)


def frozen_gpt() -> nn.Module:
    m = TinyGPT(n_layer=3)
    m.wpe.weight.requires_grad_(False)
    m.blocks[0].requires_grad_(False)          # a unit with no trainable parameter
    m.blocks[1].fc.requires_grad_(False)       # frozen parameters inside a trained unit
    return m


MODELS = {
    "gpt": lambda: TinyGPT(),
    "gpt_untied_wide": lambda: TinyGPT(d_model=48, n_layer=3, n_head=4, tie=False),
    "gpt_frozen": frozen_gpt,
    # units of several MiB: master and moments on page-aligned allocations (host_state_zeros)
    "gpt_large_units": lambda: TinyGPT(d_model=256, n_layer=1, n_head=4),
}


def on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return MODELS[name]()


def config(dtype: str, moments: str = "fp32", param_tier: str = "cpu", optimizer_tier: str = "cpu",
           nvme_path=None) -> Config:
    return Config(compute_device="cpu",
                  offload=OffloadConfig(param_tier=param_tier, optimizer_tier=optimizer_tier,
                                        nvme_path=nvme_path),
                  precision={"dtype": dtype}, optimizer={"moments_dtype": moments})


def check(est, measured: dict, pinned_upper_bound: bool = False) -> None:
    """The planner's TierBytes equal the engine's memory_bytes(). An engine without the NVMe
    tier reports no 'pinned' key (its pool does not exist); the pool may hold less than its
    budget, which is what the planner reports, so with NVMe it is an upper bound."""
    want, got = est.as_dict(), {"pinned": 0, **measured}
    if pinned_upper_bound:
        assert got.pop("pinned") <= want.pop("pinned")
    assert want == got


def train_one_step(engine, rank: int = 0, world_size: int = 1) -> None:
    for x, y in gpt_batches(1, seq=16, vocab=64):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()


# -- the planner's figures are the engine's ------------------------------------------------


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("dtype,moments", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"),
                                           ("fp16", "fp32"), ("bf16", "8bit")])
@pytest.mark.parametrize("param_tier", ["device", "cpu"])
def test_plan_equals_engine_memory_bytes(model, dtype, moments, param_tier):
    cfg = config(dtype, moments, param_tier)
    torch.manual_seed(0)
    engine = offload.initialize(MODELS[model](), cfg)
    train_one_step(engine)
    measured = engine.memory_bytes()
    est = plan(on_meta(model), machine=cpu_machine(), config=cfg).estimate(param_tier, "cpu")
    check(est.per_rank, measured)
    check(est.per_node, measured)  # one rank on the node
    engine.close()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("param_tier", ["device", "cpu"])
def test_plan_equals_engine_memory_bytes_cuda(dtype, param_tier):
    # On a GPU: shards in GPU memory (device tier) or pinned host memory, the optimizer's
    # low-precision staging buffer for GPU-resident shards, gradients pinned.
    cfg = Config(compute_device="cuda", offload=OffloadConfig(param_tier=param_tier),
                 precision={"dtype": dtype})
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=3), cfg)
    train_one_step(engine)
    machine = make_machine(gpus=1, gpu_mem=torch.cuda.get_device_properties(0).total_memory,
                           cpu_mem="64GiB")
    with torch.device("meta"):
        meta = TinyGPT(n_layer=3)
    est = plan(meta, machine=machine, config=cfg).estimate(param_tier, "cpu")
    check(est.per_rank, engine.memory_bytes())
    engine.close()


@pytest.mark.cuda
def test_gpu_free_memory_counts_the_allocators_cached_blocks():
    """Issue #30, F6: memory torch's caching allocator keeps after a free is this process's
    to use; the driver reports it used, so `initialize` saw that much less GPU memory."""
    from offload.plan.machine import gpu_free_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    before = gpu_free_bytes(device)
    block = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    assert gpu_free_bytes(device) < before - (1 << 29)  # in use: not free
    del block  # cached by the allocator, not returned to the driver
    driver_free, _ = torch.cuda.mem_get_info(device)
    assert driver_free < before - (1 << 29)  # the driver still counts it used (the old figure)
    assert gpu_free_bytes(device) >= before - (64 << 20)
    cfg = Config(compute_device="cuda")
    assert machine_mod.machine_from_system(cfg, device, 1).gpu_mem_bytes >= before - (64 << 20)


def test_plan_honours_param_groups_like_initialize():
    # Groups change the layout (group order, alignment between groups) and a parameter in no
    # group gets no moments: the planner takes the same `optimizer=` as initialize.
    cfg = config("bf16")

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.dim() < 2 and "ln_f" not in n]
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    torch.manual_seed(0)
    m = TinyGPT(n_layer=3)
    engine = offload.initialize(m, cfg, optimizer=groups(m))
    train_one_step(engine)
    with torch.device("meta"):
        meta = TinyGPT(n_layer=3)
    est = plan(meta, machine=cpu_machine(), config=cfg, optimizer=groups(meta)).estimate("cpu", "cpu")
    check(est.per_rank, engine.memory_bytes())
    engine.close()


def _ws2_memory(rank: int, world_size: int, dtype: str, param_tier: str, stage: int = 3):
    cfg = dataclasses.replace(config(dtype, "fp32", param_tier), zero_stage=stage)
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=3), cfg)
    resident = engine.memory_bytes()["device"]
    peak = [0]

    def sample(*_):  # inside a block's forward: the block and the root are gathered
        peak[0] = max(peak[0], engine.memory_bytes()["device"])

    for blk in engine.module.blocks:
        blk.ln1.register_forward_pre_hook(sample)
    train_one_step(engine, rank, world_size)
    out = engine.memory_bytes(), peak[0] - resident
    engine.close()
    return out


@pytest.mark.parametrize("dtype,param_tier", [("bf16", "cpu"), ("fp32", "device")])
def test_plan_equals_engine_memory_bytes_world_size_2(dtype, param_tier):
    (m0, gathered0), (m1, gathered1) = run_distributed(_ws2_memory, 2, dtype, param_tier,
                                                       init_group=False)
    with torch.device("meta"):
        meta = TinyGPT(n_layer=3)
    est = plan(meta, machine=cpu_machine(world_size=2), config=config(dtype, "fp32", param_tier)
               ).estimate(param_tier, "cpu")
    assert m0 != m1  # the last rank's moments cover less (padding): the ranks really differ
    check(est.per_rank, {k: max(m0[k], m1[k]) for k in m0})
    check(est.per_node, {k: m0[k] + m1[k] for k in m0})
    # The working-set estimate covers what the engine gathered during forward.
    assert 0 < max(gathered0, gathered1) <= est.working_device_bytes


def _ws2_peak(rank: int, world_size: int, dtype: str, param_tier: str, n_layer: int):
    """The engine's gathered bytes at their peak over forward and backward (sampled inside
    every block, both ways), above what it holds between steps."""
    cfg = config(dtype, "fp32", param_tier)
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=n_layer), cfg)
    resident = engine.memory_bytes()["device"]
    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], engine.memory_bytes()["device"])

    for blk in engine.module.blocks:
        for sub in (blk.ln1, blk.ln2):
            sub.register_forward_pre_hook(sample)
            sub.register_full_backward_pre_hook(sample)
    train_one_step(engine, rank, world_size)
    train_one_step(engine, rank, world_size)  # the second follows the trace: prefetch and keep
    engine.close()
    return peak[0] - resident


@pytest.mark.parametrize("dtype,param_tier", [("bf16", "cpu"), ("fp32", "device")])
def test_working_set_covers_what_prefetch_and_keep_hold(dtype, param_tier):
    """Issue #30, F6: the planner's working set counts the units kept gathered from forward
    to backward (`keep_bytes`) and the next unit gathered ahead, so it bounds the peak the
    engine reaches over a whole step; without them (the old estimate) it falls short."""
    n_layer = 12  # more kept blocks than the old estimate's gradients and reduce buffer cover
    gathered = max(run_distributed(_ws2_peak, 2, dtype, param_tier, n_layer, init_group=False))
    with torch.device("meta"):
        meta = TinyGPT(n_layer=n_layer)
    cfg = config(dtype, "fp32", param_tier)
    est = plan(meta, machine=cpu_machine(world_size=2), config=cfg).estimate(param_tier, "cpu")
    assert 0 < gathered <= est.working_device_bytes
    no_prefetch = dataclasses.replace(cfg, prefetch={"prefetch_bytes": 0, "keep_bytes": 0})
    old = plan(meta, machine=cpu_machine(world_size=2), config=no_prefetch).estimate(param_tier, "cpu")
    assert old.working_device_bytes < gathered  # negative control: what the old estimate said


@pytest.mark.parametrize("dtype,param_tier", [("bf16", "cpu"), ("fp32", "device")])
def test_plan_equals_engine_memory_bytes_at_stage_2(dtype, param_tier):
    """ZeRO stage 2: the planner adds every unit's full buffer, resident on the compute
    device, and that is what the engine holds after a step (world size 2, where the stage
    matters)."""
    (m0, _), (m1, _) = run_distributed(_ws2_memory, 2, dtype, param_tier, 2, init_group=False)
    with torch.device("meta"):
        meta = TinyGPT(n_layer=3)
    cfg = dataclasses.replace(config(dtype, "fp32", param_tier), zero_stage=2)
    est = plan(meta, machine=cpu_machine(world_size=2), config=cfg).estimate(param_tier, "cpu")
    check(est.per_rank, {k: max(m0[k], m1[k]) for k in m0})
    stage3 = plan(meta, machine=cpu_machine(world_size=2), config=config(dtype, "fp32", param_tier)
                  ).estimate(param_tier, "cpu")
    assert est.per_rank.device > stage3.per_rank.device  # the resident model: negative control


@pytest.mark.parametrize("param_tier,optimizer_tier", [("nvme", "cpu"), ("device", "nvme"),
                                                       ("cpu", "nvme"), ("nvme", "nvme")])
def test_plan_equals_engine_memory_bytes_nvme(tmp_path, param_tier, optimizer_tier):
    cfg = config("bf16", "fp32", param_tier, optimizer_tier, nvme_path=str(tmp_path))
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), cfg)
    train_one_step(engine)
    machine = make_machine(gpus=0, cpu_mem="64GiB", nvme_free="1TiB")
    est = plan(on_meta("gpt"), machine=machine, config=cfg).estimate(param_tier, optimizer_tier)
    check(est.per_rank, engine.memory_bytes(), pinned_upper_bound=True)
    engine.close()


# -- bytes per parameter for a bare count ----------------------------------------------------


def test_count_plan_bytes_per_parameter_match_the_design_numbers():
    # DESIGN.md: bf16 param 2 B, fp32 grad 4, master 4, moments 8 -> 18 B/param in host
    # memory with params on the host; padding adds < 0.1% at this size.
    n = 10**9
    cpu = make_machine(gpus=0, cpu_mem="1TiB")
    p = plan(n, machine=cpu, dtype="bf16", config={"gradient_clipping": 1.0})
    host = p.estimate("cpu", "cpu").per_rank.host
    assert 18 * n <= host < 18 * n * 1.001
    # The default non-finite guard runs the updates at step(): the gradient shards are held,
    # 18 B/param too. Without clipping and with the guard off a CPU run updates each unit
    # during backward and holds no fp32 gradient shard between steps
    # (offload.optim.sharded.transient_grad_shards): 14 B/param.
    e = plan(n, machine=cpu, dtype="bf16").estimate("cpu", "cpu")
    assert 18 * n <= e.per_rank.host < 18 * n * 1.001
    p = plan(n, machine=cpu, dtype="bf16", config={"nonfinite_loss": "off"})
    e = p.estimate("cpu", "cpu")
    assert 14 * n <= e.per_rank.host < 14 * n * 1.001
    p = plan(n, machine=make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="1TiB"), dtype="bf16",
             moments="bf16", units=100)
    e = p.estimate("device", "cpu")
    assert 2 * n <= e.per_rank.device < 2 * n * 1.001      # the bf16 shard on the GPU
    # host: grad 4 + master 4 + bf16 moments 4, plus one unit's staging buffer
    assert 12 * n <= e.per_rank.host < 12 * n * 1.01


def test_world_size_divides_per_rank_and_node_sums_ranks():
    one = plan(7e9, machine=make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="2TiB"), dtype="bf16").estimate("cpu", "cpu")
    eight = plan(7e9, machine=make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="2TiB"), dtype="bf16").estimate("cpu", "cpu")
    assert one.per_rank.host / 8 <= eight.per_rank.host < one.per_rank.host / 8 * 1.01
    assert one.per_rank.host <= eight.per_node.host < one.per_rank.host * 1.01
    two_nodes = plan(7e9, machine=make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="2TiB", world_size=16), dtype="bf16")
    e = two_nodes.estimate("cpu", "cpu")
    assert two_nodes.machine.nodes == 2
    assert e.per_node.host < eight.per_node.host / 2 * 1.01


# -- recommendations on synthetic machines ---------------------------------------------------


def test_7b_on_one_gpu_with_little_ram_goes_to_nvme():
    m = make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="64GiB", nvme_free="2TiB")
    p = plan(7e9, machine=m, dtype="bf16")
    assert p.recommended is not None
    assert (p.recommended.param_tier, p.recommended.optimizer_tier) == ("device", "nvme")
    assert "faster placements do not fit (device/cpu, cpu/cpu, nvme/cpu)" in p.reason
    assert any("host" in why for why in p.estimate("cpu", "cpu").problems)


def test_without_nvme_no_nvme_placement_is_chosen():
    m = make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="64GiB")
    p = plan(7e9, machine=m, dtype="bf16")
    assert p.recommended is None
    for e in p.estimates:
        if "nvme" in (e.param_tier, e.optimizer_tier):
            assert not e.fits and any("no NVMe" in why for why in e.problems)
    assert "no placement fits" in str(p)


def test_small_model_stays_on_the_device():
    m = make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="64GiB", nvme_free="2TiB")
    p = plan(125e6, machine=m, dtype="bf16")
    assert (p.recommended.param_tier, p.recommended.optimizer_tier) == ("device", "cpu")


def test_70b_on_8_gpus_pages_the_optimizer():
    m = make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="512GiB", nvme_free="8TiB")
    p = plan(70e9, machine=m, dtype="bf16")
    assert (p.recommended.param_tier, p.recommended.optimizer_tier) == ("device", "nvme")
    m = make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="2TiB", nvme_free="8TiB")
    assert plan(70e9, machine=m, dtype="bf16").recommended.name == "device/cpu"


def test_params_on_nvme_beat_optimizer_on_nvme_when_only_params_do_not_fit():
    # Host memory between what nvme/cpu and cpu/cpu need; a GPU too small for the shards.
    base = dict(gpus=1, gpu_mem="8GiB", nvme_free="1TiB", cpu_reserve=0)
    probe = plan(6e9, machine=make_machine(cpu_mem="4TiB", **base), dtype="bf16")
    need_cpu = probe.estimate("cpu", "cpu").per_node.host
    need_nvme = probe.estimate("nvme", "cpu").per_node.host
    assert need_nvme < need_cpu
    p = plan(6e9, machine=make_machine(cpu_mem=(need_cpu + need_nvme) // 2, **base), dtype="bf16")
    assert not p.estimate("device", "cpu").fits and not p.estimate("cpu", "cpu").fits
    assert p.estimate("cpu", "nvme").fits  # fits too, but moves 4x the disk bytes
    assert p.recommended.name == "nvme/cpu"
    assert 4 * p.estimate("nvme", "cpu").disk_bytes_per_step == p.estimate("cpu", "nvme").disk_bytes_per_step


def test_reserve_is_held_back_from_the_gpu():
    # 7B bf16 shards (14 GB) fit an 16 GiB GPU only without the default 20% reserve.
    kw = dict(gpus=1, gpu_mem="16GiB", cpu_mem="1TiB")
    assert plan(7e9, machine=make_machine(**kw), dtype="bf16").recommended.name == "cpu/cpu"
    assert plan(7e9, machine=make_machine(gpu_reserve="0.5GiB", **kw), dtype="bf16").recommended.name == "device/cpu"


def test_frozen_parameters_get_no_optimizer_state():
    m = make_machine(gpus=0, cpu_mem="1TiB")
    full = cli_mod._frozen_split_model(10**8, 10**8, 4)
    clip = {"gradient_clipping": 1.0}  # gradient shards held between steps, as with a GPU
    lora = cli_mod._frozen_split_model(10**8, 10**6, 4)
    a = plan(full, machine=m, dtype="bf16", config=clip).estimate("cpu", "cpu")
    b = plan(lora, machine=m, dtype="bf16", config=clip).estimate("cpu", "cpu")
    # trainable: shard 2 + master 4 + grad 4 + moments 8 = 18 B; frozen: its 2 B shard
    # only, also in a unit with trainable parameters ([Note: frozen parameters cost their
    # shard only] in offload/units/layout.py; it was 2 + 4 + 4 = 10 B before).
    assert a.per_rank.host == pytest.approx(18 * 10**8, rel=1e-3)
    assert b.per_rank.host == pytest.approx((2 * 99 + 18) * 10**6, rel=1e-3)
    assert plan_mod.plan(full, machine=m).trainable_params == 10**8
    assert plan_mod.plan(lora, machine=m).trainable_params == 10**6


# -- parsing and the CLI ----------------------------------------------------------------------


def test_parse_sizes_and_counts():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("2TiB") == 2 * TiB
    assert parse_bytes("512GB") == 512 * 10**9 and parse_bytes("1.5e9") == 1_500_000_000
    assert parse_count("7e9") == 7 * 10**9 and parse_count("7B") == 7 * 10**9
    assert parse_count("350M") == 350 * 10**6
    with pytest.raises(ValueError, match="80 gibibytes"):
        parse_bytes("80 gibibytes")
    with pytest.raises(ValueError, match="7e9, 7B or 350M"):
        parse_count("seven")


def test_cli_prints_the_table_and_the_recommendation(capsys):
    rc = cli_mod.main(["--params", "7e9", "--gpus", "1", "--gpu-mem", "80GiB", "--cpu-mem", "64GiB",
                       "--nvme-free", "2TiB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "7.00B parameters" in out and "NOT modelled" in out
    for pt, ot in plan_mod.PLACEMENTS:
        assert any(line.split()[:2] == [pt, ot] for line in out.splitlines())
    assert "recommended: params device, optimizer nvme" in out
    assert '"optimizer_tier": "nvme"' in out


def test_cli_json_and_exit_code_when_nothing_fits(capsys):
    rc = cli_mod.main(["--params", "70B", "--gpus", "1", "--gpu-mem", "24GiB", "--cpu-mem", "64GiB",
                       "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["recommended"] is None
    assert [(p["param_tier"], p["optimizer_tier"]) for p in data["placements"]] == list(plan_mod.PLACEMENTS)


def test_python_dash_m_offload_plan():
    out = run_python(["-m", "offload.plan", "--params", "125M", "--gpus", "0", "--cpu-mem", "16GiB"],
                     env=os.environ, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "recommended: params device, optimizer cpu" in out.stdout


def test_cli_errors_are_clear(capsys):
    with pytest.raises(SystemExit):
        cli_mod.main(["--params", "lots"])
    assert "cannot read 'lots' as a parameter count" in capsys.readouterr().err


# -- placement: "auto" ------------------------------------------------------------------------


def test_placement_auto_picks_and_logs(caplog):
    cfg = Config(compute_device="cpu", offload={"placement": "auto"}, precision={"dtype": "bf16"})
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="offload"):
        engine = offload.initialize(TinyGPT(), cfg)
    # A CPU run with memory to spare: the fastest placement, parameters on the device.
    assert (engine.config.offload.param_tier, engine.config.offload.optimizer_tier) == ("device", "cpu")
    assert engine.placement_plan.recommended.name == "device/cpu"
    assert "offload.placement='auto' chose params=device, optimizer=cpu" in caplog.text
    train_one_step(engine)  # and it trains
    engine.close()


def test_placement_auto_never_picks_nvme_without_nvme_path(monkeypatch):
    # Too little host memory for anything in memory, and no nvme_path: nothing fits.
    monkeypatch.setattr(machine_mod, "mem_available_bytes", lambda: 1 << 10)
    cfg = Config(compute_device="cpu", offload={"placement": "auto"})
    with pytest.raises(MemoryError, match="offload.placement='auto'.*host") as info:
        offload.initialize(TinyGPT(), cfg)
    assert "no NVMe" in str(info.value)


def test_placement_auto_with_explicit_tiers_is_a_config_error():
    with pytest.raises(ConfigError, match="offload.placement = 'auto' chooses the tiers"):
        OffloadConfig(placement="auto", param_tier="nvme", nvme_path="/x")
    with pytest.raises(ConfigError, match="offload.placement"):
        OffloadConfig(placement="sometimes")


# -- when nothing fits, and what the figures say (issue 22) ----------------------------------


def test_nothing_fits_suggests_bf16_moments_with_its_figures():
    # 70B on 8 x 80 GiB and 1 TiB without NVMe: fp32 moments fit nowhere; bf16 moments do.
    m = make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="1TiB")
    p = plan(70e9, machine=m, moments="fp32")
    assert p.recommended is None
    alt = plan(70e9, machine=m, moments="bf16")
    assert alt.recommended is not None  # the control: the hint is true
    hint = next(h for h in p.hints if h.startswith("bf16 Adam moments"))
    assert f"params {alt.recommended.param_tier}, optimizer {alt.recommended.optimizer_tier} fits" in hint
    assert "--moments bf16" in hint and "per node of" in hint
    assert any(h.startswith("NVMe (") for h in p.hints)  # no disk given: the NVMe option too
    text = str(p)
    assert "no placement fits" in text and "try: bf16 Adam moments" in text
    assert plan(70e9, machine=m, moments="bf16").hints == ()  # something fits: no hints
    assert p.to_dict()["hints"] == list(p.hints)


def test_over_the_limit_prints_digits_that_make_the_comparison_true():
    assert plan_mod._over("host", int(1.019 * 2**40), 2**40) == "host 1.019 TiB > 1.000 TiB"
    assert plan_mod._over("GPU", 3 * 2**30, 2 * 2**30) == "GPU 3.0 GiB > 2.0 GiB"
    assert plan_mod._over("host", 2**40 + 1, 2**40) == "host 1,099,511,627,777 B > 1,099,511,627,776 B"
    m = make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="1TiB", cpu_reserve=0)
    for e in plan(70e9, machine=m).estimates:
        for problem in e.problems:
            if " > " in problem:
                need, cap = problem.split(" ", 1)[1].split(" > ")
                assert need != cap, problem


def test_cli_gpu_mem_without_gpus_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        cli_mod.main(["--params", "7B", "--gpu-mem", "80GiB", "--cpu-mem", "64GiB"])
    assert exc.value.code == 2
    assert "--gpu-mem 80GiB needs --gpus N" in capsys.readouterr().err
    assert cli_mod.main(["--params", "125M", "--gpus", "0", "--cpu-mem", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory" not in out.split("recommended:")[1]  # a CPU plan never claims GPU memory


def _table(text: str) -> tuple[list[str], dict[tuple[str, str], dict[str, str]]]:
    """The plan's table: its header and {(params, optimizer): {column: cell}}."""
    lines = text.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith("params  optimizer"))
    head = lines[at].split()
    rows = {}
    for line in lines[at + 1:]:
        if not line.strip():
            break
        cells = [c for c in re.split(r"\s{2,}", line.strip())]
        rows[(cells[0], cells[1])] = dict(zip(head, cells))
    return head, rows


def test_a_cpu_plan_shows_host_memory_for_the_device_tier_and_no_device_column():
    # On a CPU machine the compute device is host memory: the table showed a "device/rank"
    # column beside a host/node that left it (and the ranks' work) out, under the figure the
    # fit is judged on.
    from offload.plan.machine import format_size

    result = plan(1e9, machine=make_machine(gpus=0, cpu_mem="64GiB", world_size=2), dtype="bf16")
    head, rows = _table(str(result))
    assert "device/rank" not in head and "GPU/rank" not in head
    by = {(e.param_tier, e.optimizer_tier): e for e in result.estimates}
    for key, e in by.items():
        node = e.per_node.host_total + e.per_node.device + e.working_device_bytes * result.machine.local_ranks
        assert rows[key]["host/node"] == format_size(node), key
        assert rows[key]["host/rank"] == format_size(e.per_rank.host + e.per_rank.device), key
    assert "the compute device is host memory" in str(result)
    # negative control: a GPU machine keeps its GPU column, and host/node is host memory only
    gpu = plan(1e9, machine=make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="64GiB"), dtype="bf16")
    head, rows = _table(str(gpu))
    e = next(e for e in gpu.estimates if (e.param_tier, e.optimizer_tier) == ("device", "cpu"))
    assert "GPU/rank" in head and rows[("device", "cpu")]["host/node"] == format_size(e.per_node.host_total)


def test_plan_says_gradient_shards_are_fp32_beside_bytes_per_parameter():
    text = str(plan(7e9, machine=make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="256GiB"), dtype="bf16"))
    assert ("per trainable parameter: 2 B bf16 parameter + 4 B fp32 master + 8 B fp32 moments "
            "+ 4 B gradient shard = 18 B") in text
    assert "gradient shards are kept in fp32 (4 B" in text and "16 B per parameter" in text


def test_zero_paper_figure_1_per_device_model_state() -> None:
    """The ZeRO paper's Figure 1: Ψ = 7.5B parameters, N_d = 64 devices, K = 12, fp16
    parameters and gradients -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device (GB = 10**9)."""
    from offload.plan.zero_paper import zero_model_state_bytes

    got = [zero_model_state_bytes(7.5e9, 64, s) / 1e9 for s in (0, 1, 2, 3)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9], got
    assert zero_model_state_bytes(7.5e9, 1, 3) == zero_model_state_bytes(7.5e9, 1, 0)  # one device: no saving
    with pytest.raises(ValueError, match="stages are 0"):
        zero_model_state_bytes(1e9, 8, 4)


# -- per-unit placement: the host memory an NVMe placement leaves over (issue 21) ----------------


def _host_need(e, m) -> int:
    return e.per_node.host_total + e.per_node.device + e.working_device_bytes * m.local_ranks


class _Layers(nn.Module):
    """Eight 256x256 layers, a unit each: room for some units' state in a leftover."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(256, 256) for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.float().pow(2).mean()


def test_an_nvme_placement_keeps_units_in_the_ram_left_over_and_the_engine_agrees(
        monkeypatch, tmp_path, caplog):
    """A machine whose host memory holds no in-memory placement but more than an NVMe one
    needs: the plan keeps units in the RAM left over (its budget is that leftover, the units
    the engine's own choice from the same sizes); `placement='auto'` builds exactly that
    split, and trains."""
    cfg = {"compute_device": "cpu", "precision": {"dtype": "bf16"},
           "offload": {"nvme_path": str(tmp_path), "pinned_budget_bytes": 1 << 20}}
    big = make_machine(gpus=0, cpu_mem="1TiB", nvme_free="1TiB", cpu_reserve=0)
    roomy = plan(_Layers(), machine=big, config=cfg)
    in_memory = max(_host_need(roomy.estimate(p, o), big) for p, o in (("device", "cpu"), ("cpu", "cpu")))
    disk = min(_host_need(e, big) for e in roomy.estimates if "nvme" in (e.param_tier, e.optimizer_tier))
    assert disk < in_memory
    mem = (disk + in_memory) // 2  # between: in memory does not fit, NVMe does with room left
    m = make_machine(gpus=0, cpu_mem=mem, nvme_free="1TiB", cpu_reserve=0)
    p = plan(_Layers(), machine=m, config=cfg)
    best = p.recommended
    assert "nvme" in (best.param_tier, best.optimizer_tier)
    assert 0 < p.ram_budget_bytes <= mem - _host_need(best, m)  # what it keeps fits the leftover
    assert p.split is not None and p.split != plan_mod.Placement.uniform(
        len(p.split.param), plan_mod.TierKind(best.param_tier), plan_mod.TierKind(best.optimizer_tier))
    assert p.split_disk_bytes_per_step < best.disk_bytes_per_step
    assert p.config_snippet()["offload"]["ram_budget_bytes"] == p.ram_budget_bytes
    assert "host memory left over" in str(p) and p.to_dict()["split"]["disk_bytes_per_step"] > 0

    # MemAvailable such that the default 10 % reserve leaves `mem`
    monkeypatch.setattr(machine_mod, "mem_available_bytes", lambda: int(mem / 0.9) + 1)
    auto = {**cfg, "offload": {**cfg["offload"], "placement": "auto"}}
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="offload"):
        engine = offload.initialize(_Layers(), auto)
    try:
        chosen = engine.placement_plan
        assert engine.config.offload.ram_budget_bytes == chosen.ram_budget_bytes > 0
        assert engine.placement == chosen.split  # the engine built the plan's split
        assert "keeps" in caplog.text and "for units in RAM" in caplog.text
        x = torch.randn(4, 256)
        engine.backward(engine(x))
        engine.step()
        assert engine.global_steps == 1
    finally:
        engine.close()


# -- which ZeRO stage (issue 18) ---------------------------------------------------------------


def test_stages_recommend_stage_2_where_whole_parameters_fit_on_the_gpus():
    from offload.plan import compare_stages

    m = make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="1TiB", world_size=64)
    small = compare_stages(7.5e9, machine=m)
    assert small.recommended == 2, small
    e2, e3 = small.plans[2].recommended, small.plans[3].recommended
    assert e2.per_rank.device > 10 * e3.per_rank.device  # the price: whole parameters per GPU
    assert "no all-gather" in small.reason and small.config_snippet()["zero_stage"] == 2
    # Negative control: 70B whole in bf16 is 140 GB per GPU; only stage 3 fits.
    big = compare_stages(70e9, machine=make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="2TiB"))
    assert big.plans[2].recommended is None and big.recommended == 3, big
    assert "only stage that fits" in big.reason
    # Stages 1 and 2 never page parameters through NVMe (the engine refuses it).
    assert all(e.param_tier != "nvme" for s in (1, 2) for e in small.plans[s].estimates)


def test_stages_on_the_cpu_recommend_stage_3_and_the_cli_prints_them():
    from offload.plan import compare_stages

    cpu = compare_stages(1e9, machine=make_machine(gpus=0, cpu_mem="64GiB"))
    assert cpu.recommended == 3 and "compute is on the CPU" in cpu.reason
    out = run_python(["-m", "offload.plan", "--params", "7.5e9", "--gpus", "8", "--gpu-mem", "80GiB",
                      "--cpu-mem", "1TiB", "--world-size", "64", "--stages"],
                     env=os.environ, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "recommended: stage 2" in out.stdout and '"zero_stage": 2' in out.stdout
    js = run_python(["-m", "offload.plan", "--params", "1e9", "--gpus", "0", "--cpu-mem", "64GiB",
                     "--stages", "--json"], env=os.environ, cwd=os.getcwd(), timeout=120)
    assert json.loads(js.stdout)["recommended_stage"] == 3


def test_cli_missing_nvme_path_is_one_line(tmp_path, capsys):
    """It was a 13-line traceback from shutil.disk_usage (issue #36)."""
    with pytest.raises(SystemExit) as e:
        cli_mod.main(["--params", "1e9", "--nvme-path", str(tmp_path / "missing")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"error: --nvme-path {tmp_path / 'missing'} does not exist: point "
                                                 "it at a directory on the disk to plan for (its free space is "
                                                 "measured), or give --nvme-free BYTES")


def test_cli_nvme_path_on_tmpfs_says_the_disk_is_memory(tmp_path, capsys):
    """A RAM-backed --nvme-path was planned for as if it were a disk (issue #36)."""
    from tests.fsutil import mounted_tmpfs
    with mounted_tmpfs("64m") as mnt:
        assert cli_mod.main(["--params", "1e6", "--nvme-path", mnt]) in (0, None)
        err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"warning: --nvme-path {mnt!r} is on a tmpfs filesystem, which keeps its files in host memory: "
        "the NVMe tiers' swap files would take RAM, not disk; point it at a directory on a local NVMe "
        "disk (or use the cpu tiers, which need no files)"]
    from offload.storage.swap import MEMORY_FILESYSTEMS, filesystem_type
    if filesystem_type(str(tmp_path)) not in MEMORY_FILESYSTEMS:  # pytest's tmp dir on a disk
        assert cli_mod.main(["--params", "1e6", "--nvme-path", str(tmp_path)]) in (0, None)
        assert "warning" not in capsys.readouterr().err
