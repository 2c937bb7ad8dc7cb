"""`deepspeed.utils`' leaf-module functions for `offload.compat.deepspeed.utils`.

    from offload.compat.deepspeed import utils
    utils.set_z3_leaf_modules(model, [MoEBlock])     # before initialize
    engine = offload.initialize(model, config)       # each MoEBlock is one unit

A leaf module is gathered whole, with every expert it holds, so ranks that route tokens
to different experts still make the same collectives (offload/units/partition.py). The mark
is DeepSpeed's own attribute, so a model prepared for DeepSpeed works as it is.
"""

from __future__ import annotations

from typing import Sequence, Union

from torch import nn

from offload.units.partition import LEAF_ATTR, class_names, marked_leaf

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module"]

ClassSpec = Union[type, str]


def _matches(module: nn.Module, classes: Sequence[ClassSpec]) -> bool:
    names = class_names(module)
    return any((isinstance(c, type) and isinstance(module, c)) or (isinstance(c, str) and c in names)
               for c in classes)


def _mark(model: nn.Module, classes: Sequence[ClassSpec], flag: bool) -> list[nn.Module]:
    if not isinstance(classes, (list, tuple)) or not classes:
        raise ValueError("pass a non-empty list of module classes (or class names)")
    marked = [m for m in model.modules() if _matches(m, classes)]
    if not marked:
        raise ValueError(f"no module of {[getattr(c, '__name__', c) for c in classes]} in the model; "
                         f"module classes present: {sorted({type(m).__name__ for m in model.modules()})}")
    for m in marked:
        setattr(m, LEAF_ATTR, flag)
    return marked


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[ClassSpec]) -> list[nn.Module]:
    """Mark every module of these classes (types, or names short or module-qualified) as a
    leaf: one unit with everything under it. Returns the marked modules."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[ClassSpec]) -> list[nn.Module]:
    """Undo `set_z3_leaf_modules` for these classes (before `initialize`)."""
    return _mark(model, leaf_module_classes, False)


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether `module` is marked as a leaf."""
    return marked_leaf(module)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` marked as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]
