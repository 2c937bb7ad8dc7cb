"""Parameters outside training: gathered on purpose, for a submodule called alone, for a
state dict (docs/engine.md, "Parameters outside training").

Between uses a unit's parameters are views with 0 bytes of storage (offload/units/shard.py,
[Note: freeing by storage resize]); the training path gathers a unit only in its own
forward and backward. Everything else a user does with the model goes through `Gathering`,
which *holds* units: a held unit is gathered (or, for a load, given its bytes) and stays so
until its last hold goes (`FlatUnit.holds`: `free()` leaves a held unit alone), then the
hold that gathered it frees it. Three ways in:

- `engine.gathered(params_or_modules, modifier_rank=None)`, a context (DeepSpeed's
  `GatheredParameters`, FSDP2's `unshard()`): every unit owning a named parameter is
  gathered on every rank for the whole context, in the compute dtype. With `modifier_rank=r`
  rank r's values are broadcast on exit and written into every rank's fp32 master and
  republished ([Note: writing a rank's edits back]); without it, writes are discarded
  (detected through the parameters' version counters, and warned about).
- Forward hooks on every module that directly owns parameters of a unit but is not that
  unit's module (`model.get_input_embeddings()(ids)`, `model.lm_head(h)`): when a unit of
  the call is not gathered (the call is outside the model's forward), it is gathered for
  the call and freed after. Inside the model's forward the units are gathered already and
  the hooks do nothing. A call with gradients enabled keeps its units gathered instead, until
  the backward that follows reduces them at its end ([Note: grad-enabled calls outside the
  forward]): its gradients reach the optimizer as in plain PyTorch.
- State-dict hooks: `module.state_dict()` holds each unit while torch walks its modules,
  filling every parameter entry with a CPU copy of the full value (compute dtype); and
  `module.load_state_dict(sd)` gives each unit its bytes, lets torch copy and check as
  usual, then writes the values given into the fp32 masters and republishes, unit by unit.

Every one of these is a collective at world size > 1 (all-gathers, the broadcast): every
rank must make the same calls in the same order, as with FSDP's FULL_STATE_DICT. A load
gathers nothing (it overwrites), so each rank writes its own slice of what it was given.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from offload.devices import same_device
import offload.units.collectives as _dist
from offload.runtime.backward import BackwardTracker
from offload.runtime.gather import Gatherer
from offload.runtime.residency import DeviceResidency
from offload.runtime.lifecycle import bind
from offload.runtime.view import ShardedState
from offload.units.partition import ROOT
from offload.units.shard import FROZEN_GROUP, FlatUnit

__all__ = ["Gathering", "Hold", "refuse_while_gathered"]


class Hold(enum.Enum):
    """Why a unit is held outside training, and what its release does."""

    READ = "read"
    """Gathered (compute dtype, every rank); freed on release by the hold that gathered it."""
    MODIFY = "modify"
    """Gathered; on release rank `modifier_rank`'s values go into every rank's master."""
    LOAD = "load"
    """Its full buffer has bytes but is not gathered (`load_state_dict` overwrites what it
    loads); on the unit's last LOAD release the values given are written into the masters."""


@dataclass
class _Frame:
    """One hook call's holds (a submodule call, a module's state dict or load)."""

    module: nn.Module
    units: tuple[int, ...] = ()
    ours: list[int] = field(default_factory=list)
    """Units this frame gathered (or gave bytes): its release frees them."""


def refuse_while_gathered(units: list[FlatUnit], what: str) -> None:
    """Raise when a unit is held: `what` would rewrite shards whose gathered copies the
    holder reads (and, with a modifier rank, writes back over it)."""
    held = [u.name or "<root>" for u in units if u.holds]
    if held:
        raise RuntimeError(
            f"{what} while units {held[:3]} are held by engine.gathered(...) (or a state dict "
            "or submodule call still running): it would rewrite their shards under the "
            "gathered copies; leave the context first"
        )


