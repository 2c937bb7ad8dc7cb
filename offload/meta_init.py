"""`offload.init(config)`: build a model whose values are computed as it is sharded.

(The module is `meta_init`, not `init`, so that importing it never shadows the
`offload.init` context in the package namespace.)

    with offload.init(config):
        model = GPT(cfg)                          # no memory: every write recorded
    engine = offload.initialize(model, config)    # each parameter computed as its unit fills

The constructor runs as written, and the weights are bit-identical to an eager
construction from the same seed ([Note: deferred construction] in
`offload.units.deferred`): `reset_parameters()`, a parent's `self.apply(fn)`, Hugging
Face's `post_init()`, writes under `zero.GatheredParameters`, random draws anywhere. The
random numbers are drawn at construction, as eagerly: what the program draws afterwards is
what it would draw after an eager construction.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

import offload.units.deferred as deferred

__all__ = ["init"]


class init(contextlib.AbstractContextManager):
    """Context: modules built inside have their tensors on the meta device and every write
    into them recorded, to be computed by the next `offload.initialize`, unit by unit.
    `init_fn(module)`, if given, runs on every module built inside when the context closes,
    as `model.apply(init_fn)` right after the constructor would (recorded too). Contexts
    nest (the inner one joins the outer); `offload.initialize` inside one builds for real."""

    def __init__(self, config: Any = None, init_fn: Optional[Callable[[nn.Module], None]] = None):
        if config is not None:
            from offload.config import load_config

            config = load_config(config)  # config errors surface here, at the door
        self.config = config
        self.init_fn = init_fn
        self._stack: Optional[contextlib.ExitStack] = None
        self._parents: list[nn.Module] = []
        self._children: set[int] = set()

    def __enter__(self) -> "init":
        stack = contextlib.ExitStack()
        stack.enter_context(deferred.recording())
        if self.init_fn is not None:
            stack.enter_context(register_module_module_registration_hook(self._module_registered))
            stack.enter_context(register_module_parameter_registration_hook(self._parameter_registered))
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        try:
            if exc[0] is None and self.init_fn is not None:
                # Modules built inside that no other one built inside holds: the models.
                seen: set[int] = set()
                for m in self._parents:
                    if id(m) not in self._children and id(m) not in seen:
                        seen.add(id(m))
                        m.apply(self.init_fn)
        finally:
            self._stack.close()
            self._stack = None
            self._parents.clear()
            self._children.clear()

    def _module_registered(self, module: nn.Module, name: str, child: Optional[nn.Module]) -> None:
        self._parents.append(module)
        if child is not None:
            self._children.add(id(child))

    def _parameter_registered(self, module: nn.Module, name: str, param: Any) -> None:
        self._parents.append(module)
