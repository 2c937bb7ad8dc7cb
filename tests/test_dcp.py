"""Sharded state dicts through torch.distributed.checkpoint (offload/checkpoint/sharded_dict.py).

Exactness: what DCP saves and loads back must equal the engine's fp32 masters and optimizer
states bit for bit (torch.equal), at the same world size and at another one (2 -> 1, 1 -> 2),
and training must then go on exactly as the uninterrupted run (same world size), or as the
same state loaded through offload's own re-sharding checkpoint (another world size: a run
at another world size averages its gradients differently, so it is its own reference). The
batches are drawn from a generator seeded by the step, so no RNG state needs restoring.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import offload
from tests.conftest import TinyGPT, run_distributed

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")  # DCP at world size 1 without a group

N = 2  # steps before the save, and after it
MODEL = {"vocab": 256, "d_model": 128, "n_layer": 2, "tie": True}
"""~430k parameters: large enough that DCP's per-chunk framing (a torch.save of each chunk,
~1.7 KB) is a few percent of the bytes on disk."""


def _config(tier_dir: str | None) -> dict:
    config = {"compute_device": "cpu", "optimizer": {"lr": 2e-3, "weight_decay": 0.01}}
    if tier_dir is not None:
        config["offload"] = {"param_tier": "nvme", "optimizer_tier": "nvme", "nvme_path": tier_dir,
                             "pinned_budget_bytes": 1 << 22}
    return config


def _build(seed: int, tier_dir: str | None, rank: int = 0, bf16_frozen: bool = False):
    """The engine; `bf16_frozen`: bf16 compute (a load republishes each shard from its
    master) and a frozen parameter (no master: its value lives in the parameter shard)."""
    if tier_dir is not None:
        tier_dir = os.path.join(tier_dir, f"rank{rank}")  # one swap directory per rank
        os.makedirs(tier_dir, exist_ok=True)
    torch.manual_seed(seed)
    model = TinyGPT(**MODEL)
    config = _config(tier_dir)
    if bf16_frozen:
        model.wpe.weight.requires_grad_(False)
        config["precision"] = {"dtype": "bf16"}
    return offload.initialize(model, config)


def _train(engine, first: int, steps: int, rank: int, world_size: int) -> None:
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, MODEL["vocab"], (8, 17), generator=g)
        b = 8 // world_size
        x, y = idx[rank * b:(rank + 1) * b, :-1], idx[rank * b:(rank + 1) * b, 1:]
        engine.backward(engine(x.contiguous(), y.contiguous()))
        engine.step()


def _states(engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master and optimizer states, whole (a collective), and every
    value of the model (full_state_dict: frozen parameters too)."""
    out = {}
    for name, p in engine.module.named_parameters():
        for key in ("fp32", "exp_avg", "exp_avg_sq") if p.requires_grad else ():
            out[f"{name}/{key}"] = engine.param_state.full(name, key).cpu()
    out.update({f"{k}/value": v for k, v in engine.full_state_dict(rank0_only=False).items()})
    return out


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _sd(engine) -> dict:
    return {"model": engine.sharded_state_dict(), "optim": engine.sharded_optimizer_state_dict()}


def _local_numel(sd: dict, seen: set | None = None) -> int:
    """Elements of the DTensors' local tensors (a tied parameter's one tensor counted once)."""
    seen = set() if seen is None else seen
    total = 0
    for v in sd.values():
        if isinstance(v, dict):
            total += _local_numel(v, seen)
        elif isinstance(v, DTensor) and id(v) not in seen:
            seen.add(id(v))
            total += v.to_local().numel()
    return total


