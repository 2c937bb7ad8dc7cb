"""Materialising a model built under `offload.init` straight into its shards.

    with offload.init(config):
        model = GPT(cfg)              # parameters on the meta device: no memory
    engine = offload.initialize(model, config)   # materialised unit by unit into shards

Inside the context every tensor is created on the meta device (torch's own
`torch.device("meta")` mode; nothing is patched). `initialize` then replays the model's
initialization one module at a time and copies each parameter's values into the rank's
shard as soon as its module is done, so a model larger than one process's memory can be
created: the peak is one unit's full parameters plus the shards.

What is guaranteed (the replay is `reset_parameters()` in `model.apply` order):
- For models whose parameters are initialized by their modules' `reset_parameters()` —
  every `torch.nn` layer, and custom modules that define one — the weights are *equal*
  to a plain construction under the same seed: `torch.nn` layers call `reset_parameters()`
  when constructed, children before their parent, which is the order replayed here.
- A parameter shared by several modules keeps the values of the first module (in that
  order) that initializes it, as `b.weight = a.weight` after constructing `a` then `b`
  does; the later modules still draw their random numbers, so everything after stays equal.
- `init_fn` (given to `offload.init`) is applied to each module right after its
  `reset_parameters()`, like `model.apply(init_fn)` — but interleaved, so the weights
  equal a plain construction only when `init_fn` draws no random numbers; otherwise they
  have the same distribution, not the same values.
- A parameter that neither `reset_parameters()` nor `init_fn` initialized is an error
  naming it (its values would be garbage), as is a buffer left on the meta device.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

__all__ = ["materialize_values", "set_pending_init_fn"]

_PENDING_INIT_FN: Optional[Callable[[nn.Module], None]] = None


def set_pending_init_fn(fn: Optional[Callable[[nn.Module], None]]) -> None:
    """Called by `offload.init` on exit: the init_fn the next replay applies."""
    global _PENDING_INIT_FN
    _PENDING_INIT_FN = fn


def materialize_values(
    model: nn.Module,
    records: list[list[Any]],
    slot_of: dict[int, tuple[int, int]],
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (id of the model's original parameter, its full fp32-or-native value) for every
    parameter, one module's worth at a time. Real parameters are yielded as they are; a
    meta-built model is initialized by replay (see the module docstring)."""
    all_records = [rec for recs in records for rec in recs]
    if not any(rec.param.is_meta for rec in all_records):
        for rec in all_records:
            yield id(rec.param), rec.param.detach()
        return
    yield from _replay(model, all_records)


def _replay(model: nn.Module, all_records: list[Any]) -> Iterator[tuple[int, torch.Tensor]]:
    global _PENDING_INIT_FN
    init_fn, _PENDING_INIT_FN = _PENDING_INIT_FN, None
    owners_of = {id(r.param): r.owners for r in all_records}
    originals = {id(r.param): r.param for r in all_records}
    names = {id(r.param): r.name for r in all_records}
    real: dict[int, nn.Parameter] = {}  # original (meta) param id -> materialised tensor
    current: dict[int, int] = {}  # id(materialised) -> original id
    initialized_by: dict[int, nn.Module] = {}
    done: set[int] = set()  # yielded: values final, owners point at the meta tensor again

    def orig_id(p: torch.Tensor) -> int:
        return current.get(id(p), id(p))

    # Post-order (model.apply's order), children in registration order; remember parents
    # to know where a block ends.
    order: list[nn.Module] = []
    parent: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> None:
        for c in m.children():
            if id(c) not in parent and c is not model:
                parent[id(c)] = m
                visit(c)
        order.append(m)

    visit(model)

    def release(pid: int) -> None:
        for owner, a in owners_of[pid]:
            owner._parameters[a] = originals[pid]  # the engine swaps in its views next
        current.pop(id(real.pop(pid)), None)

    def flush(m: nn.Module) -> Iterator[tuple[int, torch.Tensor]]:
        # A subtree's parameters are final once its top module ran, unless an owner
        # outside it (a tied parameter) is still to come: those wait for the end.
        subtree = {id(x) for x in m.modules()}
        for sub in m.modules():
            for p in list(sub._parameters.values()):
                pid = None if p is None else orig_id(p)
                if pid is None or pid in done or pid not in real or pid not in initialized_by:
                    continue
                if all(id(o) in subtree for o, _ in owners_of[pid]):
                    done.add(pid)
                    yield pid, real[pid].detach()
                    release(pid)

    for m in order:
        has_reset = callable(getattr(m, "reset_parameters", None))
        up = parent.get(id(m))
        # A direct child of the model or of a ModuleList/Dict (a transformer block) ends a
        # unit's worth of modules: its values go out now, so at most one block is held.
        block_end = up is model or isinstance(up, (nn.ModuleList, nn.ModuleDict))
        if not has_reset and init_fn is None:
            # A container with nothing of its own to initialize (a Block of Linears) still
            # ends its subtree here: skipping the flush would hold every block to the end.
            if block_end:
                yield from flush(m)
            continue
        # reset_parameters() may touch the module's children (nn.MultiheadAttention sets
        # out_proj.bias); init_fn, like model.apply's function, sees one module.
        scope = list(m.modules()) if has_reset else [m]
        subtree = {id(x) for x in m.modules()}
        restore = []
        for sub in scope:
            for attr, p in list(sub._parameters.items()):
                if p is None:
                    continue
                pid = orig_id(p)
                by = initialized_by.get(pid)
                if pid in done or (by is not None and id(by) not in subtree):
                    # Initialized by an earlier module elsewhere (tied): this module draws its
                    # random numbers into a scratch copy, and the first values stay.
                    restore.append((sub, attr, p))
                    sub._parameters[attr] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                    )
                elif pid not in real:
                    t = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    real[pid] = t
                    current[id(t)] = pid
                    for owner, a in owners_of[pid]:
                        owner._parameters[a] = t
            for bname, b in list(sub._buffers.items()):
                if b is not None and b.is_meta:
                    sub._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype)
        with torch.no_grad():
            if has_reset:
                m.reset_parameters()
            if init_fn is not None:
                init_fn(m)
        for sub, attr, p in restore:
            sub._parameters[attr] = p
        for sub in scope:
            for p in sub._parameters.values():
                if p is not None and orig_id(p) in real:
                    initialized_by.setdefault(orig_id(p), m)
        if block_end:
            yield from flush(m)

    missing = [names[pid] for pid in originals if pid not in initialized_by]
    if missing:
        raise ValueError(
            f"parameters {missing[:8]}{'...' if len(missing) > 8 else ''} were built under "
            "offload.init but no reset_parameters() (and no init_fn) initializes them; give "
            "their module a reset_parameters(), pass offload.init(config, init_fn=...), or "
            "build the model without offload.init"
        )
    for pid in list(real):
        done.add(pid)
        yield pid, real[pid].detach()
        release(pid)
