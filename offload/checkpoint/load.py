"""`load_checkpoint`: verify, then stream each unit's state back, re-sharding as needed.

Order: resolve the tag (`latest` by default), read the manifest, check every listed file's
size and the model signature — all before any engine state changes. Then, unit by unit,
this rank's shard under the *current* layout is assembled from the saved rank files:
elements [rank * shard_numel, (rank + 1) * shard_numel) of the flat unit, taken from
whichever saved ranks held them (one when the world size is unchanged; any number when it
differs, since offsets are world-size independent and only the cut moves). Each chunk's
CRC is checked as it lands; a unit is handed to `ShardedAdam.load_unit_state` as soon as
its last chunk is in, so at most a unit or two of state is in RAM. The values of frozen
parameters (which have no master) are read into the parameter shard's frozen suffix the
same way and published with it. Per-parameter step
counts are mapped by name. Finally the small state: counters, loss scaler, scheduler,
optimizer hyperparameters, buffers and RNG states.

[Note: load destinations]
With the optimizer state in host memory (the 'host' store, whose `unit_state` hands out
the optimizer's own tensors), chunks are read into the staging ring, verified, and copied
by the verify threads straight into those tensors; `load_unit_state` then gets the same
tensors back (its copy is a no-op: `Tensor.copy_` returns at once when source and
destination are the same tensor) and only republishes the parameter shard. Before, every
unit went through two page-aligned buffer sets and then `load_unit_state`'s copy on the
main thread: measured on the 2-core VM, that copy alone was half of a 0.76 GB load
(0.20 of 0.41 s). Large live tensors are page-aligned (`offload.optim.sharded.host_state_zeros`),
so every whole chunk is read by O_DIRECT straight into them; only a record's last, partial
chunk (and small tensors, from the CPU allocator) goes through the ring and is copied.
With the state on NVMe, each unit's chunks land straight in a pooled buffer laid out as its
swap slot (`ShardedAdam.begin_overwrite`, not read first) and are verified there. Then:
- same world size, layout and dtypes, on a filesystem with O_DIRECT (the usual resume):
  the unit is *adopted* ([Note: adopted state] in offload/storage/optim_state.py). Its state stays
  in the checkpoint's shard file, which the store holds open and reads until the unit's
  next write. No swap write at all: the load costs one read of the state, not a read and a
  write.
- otherwise (re-sharding, other moment dtypes): one asynchronous write stores the buffer
  in the swap slot (`end_overwrite`) while the next unit's chunks are read: no copy, and
  the swap write overlaps the checkpoint reads.

What is loaded (`LoadParts`, DeepSpeed's `load_checkpoint` flags):
- everything (the default): the weights (masters and frozen values), the optimizer's
  moments and per-parameter step counts, hyperparameters, scheduler, counters, loss scale,
  buffers, RNG states;
- `load_optimizer_states=False`: the weights, buffers, counters, loss scale, scheduler and
  RNG states, not the optimizer's moments, step counts and hyperparameters (this engine's
  stay, fresh ones for a new engine: fine-tuning from a checkpoint with a new optimizer);
- `load_lr_scheduler_states=False`: everything but the scheduler (this engine's stays; a
  checkpoint with or without one then loads into an engine with or without one);
- `load_module_only=True`: the weights and buffers only; the client_state is still returned.
Each weight-only unit is put together with this engine's own moments and step counts and
stored through `load_unit_state` (through to NVMe): one unit at a time.

Re-sharding and RNG: a rank that existed in the saving run gets its own RNG states and
`client_state` back; a rank beyond the saved world size gets rank 0's `client_state` and
keeps its RNG states (there are none saved for it).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from offload.storage.io import probe_direct_io
from offload.storage.nvme import NVMeContext
from offload.storage.optim_state import NVMeOptimizerStates
from offload.storage.split_states import SplitOptimizerStates
from offload.storage.state_layout import StateLayout, StateSpec, UnitTensors
from offload.checkpoint import files, manifest
from offload.checkpoint.shards import (
    DEFAULT_WINDOW,
    CheckpointStaging,
    CheckpointCorruptError,
    ReadJob,
    ShardReader,
    assemble_jobs,
)
from offload.dtypes import name_of
from offload.runtime.gathered import refuse_while_gathered
from offload.runtime.view import Location, ShardedState
from offload.units.shard import FlatUnit


@dataclass(frozen=True)
class LoadParts:
    """What of a checkpoint `load_checkpoint` restores (DeepSpeed's flags; module docstring)."""

    optimizer_states: bool = True
    """The optimizer's moments, per-parameter step counts and hyperparameters."""
    lr_scheduler_states: bool = True
    """The learning-rate scheduler's state."""
    module_only: bool = False
    """The weights and buffers only (overrides the two above)."""

    @property
    def moments(self) -> bool:
        return self.optimizer_states and not self.module_only


def load_checkpoint(
    sharded: ShardedState, load_dir: str, tag: Optional[str] = None, *,
    window: int = DEFAULT_WINDOW, copy_to_swap: Optional[bool] = None, parts: LoadParts = LoadParts(),
    staging: Optional[CheckpointStaging] = None,
) -> tuple[str, Any]:
    """Load `load_dir/<tag>` (default: the tag `latest` names) into `sharded` (the engine's
    state). Every rank must call it. Returns (checkpoint path, this rank's client_state).
    `copy_to_swap`: see `Engine.load_checkpoint`. `staging`: the engine's (None: one for
    this call)."""
    if copy_to_swap not in (None, True, False):
        raise TypeError(f"copy_to_swap must be None, True or False, got {copy_to_swap!r}")
    refuse_while_gathered(sharded.units, "engine.load_checkpoint")
    path = files.resolve_tag(os.fspath(load_dir), tag)
    saved = manifest.read(path)
    # At the saving world size each rank reads its own files only (which is all a node
    # holds of a checkpoint saved to node-local directories); re-sharding reads them all.
    same = saved["world_size"] == sharded.world_size
    manifest.verify_files(path, saved, [sharded.rank] if same else None)
    manifest.check_compatible(saved, sharded)
    own = sharded.rank if sharded.rank < saved["world_size"] else 0
    small = read_rank_state(path, saved, own)
    scheduler = parts.lr_scheduler_states and not parts.module_only
    if scheduler and (small["lr_scheduler"] is None) != (sharded.lr_scheduler is None):
        have = "has" if small["lr_scheduler"] is not None else "has no"
        mine = "has one" if sharded.lr_scheduler is not None else "has none"
        raise ValueError(
            f"checkpoint {path!r} {have} learning-rate scheduler state but this engine {mine}; "
            "build the engine with the same lr_scheduler / config.scheduler as the saving run, "
            "or load with load_lr_scheduler_states=False"
        )
    sharded.sync_device()
    sharded.optimizer.clear_grads()  # gradients of the interrupted step go
    io = staging or CheckpointStaging()
    try:
        steps = small["slot_steps"] if same else _steps_of_every_rank(path, saved)
        load_units(sharded, path, saved, steps, io, window=window, copy_to_swap=copy_to_swap,
                   moments=parts.moments)
    finally:
        if staging is None:
            io.close()
    _restore_small_state(sharded, small, restore_rng=sharded.rank < saved["world_size"], parts=parts)
    return path, small["client_state"]


def _steps_of_every_rank(path: str, saved: dict[str, Any]) -> dict[str, int]:
    """Each parameter's step count for a load at another world size: the largest any saving
    rank recorded. Every rank counts every updated parameter, but a checkpoint written before
    that was so has 0 on a rank whose shard of a unit held only padding or frozen values, and
    re-sharding may hand that rank's successor real elements: Adam's bias correction would then
    restart, a silently different update."""
    steps: dict[str, int] = {}
    for rank in range(saved["world_size"]):
        for name, step in read_rank_state(path, saved, rank)["slot_steps"].items():
            steps[name] = max(int(step), steps.get(name, 0))
    return steps


def read_rank_state(path: str, saved: dict[str, Any], rank: int) -> dict[str, Any]:
    """The small state rank `rank` saved (verified against its size and CRC)."""
    entry = saved["ranks"][rank]["state"]
    file = os.path.join(path, entry["file"])
    with open(file, "rb") as f:
        data = f.read()
    if len(data) != entry["size"] or (zlib.crc32(data) & 0xFFFFFFFF) != entry["crc32"]:
        raise CheckpointCorruptError(
            5, f"checkpoint file {file!r} is corrupt (size or checksum differs from the "
            "manifest); do not load it, use another tag", file,
        )
    # Our own file, checksummed: it holds the caller's client_state, any picklable object.
    return torch.load(io.BytesIO(data), weights_only=False)


def load_units(
    sharded: ShardedState, path: str, saved: dict[str, Any], steps_by_name: dict[str, int],
    staging: CheckpointStaging, *, window: int = DEFAULT_WINDOW, copy_to_swap: Optional[bool] = None,
    moments: bool = True,
) -> None:
    """Every unit's master and moments (this rank's shard under the current layout) from
    checkpoint `path` into the optimizer's store, with per-parameter step counts from
    `steps_by_name` (0 for a name not there). `moments` False: the masters (and frozen
    values) only, stored with this engine's own moments and step counts. See the module
    docstring."""
    staging_io = staging.get(sharded.config.aio, 0.0, saved["chunk_bytes"], window)
    old_units = {u["name"]: u for u in saved["model"]["units"]}
    records = manifest.records_by_rank(path, saved)
    pending: dict[int, dict[str, torch.Tensor]] = {}
    rank = sharded.rank
    per = {spec.name: spec.per for spec in sharded.optimizer.specs}
    """Flat elements per element of each state tensor (8-bit moments' per-block scales)."""

    # Where each unit's chunks land ([Note: load destinations]).
    in_place = state_in_host_memory(sharded)
    weights_only = not moments
    slots: dict[int, UnitTensors] = {}
    """NVMe: the pooled slot-layout buffers the chunks land in (`begin_overwrite`)."""
    sources: dict[int, tuple[str, dict[str, int]]] = {}
    """NVMe: units adopted in place (their state left in the checkpoint file)."""
    readable = ({} if in_place or copy_to_swap or sharded.nvme is None  # (device units: host copies)
                else _readable_in_place(sharded, records, copy_to_swap))

    def groups() -> Iterator[tuple[int, list[ReadJob]]]:
        for unit in sharded.units:
            layout = unit.layout
            n_opt = layout.shard_optimized_numel(rank)
            if weights_only:
                dest = {"master": torch.empty(unit.master_numel, dtype=torch.float32)}
            elif in_place or sharded.optimizer.store.resident_at(unit.index):
                with sharded.optimizer.unit_state(unit.index) as live:
                    # the host store's own tensors: they outlive the context
                    dest = {name: live[name] for name in ("master", *sharded.optimizer.state_names)}
                _check_live(unit, dest, unit.master_numel, n_opt, sharded.optimizer.specs)
            else:
                t = sharded.optimizer.begin_overwrite(unit.index)
                if t is None:
                    raise RuntimeError("the optimizer store hands out neither live tensors nor slots")
                slots[unit.index] = t
                dest = {"master": t.master, **t.moments}
            pending[unit.index] = dest
            old = old_units[unit.name]
            if unit.index in slots:
                source = _source_in_place(sharded, saved, old, records, unit, readable)
                if source is not None:
                    sources[unit.index] = source
            lo = rank * layout.shard_numel
            jobs: list[ReadJob] = []
            for name, tensor in dest.items():
                jobs += assemble_jobs(records, old, name, lo, tensor, saved["chunk_bytes"], unit.index,
                                      per=per.get(name, 1))
            if unit.frozen_numel:
                # Frozen values go to the parameter shard: straight into it when it is host
                # memory, else into a buffer `publish` stores. A version-1 checkpoint holds
                # them in its masters (`manifest.value_records`).
                frozen = dest["frozen"] = unit.frozen_buffer()
                name = "frozen" if "master_end" in old else "master"
                jobs += assemble_jobs(records, old, name, lo + unit.master_numel, frozen,
                                      saved["chunk_bytes"], unit.index)
            yield unit.index, jobs

    def on_done(index: int) -> None:
        dest = pending.pop(index)
        unit = next(u for u in sharded.units if u.index == index)
        if weights_only:  # this engine's own moments and step counts, the checkpoint's weights
            with sharded.optimizer.unit_state(index) as live:
                own = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in live.items()}
            sharded.optimizer.load_unit_state(index, {**own, **dest})
            return
        steps = [int(steps_by_name.get(s.name, 0)) for s in unit.layout.slots]
        if index in slots:
            # read straight into the slot's buffer: one asynchronous write stores it
            sharded.optimizer.end_overwrite(index, slots.pop(index), steps, sources.pop(index, None),
                                            frozen=dest.get("frozen"))
            return
        sharded.optimizer.load_unit_state(index, {**dest, "slot_steps": steps})

    try:
        with _one_torch_thread():
            reader = ShardReader(staging_io.handle, saved["chunk_bytes"], window, staging_io.ring)
            reader.run(groups(), on_done, max_open_groups=_open_units(sharded, in_place))
    finally:
        for index, t in slots.items():  # a failed load: buffers back, nothing written
            sharded.optimizer.abandon_overwrite(index, t)


