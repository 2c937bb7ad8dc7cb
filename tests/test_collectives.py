"""The object collectives the checkpoint code uses, at world size 2 over real gloo: they run
on tensors `_fresh` tracks, so `settle_collectives` covers them ([Note: collective tensors at
exit] in offload/units/collectives.py)."""

from __future__ import annotations

import pytest
import torch

from offload.units import collectives as _dist
from tests.conftest import run_distributed


def _objects(rank: int, world_size: int) -> dict:
    pg = _dist.setup_process_group("cpu")
    cpu = torch.device("cpu")
    # Sizes differ per rank (rank 1's pickle is far longer): the gather pads and cuts.
    mine = {"rank": rank, "payload": "x" * (10 + 5000 * rank), "none": None}
    gathered = _dist.all_gather_object(mine, pg, cpu)
    sent = _dist.broadcast_object(("from", rank, list(range(rank * 100))), pg, cpu)
    return {"gathered": gathered, "sent": sent, "settled": _dist.settle_collectives(),
            "tracked": len(_dist._IN_FLIGHT)}


def test_object_collectives_at_world_size_2():
    results = run_distributed(_objects, 2)
    for rank, res in enumerate(results):
        assert [g["rank"] for g in res["gathered"]] == [0, 1], rank
        assert [len(g["payload"]) for g in res["gathered"]] == [10, 5010], rank
        assert res["gathered"][1]["none"] is None
        assert res["sent"] == ("from", 0, []), rank  # rank 0's object, on both ranks
        assert res["settled"] and res["tracked"] == 0, rank


def test_object_collectives_at_world_size_1_pass_the_object_through():
    pg = _dist.ProcessGroupInfo(rank=0, world_size=1, group=None, backend=None, started_here=False)
    obj = {"a": [1, 2]}
    assert _dist.broadcast_object(obj, pg, torch.device("cpu")) is obj
    assert _dist.all_gather_object(obj, pg, torch.device("cpu")) == [obj]


# -- the backend a group runs CUDA tensors on, and the GPU a rank computes on (issue #30, F10)


def test_uses_nccl_reads_every_way_torch_names_a_backend():
    # get_backend() of a group started with backend="nccl"; get_backend_config() of it;
    # what (older) torch reports for a default group started without a backend.
    for name in ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "CPU:gloo, CUDA:nccl"):
        assert _dist.uses_nccl(name), name
    for name in ("gloo", "cpu:gloo", "cpu:gloo,cuda:gloo", "undefined", "mpi", "cpu:nccl", "", None):
        assert not _dist.uses_nccl(name), name


def _group_info(rank: int, world_size: int, start: str) -> dict:
    import torch.distributed as dist

    if start == "no backend":  # what a user script often does: init_process_group()
        dist.init_process_group(rank=rank, world_size=world_size)
    pg = _dist.setup_process_group("cpu")
    cpu = torch.device("cpu")
    # (a group started without a backend on a machine with a GPU has no CPU backend at all)
    t = torch.tensor([float(rank + 1)])
    total = None if pg.nccl else float(_dist.all_reduce_host(t, "sum", pg, cpu))
    return {"backend": pg.backend, "nccl": pg.nccl, "config": dist.get_backend_config(),
            "started_here": pg.started_here, "coll": _dist.collective_device(pg, cpu), "sum": total}


def test_process_group_info_of_a_real_gloo_group_is_not_nccl():
    # The user's gloo group (run_distributed starts it with backend="gloo"): recorded as
    # torch describes it per device, not NCCL, collectives on the CPU.
    for res in run_distributed(_group_info, 2, "gloo"):
        assert res["backend"] == res["config"] == "cpu:gloo,cuda:gloo", res
        assert not res["nccl"] and not res["started_here"] and res["coll"] == torch.device("cpu")
        assert res["sum"] == 3.0


def test_process_group_info_of_a_group_started_without_a_backend():
    # torch 2.13's get_backend() says "undefined" for it; the engine records the device map
    # (gloo for the CPU on a machine without a GPU; "cuda:nccl" on one with a GPU).
    for res in run_distributed(_group_info, 2, "no backend", init_group=False):
        assert res["backend"] == res["config"] and "undefined" not in res["backend"], res
        assert res["nccl"] == _dist.uses_nccl(res["config"])
        if not torch.cuda.is_available():
            assert res["backend"] == "cpu:gloo" and res["coll"] == torch.device("cpu")
            assert res["sum"] == 3.0


