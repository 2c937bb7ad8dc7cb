"""Hybrid sharding (HSDP, ZeRO++ hpZ: offload/units/mesh.py, hybrid.py) against plain PyTorch,
at 4 ranks run as 2 "nodes" x 2 ranks (LOCAL_WORLD_SIZE=2, gloo), at stage 3 with the host
tier and with NVMe tiers; the degenerate sizes; the bytes each mode sends within and across
nodes against the arithmetic of docs/multinode.md; one real two-node torchrun launch.

The parity bound is the suite's (tests/parity.py, [Note: derived tolerances]): the plain
AdamW loop's fp32 bound for the scenario, measured in this run (`fp32_bound` of
tests/test_engine.py, shared with the world-size-1/2 tests); the negative control (HSDP with
the average across groups skipped: each group trains on its half of the data only) lands
more than 100x outside it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import offload
from offload.config import Config, LoggingConfig, OffloadConfig, PrefetchConfig, ShardingConfig
from offload.units.groups import ShardingMode, hsdp_groups, node_groups, peers_by_node
from offload.units.mesh import sharding_mode
from tests.conftest import TinyGPT, check_torchrun_exit, free_port, lm_loss, run_distributed
from tests.parity import Fp32Bound, plain_loop
from tests.test_engine import LR, WD, batches_for, fp32_bound, make_config, make_model

STEPS, GAS, CLIP = 8, 2, 0.05
"""8 micro-batches, 4 optimizer steps, clipping active: the global norm must be right."""
NODES, PER_NODE = 2, 2


def _config(sharding: ShardingConfig, nvme: str = "", clip: float = CLIP, **kw: Any):
    tiers = (OffloadConfig(param_tier="nvme", optimizer_tier="nvme", nvme_path=nvme) if nvme
             else OffloadConfig())
    # keep_bytes=0: every unit is gathered again for its backward (the re-gather hpZ keeps in
    # the node), so the byte counts follow the arithmetic without the trace's keeping.
    # One step report, at the end, on every rank: the per-step mean over the whole run.
    return make_config(gas=GAS, clip=clip, sharding=sharding, offload=tiers,
                       prefetch=PrefetchConfig(keep_bytes=0),
                       logging=LoggingConfig(steps_per_print=STEPS // GAS, all_ranks=True), **kw)


def _train(cfg, rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The scenario's loop on this rank's share of each batch: (the full state dict on rank 0
    of each shard group, what the test checks besides: mode, layout, the step report)."""
    logging.getLogger("offload").setLevel(logging.INFO)  # the step report is made (not shown)
    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), cfg)
    hybrid = engine.pg.hybrid
    device = []
    for x, y in batches_for("gpt", STEPS):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        device.append(engine.memory_bytes()["device"])
        engine.step()
    device.append(engine.memory_bytes()["device"])
    info: dict[str, Any] = {"mode": None if hybrid is None else hybrid.mode,
                            "device before and after the last step": device[-2:],
                            "wear": None if engine.reporter.wear is None else engine.reporter.wear.as_dict(),
                            "subgroups": None if hybrid is None or hybrid.mesh is None else
                            [id(hybrid.mesh.get_group(d)) for d in hybrid.mesh.mesh_dim_names],
                            "shard_numel": [u.layout.shard_numel for u in engine.units],
                            "report": engine.reporter.last}
    info["line"] = engine.reporter._line(engine.reporter.last)  # the step report's text
    sd = engine.full_state_dict()
    engine.close()
    return sd, info


MODES = {
    "full": ShardingConfig(),
    "hsdp": ShardingConfig(shard_group_size=PER_NODE),
    "hpz": ShardingConfig(hpz_partition_size=PER_NODE),
}