def _source_in_place(
    sharded: ShardedState, saved: dict[str, Any], old: dict[str, Any], records: list[tuple[str, dict]],
    unit: FlatUnit, readable: dict[str, bool],
) -> Optional[tuple[str, dict[str, int]]]:
    """(shard file, where each of this rank's state tensors of `unit` starts in it), when
    they lie there exactly as in the swap slot (same world size and shard, fp32 master,
    the store's moment dtype) and the file may be read in place (`readable`); else None
    (the load copies the state into the slot). See [Note: adopted state] in
    offload/storage/optim_state.py."""
    store = sharded.optimizer.store
    if store.resident_at(unit.index) or saved["world_size"] != sharded.world_size or sharded.nvme is None:
        return None  # (a unit on the compute device is never read in place)
    file, by_key = records[sharded.rank]
    if old["shard_numel"] != unit.layout.shard_numel or not readable.get(file):
        return None
    lay = _disk_layouts(sharded)[unit.index]
    offsets = {}
    tensors = [("master", torch.float32, lay.master_numel)]
    tensors += [(spec.name, spec.dtype, lay.numel_of(spec)) for spec in lay.specs]
    for name, dtype, numel in tensors:
        rec = by_key.get((old["index"], name))
        if rec is None or rec["numel"] != numel or rec["dtype"] != name_of(dtype):
            return None
        offsets[name] = int(rec["offset"])
    return file, offsets


