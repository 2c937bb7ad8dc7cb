"""Unit discovery: which modules are gathered together, and which parameters each owns.

The wrap policy, as FSDP's: by default the model's blocks are the units, found where they
are ([Note: blocks wherever they are]); with `config.unit_modules` set, every module whose
class name is listed is one instead. A leaf module (`config.leaf_modules`, DeepSpeed's
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

from collections import Counter
from dataclasses import dataclass, field
from typing import Collection, Sequence

from torch import nn

# [Note: blocks wherever they are]
# Models keep their repeated blocks in different containers: Hugging Face and most others in
# an `nn.ModuleList` (every child is a unit, whatever its class, as before), torchtitan in
# an `nn.ModuleDict` ("0", "1", ...), others in an `nn.Sequential` or as attributes of a
# module of their own (block0, block1). So besides a ModuleList's children, the children of
# any module that repeat one class (two or more siblings of it) are units, with two
# exceptions that keep the blocks the units and not what surrounds or fills them:
# - classes of torch.nn itself (Linear, Embedding, LayerNorm, ...): q/k/v projections or
#   a Sequential MLP's layers are parts of a block, not blocks; and modules without
#   modules inside (a model's own RMSNorm class, two per block or beside the blocks): a
#   block is built of layers;
# - a sibling that holds blocks itself (a stack: T5's encoder and decoder, each a
#   T5Stack with its blocks in a ModuleList): the blocks inside are the units.
# Only the outermost match counts, as for every policy. The initialize line says what was
# chosen (`describe_units`).
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
    chosen_by: str = ""
    """Why it is a unit, in words for the initialize line ('' for the root)."""


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
    unit_mods: list[tuple[str, nn.Module, str]] = []
    seen_units: set[int] = set()

    def is_leaf(m: nn.Module) -> bool:
        return is_leaf_module(m, leaves)

    def visit(module: nn.Module, prefix: str, inside_unit: bool) -> None:
        repeated = set() if wanted or inside_unit or isinstance(module, nn.ModuleList) else repeated_blocks(module)
        for child_name, child in module.named_children():
            fqn = f"{prefix}{child_name}"
            if is_leaf(child):
                why = "leaf_modules"
            elif wanted:
                why = "unit_modules" if type(child).__name__ in wanted else ""
            elif isinstance(module, nn.ModuleList):
                why = "nn.ModuleList"
            else:
                why = f"repeated in {_container_name(module)}" if id(child) in repeated else ""
            if why and not inside_unit and id(child) not in seen_units:
                seen_units.add(id(child))
                unit_mods.append((fqn, child, why))
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
        found = {type(m).__name__ for _, m, _ in unit_mods}
        missing = sorted(wanted - found - {type(model).__name__})
        if missing:
            raise ValueError(
                f"unit_modules names {missing}, but the model has no module of that class; "
                f"module classes present: {sorted({type(m).__name__ for m in model.modules()})}"
            )

    # Which units can reach each module (a module object may sit in several places).
    module_units: dict[int, set[int]] = {}
    for u, (_, umod, _) in enumerate(unit_mods, start=1):
        for m in umod.modules():
            module_units.setdefault(id(m), set()).add(u)

    records: dict[int, ParamRecord] = {}
    for name, p in model.named_parameters():
        records[id(p)] = ParamRecord(name, p)
    for m in model.modules():
        for attr, owned in m._parameters.items():
            if owned is not None:
                records[id(owned)].owners.append((m, attr))

    plans = [UnitPlan("", model)] + [UnitPlan(n, m, chosen_by=why) for n, m, why in unit_mods]
    for rec in records.values():
        units: set[int] = set()
        for m, _ in rec.owners:
            units |= module_units.get(id(m), {ROOT})
        owner = units.pop() if len(units) == 1 else ROOT
        plans[owner].params.append(rec)
    return [plans[0]] + [p for p in plans[1:] if p.params]


def _own_class(module: nn.Module) -> bool:
    """Not a class of torch.nn itself ([Note: blocks wherever they are])."""
    return not type(module).__module__.startswith("torch.")


def _holds_blocks(module: nn.Module) -> bool:
    """Whether a module below `module` holds blocks: a non-empty ModuleList, or repeated
    siblings of a class of the model's own (a stack, not a block)."""
    return any((isinstance(m, nn.ModuleList) and len(m) > 0) or bool(repeated_blocks(m, nested=False))
               for m in module.modules() if m is not module)


def repeated_blocks(module: nn.Module, nested: bool = True) -> set[int]:
    """The ids of `module`'s children that are blocks by repetition ([Note: blocks wherever
    they are]): two or more siblings of one class of the model's own, built of modules,
    with parameters;
    with `nested`, less those that hold blocks themselves."""
    children = [c for c in module.children()
                if _own_class(c) and any(True for _ in c.children()) and any(True for _ in c.parameters())]
    counts = Counter(type(c) for c in children)
    blocks = [c for c in children if counts[type(c)] >= 2]
    if nested:
        blocks = [c for c in blocks if not _holds_blocks(c)]
        counts = Counter(type(c) for c in blocks)
        blocks = [c for c in blocks if counts[type(c)] >= 2]
    return {id(c) for c in blocks}


def _container_name(module: nn.Module) -> str:
    cls = type(module)
    return f"an nn.{cls.__name__}" if cls in (nn.ModuleDict, nn.Sequential) else f"a {cls.__name__}"


def describe_units(plans: Sequence[UnitPlan]) -> str:
    """What the policy chose, for the initialize line: each group of units by where they
    sit, their class and why (`UnitPlan.chosen_by`), e.g. '32 LlamaDecoderLayer in
    model.layers (nn.ModuleList)'; or that the model is one unit."""
    groups: dict[tuple[str, str], list[str]] = {}
    for plan in plans[1:]:
        parent = plan.name.rpartition(".")[0] or "the model"
        groups.setdefault((type(plan.module).__name__, plan.chosen_by), []).append(parent)
    if not groups:
        return "the model is one unit (no repeated blocks found; unit_modules names them)"
    parts = []
    for (cls, why), parents in groups.items():
        where = parents[0] if len(set(parents)) == 1 else f"{len(set(parents))} modules"
        parts.append(f"{len(parents)} {cls} in {where} ({why})")
    more = f" and {len(parts) - 3} more groups" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more