def _four_ranks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)  # 2 "nodes" of 2 ranks
    out: dict[str, Any] = {}
    for name, sharding in MODES.items():
        out[name] = _train(_config(sharding), rank, world_size)
    for name in ("hsdp", "hpz"):
        out[name + " nvme"] = _train(_config(MODES[name], nvme=os.path.join(tmp, name)), rank, world_size)
    # Negative control: HSDP without the average across groups.
    import offload.units.grad_reduce as grad_reduce

    real = grad_reduce.average_across_replicas
    grad_reduce.average_across_replicas = lambda t, pg: None  # type: ignore[assignment]
    try:
        out["hsdp without the average across groups"] = _train(_config(MODES["hsdp"]), rank, world_size)
    finally:
        grad_reduce.average_across_replicas = real  # type: ignore[assignment]
    out["resume"] = _resume(rank, world_size, os.path.join(tmp, "checkpoints"))
    out["window"] = _hsdp_window(rank, world_size)
    # No clipping: the units update during the boundary's backward, each as soon as its
    # reduction (which folds the window's sums in and averages across groups) completes.
    out["hsdp in backward"] = _train(_config(MODES["hsdp"], clip=0.0, nonfinite_loss="off"), rank, world_size)
    return out


# -- HSDP's average across groups, once per step -------------------------------------------------


class _LastBlockFirstOnly(TinyGPT):
    """The tiny GPT whose last block runs only while `use_last` (set before each forward):
    at a step's first micro-batch and not at its last, so at the boundary that block's
    gradient shard holds the first micro-batch's un-averaged sums ([Note: HSDP averages once
    per step])."""

    use_last = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks[: len(self.blocks) - (0 if self.use_last else 1)]:
            x = blk(x)
        return lm_loss(self.lm_head(self.ln_f(x)), targets)


def _route(model: torch.nn.Module, micro_batch: int) -> None:
    model.use_last = micro_batch % GAS == 0


def _last_block_first_only() -> torch.nn.Module:
    torch.manual_seed(0)
    return _LastBlockFirstOnly(n_layer=3)


WATCHED = "blocks.1.fc.weight"
"""Its gradient is read (`engine.full_grad`) inside the first window, after micro-batch 0."""


def _hsdp_window(rank: int, world_size: int) -> dict[str, Any]:
    """HSDP with a unit the boundary micro-batch never reaches, and `full_grad` read inside
    the window: (the full state dict after STEPS micro-batches, that gradient)."""
    engine = offload.initialize(_last_block_first_only(), _config(MODES["hsdp"]))
    out: dict[str, Any] = {}
    for i, (x, y) in enumerate(batches_for("gpt", STEPS)):
        n = x.shape[0] // world_size
        _route(engine.module, i)
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        if i == 0:
            out["grad"] = engine.full_grad(WATCHED).cpu()
        engine.step()
    out["sd"] = engine.full_state_dict()
    engine.close()
    return out


def test_hsdp_averages_a_unit_the_boundary_micro_batch_never_reached(four_ranks):
    """Its shard still holds micro-batch 0's un-averaged sums at the step: the step averages
    it before the norm and the update (without that, that block trains on its group's half
    of the data and lands orders of magnitude outside the bound)."""
    bound = Fp32Bound.measure(lambda **o: plain_loop(
        _last_block_first_only, batches_for("gpt", STEPS), lr=LR, weight_decay=WD, gas=GAS, clip=CLIP,
        before_forward=_route, **o))
    bound.check(four_ranks[0]["window"]["sd"], "hsdp, a unit the boundary never reached")


def test_full_grad_inside_the_window_is_the_mean_across_groups(four_ranks):
    """After micro-batch 0 the gradient shards hold each group's sums (no average yet);
    `full_grad` still returns the whole batch's gradient, against a float64 plain backward:
    bound 8x the fp32 plain backward's own error; the gradient of one group's half of the
    batch (what the shard holds) is more than 100x outside it."""
    x, y = batches_for("gpt", 1)[0]

    def grad(dtype: torch.dtype, rows: slice) -> torch.Tensor:
        model = _last_block_first_only().to(dtype)
        (model(x[rows], y[rows]) / GAS).backward()
        return dict(model.named_parameters())[WATCHED].grad.double()

    truth, fp32 = grad(torch.float64, slice(None)), grad(torch.float32, slice(None))
    bound = 8 * max(float((fp32 - truth).abs().max()), torch.finfo(torch.float32).eps * float(truth.abs().max()))
    half = x.shape[0] // NODES
    for rank, out in enumerate(four_ranks):
        err = float((out["window"]["grad"].double() - truth).abs().max())
        assert err <= bound, (rank, err, bound)
    group0 = grad(torch.float64, slice(0, half))  # shard group 0 (ranks 0, 1) holds rows [0, half)
    assert float((group0 - truth).abs().max()) > 100 * bound


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_distributed(_four_ranks, NODES * PER_NODE, str(tmp_path_factory.mktemp("hybrid")))


