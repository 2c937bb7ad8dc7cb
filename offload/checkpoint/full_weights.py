"""The model's full fp32 weights, unit by unit: the one path behind consolidation and
`engine.full_state_dict()`.

Both need the same thing: for every unit, its full flat values in fp32 (all ranks' shards
joined: the fp32 masters, and the frozen parameters' values from the parameter shards, cast
up), and every parameter's slice of it under each of its `model.state_dict()` names (tied
parameters have several). They differ only in where the flat unit comes from and
where the slices go, so `stream_full_weights` takes both as arguments:

- a *source* calls `emit(unit_index, flat)` once per unit, in order, with a 1-D fp32 tensor
  valid only during the call (`None` on a rank that does not keep the result):
  `engine_units` gathers a live engine's shards (an all-gather per unit at world size > 1,
  so every rank must run it); `checkpoint_units` assembles them from a checkpoint's rank
  files (CRCs verified, as `load_checkpoint` does).
- a *sink* `put(keys, value)` receives each parameter (shaped) and the state-dict keys it
  is stored under, and must copy what it keeps before returning: `full_state_dict` keeps
  one CPU copy shared by the tied names (as `model.state_dict()` shares them), consolidation
  writes it at each key's offset in its safetensors file.

Memory is one unit's flat fp32 buffer (plus, for a checkpoint, the reader's window of
chunks) beside whatever the sink keeps, whatever the model's size.

The way back in, `load_full_state_dict` (`engine.load_full_state_dict()`), lives here too:
it takes such a dict and writes each rank's slice of it into the masters and parameter
shards (a frozen parameter's into its parameter shard only), unit by unit.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from offload.checkpoint import manifest
from offload.checkpoint.shards import DEFAULT_WINDOW, ShardReader, assemble_jobs
from offload.runtime.gathered import refuse_while_gathered
from offload.runtime.view import Location, ShardedState

Emit = Callable[[int, Optional[torch.Tensor]], None]
Source = Callable[[Emit], None]
Sink = Callable[[list[str], torch.Tensor], None]


def param_keys(signature: dict[str, Any]) -> dict[tuple[int, int], list[str]]:
    """(unit index, slot index) -> the state-dict keys of that parameter, in state-dict
    order (several when tied). `signature` is `manifest.model_signature`'s shape."""
    keys: dict[tuple[int, int], list[str]] = {}
    for entry in signature["state_dict"]:
        if entry["kind"] == "param":
            keys.setdefault((entry["unit"], entry["slot"]), []).append(entry["key"])
    return keys


def stream_full_weights(signature: dict[str, Any], source: Source, put: Sink) -> None:
    """Run `source`, handing every parameter of every unit it emits to `put` (see the
    module docstring)."""
    keys = param_keys(signature)
    units = {u["index"]: u for u in signature["units"]}

    def emit(index: int, flat: Optional[torch.Tensor]) -> None:
        if flat is None:
            return
        for si, s in enumerate(units[index]["slots"]):
            names = keys.get((index, si))
            if names:
                put(names, flat[s["offset"] : s["offset"] + s["numel"]].view(s["shape"]))

    source(emit)


def unit_numel(unit: dict[str, Any]) -> int:
    """Elements of a unit's flat tensor that hold parameters (its padding excluded)."""
    return max((s["offset"] + s["numel"] for s in unit["slots"]), default=0)


# -- sources ------------------------------------------------------------------------------------


def engine_units(sharded: ShardedState, keep: bool = True) -> Source:
    """A live engine's units: each rank's shard in fp32 - its master, read through
    `ShardedAdam.unit_state` (NVMe: one unit in host memory at a time), and the frozen
    values of its parameter shard cast up (`FlatUnit.shard_values`) - joined by an
    all-gather at world size > 1. Every rank must run it; `keep=False` emits None (the
    rank takes part in the gathers only)."""
    import offload.units.collectives as _dist

    def run(emit: Emit) -> None:
        for unit in sharded.units:
            with sharded.optimizer.unit_state(unit.index) as state:
                master = unit.shard_values(state["master"])
                if sharded.world_size == 1:
                    full = master
                else:
                    dev = _dist.collective_device(sharded.pg, sharded.device)
                    full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=dev)
                    _dist.all_gather_into(full, master.to(dev), sharded.pg)
                emit(unit.index, full if keep else None)  # inside: the NVMe buffer is live
                del full

    return run


