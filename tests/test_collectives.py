"""The object collectives the checkpoint code uses, at world size 2 over real gloo: they run
on tensors `_fresh` tracks, so `settle_collectives` covers them ([Note: collective tensors at
exit] in offload/units/collectives.py)."""

from __future__ import annotations

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
