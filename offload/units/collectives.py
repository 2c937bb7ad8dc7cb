"""Process-group setup and the few collectives the engine uses.

The engine talks to other ranks through exactly four operations: all-gather of a unit's
shards, reduce-scatter (average) of a unit's gradients, all-reduce of a few scalars (grad
norm, overflow flag) and broadcast-free full-state gathers; outside training, one broadcast
(a rank's edits written back by `engine.gathered(..., modifier_rank=r)`), and the checkpoint
code's object broadcast and gather (its plan and every rank's outcome). Everything goes through
`ProcessGroupInfo` so that world size 1 runs with no process group and no collectives at
all: a single plain `python train.py` needs no launcher.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import logging
import os
import pickle
import re
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from offload.device_runtime import runtime
from offload.units.groups import ProcessGroupInfo, uses_nccl

# torchrun (and `torch.distributed.launch`) export these; with all of them present we can
# start the group ourselves with the `env://` rendezvous.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (same
# arguments) and deprecated the old names; older torch has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

logger = logging.getLogger("offload")

# ProcessGroupInfo and uses_nccl live in offload/units/groups.py (with hybrid sharding's
# groups); this module's import path for them is documented and stays.


def setup_process_group(device_type: str, timeout_s: float = 1800.0) -> ProcessGroupInfo:
    """Use the existing default group, or start one from torchrun's environment, or none.

    gloo when the compute device is the CPU, NCCL on CUDA. With no default group and no
    torchrun environment this is world size 1 with no group at all. On CUDA this process's
    GPU is the one LOCAL_RANK names (`select_local_gpu`), also when the user started the
    group: before the engine allocates on the device, and before a group started without a
    backend creates its NCCL communicator on the current device at its first collective.
    """
    if dist.is_available() and dist.is_initialized():
        if device_type == "cuda":
            select_local_gpu()
        return ProcessGroupInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            group=dist.group.WORLD,
            backend=_default_group_backend(),
            started_here=_OWNED[0] is dist.group.WORLD,
            timeout_s=_OWNED_TIMEOUT_S[0] if _OWNED[0] is dist.group.WORLD else None,
        )
    present = [k for k in _TORCHRUN_ENV if k in os.environ]
    if not present:
        return ProcessGroupInfo(rank=0, world_size=1, group=None, backend=None, started_here=False)
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed environment is incomplete: {present} are set but {missing} are "
            "not; launch with torchrun, or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
        )
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE is set but this torch build has no torch.distributed")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        select_local_gpu()
    dist.init_process_group(
        backend=backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s)
    )
    if _OWNED[0] is None:
        atexit.register(_leave_owned_group)
    _OWNED[0] = dist.group.WORLD
    _OWNED_TIMEOUT_S[0] = timeout_s
    return ProcessGroupInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        group=dist.group.WORLD,
        backend=_default_group_backend(),
        started_here=True,
        timeout_s=timeout_s,
    )


# [Note: the group offload starts]
# An engine launched by torchrun with no process group starts the default group from the
# environment. It is kept when the engine closes, for the next engine of the process (a
# notebook, a script that trains two models in turn): destroying it and starting it again
# on the same MASTER_PORT raced the store's teardown and stalled one rank in
# init_process_group (6 of 8 runs hung). It goes at interpreter exit, every rank together
# (a barrier first: gloo aborts a process whose peer tears its connections down while it is
# still tearing down its own), unless the user destroyed it already. A group the user
# started is never destroyed by offload.
_OWNED: list[Any] = [None]
"""The default group offload started (its `dist.group.WORLD`), while it lives."""
_OWNED_TIMEOUT_S: list[Optional[float]] = [None]
"""The timeout that group was started with (a later engine reuses the group, and its)."""


def leave_together(pg: ProcessGroupInfo, device: torch.device) -> None:
    """Every rank of `pg` leaves its current work at once: a barrier (an all-reduce: NCCL on
    the GPU), then the collectives settle ([Note: collective tensors at exit]). Called by
    `Engine.close` and at exit."""
    all_reduce_host(torch.zeros(1), "max", pg, device)  # "max": over every rank
    settle_collectives()


def exiting_on_an_error() -> bool:
    """Whether the interpreter is ending on an uncaught exception: Python records it in
    `sys.last_value` (`sys.last_exc` from 3.12) before the traceback is printed, whatever
    `sys.excepthook` a framework installed."""
    import sys

    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _leave_owned_group() -> None:
    """At exit: destroy the group offload started, if it is still there. A process ending on
    an uncaught exception skips the barrier: its peers may sit in another collective, which
    would hold it for the whole collective_timeout_s (30 minutes by default); it exits at
    once, and they fail within seconds with the "closed its connection" error
    ([Note: a rank that stops answering]), as they do for a rank killed with SIGKILL."""
    if _OWNED[0] is None or not (dist.is_available() and dist.is_initialized()) or _OWNED[0] is not dist.group.WORLD:
        return
    if exiting_on_an_error():
        _OWNED[0] = None
        return
    try:
        backend = _default_group_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if uses_nccl(backend) else torch.device("cpu")
        pg = ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, backend, True)
        leave_together(pg, device)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    _OWNED[0] = None


def _default_group_backend() -> str:
    """The default group's backend per device ("cpu:gloo,cuda:gloo", "cuda:nccl", ...).
    Not `dist.get_backend()`: for a group started without a backend it says "undefined"
    (torch 2.13) or "cpu:gloo,cuda:nccl" (older torch), neither of which names one backend."""
    return str(dist.get_backend_config())


def local_gpu_choice(local_rank: int, current: int, device_count: int) -> tuple[Optional[int], Optional[str]]:
    """Which GPU `select_local_gpu` makes current: (the index to set, or None to keep the
    current one; a warning to log, or None). Pure: the rule, tested without a GPU.

    LOCAL_RANK names this rank's GPU (torchrun's convention). The current device is kept
    when it already is that one; when LOCAL_RANK is not a visible index, the launcher gave
    each rank its own CUDA_VISIBLE_DEVICES and the current GPU is this rank's; when the
    current device is another non-zero index, which only an explicit `torch.cuda.set_device`
    gives, the user's choice wins, with a warning (ranks sharing a GPU are usually a
    mistake). Device 0 is also the default nobody chose, so from it LOCAL_RANK's is selected."""
    if local_rank == current or not 0 <= local_rank < device_count:
        return None, None
    if current != 0:
        return None, (f"torch.cuda.set_device({current}) was called but LOCAL_RANK={local_rank}: "
                      f"the engine computes on GPU {current} as chosen; to give each rank its "
                      f"own GPU, call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) or "
                      f"leave the choice to the engine")
    return local_rank, None


