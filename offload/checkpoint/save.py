"""`save_checkpoint`: every rank writes its shards in parallel; rank 0 publishes.

Per rank (all at once, no collective in the data path):
- `rankNNNNN.shards`: for each unit in order, the fp32 master and the optimizer's state tensors
  (Adam's exp_avg and exp_avg_sq, Lion's exp_avg, Adagrad's sum: torch's names) of the
  rank's shard, read through `ShardedAdam.unit_state` (the contract the NVMe tier keeps, so
  state on NVMe streams through the same bounded buffers), and "frozen": the frozen suffix
  of the rank's parameter shard in the compute dtype (`FlatUnit.read_frozen`; the values
  of frozen parameters, which have no master: [Note: frozen parameters cost their shard
  only] in offload/units/layout.py), written by `ShardWriter` (O_DIRECT, checksummed, a
  few chunks in flight): never the whole state in RAM.
- `rankNNNNN.state`: small state as `torch.save` bytes: step counters, loss scaler,
  scheduler, optimizer hyperparameters, per-parameter step counts, RNG states (torch CPU,
  CUDA, python, numpy), model buffers, the user's `client_state`.
Then rank 0 gathers each rank's file records into `manifest.json` and publishes the
directory as described in [Note: crash safety] (offload/checkpoint/files.py).

A failure on any rank (disk full, permission) reaches every rank: all ranks exchange
their outcome before anything is published, each raises, and rank 0 removes the
temporary directory. The previous checkpoint and `latest` are never touched by a save
that does not complete.

[Note: node-local checkpoints] A shared filesystem is not required. Rank 0 names the
temporary directory and every rank makes it under its own `save_dir` (the same directory
when it is shared, a node's own disk when not) and writes its files there. After rank 0
has published its directory, the first rank of every other node (LOCAL_RANK 0) finds its
node's temporary directory still there exactly when its storage is not rank 0's, and
publishes it the same way with the same manifest. Each node then holds its own ranks'
files: loading at the saving world size needs nothing else (each rank reads its own
files); re-sharding needs every rank's files in one directory, and says so.
"""

from __future__ import annotations

import errno
import io
import os
import random
import zlib
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

import torch

from offload.checkpoint import files, manifest
from offload.checkpoint.load import state_in_host_memory
from offload.checkpoint.replicas import written_by_one_replica
from offload.checkpoint.shards import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW, ShardWriter, CheckpointStaging
from offload.optim.sharded import ShardedOptimizer
from offload.runtime.view import Location, ShardedState
from offload.units import collectives as _dist


def save_checkpoint(
    sharded: ShardedState,
    save_dir: str,
    tag: Optional[str] = None,
    client_state: Optional[dict[str, Any]] = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    window: int = DEFAULT_WINDOW,
    staging: Optional[CheckpointStaging] = None,
) -> str:
    """Write a checkpoint of `sharded` (the engine's state) to `save_dir/<tag>` and point
    `save_dir/latest` at it. Every rank must call it. Returns the checkpoint's path. See the
    module docstring; under HSDP one shard group writes ([Note: HSDP checkpoints]).
    `staging`: the engine's, kept between checkpoints (None: one for this call)."""
    return written_by_one_replica(sharded, lambda: _save(sharded, save_dir, tag, client_state,
                                                         chunk_bytes, window, staging))


