"""Deferred construction: what a model built under `offload.init` did to its tensors.

    with offload.init(config):
        model = Model()           # every tensor on the meta device, every write recorded
    engine = offload.initialize(model, config)   # each parameter computed as it is sharded

[Note: deferred construction]
Inside `offload.init` the model's constructor runs as written: `reset_parameters()`, a
parent's `self.apply(init_fn)`, Hugging Face's `post_init()`, writes under
`GatheredParameters`, `nn.init.orthogonal_`, anything. Its tensors live on the meta device
(no memory), and a `TorchFunctionMode` (torch's own hook: nothing is patched) records, per
storage, the call that made it and every call that wrote into it since, with the tensors
it read referred to by (storage, version, view geometry). `initialize` then computes each
parameter from its record when its unit is filled, one parameter (and the transient
tensors it was made from) at a time, and the model's memory is never whole.

Why the values are bit-identical to an eager construction from the same seed:
- A random call (`normal_`, `randn`, `nn.init.trunc_normal_`, ...) stores its generator's
  state before it and, at construction, runs for real on a scratch tensor of the same
  geometry (strides included: the draw count of a CPU kernel depends on them) and is then
  dropped: the generator advances exactly as in eager mode, so every later draw — the next
  module's, the user's after the constructor returns — is the eager one. At `initialize`
  the call runs again from its stored state on the real tensor: the same numbers.
  (Construction costs one eager construction's draws, `initialize` another: twice the
  random-number work, one tensor of scratch at a time.)
- Every other write is replayed in order with the same arguments; a tensor a write read is
  computed at the version it had then. The generators' states at the end of `initialize`
  are the ones it started with: building the engine draws nothing from the user's stream.
- A call whose result depends on values (`.item()`, `bool(t)`, `.tolist()`, `torch.equal`)
  computes the tensors it reads there and then (one tensor's memory), as eager mode would.

A parameter made by `torch.empty` that nothing wrote is an error naming it: eager mode
would train from whatever was in memory. Buffers are computed at `initialize` before
anything else (they are small: rotary tables, position ids).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["DeferredStorage", "Recorder", "Session", "evaluate", "forget", "is_deferred",
           "recording", "suspended", "unset"]

_RANDOM_NAMES = frozenset({
    # torch / Tensor calls that draw random numbers
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial",
    "poisson", "rand_like", "randn_like", "randint_like",
    # torch.nn.init functions that are torch functions themselves (seen whole)
    "kaiming_uniform_",
})
_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__",
})
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_", "__set__"})
"""In-place by name, but they change no values (`__set__`: `p.data = t` makes `p` view
`t`'s storage, which the registry finds by address)."""
_REFUSED = frozenset({"resize_", "set_", "resize_as_"})
"""Writes that change a storage's size: not recorded (refused with a clear error)."""
_EMPTY_FACTORIES = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
_SHAPE_ONLY = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
                         "new_empty_strided", "empty_like", "zeros_like", "ones_like", "full_like",
                         "rand_like", "randn_like", "randint_like"})
"""Calls that read their first argument's geometry and dtype, not its values: replayed on a
stand-in, so that no value is computed just to be ignored (`orthogonal_`'s `new_empty`)."""
_VALUE_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__",
                          "__complex__", "numpy", "__array__", "equal", "allclose", "__format__"})
"""Calls whose non-tensor result depends on values: computed for real, then and there."""
# The getters of `t.is_meta` and `t.device`, as the mode receives them (typed as plain
# attributes in torch's stubs, they are descriptors on the class).
_IS_META = torch._C.TensorBase.__dict__["is_meta"].__get__
_DEVICE = torch._C.TensorBase.__dict__["device"].__get__
_CPU = torch.device("cpu")
_META = torch.device("meta")


def _on_meta(x: Any) -> Any:
    """A call's CPU device argument as the meta device (`t.to("cpu")` on a deferred `t`)."""
    if isinstance(x, torch.device) and x.type == "cpu":
        return _META
    if isinstance(x, str) and x in ("cpu", "cpu:0"):
        return "meta"
    return x


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or ""


def _is_random(func: Any) -> bool:
    return _name(func) in _RANDOM_NAMES


def _generator_of(kwargs: dict) -> torch.Generator:
    g = kwargs.get("generator")
    return g if isinstance(g, torch.Generator) else torch.default_generator


