"""Materialising a model whose parameters have no values yet straight into its shards.

Three kinds of models reach `initialize` without values, and each parameter's value is
made as its unit is filled, so the host never holds the whole model:

- **Built under `offload.init`** (the values deferred: `offload.units.deferred`): each
  parameter is computed from what its construction recorded, bit-identical to an eager
  construction from the same seed ([Note: deferred construction]); its buffers are computed
  before anything else (`materialize_buffers`). A parameter allocated by `torch.empty` and
  never written is an error naming it (eager mode would train from garbage).
- **Built on the meta device by the user** (`with torch.device("meta"):`, FSDP2's habit):
  `reset_parameters()` is replayed in `model.apply` order, one module at a time. For models
  whose parameters are initialized by their modules' `reset_parameters()` — every
  `torch.nn` layer, and custom modules that define one — the weights are *equal* to a plain
  construction under the same seed *at initialize* (`torch.nn` layers call
  `reset_parameters()` when constructed, children before their parent, the order replayed
  here); a parameter shared by several modules keeps the values of the first module that
  initializes it, and the later ones still draw, so everything after stays equal. A
  parameter no `reset_parameters()` initializes is an error naming it, as is a buffer left
  on the meta device. (`offload.init` is the way to get construction-time values for any
  init: a parent's `apply`, Hugging Face's `post_init`.)
Values from a source instead (a checkpoint: `offload.integrations.hf.from_pretrained`):
`attach_source(model, source, init_fn)` hands the next `initialize` of `model` — or of a
model containing it (a PEFT wrapper) — a `WeightSource`, and then no module is replayed.
Guaranteed:
- every parameter `model` had when the source was attached is read once from the source,
  under any of the names it had then (a tied parameter has several; a wrapper may rename it
  since), unit by unit in the engine's order, and released as soon as its rank's slice is in
  the master: beside the shards the host holds at most two full parameters (the one being
  read, and the previous one until the engine lets it go);
- its value is cast to the dtype the model's (meta) parameter has, as `load_state_dict`
  into that parameter would, before the fp32 master takes it;
- a parameter without a value in the source keeps its own values if it has any; if it is
  on the meta device (one the source lacks, or one added inside `model` since: an
  adapter's), its module's such parameters are made on the CPU and `init_fn(module)` fills
  them (the other parameters of the module stay on the meta device meanwhile, so an init
  touching them does nothing); one it leaves unset (still NaN) is an error naming it, as is
  one with no `init_fn` to fill it — checked before anything is read. Every rank runs the
  init and keeps its slice: ranks must share their random state (seed them alike);
- the source is consumed by that `initialize` (closed when the values are done, or when
  the build fails after it started reading), and buffers are not its business (the caller
  loads them into the real buffers before `initialize`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch import nn

import offload.units.deferred as deferred

__all__ = ["WeightSource", "attach_source", "materialize_buffers", "materialize_values"]

InitFn = Callable[[nn.Module], None]


class WeightSource(Protocol):
    """Where the values of a model's parameters come from at `initialize`, by name (every
    name `model.named_parameters(remove_duplicate=False)` gives a parameter)."""

    def __contains__(self, name: object) -> bool:
        """Whether `get(name)` gives a value."""

    def get(self, name: str) -> Optional[torch.Tensor]:
        """The full value of parameter `name`, a CPU tensor the caller owns (nothing else
        may keep a reference: its memory goes back when the caller drops it); None when
        the source has no value for it."""

    def close(self) -> None:
        """Release what the source holds (files); called once, when `initialize` is done
        with it."""


@dataclass
class _Attached:
    """A source attached to a module, with that module's parameters as they were then."""

    source: WeightSource
    init_fn: Optional[InitFn]
    names: dict[int, tuple[nn.Parameter, list[str]]]
    """id(parameter) -> (the parameter, kept so the id stays its own; its names under the
    module at attach time). Names are taken then because a wrapper may rename them later
    (PEFT's LoRA moves `q_proj.weight` to `q_proj.base_layer.weight`); the objects stay."""


# Module -> its attached source, for the next build of a model containing it (the module
# itself, or a wrapper around it such as a PeftModel): popped by `materialize_values`.
# Weak: a model never initialized takes its source with it (nothing in the value refers to
# the module).
_SOURCES: "weakref.WeakKeyDictionary[nn.Module, _Attached]" = weakref.WeakKeyDictionary()


