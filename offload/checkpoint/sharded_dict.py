"""Sharded state dicts: each rank's part of the model and optimizer state as DTensors, for
`torch.distributed.checkpoint` (DCP) and anything else that speaks torch's sharded
state-dict format (`engine.sharded_state_dict()` and friends).

The layout is FSDP2's: one entry per `model.state_dict()` key, each parameter a `DTensor`
of its full shape over a 1-D `DeviceMesh` of the engine's group, `Shard(0)` placement, the
local tensor holding exactly the rows `torch.chunk` gives this rank (empty on ranks past
the last chunk); a 0-d parameter is `Replicate()`. Under HSDP the mesh is FSDP2's 2-D
(replicate, shard) one and the placements (Replicate(), Shard(0)): every shard group holds
the same rows, DCP writes them once. Buffers are plain tensors (every rank
holds the same whole value; DCP writes one copy). The optimizer's dict is torch's
`get_optimizer_state_dict` layout: `{"state": {key: {"step": 0-d fp32 tensor, "exp_avg":
DTensor, ...}}, "param_groups": [{hyperparameters..., "params": [keys]}]}`, the state names
being the optimizer kind's (offload/optim/kind.py). At world size 1 without a process group
there is no mesh, and the values are plain tensors (the whole tensor is the rank's share;
DCP saves and re-shards them the same way).

[Note: why per-parameter Shard(0), with a redistribution]
offload's own shards are contiguous ranges of a unit's flat, padded buffer
(offload/units/layout.py): rank r owns [r * S, (r + 1) * S), S aligned to 2048 elements.
DCP names a DTensor's chunk by `compute_local_shape_and_global_offset`, i.e. by torch's
`torch.chunk` rule (ceil(n / world) rows per rank), and loads by intersecting saved chunks
with wanted ones, so it re-shards exactly between any two chunkings of the *same global
shape*. What we considered:
- One 1-D DTensor per unit's flat buffer with the padding: its length, world * S, changes
  with the world size, and DCP refuses a load whose global size differs ("Size mismatch").
- The same without the padding (length = the unit's parameter elements, which does not
  depend on the world size): torch's chunks of it (ceil(n / world)) are not offload's
  (2048-aligned S), so the offsets DCP computes from the placement would name the wrong
  elements - silently wrong data, not an error.
- Arbitrary offsets per rank exist only through torch's private `LocalShardsWrapper`
  (torchrec's), and a parameter's range is, in N-D, up to 2 * ndim - 1 boxes; a flattened
  1-D key per parameter would avoid the boxes but not load into a plain or FSDP2 model.
So the dict uses the one layout torch itself produces and consumes, and pays for it with a
redistribution inside offload: building a dict all-gathers one unit's flat state at a time
and keeps this rank's rows of each parameter (a copy); loading all-gathers, per unit, each
rank's rows packed end to end, and writes the elements of this rank's flat range into the
masters (moments), publishing the unit's shard. Both are exact (copies, no arithmetic), and
a checkpoint written this way loads at any world size, into offload or into a plain or FSDP2
model. Memory: the dict itself is this rank's share of the state (a copy: ~1/world of the
model per state tensor), plus one unit's full flat tensor while it is being cut; no tensor
of the whole model is ever built. With the optimizer state on NVMe the dict is in host
memory whole (DCP needs the tensors): offload's own `save_checkpoint` streams instead.

Plain tensors (e.g. a full `engine.full_state_dict()`, or a DCP load into plain tensors)
load too: every rank takes its range from the whole value, with no communication.
Non-tensor extra state is returned as is and not loaded, as `load_full_state_dict` does.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Union

import torch

import offload.units.collectives as _dist
from offload.runtime.gathered import refuse_while_gathered
from offload.runtime.view import Location, ShardedState
from offload.units.layout import FROZEN_GROUP, ParamSlot, intersect
from offload.units.shard import FlatUnit

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["row_range", "model_state_dict", "load_model_state_dict", "optimizer_state_dict",
           "load_optimizer_state_dict", "refuse_dtensor_load"]

Value = Union[torch.Tensor, "DTensor"]


def _dt() -> Any:
    """`torch.distributed.tensor`, imported on first use: it costs ~0.7 s, which an engine
    that never makes a sharded state dict should not pay at import."""
    import torch.distributed.tensor

    return torch.distributed.tensor


def refuse_dtensor_load(module: Any, state_dict: Mapping[str, Any], *_: Any) -> None:
    """A `load_state_dict` pre-hook on the engine's root module, registered before the
    gathering's own (offload/runtime/gathered.py): `module.load_state_dict` - and so torch's
    `set_model_state_dict` - loads full tensors; given DTensors it would fail inside torch's
    copies on one rank and leave the others waiting in a collective. No DTensor can exist
    before `torch.distributed.tensor` is imported, so nothing is imported to check."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is None:
        return
    keys = [k for k, v in state_dict.items() if isinstance(v, dt.DTensor)]
    if keys:
        raise TypeError(
            f"load_state_dict got DTensors ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}): "
            "the engine's module (and torch's set_model_state_dict on it) loads full tensors. Load "
            "a sharded state dict - engine.sharded_state_dict()'s, filled by "
            "torch.distributed.checkpoint.load - with engine.load_sharded_state_dict(sd)")


