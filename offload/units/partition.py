"""Unit discovery: which modules are gathered together, and which parameters each owns.

The wrap policy, as FSDP's: by default every child of every `nn.ModuleList` (the
transformer blocks) is a unit; with `config.unit_modules` set, every module whose class
name is listed is one instead. A leaf module (`config.leaf_modules`, DeepSpeed's
`set_z3_leaf_modules`) is a unit in either case, with all it holds: a mixture-of-experts
block whose ranks route to different experts is gathered whole, so every rank makes the
same collectives. Only the outermost match counts (a unit inside a unit is part of it).
Everything else belongs to the root unit, the model itself.

A parameter reachable from more than one unit (tied embeddings and LM head, a module
shared by two blocks) belongs to their lowest common ancestor, which for sibling units is
the root: it stays gathered while any of its users runs. The root's pre-forward runs
before any unit's and its post-backward after every unit's, so this is always safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Sequence

from torch import nn

ROOT = 0
"""The root unit's index; block units follow in module order."""


@dataclass
class ParamRecord:
    """One unique parameter of the model."""

    name: str
    """Its first name in `model.named_parameters()` order."""
    param: nn.Parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    """Every (module, attribute) slot that holds this parameter object."""


@dataclass
class UnitPlan:
    name: str
    """The module's qualified name; '' for the root."""
    module: nn.Module
    params: list[ParamRecord] = field(default_factory=list)


LEAF_ATTR = "_z3_leaf"
"""The attribute DeepSpeed's `set_z3_leaf_modules` sets on a module (and
`offload.compat.deepspeed.utils.set_z3_leaf_modules` too): its subtree is one unit."""


def marked_leaf(module: nn.Module) -> bool:
    """Whether `module` carries the leaf mark (`LEAF_ATTR`)."""
    return bool(getattr(module, LEAF_ATTR, False))


def class_names(module: nn.Module) -> tuple[str, str]:
    """The names a leaf or unit class may be given by: short, and module-qualified."""
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def is_leaf_module(module: nn.Module, leaf_modules: Collection[str]) -> bool:
    """Whether `module` is a leaf: marked (`LEAF_ATTR`), or of a class `leaf_modules` names."""
    return marked_leaf(module) or not set(leaf_modules).isdisjoint(class_names(module))


def plan_units(model: nn.Module, unit_modules: Sequence[str] = (),
               leaf_modules: Sequence[str] = ()) -> list[UnitPlan]:
    """Split `model` into units; index 0 is the root. Units without parameters are dropped
    (nothing to gather), the root is always present. A leaf module (its class in
    `leaf_modules`, short or module-qualified, or marked with `LEAF_ATTR`) is a unit whole,
    whatever the other policy says of it or of what it holds (experts in a ModuleList); the
    model a leaf is the root alone."""
    wanted = set(unit_modules)
    leaves = set(leaf_modules)
    unit_mods: list[tuple[str, nn.Module]] = []
    seen_units: set[int] = set()

    def is_leaf(m: nn.Module) -> bool:
        return is_leaf_module(m, leaves)

    def visit(module: nn.Module, prefix: str, inside_unit: bool) -> None:
        for child_name, child in module.named_children():
            fqn = f"{prefix}{child_name}"
            if is_leaf(child):
                is_unit = True
            elif wanted:
                is_unit = type(child).__name__ in wanted
            else:
                is_unit = isinstance(module, nn.ModuleList)
            if is_unit and not inside_unit and id(child) not in seen_units:
                seen_units.add(id(child))
                unit_mods.append((fqn, child))
                visit(child, fqn + ".", True)
            else:
                visit(child, fqn + ".", inside_unit)

    # The model itself a leaf (DeepSpeed's leaf_module naming the model's class, as its
    # tests do for a model that routes per rank): one unit, the root, holds everything.
    root_leaf = is_leaf(model)
    if not root_leaf:
        visit(model, "", False)
    if leaves:
        found = {n for m in model.modules() for n in class_names(m)}
        missing = sorted(leaves - found)
        if missing:
            raise ValueError(
                f"leaf_modules names {missing}, but the model has no module of that class; "
                f"module classes present: {sorted({type(m).__name__ for m in model.modules()})}"
            )
    if wanted and not root_leaf:
        found = {type(m).__name__ for _, m in unit_mods}
        missing = sorted(wanted - found - {type(model).__name__})
        if missing:
            raise ValueError(
                f"unit_modules names {missing}, but the model has no module of that class; "
                f"module classes present: {sorted({type(m).__name__ for m in model.modules()})}"
            )

    # Which units can reach each module (a module object may sit in several places).
    module_units: dict[int, set[int]] = {}
    for u, (_, umod) in enumerate(unit_mods, start=1):
        for m in umod.modules():
            module_units.setdefault(id(m), set()).add(u)

    records: dict[int, ParamRecord] = {}
    for name, p in model.named_parameters():
        records[id(p)] = ParamRecord(name, p)
    for m in model.modules():
        for attr, owned in m._parameters.items():
            if owned is not None:
                records[id(owned)].owners.append((m, attr))

    plans = [UnitPlan("", model)] + [UnitPlan(n, m) for n, m in unit_mods]
    for rec in records.values():
        units: set[int] = set()
        for m, _ in rec.owners:
            units |= module_units.get(id(m), {ROOT})
        owner = units.pop() if len(units) == 1 else ROOT
        plans[owner].params.append(rec)
    return [plans[0]] + [p for p in plans[1:] if p.params]