def attach_source(model: nn.Module, source: WeightSource, init_fn: Optional[InitFn] = None) -> None:
    """The next `offload.initialize` of `model`, or of a model that contains it, takes the
    values of `model`'s parameters (those it has now, under the names they have now) from
    `source` (module docstring); `init_fn(module)` initializes what the source lacks and
    parameters added inside `model` later (an adapter's). `init_fn` must not hold `model`
    strongly (the registry is weak on it). A source attached before and not consumed yet
    is closed and replaced."""
    old = _SOURCES.pop(model, None)
    if old is not None:
        old.source.close()
    names: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    _SOURCES[model] = _Attached(source, init_fn, names)


def materialize_buffers(model: nn.Module) -> None:
    """Compute the buffers of a model built under `offload.init` (small: done first, whole)."""
    with deferred.Session() as session:
        done: dict[int, torch.Tensor] = {}
        for m in model.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and deferred.is_deferred(b):
                    if id(b) not in done:
                        done[id(b)] = deferred.evaluate(b, session)
                    m._buffers[name] = done[id(b)]
                    deferred.forget(b)


def materialize_values(
    model: nn.Module,
    records: list[list[Any]],
    slot_of: dict[int, tuple[int, int]],
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (id of the model's original parameter, its full fp32-or-native value) for every
    parameter, one module's worth at a time. Real parameters are yielded as they are; a
    meta-built model is initialized by replay, or read from its attached source (see the
    module docstring)."""
    attached = [(m, _SOURCES.pop(m)) for m in model.modules() if m in _SOURCES]
    if attached:
        try:
            yield from _from_sources(records, attached)
        finally:
            for _, a in attached:
                a.source.close()
        return
    all_records = [rec for recs in records for rec in recs]
    if any(deferred.is_deferred(rec.param) for rec in all_records):
        yield from _deferred_values(records)
        return
    if not any(rec.param.is_meta for rec in all_records):
        for rec in all_records:
            yield id(rec.param), rec.param.detach()
        return
    yield from _replay(model, all_records)


def _deferred_values(records: list[list[Any]]) -> Iterator[tuple[int, torch.Tensor]]:
    """Each parameter of a model built under `offload.init`, computed in unit order; the
    cached outputs of shared calls are dropped between units."""
    unset = [rec.name for recs in records for rec in recs if deferred.unset(rec.param)]
    if unset:
        raise ValueError(
            f"parameters {unset[:8]}{'...' if len(unset) > 8 else ''} were allocated under "
            "offload.init (torch.empty) and nothing wrote them: an eager construction would train "
            "from whatever was in memory. Initialize them in the constructor (nn.init, "
            "reset_parameters(), a parent's apply), or pass offload.init(config, init_fn=...)")
    with deferred.Session() as session:
        for recs in records:
            for rec in recs:
                if deferred.is_deferred(rec.param):
                    value = deferred.evaluate(rec.param, session)
                    deferred.forget(rec.param)
                else:
                    value = rec.param.detach()
                yield id(rec.param), value
                del value  # the master has its slice: nothing here keeps the full value
            session.forget()


def _replay(model: nn.Module, all_records: list[Any]) -> Iterator[tuple[int, torch.Tensor]]:
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
        if not has_reset:
            # A container with nothing of its own to initialize (a Block of Linears) still
            # ends its subtree here: skipping the flush would hold every block to the end.
            if block_end:
                yield from flush(m)
            continue
        # reset_parameters() may touch the module's children (nn.MultiheadAttention sets
        # out_proj.bias).
        scope = list(m.modules())
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
            reset: Any = getattr(m, "reset_parameters")  # the user's module: checked callable above
            reset()
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
            f"parameters {missing[:8]}{'...' if len(missing) > 8 else ''} are on the meta "
            "device and no reset_parameters() initializes them; give their module a "
            "reset_parameters(), or build the model under offload.init (which keeps any init)"
        )
    for pid in list(real):
        done.add(pid)
        yield pid, real[pid].detach()
        release(pid)


def _from_sources(records: list[list[Any]], attached: list[tuple[nn.Module, _Attached]]
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    where: dict[int, tuple[_Attached, list[str]]] = {}
    for _, src in attached:
        for pid, (_, attach_names) in src.names.items():
            where[pid] = (src, attach_names)
    # a parameter added inside an attached module after attach (an adapter's) is
    # initialized by that module's init_fn
    inside = {id(sub): a for m, a in attached for sub in m.modules()}

    def names(rec: Any) -> list[str]:
        # the attach-time names, the record's own first when it is one of them (a tied
        # parameter is read under it when the source has several)
        entry = where.get(id(rec.param))
        if entry is None:
            return []
        own = rec.name if rec.name in entry[1] else None
        return ([own] if own else []) + [n for n in entry[1] if n != own]

    def source_of(rec: Any) -> Optional[_Attached]:
        entry = where.get(id(rec.param))
        return entry[0] if entry is not None else inside.get(id(rec.owners[0][0]))

    def has_value(rec: Any) -> bool:
        a = source_of(rec)
        return a is not None and any(n in a.source for n in names(rec))

    lacking = [rec for recs in records for rec in recs if rec.param.is_meta and not has_value(rec)]
    no_init = [r.name for r in lacking if (giver := source_of(r)) is None or giver.init_fn is None]
    if no_init:
        raise ValueError(
            f"parameters {no_init[:8]}{'...' if len(no_init) > 8 else ''} are on the meta device "
            "and no attached source has values for them or an init_fn to initialize them; load a "
            "checkpoint that has them, or attach the source with an init_fn")
    # Missing parameters are initialized a module at a time, on the module's first record;
    # the values wait in `made` for their own records (a head's few tensors).
    made: dict[int, torch.Tensor] = {}
    to_init = {id(r.param): r for r in lacking}
    for recs in records:
        for rec in recs:
            pid = id(rec.param)
            value: Optional[torch.Tensor] = None
            a = source_of(rec)
            for n in names(rec) if a is not None else ():
                value = a.source.get(n) if a is not None else None
                if value is not None:
                    break
            if value is not None:
                if tuple(value.shape) != tuple(rec.param.shape):
                    raise ValueError(
                        f"parameter {rec.name!r}: its source's value has shape {tuple(value.shape)}, "
                        f"the model's parameter {tuple(rec.param.shape)}")
                if value.is_floating_point() and value.dtype != rec.param.dtype:
                    value = value.to(rec.param.dtype)
            elif pid in to_init or pid in made:
                if pid in to_init:
                    module = rec.owners[0][0]
                    mine = [r for r in to_init.values() if any(o is module for o, _ in r.owners)]
                    for r in mine:
                        del to_init[id(r.param)]
                    assert a is not None and a.init_fn is not None  # checked above
                    made.update(_init_lacking(module, mine, a.init_fn))
                value = made.pop(pid)
            else:
                value = rec.param.detach()  # real values of its own: kept
            yield pid, value
            del value  # the master has its slice: nothing here keeps the full value


def _init_lacking(module: nn.Module, mine: list[Any], init_fn: Any) -> dict[int, torch.Tensor]:
    """Make `module`'s lacking parameters (`mine`) on the CPU, NaN-filled, run `init_fn` on
    the module, check each was set, and put the meta parameters back (the engine swaps in
    its views next). Returns id(meta parameter) -> value."""
    made: list[tuple[Any, str]] = []
    for r in mine:
        p = r.param
        fill = (torch.full(p.shape, float("nan"), dtype=p.dtype) if p.is_floating_point()
                else torch.zeros(p.shape, dtype=p.dtype))
        t = nn.Parameter(fill, requires_grad=p.requires_grad)
        for owner, attr in r.owners:
            owner._parameters[attr] = t
        made.append((r, next(a for o, a in r.owners if o is module)))
    out: dict[int, torch.Tensor] = {}
    try:
        with torch.no_grad():
            init_fn(module)
        for r, attr in made:
            value = module._parameters[attr]  # the init may replace it
            assert value is not None, f"{type(module).__name__}.{attr} was set to None by the init"
            out[id(r.param)] = value.detach()
    finally:
        for r, _ in made:
            for owner, a in r.owners:
                owner._parameters[a] = r.param
    unset = [r.name for r, _ in made
             if out[id(r.param)].is_floating_point() and bool(torch.isnan(out[id(r.param)]).any())]
    if unset:
        raise ValueError(
            f"parameters {unset} are not in the checkpoint and the model's init "
            f"({getattr(init_fn, '__qualname__', init_fn)}) on {type(module).__name__} left "
            "them unset; give the module an init that sets them, or load a checkpoint that has them")
    return out