def _readable_in_place(
    sharded: ShardedState, records: list[tuple[str, dict]], copy_to_swap: Optional[bool]
) -> dict[str, bool]:
    """Which shard files the NVMe store may read in place of its slots: with O_DIRECT (the
    step's reads stay direct), and by default (`copy_to_swap` None) only on the swap
    directory's own filesystem, where reading the checkpoint costs what reading the slot
    would; a checkpoint on other storage (a network share) is copied during the load."""
    swap_dev = os.stat(_nvme(sharded).directory.path).st_dev
    out = {}
    for file, _ in records:
        if not os.path.exists(file):
            continue  # another node's file (node-local checkpoint): not read by this rank
        ok = probe_direct_io(file)
        if ok and copy_to_swap is None:
            ok = os.stat(file).st_dev == swap_dev
        out[file] = ok
    return out


def _open_units(sharded: ShardedState, in_place: bool) -> int:
    """Units whose chunks may be in flight at once: two (the next unit's reads overlap this
    one's swap write), or one when the pinned pool holds only one NVMe slot buffer."""
    if in_place or sharded.nvme is None:
        return 2
    largest = max((lay.nbytes for lay in _disk_layouts(sharded)), default=0)
    return 2 if 2 * largest <= _nvme(sharded).staging.budget_bytes else 1