@pytest.mark.parametrize("name", ["full", "hsdp", "hpz", "hsdp nvme", "hpz nvme"])
def test_each_mode_matches_plain_adamw_at_4_ranks_as_2_nodes(name, four_ranks):
    sd, info = four_ranks[0][name]
    fp32_bound("gpt", GAS, CLIP, STEPS).check(sd, f"{name} 2x2")
    expected = {"full": ShardingMode.FULL, "hsdp": ShardingMode.HSDP, "hpz": ShardingMode.HPZ}
    assert info["mode"] is expected[name.split()[0]]


def _resume(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    """HSDP: 2 steps, save, 2 more (the uninterrupted run); a new HSDP engine loads and runs
    the last 2 (bit-identical); a full-sharding engine at world size 4 loads the checkpoint
    of 2-rank shards (re-sharded) and runs them (the plain loop's bound)."""
    batches = batches_for("gpt", STEPS)
    n = batches[0][0].shape[0] // world_size

    def run(engine: Any, part: list) -> None:
        for x, y in part:
            engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
            engine.step()

    out: dict[str, Any] = {}
    for name, sharding, load in (("uninterrupted", MODES["hsdp"], False), ("resumed", MODES["hsdp"], True),
                                 ("resumed as full sharding", MODES["full"], True)):
        torch.manual_seed(0)
        engine = offload.initialize(make_model("gpt"), _config(sharding))
        if load:
            engine.load_checkpoint(save_dir)
        else:
            run(engine, batches[: STEPS // 2])
            out["files"] = sorted(os.listdir(engine.save_checkpoint(save_dir)))
        run(engine, batches[STEPS // 2:])
        if name == "resumed":  # its state through DCP too: FSDP2's (replicate, shard) DTensors
            sd = {"model": engine.sharded_state_dict(), "optim": engine.sharded_optimizer_state_dict()}
            out["hsdp placements"] = [str(p) for p in sd["model"]["blocks.0.qkv.weight"].placements]
            dcp.save(sd, checkpoint_id=os.path.join(save_dir, "dcp hsdp"))
            out["moments"] = _moments(engine)
        out[name] = engine.full_state_dict()
        engine.close()
    # Full sharding at world size 4 loads that DCP checkpoint (2-way shards re-sharded 4
    # ways) and saves its own of the same values: one copy on disk each.
    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), _config(MODES["full"]))
    sd = {"model": engine.sharded_state_dict(), "optim": engine.sharded_optimizer_state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(save_dir, "dcp hsdp"))
    engine.load_sharded_state_dict(sd["model"])
    engine.load_sharded_optimizer_state_dict(sd["optim"])
    dcp.save(sd, checkpoint_id=os.path.join(save_dir, "dcp full"))
    out["dcp into full sharding"] = engine.full_state_dict()
    out["dcp moments"] = _moments(engine)
    engine.close()
    out["dcp bytes"] = {k: sum(os.path.getsize(os.path.join(save_dir, k, f)) for f in os.listdir(os.path.join(save_dir, k)))
                        for k in ("dcp hsdp", "dcp full")}
    return out


def _moments(engine: Any) -> dict[str, torch.Tensor]:
    return {name: engine.param_state.full(name, "exp_avg_sq").cpu()
            for name, p in engine.module.named_parameters() if p.requires_grad}


def test_hsdp_checkpoint_written_by_one_group_resumes_exactly_and_reshards(four_ranks):
    resume = four_ranks[0]["resume"]
    # shard group 0's 2 ranks wrote it, as ZeRO-3 at world size 2
    assert resume["files"] == ["manifest.json", "rank00000.shards", "rank00000.state", "rank00001.shards",
                               "rank00001.state"], resume["files"]
    for key, value in resume["uninterrupted"].items():
        assert torch.equal(resume["resumed"][key], value), key
    assert four_ranks[2]["resume"]["resumed"].keys() == resume["uninterrupted"].keys()  # group 1's rank 0
    fp32_bound("gpt", GAS, CLIP, STEPS).check(resume["resumed as full sharding"], "hsdp checkpoint, full sharding at 4")



def test_hsdp_sharded_state_dicts_are_one_copy_through_dcp_and_reshard_exactly(four_ranks):
    """HSDP's DTensor state dicts are FSDP2's: a 2-D (replicate, shard) mesh, placements
    (Replicate(), Shard(0)); DCP writes the two groups' identical shards once (no more bytes
    than full sharding's one copy of the same values at world size 4), and full sharding at
    4 ranks loads them re-sharded, weights and moments bit for bit."""
    for rank, out in enumerate(four_ranks):
        resume = out["resume"]
        assert resume["hsdp placements"] == ["R", "S(0)"], resume["hsdp placements"]  # Replicate(), Shard(0)
        if rank == 0:  # the full state dicts land on rank 0 (of each shard group under HSDP)
            assert resume["dcp into full sharding"].keys() == resume["resumed"].keys()
            for key, value in resume["resumed"].items():
                assert torch.equal(resume["dcp into full sharding"][key], value), key
        for key, value in resume["moments"].items():
            assert torch.equal(resume["dcp moments"][key], value), (rank, key)
    on_disk = four_ranks[0]["resume"]["dcp bytes"]
    print(f"DCP bytes on disk: HSDP 2x2 {on_disk['dcp hsdp']}, full sharding at 4 {on_disk['dcp full']}")
    assert on_disk["dcp hsdp"] <= 1.05 * on_disk["dcp full"], on_disk  # not one copy per group


def test_hsdp_with_the_optimizer_in_backward_matches_plain_adamw(four_ranks):
    """Accumulation without clipping: the boundary's units update during backward, right
    after their reduction averaged the window's sums across groups ([Note: HSDP averages
    once per step])."""
    sd, info = four_ranks[0]["hsdp in backward"]
    assert info["report"]["optimizer_in_backward_units"] > 0, info["report"]
    fp32_bound("gpt", GAS, 0.0, STEPS).check(sd, "hsdp 2x2, optimizer in backward")


def test_skipping_the_average_across_groups_fails_parity_by_orders_of_magnitude(four_ranks):
    sd, _ = four_ranks[0]["hsdp without the average across groups"]
    ratio, key, _ = fp32_bound("gpt", GAS, CLIP, STEPS).worst(sd)
    assert ratio > 100, (key, ratio)


# -- bytes within and across nodes --------------------------------------------------------------


def expected_bytes(mode: str, shard_numel: list[int], world: int = NODES * PER_NODE, per_node: int = PER_NODE,
                   gas: int = GAS, itemsize: int = 4) -> tuple[int, int]:
    """(bytes within the node, across nodes) one rank sends per optimizer step: the arithmetic
    of docs/multinode.md on this run's units. `shard_numel[u]`: unit u's shard (elements) over
    the group the units shard over. Per micro-batch the root unit (units[0]) is gathered once
    (it stays gathered until backward ends) and every other unit twice, forward and backward
    (keep_bytes=0); each unit's gradients are reduce-scattered once; fp32 compute here, and
    gradients reduce in fp32. [Note: bytes a collective sends] in offload/units/groups.py."""
    gathers = [1] + [2] * (len(shard_numel) - 1)
    gathered = sum(g * n for g, n in zip(gathers, shard_numel))  # elements per peer per micro-batch
    reduced = sum(shard_numel)
    if mode == "full":  # every collective over the world: L - 1 peers on the node, W - L off it
        per_peer = gas * (gathered + reduced) * itemsize
        return (per_node - 1) * per_peer, (world - per_node) * per_peer
    if mode == "hsdp":  # the shard group is the node; its replicas, one per other node
        groups = world // per_node
        within = (per_node - 1) * gas * (gathered + reduced) * itemsize
        # one all-reduce of the shard per step, at the boundary ([Note: HSDP averages once per step])
        across = (groups - 1) * 2 * reduced * itemsize // groups
        return within, across
    assert mode == "hpz"
    # The first gather of each unit per step over the world; the others within the node from
    # the secondary copy (the unit's padded size / L elements); reduce-scatters over the world.
    secondary = [n * world // per_node for n in shard_numel]
    node_gathered = sum((gas * g - 1) * m for g, m in zip(gathers, secondary))
    within = (per_node - 1) * (reduced + node_gathered + gas * reduced) * itemsize
    across = (world - per_node) * (reduced + gas * reduced) * itemsize
    return within, across


@pytest.mark.parametrize("name", ["full", "hsdp", "hpz", "hsdp nvme", "hpz nvme"])
def test_step_report_bytes_within_and_across_nodes_match_the_arithmetic(name, four_ranks):
    for rank in range(NODES * PER_NODE):
        _, info = four_ranks[rank][name]
        report = info["report"]
        assert report["sharding"] == name.split()[0].upper()
        within, across = expected_bytes(name.split()[0], info["shard_numel"])
        assert (report["collective_within_node_bytes"], report["collective_across_nodes_bytes"]) == (within, across)


def test_the_step_report_names_the_world_rank_and_the_bytes(four_ranks):
    # HSDP: ranks 2 and 3 are ranks 0 and 1 of their shard group; the report names the world's
    line = four_ranks[3]["hsdp"][1]["line"]
    assert line.startswith("step 4 [rank 3]"), line
    assert "HSDP collectives 416.00 KiB/step within node, 72.00 KiB across" in line, line


@pytest.mark.parametrize("name", ["full", "hsdp", "hpz"])
def test_memory_bytes_counts_hpz_copies_until_the_update_drops_them(name, four_ranks):
    """Before the last step every unit holds its hpZ copy (its padded size / L elements,
    fp32 here); the step's update drops them all. Nothing of the kind without hpZ."""
    for rank in range(NODES * PER_NODE):
        info = four_ranks[rank][name][1]
        before, after = info["device before and after the last step"]
        copies = sum(n * NODES for n in info["shard_numel"]) * 4 if name == "hpz" else 0
        assert before - after == copies, (rank, before, after, copies)


@pytest.mark.parametrize("name", ["hsdp nvme", "hpz nvme"])
def test_swap_bytes_per_step_at_4_ranks_are_initializes_estimate(name, four_ranks):
    """Issue #34's per-node swap figures at world size 4 (2 ranks per node): each rank's
    measured swap bytes per step equal `initialize`'s estimate, the node's are twice them."""
    for rank in range(NODES * PER_NODE):
        info = four_ranks[rank][name][1]
        wear, report = info["wear"], info["report"]
        assert wear is not None and wear["node_ranks"] == PER_NODE, (rank, wear)
        assert report["swap_written_bytes"] == pytest.approx(wear["rank_bytes_per_step"]), (rank, report, wear)
        assert report["node_swap_written_bytes"] == pytest.approx(PER_NODE * report["swap_written_bytes"])


def test_later_engines_of_a_shape_reuse_its_subgroups(four_ranks):
    """[Note: one mesh per shape]: the NVMe runs' engines, built after the host-tier ones,
    run on the same process groups, not new ones (which nothing would ever free)."""
    for out in four_ranks:
        for name in ("hsdp", "hpz"):
            assert out[name][1]["subgroups"] is not None
            assert out[name + " nvme"][1]["subgroups"] == out[name][1]["subgroups"], name


def test_hsdp_and_hpz_send_fewer_bytes_across_nodes_than_full_sharding(four_ranks):
    across = {name: four_ranks[0][name][1]["report"]["collective_across_nodes_bytes"] for name in MODES}
    assert across["hsdp"] < across["hpz"] < across["full"], across


# -- degenerate sizes, the door's checks ---------------------------------------------------------


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    # One node of 2 (LOCAL_WORLD_SIZE unset): a group of the world size is plain ZeRO-3.
    out = {name: _train(_config(sharding), rank, world_size)
           for name, sharding in (("hsdp 2", ShardingConfig(shard_group_size=2)),
                                  ("hpz 2", ShardingConfig(hpz_partition_size=2)))}
    out["stage 1"] = _train(_config(ShardingConfig(), zero_stage=1), rank, world_size)
    return out


def test_sizes_equal_to_world_size_2_are_plain_zero3():
    results = run_distributed(_two_ranks, 2)
    for name in ("hsdp 2", "hpz 2"):
        sd, info = results[0][name]
        assert info["mode"] is ShardingMode.FULL
        assert info["report"]["collective_across_nodes_bytes"] == 0  # one node
        fp32_bound("gpt", GAS, CLIP, STEPS).check(sd, f"{name} at world size 2")
    # Stage 1 counts its all-reduces: per micro-batch each unit's whole gradient (2 x its shard
    # over 2 ranks), 2 N / 2 = N elements to the peer; each resident unit gathered once per
    # step (after its update).
    _, info = results[0]["stage 1"]
    shards = info["shard_numel"]
    per_step = (sum(shards) + GAS * sum(2 * n for n in shards)) * 4
    assert info["report"]["collective_within_node_bytes"] == per_step


def test_world_size_1_runs_without_groups_and_checks_the_sizes():
    sd, info = _train(_config(ShardingConfig()), 0, 1)
    assert info["mode"] is None and "sharding" not in info["report"]
    fp32_bound("gpt", GAS, CLIP, STEPS).check(sd, "sharding section at world size 1")
    with pytest.raises(ValueError, match=r"sharding.shard_group_size = 2, but the world size 1 is not a "
                                         r"multiple of it"):
        offload.initialize(make_model("gpt"), _config(ShardingConfig(shard_group_size=2)))


@pytest.mark.parametrize("sharding, world, mode", [
    (ShardingConfig(), 8, ShardingMode.FULL),
    (ShardingConfig(shard_group_size=8), 32, ShardingMode.HSDP),
    (ShardingConfig(shard_group_size=32), 32, ShardingMode.FULL),
    (ShardingConfig(hpz_partition_size=8), 32, ShardingMode.HPZ),
    (ShardingConfig(hpz_partition_size=4), 4, ShardingMode.FULL),
])
def test_sharding_mode_at_a_world_size(sharding, world, mode):
    assert sharding_mode(sharding, world, 8) is mode


def test_sizes_that_do_not_divide_the_world_are_one_line_errors():
    for sharding, key in ((ShardingConfig(shard_group_size=3), "shard_group_size"),
                          (ShardingConfig(hpz_partition_size=3), "hpz_partition_size")):
        with pytest.raises(ValueError, match=rf"^sharding.{key} = 3, but the world size 8 is not a multiple of "
                                             r"it .*such as the ranks per node \(4\)$"):
            sharding_mode(sharding, 8, 4)


@pytest.mark.parametrize("section, match", [
    ({"shard_group_size": 1}, r"sharding.shard_group_size = 1, but groups of 1 rank would replicate"),
    ({"shard_group_size": -2}, r"sharding.shard_group_size = -2, but a group size must be >= 0"),
    ({"hpz_partition_size": 0}, r"sharding.hpz_partition_size = 0, but a partition size must be >= 1"),
    ({"shard_group_size": 2, "hpz_partition_size": 2}, r"are set together"),
])
def test_sharding_section_errors_name_the_key_and_the_fix(section, match):
    with pytest.raises(ValueError, match=match):
        Config.from_dict({"sharding": section})


def test_hybrid_sharding_is_refused_below_stage_3():
    with pytest.raises(ValueError, match=r"zero_stage = 2, but hybrid sharding .* runs at stage 3 only"):
        Config.from_dict({"zero_stage": 2, "sharding": {"shard_group_size": 2}})


def test_group_arithmetic():
    assert hsdp_groups(8, 4) == ([(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)])
    assert node_groups(4, 2) == [(0, 1), (2, 3)]
    assert peers_by_node(1, (0, 1, 2, 3), 2) == (1, 2)
    assert peers_by_node(1, (1, 3), 2) == (0, 1)
    assert peers_by_node(5, tuple(range(32)), 8) == (7, 24)


# -- DeepSpeed's keys ------------------------------------------------------------------------------


def test_deepspeed_hpz_partition_size_is_honoured():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Config.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
        below = Config.from_deepspeed({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}})
        ours = Config.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8},
                                      "sharding": {"hpz_partition_size": 4}})
    assert cfg.sharding == ShardingConfig(hpz_partition_size=8)
    assert "zero_optimization.zero_hpz_partition_size" not in cfg.ignored_keys
    assert below.sharding == ShardingConfig() and "zero_optimization.zero_hpz_partition_size" in below.ignored_keys
    assert ours.sharding.hpz_partition_size == 4  # offload's own section wins, as prefetch's does