def test_collective_device_of_a_cpu_gloo_cuda_nccl_group():
    # A group NCCL for cuda and gloo for cpu: CUDA compute's collectives on the GPU (they
    # were sent through the CPU, or failed, when only "nccl" counted), CPU compute's on gloo.
    pg = _dist.ProcessGroupInfo(rank=0, world_size=2, group=None, backend="cpu:gloo,cuda:nccl",
                                started_here=False)
    assert pg.nccl
    assert _dist.collective_device(pg, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert _dist.collective_device(pg, torch.device("cpu")) == torch.device("cpu")
    gloo = _dist.ProcessGroupInfo(rank=0, world_size=2, group=None, backend="cpu:gloo,cuda:gloo",
                                  started_here=False)
    assert _dist.collective_device(gloo, torch.device("cuda", 1)) == torch.device("cpu")


def test_local_gpu_choice_selects_local_rank_unless_the_user_chose():
    # (LOCAL_RANK, current device, visible devices) -> (device to set, warning)
    assert _dist.local_gpu_choice(1, 0, 2) == (1, None)  # default device 0: LOCAL_RANK's
    assert _dist.local_gpu_choice(3, 0, 8) == (3, None)
    assert _dist.local_gpu_choice(1, 1, 2) == (None, None)  # already LOCAL_RANK's: kept
    assert _dist.local_gpu_choice(0, 0, 1) == (None, None)
    # CUDA_VISIBLE_DEVICES per rank: LOCAL_RANK 3 of one visible GPU; device 0 is its own
    assert _dist.local_gpu_choice(3, 0, 1) == (None, None)
    # the user's explicit other choice is kept, with a warning saying what and how to fix
    index, warning = _dist.local_gpu_choice(1, 2, 4)
    assert index is None and "set_device(2)" in warning and "LOCAL_RANK=1" in warning
    index, warning = _dist.local_gpu_choice(0, 3, 8)
    assert index is None and "GPU 3" in warning


def _cuda_group(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group(rank=rank, world_size=world_size)  # no backend, no device_id
    pg = _dist.setup_process_group("cuda")
    dev = _dist.resolve_device("cuda")
    full = torch.zeros(world_size, device=dev)
    _dist.all_gather_into(full, torch.full((1,), float(rank), device=dev), pg)
    return {"current": torch.cuda.current_device(), "nccl": pg.nccl, "backend": pg.backend,
            "coll": str(_dist.collective_device(pg, dev)), "full": full.tolist()}


@pytest.mark.cuda
def test_user_group_without_backend_selects_local_rank_gpu_and_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: each rank on its own")
    for rank, res in enumerate(run_distributed(_cuda_group, 2, init_group=False)):
        assert res["current"] == rank and res["nccl"], res
        assert res["coll"] == f"cuda:{rank}" and res["full"] == [0.0, 1.0], res


def _bytes_alive(ref) -> int:
    """Bytes a storage known only by a weak reference still holds (0 once it is gone)."""
    if ref.expired():
        return 0
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()


def _reduce_temporaries(rank: int, world_size: int) -> dict:
    from torch.multiprocessing.reductions import StorageWeakRef

    from offload.units.grad_reduce import GradReduce

    pg = _dist.setup_process_group("cpu")
    n = 1 << 16
    flat = torch.full((n * world_size,), float(rank + 1))  # the unit's flat fp32 gradients
    out = torch.empty(n)  # the reduce-scatter's temporary output
    grad_shard = torch.zeros(n // 2)  # a shard shorter than the output: copied out on completion
    work = _dist.reduce_scatter_mean(out, flat, pg, async_op=True)
    refs = [StorageWeakRef(flat.untyped_storage()), StorageWeakRef(out.untyped_storage())]
    reduce = GradReduce([True], work, flat, (out, grad_shard, False))
    del flat, out, work
    reduce.wait()
    alive = [_bytes_alive(r) for r in refs]
    settled = _dist.settle_collectives()
    return {"alive": alive, "settled": settled, "shard": grad_shard[:4].tolist(),
            "after_settle": [_bytes_alive(r) for r in refs]}


def test_a_finished_reduce_holds_no_bytes():
    """Issue #30, F6: once a gradient reduce-scatter was waited, its flat input and its
    temporary output hold no memory, though the views handed to the collective live on
    until the group's threads let them go (and, before, until the next collective): on a
    GPU that was a unit's fp32 gradients, twice, outside the plan."""
    for rank, res in enumerate(run_distributed(_reduce_temporaries, 2)):
        assert res["shard"] == [1.5] * 4, rank  # the mean of 1 and 2: the reduction is right
        assert res["alive"] == [0, 0], res
        assert res["settled"] and res["after_settle"] == [0, 0], res