def select_local_gpu() -> None:
    """Make LOCAL_RANK's GPU this process's current one (`local_gpu_choice`), when LOCAL_RANK
    is set and CUDA is available; a user's explicit other choice is kept, with a warning."""
    local = os.environ.get("LOCAL_RANK", "")
    if not local.isdigit() or not torch.cuda.is_available():
        return
    index, warning = local_gpu_choice(int(local), torch.cuda.current_device(), torch.cuda.device_count())
    if warning is not None:
        logger.warning("compute device: %s", warning)
    if index is not None:
        torch.cuda.set_device(index)


# [Note: collective tensors at exit] gloo runs each collective on its own threads, and such
# a thread drops its reference to the work - and through it to the work's tensors - only
# *after* the waiter was woken. If Python dropped its own reference first, that last
# release happens on the gloo thread and must take the GIL to free the tensor's Python
# object. While the interpreter is alive that is harmless; during interpreter shutdown
# (a script that ends right after its last step, or right after close()) the GIL cannot be
# taken, CPython ends the thread with pthread_exit, and the unwind through C++ aborts the
# process: "terminate called without an active exception", SIGABRT after all work was
# done (seen in gdb: ProcessGroupGloo::runLoop -> ~AsyncWork -> decref_pyobject ->
# take_gil -> pthread_exit -> std::terminate). So every collective gets fresh views of its
# tensors, kept here until their use count says the group's threads let them go, and
# `settle_collectives()` (at close and at exit) waits for that before Python may free them.
_IN_FLIGHT: collections.deque = collections.deque()
"""Views passed to collectives that the group's threads may still hold (see the note)."""


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A new view of `t` to hand to a collective, remembered until the group's threads let
    it go. Being new, only this module and the collective reference it: its use count is
    back to 1 exactly when the work holding it was released."""
    while _IN_FLIGHT and _IN_FLIGHT[0]._use_count() <= 1:
        _IN_FLIGHT.popleft()
    v = t.view(t.shape)
    _IN_FLIGHT.append(v)
    return v


def settle_collectives(timeout_s: float = 10.0) -> bool:
    """Wait until the group's threads hold none of the views handed to collectives (see
    the note); True when settled, False after `timeout_s`. Call after waiting every work:
    what remains is each thread's last release, which follows the wait within moments."""
    if _LOST[0]:
        return False  # a peer went silent: the group's threads may never let go ([Note: a rank that stops answering])
    deadline = time.monotonic() + timeout_s
    while _IN_FLIGHT:
        if _IN_FLIGHT[0]._use_count() <= 1:
            _IN_FLIGHT.popleft()
            continue
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