@dataclass(frozen=True)
class _Ref:
    """A deferred tensor as a call read it: its storage after `version` writes, and its
    geometry on that storage."""

    storage: "DeferredStorage"
    version: int
    size: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class _StandIn:
    """A `_SHAPE_ONLY` call's first argument: only its geometry and dtype matter."""

    size: tuple
    stride: tuple
    dtype: torch.dtype

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="cpu")


@dataclass(frozen=True)
class _Call:
    """One recorded call, with deferred tensors as `_Ref`s and real ones cloned."""

    func: Callable
    args: tuple
    kwargs: dict
    rng: Optional[tuple[torch.Generator, torch.Tensor]] = None
    """A random call: its generator and the generator's state just before the call."""
    index: Optional[int] = None
    """Which tensor of a call's (flattened) outputs a storage it made is."""


@dataclass(eq=False)
class DeferredStorage:
    """One storage made under `offload.init`: the call that made it and every write since."""

    base: torch.Tensor
    """The meta tensor the storage was made as (kept: while it lives, the address is ours)."""
    made_by: _Call
    writes: list[_Call] = field(default_factory=list)
    empty: bool = False
    """Allocated without values (`torch.empty`) and not written since."""


class _Registry:
    """Deferred storages, found by storage address; each kept alive by the tensors on it."""

    def __init__(self) -> None:
        self.by_address: dict[int, weakref.ref] = {}
        self.alive = WeakIdKeyDictionary()

    def find(self, t: Any) -> Optional[DeferredStorage]:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return None
        ref = self.by_address.get(t.untyped_storage()._cdata)
        s = ref() if ref is not None else None
        if s is not None and t not in self.alive:
            self.alive[t] = s  # an alias made where the mode did not see it (nn.Parameter)
        return s

    def add(self, t: torch.Tensor, s: DeferredStorage) -> None:
        self.by_address[t.untyped_storage()._cdata] = weakref.ref(s)
        self.alive[t] = s

    def forget(self, t: torch.Tensor) -> None:
        self.alive.pop(t, None)


_REGISTRY = _Registry()


def is_deferred(t: Any) -> bool:
    """Whether `t` is a tensor made under `offload.init` whose values are not computed yet."""
    return _REGISTRY.find(t) is not None


def unset(t: torch.Tensor) -> bool:
    """Whether deferred `t` was allocated without values and nothing wrote into it."""
    s = _REGISTRY.find(t)
    return s is not None and s.empty


def forget(t: torch.Tensor) -> None:
    """`t`'s value has been taken: it no longer keeps its record alive."""
    _REGISTRY.forget(t)


def _ref(t: torch.Tensor, s: DeferredStorage) -> _Ref:
    return _Ref(s, len(s.writes), tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))


def _recorded(x: Any) -> Any:
    """A call argument as recorded: a deferred tensor by reference, a real one cloned (the
    value it had at the call, whatever happens to it later)."""
    if isinstance(x, torch.Tensor):
        s = _REGISTRY.find(x)
        if s is not None:
            return _ref(x, s)
        return x.detach().clone() if x.device.type != "meta" else x
    return x