def _values(sd: dict):
    for v in sd.values():
        yield from (_values(v) if isinstance(v, dict) else (v,))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _save_phase(rank: int, world_size: int, ckpt: str, tier_dir: str | None,
                bf16_frozen: bool = False) -> dict:
    """Train N steps, save through DCP (and offload's own checkpoint, the reference for a
    load at another world size), then train N more: the uninterrupted run."""
    engine = _build(0, tier_dir, rank, bf16_frozen)
    _train(engine, 0, N, rank, world_size)
    sd = _sd(engine)
    dcp.save(sd, checkpoint_id=os.path.join(ckpt, "dcp"))
    engine.save_checkpoint(os.path.join(ckpt, "native"))
    n_params = sum(p.numel() for p in engine.module.parameters())
    locals_ = [v.to_local().numel() for part in sd.values() for v in _values(part) if isinstance(v, DTensor)]
    out = {"saved": _states(engine), "local_numel": _local_numel(sd), "n_params": n_params,
           "max_local_numel": max(locals_, default=0),
           "largest_param": max(p.numel() for p in engine.module.parameters() if p.requires_grad),
           "dtensors": all(isinstance(v, DTensor) for k, v in sd["model"].items() if "weight" in k)}
    _train(engine, N, 1, rank, world_size)
    out["one_more"] = _states(engine)
    _train(engine, N + 1, N - 1, rank, world_size)
    out["straight"] = engine.full_state_dict(rank0_only=False)
    engine.close()
    return out


def _load_phase(rank: int, world_size: int, ckpt: str, tier_dir: str | None, native: bool,
                bf16_frozen: bool = False) -> dict:
    """A fresh engine (other seed) loads the DCP checkpoint, then trains N steps; with
    `native` a second one loads offload's own checkpoint of the same state and trains too."""
    out = {}
    engine = _build(7, tier_dir, rank, bf16_frozen)
    sd = _sd(engine)
    dcp.load(sd, checkpoint_id=os.path.join(ckpt, "dcp"))
    engine.load_sharded_state_dict(sd["model"])
    engine.load_sharded_optimizer_state_dict(sd["optim"])
    out["loaded"] = _states(engine)
    _train(engine, N, N, rank, world_size)
    out["resumed"] = engine.full_state_dict(rank0_only=False)
    engine.close()
    if native:
        engine = _build(7, tier_dir, rank, bf16_frozen)
        engine.load_checkpoint(os.path.join(ckpt, "native"))
        _train(engine, N, N, rank, world_size)
        out["native"] = engine.full_state_dict(rank0_only=False)
        engine.close()
    return out


