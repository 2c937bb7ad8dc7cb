"""`load_checkpoint`: verify, then stream each unit's state back, re-sharding as needed.

Order: resolve the tag (`latest` by default), read the manifest, check every listed file's
size and the model signature — all before any engine state changes. Then, unit by unit,
this rank's shard under the *current* layout is assembled from the saved rank files:
elements [rank * shard_numel, (rank + 1) * shard_numel) of the flat unit, taken from
whichever saved ranks held them (one when the world size is unchanged; any number when it
differs, since offsets are world-size independent and only the cut moves). Each chunk's
CRC is checked as it lands; a unit is handed to `ShardedAdam.load_unit_state` as soon as
its last chunk is in, so at most a unit or two of state is in RAM. Per-parameter step
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
from typing import Any, Iterator, Optional

import torch

from offload.storage.io import probe_direct_io
from offload.checkpoint import files, manifest
from offload.checkpoint.shards import (
    DTYPES,
    DEFAULT_WINDOW,
    Staging,
    CheckpointCorruptError,
    ReadJob,
    ShardReader,
    chunk_jobs,
)


def load_checkpoint(
    engine: Any, load_dir: str, tag: Optional[str] = None, *, window: int = DEFAULT_WINDOW,
    copy_to_swap: Optional[bool] = None,
) -> tuple[str, Any]:
    """Load `load_dir/<tag>` (default: the tag `latest` names) into `engine`. Every rank
    must call it. Returns (checkpoint path, this rank's client_state). `copy_to_swap`: see
    `Engine.load_checkpoint`."""
    if copy_to_swap not in (None, True, False):
        raise TypeError(f"copy_to_swap must be None, True or False, got {copy_to_swap!r}")
    path = files.resolve_tag(os.fspath(load_dir), tag)
    saved = manifest.read(path)
    # At the saving world size each rank reads its own files only (which is all a node
    # holds of a checkpoint saved to node-local directories); re-sharding reads them all.
    same = saved["world_size"] == engine.world_size
    manifest.verify_files(path, saved, [engine.rank] if same else None)
    manifest.check_compatible(saved, engine)
    own = engine.rank if engine.rank < saved["world_size"] else 0
    state = read_rank_state(path, saved, own)
    if (state["lr_scheduler"] is None) != (engine.lr_scheduler is None):
        have = "has" if state["lr_scheduler"] is not None else "has no"
        mine = "has one" if engine.lr_scheduler is not None else "has none"
        raise ValueError(
            f"checkpoint {path!r} {have} learning-rate scheduler state but this engine {mine}; "
            "build the engine with the same lr_scheduler / config.scheduler as the saving run"
        )
    engine._sync_device()
    engine.optimizer.zero_grad()
    load_units(engine, path, saved, state["slot_steps"], window=window, copy_to_swap=copy_to_swap)
    _restore_small_state(engine, state, restore_rng=engine.rank < saved["world_size"])
    return path, state["client_state"]


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
    engine: Any, path: str, saved: dict[str, Any], steps_by_name: dict[str, int],
    *, window: int = DEFAULT_WINDOW, copy_to_swap: Optional[bool] = None,
) -> None:
    staging = Staging.of(engine, engine.config.aio, 0.0, saved["chunk_bytes"], window)
    old_units = {u["name"]: u for u in saved["model"]["units"]}
    records = _records_by_rank(path, saved)
    pending: dict[int, dict[str, torch.Tensor]] = {}
    rank = engine.rank

    # Where each unit's chunks land ([Note: load destinations]).
    in_place = _state_in_host_memory(engine)
    slots: dict[int, Any] = {}
    """NVMe: the pooled slot-layout buffers the chunks land in (`begin_overwrite`)."""
    sources: dict[int, tuple[str, dict[str, int]]] = {}
    """NVMe: units adopted in place (their state left in the checkpoint file)."""
    readable = {} if in_place or copy_to_swap else _readable_in_place(engine, records, copy_to_swap)

    def groups() -> Iterator[tuple[int, list[ReadJob]]]:
        for i, unit in enumerate(engine.units):
            layout = unit.layout
            n_opt = layout.shard_optimized_numel(rank)
            if in_place:
                with engine.optimizer.unit_state(unit.index) as live:
                    # the host store's own tensors: they outlive the context
                    dest = {name: live[name] for name in ("master", "exp_avg", "exp_avg_sq")}
                _check_live(unit, dest, layout.shard_numel, n_opt)
            else:
                t = engine.optimizer.begin_overwrite(unit.index)
                if t is None:
                    raise RuntimeError("the optimizer store hands out neither live tensors nor slots")
                slots[unit.index] = t
                dest = {"master": t.master, "exp_avg": t.exp_avg, "exp_avg_sq": t.exp_avg_sq}
            pending[unit.index] = dest
            old = old_units[unit.name]
            if not in_place:
                source = _source_in_place(engine, saved, old, records, unit, readable)
                if source is not None:
                    sources[unit.index] = source
            lo = rank * layout.shard_numel
            jobs: list[ReadJob] = []
            for name, t in dest.items():
                jobs += _assemble(records, old, name, lo, t, saved["chunk_bytes"], unit.index)
            yield unit.index, jobs

    def on_done(index: int) -> None:
        dest = pending.pop(index)
        unit = next(u for u in engine.units if u.index == index)
        steps = [int(steps_by_name.get(s.name, 0)) for s in unit.layout.slots]
        if index in slots:
            # read straight into the slot's buffer: one asynchronous write stores it
            engine.optimizer.end_overwrite(index, slots.pop(index), steps, sources.pop(index, None))
            return
        dest["slot_steps"] = steps
        engine.optimizer.load_unit_state(index, dest)

    try:
        with _one_torch_thread():
            reader = ShardReader(staging.handle, saved["chunk_bytes"], window, staging.ring)
            reader.run(groups(), on_done, max_open_groups=_open_units(engine, in_place))
    finally:
        for index, t in slots.items():  # a failed load: buffers back, nothing written
            engine.optimizer.abandon_overwrite(index, t)


def _source_in_place(
    engine: Any, saved: dict[str, Any], old: dict[str, Any], records: list[tuple[str, dict]],
    unit: Any, readable: dict[str, bool],
) -> Optional[tuple[str, dict[str, int]]]:
    """(shard file, where each of this rank's state tensors of `unit` starts in it), when
    they lie there exactly as in the swap slot (same world size and shard, fp32 master,
    the store's moment dtype) and the file may be read in place (`readable`); else None
    (the load copies the state into the slot). See [Note: adopted state] in
    offload/storage/optim_state.py."""
    store = engine.optimizer.store
    if store.kind != "nvme" or saved["world_size"] != engine.world_size:
        return None
    file, by_key = records[engine.rank]
    if old["shard_numel"] != unit.layout.shard_numel or not readable.get(file):
        return None
    lay = store.layouts[unit.index]
    offsets = {}
    for name, dtype, numel in (
        ("master", torch.float32, lay.master_numel),
        ("exp_avg", store.moment_dtype, lay.moment_numel),
        ("exp_avg_sq", store.moment_dtype, lay.moment_numel),
    ):
        rec = by_key.get((old["index"], name))
        if rec is None or rec["numel"] != numel or DTYPES.get(rec["dtype"]) != dtype:
            return None
        offsets[name] = int(rec["offset"])
    return file, offsets


def _readable_in_place(
    engine: Any, records: list[tuple[str, dict]], copy_to_swap: Optional[bool]
) -> dict[str, bool]:
    """Which shard files the NVMe store may read in place of its slots: with O_DIRECT (the
    step's reads stay direct), and by default (`copy_to_swap` None) only on the swap
    directory's own filesystem, where reading the checkpoint costs what reading the slot
    would; a checkpoint on other storage (a network share) is copied during the load."""
    swap_dev = os.stat(engine.nvme.directory.path).st_dev
    out = {}
    for file, _ in records:
        if not os.path.exists(file):
            continue  # another node's file (node-local checkpoint): not read by this rank
        ok = probe_direct_io(file)
        if ok and copy_to_swap is None:
            ok = os.stat(file).st_dev == swap_dev
        out[file] = ok
    return out


def _open_units(engine: Any, in_place: bool) -> int:
    """Units whose chunks may be in flight at once: two (the next unit's reads overlap this
    one's swap write), or one when the pinned pool holds only one NVMe slot buffer."""
    if in_place:
        return 2
    store = engine.optimizer.store
    largest = max((lay.nbytes for lay in store.layouts), default=0)
    return 2 if 2 * largest <= engine.nvme.staging.budget_bytes else 1


def _state_in_host_memory(engine: Any) -> bool:
    """Whether `unit_state` hands out the optimizer's own host tensors (the 'host' store),
    which a load may then fill in place; the NVMe store hands out pooled copies."""
    return engine.optimizer.store.kind == "host"


def _check_live(unit: Any, dest: dict[str, torch.Tensor], shard_numel: int, n_opt: int) -> None:
    for name, want in (("master", shard_numel), ("exp_avg", n_opt), ("exp_avg_sq", n_opt)):
        t = dest[name]
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


def _records_by_rank(path: str, saved: dict[str, Any]) -> list[tuple[str, dict]]:
    out = []
    for entry in saved["ranks"]:
        shards = entry["shards"]
        by_key = {(r["unit"], r["name"]): r for r in shards["tensors"]}
        out.append((os.path.join(path, shards["file"]), by_key))
    return out


def _assemble(
    records: list[tuple[str, dict]], old_unit: dict[str, Any], name: str, lo: int,
    dest: torch.Tensor, chunk_bytes: int, tag: Any,
) -> list[ReadJob]:
    """Jobs filling `dest` with flat elements [lo, lo + dest.numel()) of the saved unit's
    tensor `name`, from every saved rank whose part overlaps."""
    hi = lo + dest.numel()
    old_shard = old_unit["shard_numel"]
    jobs: list[ReadJob] = []
    spans = []
    for r, (file, by_key) in enumerate(records):
        rec = by_key[(old_unit["index"], name)]
        start = r * old_shard
        a, b = max(lo, start), min(hi, start + rec["numel"])
        if a < b:
            jobs += chunk_jobs(rec, file, chunk_bytes, a - start, b - start, dest[a - lo : b - lo], tag)
            spans.append((a - lo, b - lo))
    # What no saved rank holds (padding of a larger layout, moments past the optimized
    # prefix) is zero, as in a fresh engine; `dest` starts uninitialised.
    pos = 0
    for a, b in sorted(spans) + [(dest.numel(), dest.numel())]:
        if a > pos:
            dest[pos:a].zero_()
        pos = max(pos, b)
    return jobs


@torch.no_grad()
def _restore_small_state(engine: Any, state: dict[str, Any], restore_rng: bool) -> None:
    engine.global_steps = int(state["global_steps"])
    engine.micro_steps = int(state["micro_steps"])
    engine.skipped_steps = int(state["skipped_steps"])
    engine.last_grad_norm = state["last_grad_norm"]
    engine.scaler.load_state_dict(state["loss_scaler"])
    for mine, theirs in zip(engine.optimizer.param_groups, state["param_groups"]):
        mine.update(theirs)
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    buffers = state["buffers"]
    for key, (kind, what) in engine._sd_index:
        if kind == "buffer" and key in buffers:
            what.copy_(buffers[key].to(device=what.device, dtype=what.dtype))
    if restore_rng:
        set_rng_state(state["rng"])


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