def _disk_layouts(sharded: ShardedState) -> list[StateLayout]:
    """The slot layouts of an optimizer store with state on NVMe (the paths that read them
    run only then)."""
    store = sharded.optimizer.store
    if not isinstance(store, (NVMeOptimizerStates, SplitOptimizerStates)):
        raise TypeError(f"{type(store).__name__} keeps no optimizer state on NVMe")
    return store.layouts


def _nvme(sharded: ShardedState) -> NVMeContext:
    if sharded.nvme is None:
        raise TypeError("this engine has no NVMe tier")
    return sharded.nvme


def state_in_host_memory(sharded: ShardedState) -> bool:
    """Whether `unit_state` hands out the optimizer's own host tensors (the 'host' store),
    which a load may then fill in place and a save write straight from; the NVMe store
    hands out pooled copies (a save then reads the next unit ahead)."""
    return sharded.optimizer.store.resident


def _check_live(unit: FlatUnit, dest: dict[str, torch.Tensor], n_master: int, n_opt: int,
                specs: Sequence[StateSpec]) -> None:
    numel = {spec.name: spec.numel(n_opt) for spec in specs}
    for name, t in dest.items():
        want = n_master if name == "master" else numel[name]
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != want:
            raise RuntimeError(
                f"unit {unit.name or '<root>'} {name}: the host optimizer state is not a "
                f"contiguous CPU tensor of {want} elements ({tuple(t.shape)} on {t.device})"
            )


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """`load_unit_state` copies each unit with `Tensor.copy_`, which splits a large copy
    over torch's intra-op threads; beside the I/O and checksum threads that split waits on
    its slowest thread (see `shards.copy_bytes`). One thread copies at memory speed."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@torch.no_grad()
def _restore_small_state(sharded: ShardedState, small: dict[str, Any], restore_rng: bool,
                         parts: LoadParts = LoadParts()) -> None:
    """Counters, loss scaler, optimizer hyperparameters, scheduler, buffers and (when this
    rank saved them) RNG states from the rank's small state `small`, as far as `parts` says."""
    buffers = small["buffers"]
    for entry in sharded.state_dict_index:
        if entry.location is Location.BUFFER and entry.key in buffers:
            buffer = entry.where
            buffer.copy_(buffers[entry.key].to(device=buffer.device, dtype=buffer.dtype))
    if parts.module_only:
        return
    counters = sharded.counters
    counters.global_steps = int(small["global_steps"])
    counters.micro_steps = int(small["micro_steps"])
    counters.skipped_steps = int(small["skipped_steps"])
    counters.last_grad_norm = small["last_grad_norm"]
    sharded.scaler.load_state_dict(small["loss_scaler"])
    if parts.optimizer_states:
        for mine, theirs in zip(sharded.optimizer.param_groups, small["param_groups"]):
            mine.update(theirs)
    if parts.lr_scheduler_states and sharded.lr_scheduler is not None and small["lr_scheduler"] is not None:
        sharded.lr_scheduler.load_state_dict(small["lr_scheduler"])
        last = getattr(sharded.lr_scheduler, "get_last_lr", None)  # a torch LRScheduler (the user's)
        if not parts.optimizer_states and callable(last):
            # the groups' other hyperparameters stay this engine's; the rate is the schedule's
            for group, lr in zip(sharded.optimizer.param_groups, last()):
                group["lr"] = lr
    if restore_rng:
        set_rng_state(small["rng"])


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        try:
            import numpy

            numpy.random.set_state(rng["numpy"])
        except ImportError:
            pass