class Gathering:
    """Holds of units outside training, for one engine; see the module docstring."""

    def __init__(self, sharded: ShardedState, gather: Gatherer, tracker: BackwardTracker,
                 hooks: list[Any], residency: DeviceResidency) -> None:
        """Registers the hooks on the model (`install`), their handles added to `hooks` (the
        Engine's list, removed at close). Built after the Engine registered its own hooks."""
        self.sharded = sharded
        self.units = sharded.units
        self.gather = gather
        self.tracker = tracker
        self.residency = residency
        self.slot_of: dict[int, tuple[int, int]] = {
            id(p): (ui, si) for ui, u in enumerate(self.units) for si, p in enumerate(u.params)
        }
        """id(parameter view) -> (unit index, slot index)."""
        self.forwards = 0
        """Root forwards running (nested: a recomputation inside backward)."""
        self.gathers_for_state_dict = True
        """`module.state_dict()` gathers each unit for its full tensors; False while torch's
        get_model_state_dict traverses (offload/checkpoint/torch_state_dict.py)."""
        self.contexts = 0
        """`engine.gathered` contexts open."""
        self._calls: list[Optional[_Frame]] = []
        """Submodule calls running, innermost last: the holds of each (None: it held nothing)."""
        self._frames: dict[str, list[_Frame]] = {"state_dict": [], "load": []}
        self._copies: dict[tuple[int, int], torch.Tensor] = {}
        """State-dict copies of (unit, slot), shared by tied names while the unit is held."""
        self._loads: dict[int, dict[int, Any]] = {}
        """unit -> slot -> the value `load_state_dict` was given (the last, for tied names)."""
        self._load_depth = [0] * len(self.units)
        self._names: dict[int, str] = {}
        hooks += self.install()

    def owns(self, param: Any) -> bool:
        return id(param) in self.slot_of

    # -- checks -----------------------------------------------------------------------

    def check_closed(self, what: str) -> None:
        """`what` (a step, a backward, a save: `Engine._check_ready`) must not run while a
        context is open, except the model's forward without gradients (generation)."""
        if self.contexts and not self.forwards:
            raise RuntimeError(
                f"{what} inside engine.gathered(...): while parameters are held gathered only "
                "the model's forward without gradients may run (a step would change shards "
                "under the gathered copies, and a modifier rank would write back over it); "
                "leave the context first"
            )

    def _between_steps(self, what: str) -> None:
        if self.forwards or self.tracker.active:
            where = "the model's forward" if self.forwards else "a backward pass"
            raise RuntimeError(
                f"{what} inside {where}: parameters can be gathered or written on purpose only "
                "between steps (the forward and backward gather and free units themselves); "
                "move it before the forward or after engine.backward()"
            )
        if self.tracker.has_work():
            raise RuntimeError(
                f"{what} after a forward with gradients whose backward has not run: the "
                "backward needs the parameters that forward saw. Call engine.backward(loss) "
                "first, or run that forward under torch.no_grad()"
            )

    # -- holding ------------------------------------------------------------------------

    def _hold(self, units: Iterable[int], hold: Hold) -> list[int]:
        """Hold `units` (in index order: the gathers are collectives); returns those this
        hold gathered or gave bytes, which its release frees."""
        units = tuple(units)
        if units:
            self.residency.check("gathering parameters outside training (a state_dict, "
                                 "load_state_dict, submodule call or engine.gathered)")
        ours: list[int] = []
        held: list[int] = []
        try:
            for ui in units:
                unit = self.units[ui]
                if hold is Hold.LOAD:
                    if not unit.is_gathered:
                        self.gather.drop(ui)  # a copy ahead into its slot lands (or goes) first
                        unit.alloc_full()
                        ours.append(ui)
                    self._load_depth[ui] += 1
                elif not unit.is_gathered:
                    self.gather.gather_now(unit)  # also finishes a gather issued ahead
                    ours.append(ui)
                unit.holds += 1
                held.append(ui)
        except BaseException:
            for ui in held:  # a failed gather (an I/O error, say) leaves nothing held
                self.units[ui].holds -= 1
                if hold is Hold.LOAD:
                    self._load_depth[ui] -= 1
            for ui in ours:
                self.units[ui].free()
            raise
        return ours

    def _release(self, units: Iterable[int], ours: list[int], hold: Hold) -> None:
        for ui in units:
            unit = self.units[ui]
            if hold is Hold.LOAD:
                self._load_depth[ui] -= 1
                if self._load_depth[ui] == 0:
                    self._write_loaded(ui)
            unit.holds -= 1
            if unit.holds == 0:
                self._forget_copies(ui)
        for ui in ours:
            self.units[ui].free()  # a no-op while an outer hold keeps it

    # -- engine.gathered ------------------------------------------------------------------

    def context(self, what: Any, modifier_rank: Optional[int],
                failure: Optional[BaseException]) -> "GatheredContext":
        """`engine.gathered(what, modifier_rank)`; `failure`: the engine's, if it FAILED."""
        if failure is not None:
            raise RuntimeError(
                f"engine.gathered: an earlier optimizer step failed part-way ({type(failure).__name__}: "
                f"{failure}), so the parameters are inconsistent; engine.load_checkpoint(...) "
                "restores a consistent state"
            ) from failure
        if modifier_rank is not None and (
            isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
            or not 0 <= modifier_rank < self.sharded.world_size
        ):
            raise ValueError(
                f"modifier_rank={modifier_rank!r}: must be None (read only) or the rank whose "
                f"changes are kept, an int in [0, {self.sharded.world_size})"
            )
        return GatheredContext(self, self._resolve(what), modifier_rank)

    def _resolve(self, what: Any) -> dict[int, list[int]]:
        """unit index -> the slot indices named (parameters, modules, or None for all)."""
        if what is None:
            return {ui: list(range(len(u.params))) for ui, u in enumerate(self.units)}
        items = [what] if isinstance(what, (torch.Tensor, nn.Module)) else what
        try:
            items = list(items)
        except TypeError:
            raise TypeError(
                f"engine.gathered() takes parameters, modules, an iterable of them, or None; "
                f"got {type(what).__name__}"
            ) from None
        named: dict[int, set[int]] = {}
        for item in items:
            params = list(item.parameters()) if isinstance(item, nn.Module) else [item]
            for p in params:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"engine.gathered(): {type(p).__name__} is neither a "
                                    "parameter nor a module")
                where = self.slot_of.get(id(p))
                if where is None:
                    raise ValueError(
                        f"engine.gathered(): a tensor of shape {tuple(p.shape)} is not a parameter "
                        "of this engine's model; initialize replaced the model's parameters, so "
                        "take them from engine.module (e.g. engine.module.lm_head.weight)"
                    )
                named.setdefault(where[0], set()).add(where[1])
        return {ui: sorted(s) for ui, s in sorted(named.items())}

    def _agree(self, named: dict[int, list[int]], modifier_rank: Optional[int]) -> None:
        """Every rank must gather the same units in the same order and name the same modifier
        rank: one small all-reduce (of a few sums over the named units and parameters) says
        so before any gather could deadlock, or ranks write different parameters."""
        sh = self.sharded
        if sh.world_size == 1:
            return
        units = list(named)
        slots = [ui * 1_000_003 + si + 1 for ui, ss in named.items() for si in ss]
        mod = -1 if modifier_rank is None else modifier_rank
        mine = torch.tensor([len(units), sum(units), sum(u * u for u in units), len(slots),
                             sum(slots), sum(s * s for s in slots) % (1 << 61), mod], dtype=torch.int64)
        n = mine.numel()
        both = _dist.all_reduce_host(torch.cat([mine, -mine]), "max", sh.pg, sh.device)
        if not torch.equal(both[:n], -both[n:]):
            raise RuntimeError(
                f"engine.gathered(): ranks named different parameters or modifier ranks (this "
                f"rank: {len(units)} unit(s), modifier_rank={modifier_rank}); every rank must enter "
                "the context with the same arguments"
            )

    def _write_modified(self, named: dict[int, list[int]], src: int) -> None:
        """[Note: writing a rank's edits back]
        Rank `src`'s full buffer of each unit is broadcast (compute dtype); each rank then
        writes the named parameters' part of its own shard into its fp32 master (a frozen
        parameter's into the parameter shard, which is all it has) and republishes the
        low-precision shard. Only elements whose value differs from the
        master rounded to the compute dtype are written (upcast): an element the user did
        not change keeps its fp32 master bits, so zeroing one row of a bf16 run's embedding
        does not round the rest of it to bf16 (DeepSpeed writes the whole gathered
        parameter; in fp32 both are the same). The optimizer's moments stay as they are."""
        sh = self.sharded
        sh.sync_device()  # queued host-to-device copies still read the shards rewritten here
        coll = _dist.collective_device(sh.pg, sh.device)
        for ui, slots in named.items():
            unit = self.units[ui]
            buf = unit.full if same_device(unit.full.device, coll) else unit.full.to(coll)
            _dist.broadcast_(buf, src, sh.pg)
            if buf is not unit.full:
                unit.full.copy_(buf)  # an outer hold reads these values too
            values = buf.cpu()
            with sh.optimizer_states.open(ui, write=True) as t:
                self.gather.drop(ui)  # shards fetched ahead are stale now
                given = [(si, values[s.offset : s.end].view(s.shape))
                         for si, s in ((si, unit.layout.slots[si]) for si in slots)]
                unit.write_slots(given, t.master, merge=True)  # a frozen one: its shard
            self._forget_copies(ui)

    def _restore(self, changed: Iterable[tuple[int, int]]) -> bool:
        """Discard writes to the (unit, slot)s `changed` of aliased units (world size 1, the
        shard is the full buffer): republish their shards from the masters. False when a
        master is that very memory (fp32 on the CPU), or a changed parameter is frozen (its
        value lives only in that shard), where the write cannot be undone."""
        undone = True
        changed = list(changed)
        for ui in sorted({ui for ui, _ in changed}):
            unit = self.units[ui]
            if not unit.aliased:
                continue  # the gathered copy is freed on release: the write goes with it
            if any(unit.layout.slots[si].group == FROZEN_GROUP for u, si in changed if u == ui):
                undone = False
            with self.sharded.optimizer_states.open(ui) as t:
                if unit.shard is not None and unit.shard.data_ptr() == t.master.data_ptr():
                    undone = False
                    continue
                self.gather.drop(ui)
                unit.publish(t.master)
        return undone

    def _forget_copies(self, ui: int) -> None:
        for key in [k for k in self._copies if k[0] == ui]:
            del self._copies[key]

    # -- hooks ----------------------------------------------------------------------------

    def install(self) -> list[Any]:
        """Register the hooks on the engine's model; returns their handles. The root's
        pre-forward hook is prepended after the Engine's own, so it runs before it."""
        model = self.sharded.module
        unit_module = {id(model): ROOT}
        for unit in self.units[1:]:
            unit_module[id(model.get_submodule(unit.name))] = unit.index
        handles = [
            model.register_forward_pre_hook(bind(self._root_pre, None), prepend=True),
            model.register_forward_hook(bind(self._root_post, None), always_call=True),
        ]
        for name, module in model.named_modules():
            self._names[id(module)] = name or "<model>"
            direct = {self.slot_of[id(p)][0] for p in module._parameters.values()
                      if p is not None and id(p) in self.slot_of}
            own = unit_module.get(id(module))
            held = tuple(sorted(direct | ({own} if own is not None else set())))
            if not held:
                continue
            calls = tuple(ui for ui in held if ui != own)
            if calls:
                handles.append(module.register_forward_pre_hook(
                    bind(self._call_pre, calls), with_kwargs=True, prepend=True))
                handles.append(module.register_forward_hook(bind(self._call_post, calls), always_call=True))
            handles.append(module.register_state_dict_pre_hook(bind(self._state_dict_pre, held)))
            handles.append(module.register_state_dict_post_hook(bind(self._state_dict_post, held)))
            handles.append(module.register_load_state_dict_pre_hook(bind(self._load_pre, held)))
            handles.append(module.register_load_state_dict_post_hook(bind(self._load_post, held)))
        return handles

    def _root_pre(self, _: None, module: nn.Module, args: Any) -> None:
        self.forwards += 1  # the always-called post hook takes it back, also if this raises
        if self.contexts and torch.is_grad_enabled() and not self.tracker.active:
            raise RuntimeError(
                "the model's forward with gradients enabled inside engine.gathered(...): its "
                "backward and step would change the shards the context holds copies of. Run "
                "it under torch.no_grad() (generation, evaluation), or leave the context first"
            )

    def _root_post(self, _: None, module: nn.Module, args: Any, output: Any) -> None:
        self.forwards -= 1

    def _call_pre(self, units: tuple[int, ...], module: nn.Module, args: Any, kwargs: Any) -> None:
        stack = self._calls
        stack.append(None)  # first: the always-called post hook pops one entry per call
        for ui in units:
            if not self.units[ui].is_gathered:
                break
        else:
            return None  # inside the model's forward (or a context): nothing to do
        if torch.is_grad_enabled() and (
            any(p is not None and p.requires_grad for p in module._parameters.values())
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten((args, kwargs))[0])
        ):
            if self.contexts:
                name = self._names.get(id(module), type(module).__name__)
                raise RuntimeError(
                    f"{name} ({type(module).__name__}) was called with gradients enabled inside "
                    "engine.gathered(...): its backward and step would change the shards the "
                    "context holds copies of. Leave the context first, or call it under no_grad"
                )
            # [Note: grad-enabled calls outside the forward] (`emb = model.get_input_embeddings()
            # (ids)` then `engine(inputs_embeds=emb, ...)`: the multimodal and TRL pattern). The
            # units are gathered as for the model's forward and stay so until the backward
            # reduces them at its end (no trigger sees this call's gradients arrive).
            for ui in units:
                unit = self.units[ui]
                if not unit.is_gathered:
                    self.gather.gather_now(unit)
                self.gather.keep_for_backward(unit)
                self.tracker.called_outside(unit)
            return None
        stack[-1] = _Frame(module, units, self._hold(units, Hold.READ))
        return None

    def _call_post(self, units: tuple[int, ...], module: nn.Module, args: Any, output: Any) -> None:
        frame = self._calls.pop() if self._calls else None
        if frame is not None:
            self._release(frame.units, frame.ours, Hold.READ)

    def _held_or_unwind(self, kind: str, units: tuple[int, ...], hold: Hold) -> Any:
        """`_hold` for a state-dict traversal's module; when it raises (an allocation, an I/O
        error), the traversal ends with the error and its post-hooks never run: release what
        the frames of `kind` still hold (and forget values a load collected) first."""
        try:
            return self._hold(units, hold)
        except BaseException:
            stack = self._frames[kind]
            while stack:
                frame = stack.pop()
                if frame.units:
                    self._release(frame.units, frame.ours, hold)
            if kind == "load":
                self._loads.clear()
            raise

    def _pop(self, kind: str, module: nn.Module) -> Optional[_Frame]:
        stack = self._frames[kind]
        if stack and stack[-1].module is module:
            return stack.pop()
        return None  # another hook raised before ours ran: nothing was held

    # -- state dicts ------------------------------------------------------------------------

    def _state_dict_pre(self, units: tuple[int, ...], module: nn.Module, prefix: str,
                        keep_vars: bool) -> None:
        frame = _Frame(module)
        # keep_vars=True asks for the live parameters: the views themselves; and torch's
        # get_model_state_dict gets the sharded dict instead (checkpoint/torch_state_dict.py)
        if not keep_vars and self.gathers_for_state_dict:
            frame.units = units
            frame.ours = self._held_or_unwind("state_dict", units, Hold.READ)
        self._frames["state_dict"].append(frame)

    def _state_dict_post(self, units: tuple[int, ...], module: nn.Module, state_dict: Any,
                         prefix: str, local_metadata: Any) -> None:
        frame = self._pop("state_dict", module)
        if frame is None or not frame.units:
            return
        for name, p in module._parameters.items():
            key = prefix + name
            where = None if p is None else self.slot_of.get(id(p))
            if p is None or where is None or key not in state_dict:
                continue
            unit = self.units[where[0]]
            if unit.aliased and unit.full.device.type == "cpu":
                continue  # the engine's own memory, always there: a view, as torch gives
            copy = self._copies.get(where)
            if copy is None:
                copy = self._copies[where] = p.detach().to("cpu", copy=True)
            state_dict[key] = copy
        self._release(frame.units, frame.ours, Hold.READ)
        if not self._frames["state_dict"]:
            _check_no_dead_tensors(state_dict)

    def _load_pre(self, units: tuple[int, ...], module: nn.Module, state_dict: Any, prefix: str,
                  local_metadata: Any, strict: bool, missing: Any, unexpected: Any, errors: Any) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError(
                "load_state_dict(assign=True) would replace the engine's parameters (views into "
                "its units) by the given tensors, which it never trains; load with assign=False "
                "(the values go into the engine's fp32 masters)"
            )
        if not self._frames["load"]:
            self._between_steps(f"{self._names.get(id(module), 'module')}.load_state_dict")
        frame = _Frame(module, units, self._held_or_unwind("load", units, Hold.LOAD))
        self._frames["load"].append(frame)
        for name, p in module._parameters.items():
            where = None if p is None else self.slot_of.get(id(p))
            value = state_dict.get(prefix + name)
            if p is None or where is None or not isinstance(value, torch.Tensor) or value.shape != p.shape:
                continue  # torch reports a missing key or a wrong shape as it does for any model
            # A tied parameter's later name overwrites the earlier, as torch's copies do.
            self._loads.setdefault(where[0], {})[where[1]] = value

    def _load_post(self, units: tuple[int, ...], module: nn.Module, incompatible: Any) -> None:
        frame = self._pop("load", module)
        if frame is not None:
            self._release(frame.units, frame.ours, Hold.LOAD)

    def _write_loaded(self, ui: int) -> None:
        """The values `load_state_dict` gave for unit `ui` into its fp32 master as given
        (upcast: a bf16 state dict gives bf16-exact masters), and the shard republished; the
        rest of the unit is unchanged. Unlike a modifier rank's edits, every element is
        written: a load restores values, whatever the master holds now."""
        values = self._loads.pop(ui, None)
        if not values:
            return
        sh, unit = self.sharded, self.units[ui]
        sh.sync_device()
        with sh.optimizer_states.open(ui, write=True) as t:
            self.gather.drop(ui)
            unit.write_slots(values.items(), t.master)  # a frozen one: into its shard
        self._forget_copies(ui)