# [Note: a rank that stops answering] A rank that stops (SIGSTOP, a debugger, a hung data
# loader), dies (OOM killer, kill -9) or falls far behind leaves every other rank waiting in
# its next collective. gloo gives up after the group's timeout (`collective_timeout_s` when
# offload started the group) with a transport message that names neither the collective nor
# a rank ("[.../unbound_buffer.cc:129] Timed out waiting 5000ms for send operation to
# complete"; a peer that died: "Connection closed by peer"). So every collective here, and
# every `wait()` of one issued asynchronously, turns such a failure into a
# `CollectiveTimeoutError` that names the collective, this rank, the timeout and what to do,
# with torch's error as its __cause__. The process then unwinds as from any error: the
# engine's finalizer and the exit path delete its swap files (tests/test_timeouts.py).
# From then on `settle_collectives` does not wait: works queued behind the failed one may
# never release their tensors, and waiting for them held the exit 10 s for nothing.
_PEER_LOST = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe|"
                        r"socket closed", re.IGNORECASE)


_LOST: list[bool] = [False]
"""Whether a collective of this process raised `CollectiveTimeoutError` (see the note)."""


class CollectiveTimeoutError(RuntimeError):
    """A collective the other ranks did not complete in time, or whose peer went away
    ([Note: a rank that stops answering]). `__cause__` is torch.distributed's error."""


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc`, raised by a collective, says a peer did not answer (a timeout, a closed
    or reset connection) rather than a misuse (a shape or dtype torch refused)."""
    return isinstance(exc, RuntimeError) and bool(_PEER_LOST.search(str(exc)))


def lost_peer_error(what: str, pg: ProcessGroupInfo, exc: BaseException) -> CollectiveTimeoutError:
    """The error for collective `what` of rank `pg.rank` that no peer completed; the ranks it
    names are the world's (a subgroup's members by `pg.ranks`)."""
    members = pg.ranks or tuple(range(pg.world_size))
    others = [r for i, r in enumerate(members) if i != pg.rank]
    if len(others) == 1:
        peers = f"rank {others[0]}"
    elif pg.ranks:  # a subgroup's members need not be consecutive
        peers = "one of ranks " + ", ".join(map(str, others))
    else:
        peers = f"one of ranks {others[0]}..{others[-1]}"
    who = (f"rank {pg.rank} of {pg.world_size}" if not pg.ranks
           else f"rank {members[pg.rank]} (in the group of ranks {', '.join(map(str, members))})")
    limit = (f"collective_timeout_s={pg.timeout_s:g} s" if pg.timeout_s is not None
             else "your process group's timeout")
    if re.search(r"timed out|timeout", str(exc), re.IGNORECASE):
        happened = f"was not completed by the other ranks within {limit} ({peers} did not answer"
    else:  # the connection closed at once: no timeout was waited for
        happened = f"failed: {peers} closed its connection (it died or exited"
    return CollectiveTimeoutError(
        f"{who}: the {what} {happened}; torch.distributed: "
        f"{str(exc).strip()[:200]}). "
        f"A rank stopped, died or is far behind: check the other ranks' logs for their error; "
        f"raise collective_timeout_s if steps are really this slow")


@contextlib.contextmanager
def _answered(what: str, pg: ProcessGroupInfo) -> Iterator[None]:
    """Run a collective; a peer's silence becomes a `CollectiveTimeoutError` (see the note)."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveTimeoutError) or not peer_lost(exc):
            raise
        _LOST[0] = True
        raise lost_peer_error(what, pg, exc) from exc


class _CheckedWork(dist.Work):
    """An asynchronous collective's work whose `wait()` raises `CollectiveTimeoutError`
    when a peer did not answer (see the note). Only `wait()` is offload's to call."""

    def __init__(self, work: dist.Work, what: str, pg: ProcessGroupInfo) -> None:
        super().__init__()
        self._work, self._what, self._pg = work, what, pg

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        with _answered(self._what, self._pg):
            return bool(self._work.wait(timeout))

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


def _checked(work: Optional[dist.Work], what: str, pg: ProcessGroupInfo) -> Optional[dist.Work]:
    return None if work is None else _CheckedWork(work, what, pg)


def all_gather_into(
    full: torch.Tensor, shard: torch.Tensor, pg: ProcessGroupInfo, async_op: bool = False
) -> Optional[dist.Work]:
    """full[r * n:(r + 1) * n] = shard of rank r, for every rank (n = shard.numel()).
    With `async_op` (world size > 1) the collective is only issued: `wait()` the work."""
    if pg.world_size == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return None
    what = f"all-gather of {shard.numel():,} elements per rank"
    with _answered(what, pg):
        return _checked(_ALL_GATHER(_fresh(full), _fresh(shard), group=pg.group, async_op=async_op), what, pg)


def reduce_scatter_mean(
    shard: torch.Tensor, full: torch.Tensor, pg: ProcessGroupInfo, async_op: bool = False
) -> Optional[dist.Work]:
    """shard = mean over ranks of full[rank * n:(rank + 1) * n] (n = shard.numel()).
    With `async_op` the collective is only issued: `wait()` the returned work before
    reading `shard` (and keep `full` alive until then)."""
    if pg.world_size == 1:
        shard.copy_(full)
        return None
    what = f"gradient reduce-scatter of {full.numel():,} elements"
    with _answered(what, pg):
        return _checked(_REDUCE_SCATTER(_fresh(shard), _fresh(full), op=dist.ReduceOp.AVG, group=pg.group,
                                        async_op=async_op), what, pg)


def all_reduce_mean_(t: torch.Tensor, pg: ProcessGroupInfo, async_op: bool = False) -> Optional[dist.Work]:
    """t = mean over ranks of t (ZeRO stage 1's gradient all-reduce): each rank's t divided
    by the world size, then summed (gloo's all-reduce has no AVG). With `async_op` the
    collective is only issued: `wait()` the returned work before reading `t`."""
    if pg.world_size == 1:
        return None
    t.div_(pg.world_size)
    what = f"gradient all-reduce of {t.numel():,} elements"
    with _answered(what, pg):
        return _checked(dist.all_reduce(_fresh(t), op=dist.ReduceOp.SUM, group=pg.group, async_op=async_op),
                        what, pg)


def all_reduce_sum_(t: torch.Tensor, pg: ProcessGroupInfo) -> torch.Tensor:
    if pg.world_size > 1:
        with _answered(f"all-reduce (sum) of {t.numel()} values", pg):
            dist.all_reduce(_fresh(t), op=dist.ReduceOp.SUM, group=pg.group)
    return t


def all_reduce_max_(t: torch.Tensor, pg: ProcessGroupInfo) -> torch.Tensor:
    if pg.world_size > 1:
        with _answered(f"all-reduce (max) of {t.numel()} values", pg):
            dist.all_reduce(_fresh(t), op=dist.ReduceOp.MAX, group=pg.group)
    return t


def broadcast_(t: torch.Tensor, src: int, pg: ProcessGroupInfo) -> torch.Tensor:
    """t = rank `src`'s t, on every rank (`src` is a rank of the group). Used outside
    training only (`engine.gathered(..., modifier_rank=src)` writing back a rank's edits)."""
    if pg.world_size > 1:
        root = src if pg.group is None else dist.get_global_rank(pg.group, src)
        with _answered(f"broadcast from rank {src} of {t.numel():,} elements", pg):
            dist.broadcast(_fresh(t), src=root, group=pg.group)  # group_src needs torch >= 2.6
    return t


def broadcast_object(obj: Any, pg: ProcessGroupInfo, compute_device: torch.device) -> Any:
    """Group rank 0's picklable `obj`, on every rank. torch's broadcast_object_list is not
    used: its tensors are its own, out of `_fresh`'s reach ([Note: collective tensors at
    exit]): a save right before the script ends aborted it one run in ten."""
    if pg.world_size == 1:
        return obj
    dev = collective_device(pg, compute_device)
    data = _pickled(obj) if pg.rank == 0 else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    broadcast_(size, 0, pg)
    buf = data.to(dev) if pg.rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    broadcast_(buf, 0, pg)
    return obj if pg.rank == 0 else _unpickled(buf)


def all_gather_object(obj: Any, pg: ProcessGroupInfo, compute_device: torch.device) -> list[Any]:
    """Every rank's picklable `obj`, in rank order, on every rank (as broadcast_object, on
    tracked tensors)."""
    if pg.world_size == 1:
        return [obj]
    dev = collective_device(pg, compute_device)
    data = _pickled(obj)
    sizes = torch.zeros(pg.world_size, dtype=torch.int64, device=dev)
    all_gather_into(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev), pg)
    longest = int(sizes.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    mine[: data.numel()].copy_(data)
    full = torch.empty(longest * pg.world_size, dtype=torch.uint8, device=dev)
    all_gather_into(full, mine, pg)
    return [_unpickled(full[r * longest: r * longest + int(sizes[r])]) for r in range(pg.world_size)]


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(buf: torch.Tensor) -> Any:
    return pickle.loads(buf.cpu().numpy().tobytes())


def collective_device(pg: ProcessGroupInfo, compute_device: torch.device) -> torch.device:
    """Where tensors must live for this group's collectives (NCCL: the GPU; gloo: the CPU;
    no group at world size 1: the compute device, where the "collective" is a local copy).
    A group with NCCL for cuda and gloo for cpu ("cpu:gloo,cuda:nccl") runs CUDA compute's
    collectives on the GPU and CPU compute's on the CPU."""
    if pg.world_size == 1 or (pg.nccl and compute_device.type == "cuda"):
        return compute_device
    return torch.device("cpu")


def all_reduce_host(t: torch.Tensor, op: str, pg: ProcessGroupInfo, compute_device: torch.device) -> torch.Tensor:
    """All-reduce a small host tensor ('sum' over the group, 'max' over every rank: `pg.world`),
    through the device the backend needs (NCCL: the GPU); the result on the host. World size
    1: `t` itself."""
    # A "max" is agreement (a flag any rank raises), so it spans every rank; a "sum" adds the
    # parts of one sharded value, which live within the group the units shard over (HSDP's
    # replicas hold the same parts: summing over them too would count each once per group).
    return all_reduce_host_later(t, op, pg, compute_device, blocking=True)()


def all_reduce_host_later(t: torch.Tensor, op: str, pg: ProcessGroupInfo, compute_device: torch.device,
                          blocking: bool = False) -> Callable[[], torch.Tensor]:
    """`all_reduce_host`, read later: the collective is issued now (every rank issues its
    collectives in one order), and the function returned waits for the result on the host
    and returns it. Where the collective runs on a device's stream (NCCL), nothing here
    waits for the device: the result comes down asynchronously (unless `blocking`)."""
    group = pg.world if op == "max" else pg
    if group.world_size == 1:
        return lambda: t
    x = t.to(collective_device(group, compute_device))
    (all_reduce_max_ if op == "max" else all_reduce_sum_)(x, group)
    rt = runtime()
    if not rt.has_streams(x.device):
        return lambda: x  # a host collective: complete
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=torch.cuda.is_available())
    rt.copy(host, x, non_blocking=not blocking)
    if blocking:
        return lambda: host
    event = rt.record(rt.current_stream(x.device), "host all-reduce")

    def read() -> torch.Tensor:
        rt.synchronize(event)
        return host

    return read


def resolve_device(name: str) -> torch.device:
    """The compute device `config.compute_device` names ('auto', 'cpu', 'cuda': this
    process's current GPU, which `setup_process_group` selected from LOCAL_RANK)."""
    if name == "auto":
        # Through the 'cuda' branch, so the device carries its index: torch.device("cuda")
        # != torch.device("cuda", 0), and every tensor's .device has one (issue #30, F2).
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("compute_device='cuda' but no CUDA GPU is available; use 'cpu' or 'auto'")
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"compute_device={name!r}; allowed: 'auto', 'cpu', 'cuda'")