def test_mics_shard_size_is_rejected_pointing_at_offloads_section():
    with pytest.raises(ValueError, match=r"zero_optimization.mics_shard_size = 8 was removed from DeepSpeed .*"
                                         r'"sharding": \{"shard_group_size": 8\}'):
        Config.from_deepspeed({"zero_optimization": {"stage": 3, "mics_shard_size": 8}})


# -- a real two-node launch --------------------------------------------------------------------

_TWO_NODES_SCRIPT = """
import os, sys, torch
from tests.test_hybrid import MODES, _config, _train
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out = {}
for name in ("hsdp", "hpz"):  # two engines in turn, on the group torchrun's env started
    sd, info = _train(_config(MODES[name]), rank, world)
    out[name] = (sd, info["mode"].name, info["report"], info["shard_numel"])
torch.save(out, os.path.join(sys.argv[1], f"{rank}.pt"))
"""


def test_torchrun_two_nodes_of_two_ranks_train_each_mode_like_plain_adamw(tmp_path):
    """Two `torchrun --nnodes 2 --nproc-per-node 2` launches, node ranks 0 and 1, on one
    rendezvous (gloo): torchrun's own RANK / LOCAL_WORLD_SIZE place the ranks on nodes."""
    script = tmp_path / "train.py"
    script.write_text(_TWO_NODES_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
         str(PER_NODE), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(script), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(NODES)]
    for node, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:  # ours, started above
                p.kill()
            raise
        done = all((tmp_path / f"{r}.pt").exists() for r in range(NODES * PER_NODE))
        check_torchrun_exit(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), done,
                            f"torchrun node {node}")
    for rank in range(NODES * PER_NODE):
        out = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        for name in ("hsdp", "hpz"):
            sd, mode, report, shard_numel = out[name]
            assert mode == name.upper()
            assert (report["collective_within_node_bytes"],
                    report["collective_across_nodes_bytes"]) == expected_bytes(name, shard_numel)
            if rank == 0:
                fp32_bound("gpt", GAS, CLIP, STEPS).check(sd, f"{name} torchrun 2 nodes x 2")


def test_a_subgroups_lost_peer_is_named_by_its_world_rank():
    from offload.units.collectives import lost_peer_error
    from offload.units.groups import ProcessGroupInfo

    # HSDP's replicate group of world ranks 1 and 3 (rank 1 is its rank 0)
    pg = ProcessGroupInfo(rank=0, world_size=2, group=None, backend="cpu:gloo", started_here=True,
                          timeout_s=5.0, ranks=(1, 3))
    text = str(lost_peer_error("all-reduce of 8 elements", pg, RuntimeError("Timed out waiting")))
    assert text.startswith("rank 1 (in the group of ranks 1, 3): the all-reduce of 8 elements was not "
                           "completed by the other ranks within collective_timeout_s=5 s (rank 3 "
                           "did not answer"), text