def checkpoint_units(path: str, saved: dict[str, Any], window: int = DEFAULT_WINDOW) -> Source:
    """A checkpoint's units: each unit's flat values in fp32 assembled from every rank file
    (its masters, and the frozen values cast up; chunk CRCs verified), reads running ahead
    while the previous unit is emitted."""
    from offload.storage.io import AIOHandle

    units = {u["index"]: u for u in saved["model"]["units"]}

    def run(emit: Emit) -> None:
        records = manifest.records_by_rank(path, saved)
        pending: dict[int, torch.Tensor] = {}

        def groups():
            for index, unit in units.items():
                n = unit_numel(unit)
                full = torch.empty(n, dtype=torch.float32)  # gaps zeroed by assemble_jobs
                pending[index] = full
                jobs = []
                for name, lo, hi in manifest.value_records(unit):  # masters, frozen values
                    if lo < min(hi, n):
                        jobs += assemble_jobs(records, unit, name, lo, full[lo : min(hi, n)],
                                              saved["chunk_bytes"], index)
                yield index, jobs

        handle = AIOHandle()
        try:
            ShardReader(handle, saved["chunk_bytes"], window).run(
                groups(), lambda index: emit(index, pending.pop(index))
            )
        finally:
            handle.close()

    return run


# -- engine.full_state_dict, engine.load_full_state_dict ------------------------------------------


@torch.no_grad()
def full_state_dict(sharded: ShardedState, rank0_only: bool = True) -> dict[str, Any]:
    """`engine.full_state_dict()`: the consolidated fp32 weights with exactly
    `model.state_dict()`'s keys (a tied parameter's names share one tensor; buffers in
    their original dtype; non-tensor extra state as is), on CPU. Every rank must call it;
    with `rank0_only` the other ranks take part in the gathers and get {}."""
    keep = sharded.rank == 0 or not rank0_only
    params: dict[str, torch.Tensor] = {}

    def put(keys: list[str], value: torch.Tensor) -> None:
        copy = value.to("cpu", copy=True)
        for key in keys:
            params[key] = copy

    stream_full_weights(manifest.model_signature(sharded), engine_units(sharded, keep), put)
    if not keep:
        return {}
    out: dict[str, Any] = {}
    for entry in sharded.state_dict_index:
        if entry.location is Location.PARAM:
            out[entry.key] = params[entry.key]
        elif entry.location is Location.BUFFER:
            buffer = entry.where
            dtype = sharded.buffer_dtypes.get(id(buffer), buffer.dtype)
            out[entry.key] = buffer.detach().to("cpu", dtype=dtype, copy=True)
        else:
            out[entry.key] = entry.where
    return out


@torch.no_grad()
def load_full_state_dict(
    sharded: ShardedState, state_dict: Mapping[str, Any], strict: bool = True
) -> None:
    """`engine.load_full_state_dict()`: consolidated weights (as `full_state_dict` returns
    them) into the masters and parameter shards. Every rank passes the full dict (e.g. each
    `torch.load`s it) and keeps its own slice; optimizer moments are left as they are.

    `strict`: the keys must be exactly `model.state_dict()`'s (KeyError naming the missing
    and unexpected ones); otherwise absent keys keep their values and unknown ones are
    ignored. A tied parameter is taken from its first name in state-dict order; buffers are
    copied whole (cast to the dtype they run in); non-tensor extra state is not loaded."""
    refuse_while_gathered(sharded.units, "engine.load_full_state_dict")
    sharded.sync_device()  # queued host-to-device copies still read the shards rewritten here
    keys = [entry.key for entry in sharded.state_dict_index]
    if strict:
        known = set(keys)
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in known]
        if missing or unexpected:
            raise KeyError(
                f"state dict does not match the model: missing keys {missing[:10]}"
                f"{'...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                f"{'...' if len(unexpected) > 10 else ''}"
            )
    per_unit: dict[int, list[tuple[int, torch.Tensor]]] = {}
    """unit index -> (slot index, full value) of the parameters given for it."""
    for entry in sharded.state_dict_index:
        if entry.key not in state_dict:
            continue
        value = state_dict[entry.key]
        if entry.location is Location.PARAM:
            ui, si = entry.where
            if any(s == si for s, _ in per_unit.get(ui, ())):
                continue  # a tied parameter's second name: its slot is already taken
            per_unit.setdefault(ui, []).append((si, torch.as_tensor(value)))
        elif entry.location is Location.BUFFER:
            buffer = entry.where
            buffer.copy_(torch.as_tensor(value).to(buffer.dtype))
    for ui, unit in enumerate(sharded.units):
        # One unit at a time: on NVMe its state is read, changed and written back (only
        # when a value was given for it; every unit's shard is republished regardless). A
        # frozen parameter's value goes to the parameter shard, the only place it lives.
        with sharded.optimizer_states.open(ui, write=ui in per_unit) as t:
            unit.write_slots(per_unit.get(ui, ()), t.master)