class Recorder(TorchFunctionMode):
    """The mode `offload.init` pushes ([Note: deferred construction]): factories make meta
    tensors, and every call that touches one is recorded. One per process at a time (nested
    contexts share it); `enabled` False passes every call through (`suspended`)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if not self.enabled:
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        deferred = [t for t in flat if isinstance(t, torch.Tensor) and _REGISTRY.find(t) is not None]
        # The constructor sees CPU tensors, as eagerly: nn.init.trunc_normal_ skips meta
        # ones, and Hugging Face skips its init when `torch.tensor([]).device` is meta.
        if func == _IS_META and deferred:
            return False
        if func == _DEVICE and deferred:
            return _CPU
        device = kwargs.get("device")
        if func in _device_constructors() and not deferred and kwargs.get("out") is None and (
                device is None or torch.device(device).type in ("cpu", "meta")):
            return self._factory(func, args, kwargs)
        if not deferred:
            return func(*args, **kwargs)
        name = _name(func)
        if name in _VALUE_READS:
            return func(*_computed(args), **_computed(kwargs))
        if name in _REFUSED:
            raise RuntimeError(f"offload.init: {name} on a tensor built under offload.init is not "
                               "supported (it changes the storage's size); build the model without "
                               "offload.init, or allocate the tensor at its final size")
        if name not in _NOT_WRITES and (name in _IN_PLACE_DUNDERS or kwargs.get("out") is not None
                                        or (name.endswith("_") and not name.startswith("_"))):
            return self._write(func, args, kwargs)
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dim() > 0 for t in flat):
            # Mixed with real tensors (a forward inside an open offload.init): computed for
            # real, as eagerly, from the real tensors' values now.
            return func(*_computed(args), **_computed(kwargs))
        try:
            out = func(*tree_map(_on_meta, args), **tree_map(_on_meta, kwargs))  # shapes and dtypes only
        except NotImplementedError:
            # No meta kernel (the result depends on values): computed for real, as eagerly.
            return func(*_computed(args), **_computed(kwargs))
        return self._made(func, args, kwargs, out)

    def _factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        rng = None
        if _is_random(func):
            gen = _generator_of(kwargs)
            rng = (gen, gen.get_state())
            func(*args, **{**kwargs, "device": "cpu"})  # the eager draw: the generator advances
        out = func(*args, **{**kwargs, "device": "meta"})
        if isinstance(out, torch.Tensor):
            call = _Call(func, tree_map(_recorded, args), {k: v for k, v in kwargs.items() if k != "device"}, rng)
            _REGISTRY.add(out, DeferredStorage(out, call, empty=_name(func) in _EMPTY_FACTORIES))
        return out

    def _write(self, func: Any, args: tuple, kwargs: dict) -> Any:
        target = _written(args, kwargs)
        s = _REGISTRY.find(target)
        if s is None:
            raise RuntimeError(
                f"offload.init: {_name(func)} writes a value computed from tensors built under "
                "offload.init (on the meta device, their values deferred to offload.initialize) "
                "into a real tensor; build that tensor under offload.init too, or the model without it")
        rng = None
        if _is_random(func):
            gen = _generator_of(kwargs)
            rng = (gen, gen.get_state())
            # The eager draw, on scratch of the storage's own geometry (a kernel's draw count
            # depends on strides): the generator advances as it would have.
            scratch = torch.empty_strided(s.base.size(), s.base.stride(), dtype=s.base.dtype, device="cpu")
            view = scratch.as_strided(target.size(), target.stride(), target.storage_offset())
            real_args, real_kwargs = _computed((args, kwargs), target, view)
            func(*real_args, **real_kwargs)
            del scratch, view, real_args, real_kwargs
        call = _Call(func, tree_map(_recorded, args), tree_map(_recorded, kwargs), rng)
        out = func(*args, **kwargs)  # on the meta device: checks shapes, changes no values
        s.writes.append(call)
        s.empty = False
        return out

    def _made(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        flat_out, _ = tree_flatten(out)
        fresh = [(i, t) for i, t in enumerate(flat_out)
                 if isinstance(t, torch.Tensor) and t.device.type == "meta" and _REGISTRY.find(t) is None]
        if not fresh:
            return out  # views of deferred storages (their geometry says which), or no tensors
        rng = None
        if _is_random(func):
            gen = _generator_of(kwargs)
            rng = (gen, gen.get_state())
            real_args, real_kwargs = _computed((args, kwargs))
            func(*real_args, **real_kwargs)  # the eager draw: the generator advances
        if _name(func) in _SHAPE_ONLY:
            first = args[0]
            call_args = (_StandIn(tuple(first.size()), tuple(first.stride()), first.dtype),) + \
                tuple(tree_map(_recorded, args[1:]))
        else:
            call_args = tree_map(_recorded, args)
        call_kwargs = tree_map(_recorded, kwargs)
        for i, t in fresh:
            made = _Call(func, call_args, call_kwargs, rng, index=i)
            _REGISTRY.add(t, DeferredStorage(t, made, empty=_name(func) in _EMPTY_FACTORIES))
        return out


def _written(args: tuple, kwargs: dict) -> Any:
    """The tensor an in-place call writes: `out=`, else its first argument (`nn.init`'s
    functions pass it as `tensor=` through `handle_torch_function`)."""
    if kwargs.get("out") is not None:
        return kwargs["out"]
    if args:
        return args[0]
    return next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)


def _computed(tree: Any, target: Any = None, view: Any = None) -> Any:
    """`tree` with every deferred tensor computed (`target` replaced by `view`)."""
    with Session() as session:
        def real(x: Any) -> Any:
            if target is not None and x is target:
                return view
            s = _REGISTRY.find(x)
            return session.value(_ref(x, s)) if s is not None else x

        return tree_map(real, tree)


# -- computing values ------------------------------------------------------------------------------


class Session(contextlib.AbstractContextManager):
    """Computes deferred values. On exit, every generator a replayed random call set is put
    back in the state it had before (the user's stream is left where it was)."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._outputs: dict[int, list[Any]] = {}
        """id(call) -> its flattened outputs, for a call that made several storages (qr)."""
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> "Session":
        self._exit.enter_context(suspended())
        return self

    def __exit__(self, *exc: Any) -> None:
        for gen, state in self._saved.values():
            gen.set_state(state)
        self._saved.clear()
        self._outputs.clear()
        self._exit.close()

    def forget(self) -> None:
        """Drop cached outputs (between units: the memory held stays one unit's worth)."""
        self._outputs.clear()

    def value(self, ref: _Ref) -> torch.Tensor:
        """The real tensor `ref` names."""
        return self.base(ref.storage, ref.version).as_strided(ref.size, ref.stride, ref.offset)

    def base(self, s: DeferredStorage, version: Optional[int] = None) -> torch.Tensor:
        """Storage `s` after its first `version` writes (all: None), in its own geometry."""
        out = self._outputs_of(s.made_by)[s.made_by.index or 0]
        if s.made_by.index is not None and s.writes:
            out = out.clone()  # the cached output is read again (Q, then R): writes go to a copy
        if tuple(out.size()) != tuple(s.base.size()) or tuple(out.stride()) != tuple(s.base.stride()):
            out = torch.empty_strided(s.base.size(), s.base.stride(), dtype=s.base.dtype).copy_(out)
        for call in s.writes[: len(s.writes) if version is None else version]:
            self._run(call, s, out)
        return out

    def _outputs_of(self, call: _Call) -> list[Any]:
        if call.index is None:
            return [self._run(call)]
        key = id(call.args)  # the calls made by one function call share their arguments
        if key not in self._outputs:
            self._outputs[key] = tree_flatten(self._run(call))[0]
        return self._outputs[key]

    def _run(self, call: _Call, s: Optional[DeferredStorage] = None, base: Optional[torch.Tensor] = None) -> Any:
        def resolve(x: Any) -> Any:
            if isinstance(x, _Ref):
                if x.storage is s:  # the storage being written, as it is now
                    assert base is not None  # a write is always run on its storage's base
                    return base.as_strided(x.size, x.stride, x.offset)
                return self.value(x)
            if isinstance(x, _StandIn):
                return x.make()
            return x

        args = tree_map(resolve, call.args)
        kwargs = tree_map(resolve, call.kwargs)
        if call.func in _device_constructors() and s is None:
            kwargs["device"] = "cpu"
        if call.rng is not None:
            gen, state = call.rng
            self._saved.setdefault(id(gen), (gen, gen.get_state()))
            gen.set_state(state)
        return call.func(*args, **kwargs)


def evaluate(t: torch.Tensor, session: Session) -> torch.Tensor:
    """The value of deferred tensor `t`: a new CPU tensor, every write applied."""
    s = _REGISTRY.find(t)
    if s is None:
        raise ValueError("not a tensor built under offload.init")
    return session.value(_ref(t, s))


# -- the context -----------------------------------------------------------------------------------

_ACTIVE: Optional[Recorder] = None
"""The open `offload.init` recording, if any: the context's own state (as torch's mode stack
is process state), set and cleared by `recording` only; a nested context joins it."""


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record what the code inside does to its tensors; a nested call joins the open one."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    rec = Recorder()
    _ACTIVE = rec
    try:
        with rec:
            yield rec
    finally:
        _ACTIVE = None


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Real tensors inside, even within an open `offload.init` (`offload.initialize` called
    there, and the computing of deferred values)."""
    rec = _ACTIVE
    if rec is None or not rec.enabled:
        yield
        return
    rec.enabled = False
    try:
        yield
    finally:
        rec.enabled = True
