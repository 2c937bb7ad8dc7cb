"""The planner past one node (offload/plan/sharding.py, `python -m offload.plan --sharding`):
which sharding mode fits a node's host memory, what each sends across nodes, and the mode
it recommends; the traffic is docs/multinode.md's arithmetic, which tests/test_hybrid.py pins
to the engine's own counters."""

from __future__ import annotations

import json

import pytest

from offload.plan.cli import main
from offload.plan.machine import make_machine
from offload.plan.sharding import collective_bytes, compare_sharding

BF16 = {"precision": {"dtype": "bf16"}}


def _machine(cpu_mem: str) -> object:
    return make_machine(gpus=8, gpu_mem="80GiB", cpu_mem=cpu_mem, world_size=32, ranks_per_node=8)


def test_the_70b_on_4x8_arithmetic():
    # bf16 parameters, fp32 gradient reduction; W = 32, L = 8 (docs/multinode.md's table)
    assert collective_bytes("full sharding", 32, 8, 2) == (1.75, 6.0)
    assert collective_bytes("hpZ", 32, 8, 2) == (pytest.approx(3.0625), 4.5)
    assert collective_bytes("HSDP", 32, 8, 2) == (7.0, 0.75)


def test_hsdp_is_recommended_when_a_whole_replica_fits_each_node():
    choice = compare_sharding(70e9, machine=_machine("2TiB"), config=BF16)
    assert choice.recommended is not None and choice.recommended.mode == "HSDP"
    hsdp, hpz, full = choice.modes
    # HSDP holds the whole optimizer state per node: 16 B/param (master, moments, gradients)
    assert hsdp.plan.recommended.per_node.host_total == pytest.approx(4 * full.plan.recommended.per_node.host_total,
                                                                      rel=0.01)
    assert hsdp.across_nodes_bytes_per_step == 0.75 * 70e9
    assert choice.config_snippet()["sharding"] == {"shard_group_size": 8}


def test_hpz_is_recommended_when_a_replica_does_not_fit_the_nodes_ram():
    choice = compare_sharding(70e9, machine=_machine("512GiB"), config=BF16)
    assert not choice.modes[0].fits  # HSDP: 1.12 TB of state per node
    assert choice.recommended is not None and choice.recommended.mode == "hpZ"
    assert "HSDP would need a whole replica per node, which does not fit" in choice.reason
    assert choice.config_snippet()["sharding"] == {"hpz_partition_size": 8}
    assert choice.recommended.secondary_bytes_per_rank == 70e9 // 8 * 2  # bf16, 1/8 of the model
    assert choice.recommended.across_nodes_bytes_per_step == 4.5 * 70e9


def test_one_node_is_not_a_comparison():
    with pytest.raises(ValueError, match="needs several whole nodes"):
        compare_sharding(7e9, machine=make_machine(gpus=8, gpu_mem="80GiB", cpu_mem="1TiB", world_size=8))


def test_cli_nodes_and_sharding_flags(capsys):
    assert main(["--params", "70e9", "--nodes", "4", "--gpus", "8", "--gpu-mem", "80GiB",
                 "--cpu-mem", "512GiB", "--sharding", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] == "hpZ"
    assert [m["mode"] for m in out["modes"]] == ["HSDP", "hpZ", "full sharding"]
    assert [m["fits"] for m in out["modes"]] == [False, True, True]
    assert main(["--params", "70e9", "--nodes", "4", "--gpus", "8", "--gpu-mem", "80GiB",
                 "--cpu-mem", "2TiB", "--sharding"]) == 0
    text = capsys.readouterr().out
    assert "recommended: HSDP" in text and "4 nodes of 8 ranks" in text
    with pytest.raises(SystemExit):
        main(["--params", "7e9", "--nodes", "2", "--gpus", "8", "--gpu-mem", "80GiB", "--world-size", "8"])
    assert "differs from --nodes 2 x 8 ranks per node" in capsys.readouterr().err
