"""The model's full fp32 weights, unit by unit: the one path behind consolidation and
`engine.full_state_dict()`.

Both need the same thing: for every unit, its full flat fp32 master (all ranks' shards
joined), and every parameter's slice of it under each of its `model.state_dict()` names
(tied parameters have several). They differ only in where the flat unit comes from and
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
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from offload.checkpoint import manifest
from offload.checkpoint.load import _assemble, _records_by_rank
from offload.checkpoint.shards import DEFAULT_WINDOW, ShardReader

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


def engine_units(engine: Any, keep: bool = True) -> Source:
    """A live engine's units: each rank's fp32 master shard, read through
    `ShardedAdam.unit_state` (NVMe: one unit in host memory at a time) and joined by an
    all-gather at world size > 1. Every rank must run it; `keep=False` emits None (the
    rank takes part in the gathers only)."""
    import offload.units.collectives as _dist

    def run(emit: Emit) -> None:
        for unit in engine.units:
            with engine.optimizer.unit_state(unit.index) as state:
                master = state["master"]
                if engine.world_size == 1:
                    full = master
                else:
                    dev = _dist.collective_device(engine.pg, engine.device)
                    full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=dev)
                    _dist.all_gather_into(full, master.to(dev), engine.pg)
                emit(unit.index, full if keep else None)  # inside: the NVMe buffer is live
                del full

    return run


def checkpoint_units(path: str, saved: dict[str, Any], window: int = DEFAULT_WINDOW) -> Source:
    """A checkpoint's units: each unit's flat master assembled from every rank file (chunk
    CRCs verified), reads running ahead while the previous unit is emitted."""
    from offload.storage.io import AIOHandle

    units = {u["index"]: u for u in saved["model"]["units"]}

    def run(emit: Emit) -> None:
        records = _records_by_rank(path, saved)
        pending: dict[int, torch.Tensor] = {}

        def groups():
            for index, unit in units.items():
                full = torch.empty(unit_numel(unit), dtype=torch.float32)  # _assemble zeroes gaps
                pending[index] = full
                yield index, _assemble(records, unit, "master", 0, full, saved["chunk_bytes"], index)

        handle = AIOHandle()
        try:
            ShardReader(handle, saved["chunk_bytes"], window).run(
                groups(), lambda index: emit(index, pending.pop(index))
            )
        finally:
            handle.close()

    return run


# -- engine.full_state_dict -----------------------------------------------------------------------


@torch.no_grad()
def full_state_dict(engine: Any, rank0_only: bool = True) -> dict[str, Any]:
    """`engine.full_state_dict()`: the consolidated fp32 weights with exactly
    `model.state_dict()`'s keys (a tied parameter's names share one tensor; buffers in
    their original dtype; non-tensor extra state as is), on CPU. Every rank must call it;
    with `rank0_only` the other ranks take part in the gathers and get {}."""
    keep = engine.rank == 0 or not rank0_only
    params: dict[str, torch.Tensor] = {}

    def put(keys: list[str], value: torch.Tensor) -> None:
        copy = value.to("cpu", copy=True)
        for key in keys:
            params[key] = copy

    stream_full_weights(manifest.model_signature(engine), engine_units(engine, keep), put)
    if not keep:
        return {}
    out: dict[str, Any] = {}
    for key, (kind, what) in engine._sd_index:
        if kind == "param":
            out[key] = params[key]
        elif kind == "buffer":
            dtype = engine._buffer_dtypes.get(id(what), what.dtype)
            out[key] = what.detach().to("cpu", dtype=dtype, copy=True)
        else:
            out[key] = what
    return out