def _get_set_model_state_dict(rank: int, world_size: int) -> dict:
    """torch's get_model_state_dict / set_model_state_dict on the engine's module."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                          set_model_state_dict)

    engine = _build(0, None, rank)
    _train(engine, 0, 1, rank, world_size)
    full = engine.full_state_dict(rank0_only=False)
    sharded = engine.sharded_state_dict()
    gathers = []
    hold = engine.gathering._hold  # counts the units gathered for the traversal
    engine.gathering._hold = lambda units, kind: gathers.append(tuple(units)) or hold(units, kind)
    got = get_model_state_dict(engine.module)
    engine.gathering._hold = hold
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in got.items()}
    out = {"gathers": gathers, "keys": list(got) == list(sharded),
           "dtensors": sum(isinstance(v, DTensor) for v in got.values()),
           "as_sharded": _same(local, {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sharded.items()})}
    whole = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["whole_on_rank0"] = _same(whole, {k: v.float() for k, v in full.items()}) if rank == 0 else whole == {}
    out["plain_state_dict_is_full"] = _same(engine.module.state_dict(), full)  # module.state_dict() unchanged
    set_model_state_dict(engine.module, {k: v + 1 for k, v in full.items()})
    out["set_full"] = all(torch.equal(v, full[k] + 1) for k, v in engine.full_state_dict(rank0_only=False).items())
    try:
        set_model_state_dict(engine.module, engine.sharded_state_dict())
        out["set_sharded"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        out["set_sharded"] = f"{type(exc).__name__}: {exc}"
    out["after"] = _same(engine.full_state_dict(rank0_only=False), {k: v + 1 for k, v in full.items()})
    engine.close()
    return out


def _in_process(fn, *args):
    """World size 1 without a process group: values are plain tensors."""
    return fn(0, 1, *args)


def test_model_only_is_one_copy_on_disk(tmp_path):
    engine = _build(0, None)
    sd = engine.sharded_state_dict()
    dcp.save(sd, checkpoint_id=str(tmp_path))
    fp32_bytes = 4 * sum(p.numel() for p in engine.module.parameters())
    on_disk = _dir_bytes(str(tmp_path))
    print(f"DCP bytes on disk, model only {on_disk}, fp32 model {fp32_bytes}: {on_disk / fp32_bytes:.3f} copies")
    # One copy, the tied head's second name (256 x 128 fp32: 0.08 copies), framing, metadata.
    assert fp32_bytes <= on_disk <= 1.15 * fp32_bytes, (on_disk, fp32_bytes)
    engine.close()


def test_torch_get_set_model_state_dict():
    """[Note: torch's state-dict helpers on the engine's module]: get_model_state_dict
    (engine.module) is the sharded dict (DTensors at world size 2: each rank's Shard(0) rows),
    with no unit gathered for it; with full_state_dict and cpu_offload torch gathers it to
    full tensors on rank 0 only, as for FSDP2; module.state_dict() stays full.
    set_model_state_dict takes full tensors, and refuses DTensors on every rank with the way
    to load them (before: one rank failed inside torch, the other hung)."""
    for r, out in enumerate(run_distributed(_get_set_model_state_dict, 2)):
        assert out["gathers"] == [], (r, out["gathers"])
        assert out["keys"] and out["as_sharded"] and out["dtensors"] > 0, (r, out)
        assert out["whole_on_rank0"], r
        assert out["plain_state_dict_is_full"], r
        assert out["set_full"], r
        assert out["set_sharded"].startswith("TypeError: load_state_dict got DTensors"), out
        assert "engine.load_sharded_state_dict(sd)" in out["set_sharded"]



def test_torch_get_model_state_dict_at_world_size_1():
    """Without a process group the sharded dict holds plain tensors (the rank's share is the
    whole); torch's helper still gets it without a gather, and the full option agrees."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    engine = _build(0, None)
    _train(engine, 0, 1, 0, 1)
    full = engine.full_state_dict(rank0_only=False)
    gathers = []
    hold = engine.gathering._hold
    engine.gathering._hold = lambda units, kind: gathers.append(tuple(units)) or hold(units, kind)
    got = get_model_state_dict(engine.module)
    engine.gathering._hold = hold
    assert gathers == []
    assert _same(got, engine.sharded_state_dict())
    whole = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert _same(whole, {k: v.float() for k, v in full.items()})
    engine.close()

# -- another world size: DCP re-shards, the engine takes its range -------------------------------


@pytest.fixture(scope="module")
def saved_ws2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ws2"))
    return ckpt, run_distributed(_save_phase, 2, ckpt, None)


def test_round_trip_world_size_2_is_exact_and_one_copy_on_disk(saved_ws2):
    ckpt, saved = saved_ws2
    loaded = run_distributed(_load_phase, 2, ckpt, None, False)
    for r in range(2):
        assert _same(loaded[r]["loaded"], saved[r]["saved"])
        assert _same(loaded[r]["resumed"], saved[r]["straight"])
        # Negative control: the comparison sees one step's difference.
        assert not _same(loaded[r]["loaded"], saved[r]["one_more"])
        assert saved[r]["dtensors"]
        # No rank holds the model: its dict is its Shard(0) rows of master + 2 moments (~1/2
        # of 3 copies; the rows of an odd dim-0 round up to one row per parameter).
        assert saved[r]["local_numel"] <= 3 * saved[r]["n_params"] // 2 + 3 * 16 * 512
        assert saved[r]["max_local_numel"] < saved[r]["largest_param"]
    fp32_bytes = 4 * saved[0]["n_params"]
    on_disk = _dir_bytes(os.path.join(ckpt, "dcp"))
    # master + exp_avg + exp_avg_sq once each; beside them the tied head's second name
    # (model.state_dict() has both: 256 x 128 fp32), buffers, DCP's per-chunk framing, metadata.
    print(f"DCP bytes on disk {on_disk}, fp32 model {fp32_bytes}: {on_disk / fp32_bytes:.3f} copies")
    assert 3 * fp32_bytes <= on_disk <= 3.3 * fp32_bytes, (on_disk, fp32_bytes)


def test_world_size_2_to_1_reshards_exactly(saved_ws2):
    ckpt, saved = saved_ws2
    (loaded,) = run_distributed(_load_phase, 1, ckpt, None, True)  # a group of 1: DTensors
    assert _same(loaded["loaded"], saved[0]["saved"])
    # Training goes on as the same state loaded by offload's own re-sharding checkpoint.
    assert _same(loaded["resumed"], loaded["native"])
    assert not _same(loaded["resumed"], saved[0]["straight"])  # another world size: another run
    # The checkpoint is torch's layout: a plain model (no engine, no group) loads it.
    plain = TinyGPT(**MODEL)
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(ckpt, "dcp"))
    plain.load_state_dict(sd["model"])
    assert all(torch.equal(p, saved[0]["saved"][f"{n}/fp32"]) for n, p in plain.named_parameters())