def _save(sharded: ShardedState, save_dir: str, tag: Optional[str], client_state: Optional[dict[str, Any]],
          chunk_bytes: int, window: int, staging: Optional[CheckpointStaging]) -> str:
    save_dir = os.fspath(save_dir)
    tag = files.check_tag(tag if tag is not None else f"global_step{sharded.counters.global_steps}")
    if any(st.grad_shard.has_gradient for st in sharded.states):
        raise RuntimeError(
            "save_checkpoint called between micro-batches of an accumulation step: the "
            "accumulated gradients are not part of a checkpoint; save after engine.step() "
            "at an accumulation boundary"
        )
    sharded.sync_device()
    rank = sharded.rank
    tag = _validated_tag(sharded, tag)

    # 1. Rank 0 names the temporary directory (and clears what killed saves left); every
    #    rank makes it under its own save_dir, so node-local directories work as well as a
    #    shared one ([Note: node-local checkpoints]).
    prep: Any = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            files.remove_stale(save_dir)
            prep = ("ok", os.path.basename(files.new_temp_dir(save_dir, tag)))
        except OSError as exc:
            prep = ("error", _describe(exc, f"cannot create a checkpoint in {save_dir!r}"))
    prep = _broadcast(sharded, prep)
    if prep[0] != "ok":
        raise _as_oserror(prep[1])
    tmp = os.path.join(save_dir, prep[1])
    leader = rank != 0 and _local_rank(sharded) == 0
    if rank != 0:
        try:
            os.makedirs(tmp, exist_ok=True)  # a no-op on a directory shared with rank 0
            if leader:
                files.remove_stale(save_dir, keep=prep[1])
        except OSError:
            pass  # reported by this rank's write below

    # 2. Every rank writes its files.
    outcome: Any
    own_error: Optional[BaseException] = None
    try:
        io = staging or CheckpointStaging()
        try:
            outcome = ("ok", _write_rank(sharded, tmp, client_state, chunk_bytes, window, io))
        finally:
            if staging is None:
                io.close()
    except BaseException as exc:
        own_error = exc
        outcome = ("error", _describe(exc, f"rank {rank} failed writing checkpoint {tag!r}"))
    outcomes = _gather(sharded, outcome)
    failed = [o[1] for o in outcomes if o[0] != "ok"]

    # 3. Rank 0 writes the manifest and publishes; everyone learns the outcome (and the
    #    manifest, for the nodes whose directory rank 0 does not see).
    final = os.path.join(save_dir, tag)
    status: Any = None
    if rank == 0:
        if failed:
            status = ("error", failed[0])
        else:
            try:
                m = manifest.build(sharded, tag, chunk_bytes, [o[1] for o in outcomes])
                data = manifest.dumps(m)
                files.write_file_durably(os.path.join(tmp, files.MANIFEST), data)
                files.fsync_path(tmp)
                files.test_pause("rename")
                files.publish_dir(tmp, final)
                files.test_pause("latest")
                files.replace_file_durably(os.path.join(save_dir, files.LATEST), tag.encode() + b"\n")
                status = ("ok", final, data)
            except OSError as exc:
                status = ("error", _describe(exc, f"rank 0 failed publishing checkpoint {tag!r}"))
        if status[0] != "ok":
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    status = _broadcast(sharded, status)
    if status[0] != "ok":
        if os.path.isdir(tmp):  # this node's part of the failed save
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        if own_error is not None and isinstance(own_error, OSError):
            raise _as_oserror(status[1]) from own_error
        if own_error is not None:
            raise own_error
        raise _as_oserror(status[1])

    # 4. A node whose directory is its own (the temporary directory is still there after
    #    rank 0 published its own) publishes it the same way.
    published: Any = ("ok", None)
    if leader and os.path.isdir(tmp):
        try:
            files.write_file_durably(os.path.join(tmp, files.MANIFEST), status[2])
            files.fsync_path(tmp)
            files.publish_dir(tmp, final)
            files.replace_file_durably(os.path.join(save_dir, files.LATEST), tag.encode() + b"\n")
        except OSError as exc:
            published = ("error", _describe(exc, f"rank {rank} failed publishing checkpoint {tag!r} "
                                                 "in its node's directory"))
    published_all = _gather(sharded, published)
    bad = [p[1] for p in published_all if p[0] != "ok"]
    if bad:
        raise _as_oserror(bad[0])
    return status[1]