class GatheredContext:
    """What `engine.gathered(...)` returns; see `Gathering` and the module docstring."""

    def __init__(self, owner: Gathering, named: dict[int, list[int]], modifier_rank: Optional[int]) -> None:
        self.owner = owner
        self.named = named
        self.modifier_rank = modifier_rank
        self._ours: Optional[list[int]] = None
        self._versions: list[tuple[int, int, int]] = []

    def __enter__(self) -> None:
        owner = self.owner
        owner._between_steps("engine.gathered")
        owner._agree(self.named, self.modifier_rank)
        self._ours = owner._hold(self.named, Hold.MODIFY if self.modifier_rank is not None else Hold.READ)
        owner.contexts += 1
        if self.modifier_rank is None:
            self._versions = [(ui, si, owner.units[ui].params[si]._version)
                              for ui, slots in self.named.items() for si in slots]
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        owner, named = self.owner, self.named
        owner.contexts -= 1
        try:
            if self.modifier_rank is not None:
                # Write back only when no rank raised inside the context: every rank learns it
                # from one all-reduce, so all take the same path (no broadcast left waiting).
                sh = owner.sharded
                flag = torch.tensor([0.0 if exc_type is None else 1.0])
                if float(_dist.all_reduce_host(flag, "max", sh.pg, sh.device)[0]) == 0.0:
                    owner._write_modified(named, self.modifier_rank)
            else:
                self._discard_writes()
        finally:
            owner._release(named, self._ours or [], Hold.READ)

    def _discard_writes(self) -> None:
        units = self.owner.units
        changed = [(ui, si) for ui, si, v in self._versions if units[ui].params[si]._version != v]
        if not changed:
            return
        names = [units[ui].layout.slots[si].name for ui, si in changed]
        undone = self.owner._restore(changed)
        warnings.warn(
            f"parameters {names[:5]}{' ...' if len(names) > 5 else ''} were changed inside "
            "engine.gathered(...) without modifier_rank: "
            + ("the change is discarded" if undone else
               "at world size 1 on the CPU the parameters are the engine's own shard (the fp32 "
               "master itself in fp32, and a frozen parameter's only copy), so the change was "
               "kept, but on more ranks it would be discarded")
            + "; pass modifier_rank=<the rank whose values to keep> to change them on purpose",
            stacklevel=3,
        )


def _check_no_dead_tensors(state_dict: Any) -> None:
    """A state dict must never hold a tensor without storage (a view of a freed unit that
    the hooks did not fill: a module that renamed its keys, say)."""
    dead = [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.numel()
            and v.device.type != "meta" and v.untyped_storage().nbytes() == 0]
    if dead:
        raise RuntimeError(
            f"state dict entries {dead[:3]} hold no data: their module stores its parameters "
            "under other keys than their names, so the engine could not fill them; use "
            "engine.full_state_dict() (fp32, every key of model.state_dict())"
        )