def test_world_size_1_to_2_reshards_exactly(tmp_path):
    ckpt = str(tmp_path)
    saved = _save_phase(0, 1, ckpt, None)  # no process group: plain tensors
    assert not saved["dtensors"]
    loaded = run_distributed(_load_phase, 2, ckpt, None, True)
    for r in range(2):
        assert _same(loaded[r]["loaded"], saved["saved"])
        assert _same(loaded[r]["resumed"], loaded[r]["native"])
    # And back at world size 1 without a group (plain tensors in, plain tensors out).
    again = _load_phase(0, 1, ckpt, None, False)
    assert _same(again["loaded"], saved["saved"]) and _same(again["resumed"], saved["straight"])


def test_nvme_tiers_world_size_2(tmp_path):
    ckpt, swap = str(tmp_path / "ckpt"), str(tmp_path / "swap")
    saved = run_distributed(_save_phase, 2, ckpt, swap)
    loaded = run_distributed(_load_phase, 2, ckpt, swap, False)
    for r in range(2):
        assert _same(loaded[r]["loaded"], saved[r]["saved"])
        assert _same(loaded[r]["resumed"], saved[r]["straight"])
        assert not _same(loaded[r]["loaded"], saved[r]["one_more"])


def test_bf16_with_a_frozen_parameter_world_size_2(tmp_path):
    ckpt = str(tmp_path)
    saved = run_distributed(_save_phase, 2, ckpt, None, True)
    loaded = run_distributed(_load_phase, 2, ckpt, None, False, True)
    for r in range(2):
        assert "wpe.weight/fp32" not in saved[r]["saved"] and "wpe.weight/value" in saved[r]["saved"]
        assert _same(loaded[r]["loaded"], saved[r]["saved"])
        assert _same(loaded[r]["resumed"], saved[r]["straight"])
        assert not _same(loaded[r]["loaded"], saved[r]["one_more"])


def test_model_state_only_keeps_the_moments(tmp_path):
    """load_sharded_state_dict writes the masters only; the optimizer state is its own dict."""
    a, b = _build(0, None), _build(7, None)
    _train(a, 0, N, 0, 1)
    _train(b, 0, 1, 0, 1)
    moments = {k: v for k, v in _states(b).items() if k.endswith(("/exp_avg", "/exp_avg_sq"))}
    b.load_sharded_state_dict(a.sharded_state_dict())
    after = _states(b)
    assert all(torch.equal(after[k], v) for k, v in moments.items())
    assert all(torch.equal(after[k], v) for k, v in _states(a).items() if k.endswith(("/fp32", "/value")))
    with pytest.raises(KeyError, match="missing keys"):
        b.load_sharded_state_dict({})
    a.close()
    b.close()


def test_nvme_tiers_world_size_1(tmp_path):
    """No group: plain tensors cut from the NVMe tier's pooled buffers while they are valid."""
    ckpt, swap = str(tmp_path / "ckpt"), str(tmp_path / "swap")
    saved = _save_phase(0, 1, ckpt, swap)
    loaded = _load_phase(0, 1, ckpt, swap, False)
    assert _same(loaded["loaded"], saved["saved"]) and _same(loaded["resumed"], saved["straight"])