def _write_rank(
    sharded: ShardedState, tmp: str, client_state: Any, chunk_bytes: int, window: int,
    io: CheckpointStaging,
) -> dict[str, Any]:
    """This rank's two files in `tmp`; returns their records for the manifest."""
    rank = sharded.rank
    shards_path = os.path.join(tmp, files.shard_file(rank))
    staging = io.get(sharded.config.aio, files.io_delay_s(), chunk_bytes, window)
    writer = ShardWriter(staging.handle, shards_path, chunk_bytes, window, staging.ring)
    # NVMe: read the next unit's state from the swap file while this one is written.
    states = _UnitStates(sharded.optimizer, ahead=not state_in_host_memory(sharded))
    slot_steps: dict[int, list[int]] = {}
    try:
        writer.preallocate(_shards_bytes(sharded))
        indices = [unit.index for unit in sharded.units]
        for i, index in enumerate(indices):
            state = states.open(index, writer, following=indices[i + 1 : i + 2])
            for name in ("master", *sharded.optimizer.state_names):
                writer.write(index, name, state[name])
            writer.write(index, "frozen", sharded.units[index].read_frozen())
            slot_steps[index] = [int(s) for s in state["slot_steps"]]
            # the workers read the state's tensors until then (NVMe: pooled buffers)
            writer.when_written(states.closer(index))
            if i == 0:
                files.test_pause("shards")
        size = writer.finish()
    except BaseException:
        writer.abort()  # waits for every write before any buffer is let go
        raise
    finally:
        states.close_all()
    state_bytes = _state_bytes(sharded, client_state, slot_steps)
    state_path = os.path.join(tmp, files.state_file(rank))
    files.write_file_durably(state_path, state_bytes)
    return {
        "rank": rank,
        "shards": {"file": files.shard_file(rank), "size": size, "tensors": writer.records},
        "state": {
            "file": files.state_file(rank), "size": len(state_bytes),
            "crc32": zlib.crc32(state_bytes) & 0xFFFFFFFF,
        },
    }


class _UnitStates:
    """`optimizer.unit_state(i)` contexts, opened one unit ahead on a helper thread when
    `ahead` (the NVMe store reads a unit's state from the swap file on entry: that read
    then overlaps the previous unit's checkpoint writes), and closed by the writer's
    `when_written` callback once the unit's bytes are on disk.

    The NVMe store's staging pool does not wait for buffers held by open contexts: it
    raises RuntimeError when its budget cannot hold another unit. Then the unit is opened
    again on this thread after every earlier unit's writes have retired and their contexts
    closed (and a failed read ahead stops reading ahead for the rest of the save); a
    failure with nothing of this save open is the caller's, raised as is.
    """

    def __init__(self, optimizer: ShardedOptimizer, ahead: bool) -> None:
        self.optimizer = optimizer
        self.ahead = ahead
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-read-ahead") if ahead else None
        self._opened: dict[int, AbstractContextManager[dict[str, Any]]] = {}
        """index -> entered context, not yet closed."""
        self._next: Optional[tuple[int, Future]] = None

    def _enter(self, index: int) -> tuple[AbstractContextManager[dict[str, Any]], dict[str, Any]]:
        cm = self.optimizer.unit_state(index)
        return cm, cm.__enter__()

    def open(self, index: int, writer: ShardWriter, following: list[int]) -> dict[str, Any]:
        """Unit `index`'s state (entered), and the read of `following` started."""
        got: Optional[tuple[Any, dict[str, Any]]] = None
        if self._next is not None:
            ahead_index, fut = self._next
            self._next = None
            assert ahead_index == index, (ahead_index, index)
            try:
                got = fut.result()
            except RuntimeError:
                self.ahead = False  # the budget holds too few units: read in turn from now on
        if got is None:
            try:
                got = self._enter(index)
            except RuntimeError:
                if not self._opened:
                    raise  # nothing of this save holds the budget: not ours to fix
                writer.settle()  # earlier units' writes done, their contexts closed
                got = self._enter(index)
        cm, state = got
        self._opened[index] = cm
        if self.ahead and following:
            assert self._pool is not None, "reading ahead was on from the start: the pool exists"
            self._next = (following[0], self._pool.submit(self._enter, following[0]))
        return state

    def closer(self, index: int) -> Callable[[], None]:
        def close() -> None:
            cm = self._opened.pop(index, None)
            if cm is not None:
                cm.__exit__(None, None, None)

        return close

    def close_all(self) -> None:
        """Once the writer is drained: close what is still open (after an error), quietly,
        and stop the helper thread."""
        if self._next is not None:
            _, fut = self._next
            self._next = None
            try:
                cm, _ = fut.result()
                self._opened[-1] = cm
            except BaseException:
                pass
        for cm in list(self._opened.values()):
            try:
                cm.__exit__(None, None, None)
            except BaseException:
                pass
        self._opened.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _shards_bytes(sharded: ShardedState) -> int:
    """The size of this rank's shard file: per unit, the master, the state tensors and the
    frozen suffix, each rounded up to 4 KiB (ShardWriter's layout)."""
    from offload.sizes import align_up

    total = 0
    for unit in sharded.units:
        n_opt = unit.layout.shard_optimized_numel(sharded.rank)
        total += align_up(unit.master_numel * 4)
        total += sum(align_up(s.numel(n_opt) * s.dtype.itemsize) for s in sharded.optimizer.specs)
        total += align_up(unit.frozen_numel * unit.dtype.itemsize)
    return total