def row_range(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a dim-0 of `dim0` rows that `Shard(0)` gives `rank`: torch's
    own rule (`Shard.local_shard_size_and_offset`, as `torch.chunk`: ceil(dim0 / world)
    rows per rank, the last ones short or empty)."""
    size, offset = _dt().Shard.local_shard_size_and_offset(dim0, world_size, rank)
    return int(offset), int(offset) + int(size)


def _flat_range(slot: ParamSlot, world_size: int, rank: int) -> tuple[int, int]:
    """The parameter-local flat elements [lo, hi) of `rank`'s Shard(0) rows (all of a 0-d one)."""
    if not slot.shape:
        return 0, slot.numel
    start, stop = row_range(slot.shape[0], world_size, rank)
    per_row = slot.numel // slot.shape[0] if slot.shape[0] else 0
    return start * per_row, stop * per_row


def _mesh(sharded: ShardedState) -> Optional["DeviceMesh"]:
    """A mesh over the engine's ranks (None without one: world size 1, no group): 1-D over
    the group the units shard over; under HSDP, FSDP2's 2-D (replicate, shard) mesh of the
    world, whose replicas torch.distributed.checkpoint writes once (it drops the copies of
    a shard that several ranks hold) and reads into each.

    Its device type is "cpu" whatever the group's backend: the dicts live in host memory,
    where the state does, and `DTensor.from_local` copies a local tensor to its mesh's
    device type. DCP reads only the mesh's shape and this rank's coordinate."""
    if sharded.pg.group is None:
        return None
    h = sharded.pg.hybrid
    if h is not None and h.replicate is not None and h.replicate.group is not None:
        ranks = torch.arange(h.world.world_size).view(-1, sharded.world_size)
        return _dt().DeviceMesh.from_group([h.replicate.group, sharded.pg.group], "cpu", mesh=ranks,
                                           mesh_dim_names=("replicate", "shard"))
    return _dt().DeviceMesh.from_group(sharded.pg.group, "cpu")


def _wrap(local: torch.Tensor, slot: ParamSlot, mesh: "DeviceMesh") -> Value:
    """`local` (this rank's rows) as a DTensor of the parameter's full shape: Shard(0) over
    the mesh's last dimension, replicated over the others (HSDP's replicas)."""
    dt = _dt()
    full = torch.empty(slot.shape, dtype=local.dtype, device="meta")  # its contiguous stride
    placements = [dt.Replicate()] * (mesh.ndim - 1) + [dt.Shard(0) if slot.shape else dt.Replicate()]
    return dt.DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def _gather_unit(sharded: ShardedState, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
    """The unit's full flat tensor from every rank's `shard` (a prefix of the rank's shard;
    zeros after it): one all-gather at world size > 1."""
    n = unit.layout.shard_numel
    if sharded.world_size == 1 and shard.numel() == n:
        return shard
    local = torch.zeros(n, dtype=shard.dtype)
    local[: shard.numel()].copy_(shard)
    if sharded.world_size == 1:
        return local
    dev = _dist.collective_device(sharded.pg, sharded.device)
    full = torch.empty(unit.layout.padded_numel, dtype=shard.dtype, device=dev)
    _dist.all_gather_into(full, local.to(dev), sharded.pg)
    return full.cpu()


def _rows_of(sharded: ShardedState, full: torch.Tensor, slot: ParamSlot,
             mesh: Optional["DeviceMesh"]) -> Value:
    """This rank's Shard(0) rows of `slot` from its unit's full flat tensor, as a copy (the
    whole parameter without a mesh)."""
    if mesh is None:
        return full[slot.offset : slot.end].clone().view(slot.shape)
    lo, hi = _flat_range(slot, sharded.world_size, sharded.rank)
    local = full[slot.offset + lo : slot.offset + hi].clone()
    if slot.shape:
        start, stop = row_range(slot.shape[0], sharded.world_size, sharded.rank)
        local = local.view(stop - start, *slot.shape[1:])
    return _wrap(local.view(()) if not slot.shape else local, slot, mesh)


def _param_keys(sharded: ShardedState) -> dict[tuple[int, int], list[str]]:
    """(unit, slot) -> its `model.state_dict()` keys, in order (several when tied)."""
    keys: dict[tuple[int, int], list[str]] = {}
    for entry in sharded.state_dict_index:
        if entry.location is Location.PARAM:
            ui, si = entry.where
            keys.setdefault((ui, si), []).append(entry.key)
    return keys


# -- out -------------------------------------------------------------------------------------


@torch.no_grad()
def model_state_dict(sharded: ShardedState) -> dict[str, Any]:
    """`engine.sharded_state_dict()`: `model.state_dict()`'s keys in order, each parameter
    this rank's Shard(0) rows of its fp32 value (the master; a frozen parameter's value cast
    up), buffers whole in their original dtype. A collective (one all-gather per unit)."""
    mesh = _mesh(sharded)
    keys = _param_keys(sharded)
    params: dict[str, Value] = {}
    for unit in sharded.units:
        # Cut inside the context: at world size 1 `full` may be the NVMe tier's pooled buffer.
        with sharded.optimizer.unit_state(unit.index) as state:
            full = _gather_unit(sharded, unit, unit.shard_values(state["master"]))
            for si, slot in enumerate(unit.layout.slots):
                names = keys.get((unit.index, si))
                if names:
                    value = _rows_of(sharded, full, slot, mesh)
                    for name in names:  # a tied parameter: one tensor under each name
                        params[name] = value
            del full
    out: dict[str, Any] = {}
    for entry in sharded.state_dict_index:
        if entry.location is Location.PARAM:
            out[entry.key] = params[entry.key]
        elif entry.location is Location.BUFFER:
            dtype = sharded.buffer_dtypes.get(id(entry.where), entry.where.dtype)
            out[entry.key] = entry.where.detach().to("cpu", dtype=dtype, copy=True)
        else:
            out[entry.key] = entry.where
    return out


def _state_names(sharded: ShardedState) -> tuple[str, ...]:
    opt = sharded.optimizer
    for spec in opt.specs:
        if not spec.dtype.is_floating_point or spec.per != 1:
            raise NotImplementedError(
                f"engine.sharded_optimizer_state_dict(): the {opt.kind} state {spec.name!r} is kept "
                f"as blocks ({spec.dtype}, {spec.per} elements each: optimizer.moments_dtype "
                f"{opt.moments!r}), not one value per element; use fp32 or bf16 moments, or "
                "engine.save_checkpoint")
    return tuple(opt.state_names)


@torch.no_grad()
def optimizer_state_dict(sharded: ShardedState) -> dict[str, Any]:
    """`engine.sharded_optimizer_state_dict()`: torch's optimizer layout keyed by parameter
    names (a tied parameter under its first), each state this rank's Shard(0) rows; "step"
    a 0-d fp32 tensor, as torch's Adam keeps it. A collective (one all-gather per unit and
    state tensor)."""
    names = _state_names(sharded)
    mesh = _mesh(sharded)
    keys = _param_keys(sharded)
    state: dict[str, dict[str, Value]] = {}
    group_keys: dict[int, list[str]] = {}
    for st in sharded.states:
        unit = st.unit
        slots = [(si, s) for si, s in enumerate(unit.layout.slots)
                 if s.group != FROZEN_GROUP and (unit.index, si) in keys]
        if not slots:
            continue
        with sharded.optimizer.unit_state(unit.index) as current:  # cut inside, as above
            fulls = {name: _gather_unit(sharded, unit, current[name]) for name in names}
            steps = list(current["slot_steps"])
            for si, slot in slots:
                key = keys[(unit.index, si)][0]
                entry: dict[str, Value] = {"step": torch.tensor(float(steps[si]), dtype=torch.float32)}
                for name in names:
                    entry[name] = _rows_of(sharded, fulls[name], slot, mesh)
                state[key] = entry
                group_keys.setdefault(slot.group, []).append(key)
            del fulls
    groups = []
    for gi, group in enumerate(sharded.optimizer.param_groups):
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = group_keys.get(gi, [])
        groups.append(g)
    return {"state": state, "param_groups": groups}


# -- in --------------------------------------------------------------------------------------


def _local(key: str, value: Any, slot: ParamSlot, sharded: ShardedState) -> tuple[torch.Tensor, bool]:
    """(the local tensor, whether it holds this rank's Shard(0) rows) of a given value; a
    plain tensor or a replicated DTensor holds the whole value."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and isinstance(value, dt.DTensor):
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"{key}: shape {tuple(value.shape)}, the parameter's {slot.shape}")
        mesh, placements = value.device_mesh, value.placements
        if mesh.shape[-1] != sharded.world_size or any(not p.is_replicate() for p in placements[:-1]):
            raise ValueError(f"{key}: a DTensor over mesh {mesh} with placements {placements}; this "
                             f"engine loads a mesh whose last dimension is its {sharded.world_size} "
                             "sharding ranks, replicated over any other (engine.sharded_state_dict()'s)")
        placement = placements[-1]
        if placement.is_replicate():
            return value.to_local().reshape(-1), False
        if not placement.is_shard(0):
            raise ValueError(f"{key}: placement {placement}; only Shard(0) and Replicate() load")
        return value.to_local().reshape(-1), bool(slot.shape)
    tensor = torch.as_tensor(value)
    if tuple(tensor.shape) != slot.shape:
        raise ValueError(f"{key}: shape {tuple(tensor.shape)}, the parameter's {slot.shape}")
    return tensor.reshape(-1), False


def _scatter_into(sharded: ShardedState, unit: FlatUnit, given: list[tuple[int, str, Any]],
                  dest: torch.Tensor) -> None:
    """Write the given parameters' values into `dest`, this rank's shard of the unit (its
    first dest.numel() elements): from a whole value directly, from Shard(0) rows through one
    all-gather of every rank's rows packed in slot order."""
    layout, ws, rank = unit.layout, sharded.world_size, sharded.rank
    lo_shard, _ = layout.shard_range(rank)
    mine = (lo_shard, lo_shard + dest.numel())
    rows: list[tuple[ParamSlot, torch.Tensor]] = []
    for si, key, value in given:
        slot = layout.slots[si]
        local, sharded_rows = _local(key, value, slot, sharded)
        if sharded_rows:
            lo, hi = _flat_range(slot, ws, rank)
            if local.numel() != hi - lo:
                raise ValueError(f"{key}: the local rows hold {local.numel()} elements; "
                                 f"Shard(0) gives rank {rank} {hi - lo}")
            rows.append((slot, local))
            continue
        r = intersect((slot.offset, slot.end), mine)
        if r is not None:
            dest[r[0] - mine[0] : r[1] - mine[0]].copy_(local[r[0] - slot.offset : r[1] - slot.offset])
    if not rows:
        return
    sizes = [sum(_span(s, ws, q) for s, _ in rows) for q in range(ws)]
    width = max(max(sizes), 1)
    pack = torch.zeros(width, dtype=dest.dtype)
    pos = 0
    for slot, local in rows:
        pack[pos : pos + local.numel()].copy_(local)
        pos += local.numel()
    if ws == 1:
        packs = pack
    else:
        dev = _dist.collective_device(sharded.pg, sharded.device)
        packs = torch.empty(ws * width, dtype=dest.dtype, device=dev)
        _dist.all_gather_into(packs, pack.to(dev), sharded.pg)
        packs = packs.cpu()
    for q in range(ws):
        pos = q * width
        for slot, _ in rows:
            lo, hi = _flat_range(slot, ws, q)
            r = intersect((slot.offset + lo, slot.offset + hi), mine)
            if r is not None:
                src = pos + r[0] - (slot.offset + lo)
                dest[r[0] - mine[0] : r[1] - mine[0]].copy_(packs[src : src + r[1] - r[0]])
            pos += hi - lo


def _span(slot: ParamSlot, world_size: int, rank: int) -> int:
    lo, hi = _flat_range(slot, world_size, rank)
    return hi - lo


def _check_keys(want: Iterable[str], given: Mapping[str, Any], what: str, strict: bool) -> None:
    if not strict:
        return
    want = list(want)
    known = set(want)
    missing = [k for k in want if k not in given]
    unexpected = [k for k in given if k not in known]
    if missing or unexpected:
        raise KeyError(f"{what} does not match the model: missing keys {missing[:10]}, "
                       f"unexpected keys {unexpected[:10]}")


def _prepare(sharded: ShardedState, what: str) -> None:
    refuse_while_gathered(sharded.units, what)
    sharded.sync_device()  # queued host-to-device copies still read the shards rewritten here


@torch.no_grad()
def load_model_state_dict(sharded: ShardedState, state_dict: Mapping[str, Any],
                          strict: bool = True) -> None:
    """`engine.load_sharded_state_dict()`: the parameters (DTensors as
    `model_state_dict` makes them, at any world size once DCP has re-sharded them, or whole
    tensors) into the fp32 masters and parameter shards; buffers copied whole. Every rank
    calls it with the same keys. `strict`: exactly `model.state_dict()`'s keys."""
    _prepare(sharded, "engine.load_sharded_state_dict")
    _check_keys((e.key for e in sharded.state_dict_index), state_dict, "the sharded state dict", strict)
    per_unit: dict[int, list[tuple[int, str, Any]]] = {}
    for entry in sharded.state_dict_index:
        if entry.key not in state_dict:
            continue
        if entry.location is Location.PARAM:
            ui, si = entry.where
            if all(s != si for s, _, _ in per_unit.get(ui, ())):  # a tied name: taken once
                per_unit.setdefault(ui, []).append((si, entry.key, state_dict[entry.key]))
        elif entry.location is Location.BUFFER:
            value = state_dict[entry.key]
            if hasattr(value, "full_tensor"):  # a DTensor: buffers are small
                value = value.full_tensor()
            entry.where.copy_(torch.as_tensor(value).to(entry.where.dtype))
    for unit in sharded.units:
        given = per_unit.get(unit.index, [])
        # Every rank runs the same gathers: the keys given are the same on every rank.
        with sharded.optimizer_states.open(unit.index, write=bool(given)) as t:
            if not given:
                continue
            values = unit.shard_values(t.master).clone()
            _scatter_into(sharded, unit, given, values)
            n = unit.master_numel
            t.master.copy_(values[:n])
            frozen = None
            if any(unit.layout.slots[si].group == FROZEN_GROUP for si, _, _ in given) and unit.frozen_numel:
                frozen = values[n:].to(unit.dtype)
            unit.publish(t.master, frozen)


@torch.no_grad()
def load_optimizer_state_dict(sharded: ShardedState, state_dict: Mapping[str, Any],
                              strict: bool = True) -> None:
    """`engine.load_sharded_optimizer_state_dict()`: each parameter's state tensors and step
    count (as `optimizer_state_dict` makes them, re-sharded by DCP or whole) into this rank's
    optimizer state, and every group's hyperparameters; the masters are left as they are.
    Every rank calls it with the same keys."""
    _prepare(sharded, "engine.load_sharded_optimizer_state_dict")
    names = _state_names(sharded)
    groups = state_dict["param_groups"]
    if len(groups) != len(sharded.optimizer.param_groups):
        raise ValueError(f"optimizer state has {len(groups)} param groups, this engine has "
                         f"{len(sharded.optimizer.param_groups)}")
    keys = _param_keys(sharded)
    state = state_dict["state"]
    want = [keys[(st.unit.index, si)][0] for st in sharded.states
            for si, s in enumerate(st.unit.layout.slots)
            if s.group != FROZEN_GROUP and (st.unit.index, si) in keys]
    _check_keys(want, state, "the sharded optimizer state dict", strict)
    for mine, theirs in zip(sharded.optimizer.param_groups, groups):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    for st in sharded.states:
        unit = st.unit
        given = [(si, keys[(unit.index, si)][0]) for si, s in enumerate(unit.layout.slots)
                 if s.group != FROZEN_GROUP and (unit.index, si) in keys
                 and keys[(unit.index, si)][0] in state]
        if not given:
            continue
        with sharded.optimizer_states.open(unit.index, write=True) as t:
            for name in names:
                dest = t.moments[name]
                _scatter_into(sharded, unit, [(si, f"{key}.{name}", state[key][name]) for si, key in given], dest)
        for si, key in given:
            if "step" in state[key]:
                st.slot_steps[si] = int(torch.as_tensor(state[key]["step"]).item())