def _state_bytes(sharded: ShardedState, client_state: Any, slot_steps: dict[int, list[int]]) -> bytes:
    """The rank's small state (`rankNNNNN.state`) as `torch.save` bytes."""
    opt = sharded.optimizer
    names = {u.index: [s.name for s in u.layout.slots] for u in sharded.units}
    buffers, extra = {}, {}
    for entry in sharded.state_dict_index:
        if entry.location is Location.BUFFER:
            buffer = entry.where
            dtype = sharded.buffer_dtypes.get(id(buffer), buffer.dtype)
            buffers[entry.key] = buffer.detach().to("cpu", dtype=dtype, copy=True)
        elif entry.location is Location.OTHER:
            extra[entry.key] = entry.where
    counters = sharded.counters
    scheduler = sharded.lr_scheduler
    state = {
        "rank": sharded.rank,
        "world_size": sharded.world_size,
        "global_steps": counters.global_steps,
        "micro_steps": counters.micro_steps,
        "skipped_steps": counters.skipped_steps,
        "last_grad_norm": counters.last_grad_norm,
        "loss_scaler": sharded.scaler.state_dict(),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        # by parameter name, so a load with another layout or world size maps them
        "slot_steps": {
            name: step
            for index, steps in slot_steps.items()
            for name, step in zip(names[index], steps)
        },
        "rng": rng_state(),
        "buffers": buffers,
        "extra_state": extra,
        "client_state": client_state,
    }
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


# -- collectives (no-ops at world size 1) -------------------------------------------------------


def _validated_tag(sharded: ShardedState, tag: str) -> str:
    """The tag every rank saves under: rank 0's. Ranks that passed others (a tag built from a
    rank-local counter, a clock) are handled as config.checkpoint_tag_validation says
    (DeepSpeed's checkpoint.tag_validation): a warning, silence, or an error on every rank
    before anything is written. One small gather per save."""
    if sharded.world_size == 1:
        return tag
    tags = _gather(sharded, tag)
    if len(set(tags)) == 1:
        return tag
    mode = sharded.config.checkpoint_tag_validation
    which = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if mode == "Fail":
        raise ValueError(f"save_checkpoint: the ranks passed different tags ({which}); pass the same "
                         "tag on every rank (checkpoint_tag_validation 'Fail': nothing was written)")
    if mode == "Warn" and sharded.rank == 0:
        warnings.warn(f"save_checkpoint: the ranks passed different tags ({which}); saving under rank "
                      f"0's {tags[0]!r} (set checkpoint_tag_validation to 'Ignore' or 'Fail')",
                      RuntimeWarning, stacklevel=3)
    return tags[0]


def _broadcast(sharded: ShardedState, obj: Any) -> Any:
    return _dist.broadcast_object(obj, sharded.pg, sharded.device)


def _gather(sharded: ShardedState, obj: Any) -> list[Any]:
    return _dist.all_gather_object(obj, sharded.pg, sharded.device)


def _local_rank(sharded: ShardedState) -> int:
    """This rank's index on its node (torchrun's LOCAL_RANK; without it, one node)."""
    local = os.environ.get("LOCAL_RANK", "")
    return int(local) if local.isdigit() else sharded.rank


def _describe(exc: BaseException, what: str) -> tuple[int, str, Optional[str]]:
    err = getattr(exc, "errno", None) or 0
    return (err, f"{what}: {type(exc).__name__}: {exc}", getattr(exc, "filename", None))


def _as_oserror(desc: tuple[int, str, Optional[str]]) -> OSError:
    err, msg, filename = desc
    if err == errno.ENOSPC:
        msg += "; free space on that filesystem or save elsewhere"
    elif err in (errno.EROFS, errno.EACCES, errno.EPERM):
        msg += "; pass a save_dir on a writable filesystem you own"
    msg += " (the previous checkpoint and 'latest' are untouched)"
    return OSError(err, msg, filename) if err else OSError(msg)
