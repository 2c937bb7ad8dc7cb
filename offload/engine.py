"""The user's object: `offload.initialize(model, config)` and the `Engine` it returns.

    engine = offload.initialize(model, config)
    loss = engine(batch)        # the model's forward, same arguments and outputs
    engine.backward(loss)
    engine.step()               # optimizer step at accumulation boundaries

Underneath (docs/engine.md, docs/architecture.md): `runtime.build` makes the units, tiers
and optimizer state; module hooks ask the collaborator that owns each piece of state; swap
files are deleted by `close()` (also on `with` exit, at garbage collection and at exit).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

import offload.units.collectives as _dist
from offload.checkpoint import sharded_dict  # DTensor state dicts (torch's DTensor imported on use)
from offload.checkpoint.shards import CheckpointStaging
from offload.checkpoint.torch_state_dict import TorchStateDictRoute  # torch's helpers on the module
from offload.config import Config, load_config
from offload.dtypes import DTYPES
from offload.optim.lr_schedules import resolve_scheduler
from offload.optim.sharded import ShardedAdam
from offload.optim.threads import resolve_threads
from offload.runtime.accounting import device_tensors, memory_bytes
from offload.runtime.activations import ActivationSettings
from offload.runtime.backward import BackwardTracker
from offload.runtime.build import build
from offload.runtime.gather import Gatherer
from offload.runtime.gathered import Gathering
from offload.runtime.generation import mark_synced_generation, unmark_synced_generation
from offload.runtime.grads import Gradients
from offload.runtime.health import Health
from offload.runtime.lifecycle import (  # EngineState: importable from here, as before
    LIVE_ENGINES,
    EngineState,
    drain_at_exit,
    check_weights_present,
    forward_of_a_closed_model,
    released_parameters,
    remove_hooks,
    take_over,
)
from offload.runtime.monitors import check_monitors
from offload.runtime.optimizer_step import StepPolicy
from offload.runtime.param_state import ParamState
from offload.runtime.report import StepReporter
from offload.runtime.residency import DeviceResidency
from offload.runtime.timeline import Timeline
from offload.runtime.unit_hooks import UnitHooks
from offload.runtime.view import ShardedState
from offload.units.deferred import suspended
from offload.units.mesh import setup_groups

__all__ = ["Engine", "initialize", "EngineState"]

ConfigLike = Union[Config, Mapping[str, Any], str, "os.PathLike[str]", None]


def initialize(
    model: nn.Module,
    config: ConfigLike = None,
    optimizer: Any = None,  # kinds.OptimizerArg: the user's union, resolved in optim/kinds.py
    lr_scheduler: Any = None,
) -> "Engine":
    """Wrap `model` for partitioned training; see `Engine`.

    config: an `offload.Config`, a dict or JSON/YAML path (ours or DeepSpeed's), or None
        for the defaults.
    optimizer: None (one group from `config.optimizer`); a dict of hyperparameters that
        override it; a list of torch-style param groups (`[{"params": [...], "weight_decay":
        0.0}, ...]` over the model's parameters); or a `torch.optim.Adam`/`AdamW`/`Adagrad`
        (or a `lion_pytorch.Lion`) built on the model, whose type, groups and hyperparameters
        are taken over (its state is not). config.optimizer.type picks Adam, AdamW, Lion or
        Adagrad otherwise (offload/optim/kinds.py).
    lr_scheduler: a `torch.optim.lr_scheduler` object over `engine.optimizer` cannot exist
        yet, so pass a callable `optimizer -> scheduler`; it is built on `engine.optimizer`
        and stepped by `engine.step()` at every applied optimizer step (as DeepSpeed does).
        None with `config.scheduler` set builds that schedule.
    """
    with suspended():  # inside an open offload.init the engine's own tensors are real
        take_over(model)  # a model a live engine of this process holds (a notebook re-run)
        return Engine(model, load_config(config), optimizer=optimizer, lr_scheduler=lr_scheduler)


class Engine:
    """ZeRO-3 partitioned training of one model; built by `offload.initialize`.

    Attributes users rely on: `module`, `optimizer` (its `param_groups` drive the learning
    rate), `lr_scheduler`, `global_steps`, `micro_steps`, `skipped_steps`, `loss_scale`,
    `last_grad_norm`, `rank`, `world_size`, `device`, `param_state` (one parameter's fp32
    value and optimizer state: offload/runtime/param_state.py).

    The wiring: `build` makes the units, tiers and optimizer state; the `Gatherer` hands each
    unit a gathered buffer when its hooks ask (`UnitHooks`: offload/runtime/unit_hooks.py); the `BackwardTracker` reduces gradients
    into the shards; the `StepPolicy` decides where updates run; `sharded_state` is what
    checkpoints and weight export see.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        *,
        optimizer: Any = None,  # kinds.OptimizerArg
        lr_scheduler: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config
        self.module = model
        device_type = _dist.resolve_device(config.compute_device).type
        self.dtype = DTYPES[config.precision.dtype]
        # The groups first (torchrun's env selects LOCAL_RANK's GPU); the units' group: HSDP's shard group
        self.pg = setup_groups(config, device_type)
        self.device = _dist.resolve_device(config.compute_device)
        self.rank, self.world_size = self.pg.world.rank, self.pg.world.world_size  # every rank
        self.placement_plan = None
        if config.offload.placement == "auto":  # the planner picks the tiers (offload.plan)
            from offload.plan import resolve_placement

            config, self.placement_plan = resolve_placement(model, config, optimizer, self.pg, self.device)
            self.config = config
        self._close_nvme: Optional[Callable[[], Any]] = None
        self._hooks: list[Any] = []
        self._at_exit = drain_at_exit(self)  # a script that ends without close()
        self.residency = DeviceResidency()
        self.checkpoint_staging = CheckpointStaging()  # I/O buffers kept between checkpoints
        check_weights_present(model)
        check_monitors(config.monitors)  # a missing library fails here, before the build
        # offload.checkpointing's default while this engine's forward runs (runtime/activations.py)
        activations = ActivationSettings(cpu_offload=True) if config.activation_checkpointing.cpu_offload else None
        built = build(self, model, config, self.pg, self.device, self.dtype, optimizer)
        self._close_nvme = built.close_nvme
        self.units, self.states = built.units, built.states
        self.param_tier, self.nvme, self.placement = built.param_tier, built.nvme, built.placement
        self.optimizer_states = built.optimizer_states
        self.optimizer = ShardedAdam(
            built.param_groups, self.states, decoupled_weight_decay=built.decoupled_weight_decay,
            rank=self.pg.rank, param_tier=self.param_tier, threads=resolve_threads(config.cpu_adam_threads),
            store=built.optimizer_states, kind=built.kind, moments=config.optimizer.moments_dtype)
        tl = config.timeline
        self.timeline = Timeline(tl.enabled, tl.path,
                                 io_stats=None if self.nvme is None else self.nvme.stats)
        self.gather = Gatherer(self.units, self.param_tier, config.prefetch, self.dtype,
                               self.pg.world_size, self.timeline)
        self.policy = StepPolicy(config, self.dtype, self.optimizer, self.states, self.pg,
                                 self.device, self.timeline, self.nvme, built.transient_grads)
        self.backward_tracker = BackwardTracker(self.units, self.states, built.transient_grads,
                                                self.timeline, self.gather.compute_started,
                                                share_scratch=self.policy.worker is None)
        self.policy.set_scheduler(resolve_scheduler(self.optimizer, lr_scheduler, config.scheduler))
        self.grads = Gradients(model, self.units, self.states, self.policy, self.pg, self.device)
        self.param_state = ParamState(self.grads, self.units, self.optimizer, self.pg, self.device, self.policy)
        self.sharded_state = ShardedState(
            module=model, config=config, rank=self.pg.rank, world_size=self.pg.world_size, pg=self.pg,
            device=self.device, dtype=self.dtype, units=self.units, states=self.states,
            optimizer=self.optimizer, param_tier=self.param_tier,
            optimizer_states=built.optimizer_states, nvme=self.nvme, scaler=self.policy.scaler,
            counters=self.policy.counters, schedule=self.policy.schedule, placement=built.placement,
            state_dict_index=built.state_dict_index, buffer_dtypes=built.buffer_dtypes,
            units_chosen=built.units_chosen,
        )
        self.unit_hooks = UnitHooks(model, self.units, self.gather, self.backward_tracker, self.policy,
                                    self.grads, self.timeline, self.device, self.dtype, activations)
        self.unit_hooks.register(self._hooks)  # then torch's state-dict helpers' hooks, before the gathering's:
        weakref.finalize(self, remove_hooks, self._hooks)  # [Note: weak hooks]
        route = TorchStateDictRoute(model, self.sharded_state, self._hooks)
        self.gathering = Gathering(self.sharded_state, self.gather, self.backward_tracker, self._hooks,
                                   self.residency)
        self.health = Health(self.policy, self.gather, self.backward_tracker, self.gathering, self.residency,
                             self.param_tier, self.optimizer.store, self.nvme)  # EngineState, checks
        route.attach(self.gathering, self.health)
        self.unit_hooks.health = self.health
        self._marked_generation = mark_synced_generation(model, self.world_size)  # [Note: generation in step]
        self.reporter = StepReporter(self.sharded_state)  # logs, step report, monitors
        self.reporter.log_built()
        if config.logging.tokens_per_step and config.logging.steps_per_print:
            from offload.plan.engine_prediction import predict_for_engine  # the planner, handed down

            predicted = predict_for_engine(model, config, on_gpu=self.device.type == "cuda",
                                           world_size=self.world_size)
            if predicted is not None:
                self.reporter.predicted_step_s, self.reporter.predicted_bound = predicted.step_s, predicted.bound_text()
        LIVE_ENGINES.add(self)  # built: zero.GatheredParameters / safe_get_* may find it

    # -- the user's loop -------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """`loss.backward()` with the fp16 loss scale. Gradients accumulate in the shards until
        `step()` reaches a boundary, where they are divided by gradient_accumulation_steps
        (DeepSpeed's default: pass the plain loss). `scale_wrt_gas=False` (DeepSpeed's): this
        loss is not to be divided (a sum over micro-batches, a Trainer's loss normalised for
        its window): the engine multiplies it back before its step divides."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor")
        self.health.check_ready("engine.backward")
        if not scale_wrt_gas and self.policy.gradient_accumulation_steps != 1:
            loss = loss * self.policy.gradient_accumulation_steps
        bad = self.policy.nonfinite_loss(loss)  # reads the loss (a device sync) unless off
        self.reporter.observe_loss(loss)  # a float only for a step that will be reported
        if bad is not None:
            self.unit_hooks.abort_backward()  # the forward's gathered units and pending reduces go
            self.policy.skip_for_loss(bad)  # raises with nonfinite_loss='raise'
            return
        scale = self.policy.scaler.scale
        if scale != 1.0:
            loss = loss.float() * scale
        try:
            loss.backward(retain_graph=retain_graph)
        except BaseException as exc:
            # Drop the pass's state and gradients (BackwardTracker.abort). Updates already
            # run in backward (part-applied) or a failed disk: FAILED, as in step().
            partial = self.backward_tracker.active and self.policy.pass_updates > 0
            self.unit_hooks.abort_backward(exc)
            if partial or isinstance(exc, OSError):
                self.health.fail(exc)
            raise
        self.unit_hooks.finish_backward()

    is_gradient_accumulation_boundary = lambda self: self.policy.is_boundary()  # noqa: E731
    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Whether the coming micro-batch ends an accumulation window (DeepSpeed's method):
        set before its backward; None counts to gradient_accumulation_steps again."""
        self.policy.set_boundary(is_boundary)

    def step(self) -> None:
        """Advance one micro-batch; at an accumulation boundary apply the optimizer step. If it
        fails (an I/O error), its error is raised here and the engine enters FAILED: load a
        checkpoint to go on. Ending a window that ran no backward, it does nothing (warned)."""
        self.health.check_ready("engine.step")
        self.unit_hooks.finish_backward()
        if self.policy.no_gradient():
            return  # not counted: warned once
        self.policy.lost.check("engine.step()")
        boundary = self.policy.end_micro_batch()  # counts it (and the backward passes it ran)
        if not boundary:
            return
        try:
            # The CPU Adam at step() rewrites host shards that asynchronous host-to-device
            # copies of this step's gathers read from: those copies must have landed first.
            # Updates run during backward waited for their unit's own copies instead
            # ([Note: streams and threads] in offload/devices.py).
            if self.policy.updates_at_step():
                self.sharded_state.sync_device()
            self.gather.before_optimizer_step()
            nonfinite = self.policy.apply()
            self.gather.prefetch_next_iteration()
            stats = self.timeline.end_step()
        except BaseException as exc:
            self.health.fail(exc)
            raise
        self.reporter.after_step(stats)
        if nonfinite is not None:
            raise nonfinite  # the step was skipped whole: the engine stays consistent

    def step_stats(self) -> Optional[dict[str, Any]]:
        """The last optimizer step as the engine measured it (offload.runtime.timeline: step,
        stall, optimizer and fetch figures; docs/prefetch.md), or None before the first step."""
        last = self.timeline.last
        return None if last is None else last.as_dict()

    # -- conveniences torch users expect ----------------------------------------------------

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterable[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    state = property(lambda self: self.health.state, doc="EngineState: READY, or FAILED by a step.")
    global_steps = property(lambda self: self.policy.counters.global_steps,
                            doc="Applied optimizer steps.")
    micro_steps = property(lambda self: self.policy.counters.micro_steps,
                           doc="engine.step() calls (micro-batches).")
    skipped_steps = property(lambda self: self.policy.counters.skipped_steps,
                             doc="Optimizer steps skipped (overflow, non-finite loss or norm).")
    last_grad_norm = property(lambda self: self.policy.counters.last_grad_norm,
                              doc="get_global_grad_norm(): the last step's gradient norm.")
    scaler = property(lambda self: self.policy.scaler, doc="The fp16 loss scaler.")
    gradient_accumulation_steps = property(lambda self: self.policy.gradient_accumulation_steps)

    @property
    def lr_scheduler(self) -> Any:
        return self.policy.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        """A scheduler over `engine.optimizer`: stepped at every applied step, checkpointed."""
        self.policy.set_scheduler(scheduler)  # the checkpoint view shares its Schedule

    @property
    def loss_scale(self) -> float:
        return self.policy.scaler.scale

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # -- gradients: offload/runtime/grads.py, docs/engine.md "Gradients" ---------------------

    def get_global_grad_norm(self) -> Optional[float]:
        """The last step's un-scaled gradient norm before clipping (inf: skipped; None: none yet)."""
        return self.policy.counters.last_grad_norm

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this step as torch.nn.utils.clip_grad_norm_ would; see Gradients.clip_grad_norm_."""
        self.health.check_ready("engine.clip_grad_norm_")
        return self.grads.clip_grad_norm_(max_norm, norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last step; see Gradients.zero_grad."""
        self.health.check_ready("engine.zero_grad")
        self.grads.zero_grad()

    def full_grad(self, param: Union[str, nn.Parameter]) -> Optional[torch.Tensor]:
        """A parameter's full fp32 gradient, on every rank; see Gradients.full_grad."""
        self.health.check_ready("engine.full_grad")
        return self.grads.full_grad(param)

    # -- weights in and out: gathered on purpose (offload/runtime/gathered.py), full weights --
    def gathered(self, params_or_modules: Any = None, modifier_rank: Optional[int] = None) -> Any:
        """A context with full parameters on every rank: offload/runtime/gathered.py."""
        self.health.settle("engine.gathered")
        return self.gathering.context(params_or_modules, modifier_rank, self.health.failure)

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """The consolidated fp32 weights, with exactly `model.state_dict()`'s keys (tied
        parameters under each of their names; buffers in their original dtype), on CPU.

        Every rank must call it (it gathers); with `rank0_only` the other ranks get {}.
        Units are gathered one at a time, so at most one unit's full fp32 copy exists
        beside the result: the same unit-by-unit path as checkpoint consolidation
        (`offload.checkpoint.full_weights`)."""
        from offload.checkpoint.full_weights import full_state_dict

        self.health.settle("engine.full_state_dict")
        return full_state_dict(self.sharded_state, rank0_only)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load consolidated weights (as `full_state_dict` returns) into the shards. Every
        rank passes the full dict (e.g. each `torch.load`s it); each keeps its own slice.
        Optimizer moments are left as they are."""
        from offload.checkpoint.full_weights import load_full_state_dict

        load_full_state_dict(self.sharded_state, state_dict, strict)
        self.gather.drop()  # shards fetched ahead (a GPU's side-stream copies) are stale

    # -- sharded state dicts as DTensors for torch.distributed.checkpoint: checkpoint/sharded_dict.py
    def _sharded_dict(self, what: str) -> Any:
        self.health.settle(f"engine.{what}")
        return sharded_dict

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's fp32 parameters (Shard(0) DTensors over the group), buffers whole."""
        return self._sharded_dict("sharded_state_dict").model_state_dict(self.sharded_state)

    def sharded_optimizer_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in torch's layout (Shard(0) DTensors, steps)."""
        return self._sharded_dict("sharded_optimizer_state_dict").optimizer_state_dict(self.sharded_state)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load `sharded_state_dict()`'s values, saved at any world size."""
        self._sharded_dict("load_sharded_state_dict").load_model_state_dict(self.sharded_state, state_dict, strict)
        self.gather.drop()  # shards fetched ahead are stale

    def load_sharded_optimizer_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load `sharded_optimizer_state_dict()`'s values, saved at any world size."""
        self._sharded_dict("load_sharded_optimizer_state_dict").load_optimizer_state_dict(
            self.sharded_state, state_dict, strict)

    def save_pretrained(self, save_directory: str, dtype: Any = None, max_shard_size: Union[int, str] = "5GB",
                        safe_serialization: bool = True) -> str:
        """A directory Hugging Face's `from_pretrained` loads (config.json, safetensors, tied
        weights once; `dtype` None: the config's); every rank calls it, rank 0 writes, unit by
        unit. offload/checkpoint/pretrained.py."""
        from offload.checkpoint.pretrained import save_pretrained

        self.health.check_ready("engine.save_pretrained")
        return save_pretrained(self.sharded_state, save_directory, dtype, max_shard_size, safe_serialization)

    # -- checkpoints (offload/checkpoint, docs/checkpoint.md) ---------------------------------

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None) -> str:
        """Write a checkpoint to `save_dir/<tag>` (default tag `global_step<N>`) and point
        `save_dir/latest` at it once complete. Every rank calls it and writes its shards.
        `client_state` (the data-loader position) comes back from `load_checkpoint`."""
        from offload.checkpoint import save_checkpoint

        self.health.check_ready("engine.save_checkpoint")
        self.policy.lost.check("engine.save_checkpoint")  # the real cause, not "between micro-batches"
        return save_checkpoint(self.sharded_state, save_dir, tag, client_state, staging=self.checkpoint_staging)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, *, copy_to_swap: Optional[bool] = None,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str, Any]:
        """Resume from `load_dir/<tag>` (default: `latest`'s), also at another world size; every
        rank calls it; returns (path, client_state). `copy_to_swap`: read NVMe state in place
        (False), copy it into the swap (True), or in place on the swap's filesystem (None).
        The `load_*` flags are DeepSpeed's (what each keeps: `offload.checkpoint.load`)."""
        from offload.checkpoint.load import LoadParts, load_checkpoint

        self.health.settle("engine.load_checkpoint")
        self.health.recover()  # after a failed step: the writes in flight settle first
        self.gather.drop()  # shards fetched ahead are about to go stale
        out = load_checkpoint(self.sharded_state, load_dir, tag, copy_to_swap=copy_to_swap,
                              parts=LoadParts(load_optimizer_states, load_lr_scheduler_states, load_module_only),
                              staging=self.checkpoint_staging)
        self.health.ready()
        return out

    # -- accounting ---------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the engine holds right now, per kind of memory: 'device', 'host', 'pinned',
        'nvme' (see offload/runtime/accounting.py for what each counts)."""
        return memory_bytes(self.sharded_state, self.residency.memory_tensors())

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's: park what lives on the compute device in host memory until
        `reload_states()` (offload/runtime/residency.py); every rank calls it, between steps."""
        if self.residency.parked:
            return  # parked already (DeepSpeed's is idempotent too)
        self.health.check_ready("engine.offload_states")
        self.gather.drop()
        self.gather.free_all()  # gathered copies the schedule rebuilds: freed, not parked
        self.residency.offload(device_tensors(self.sharded_state), include, device, pin_memory)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Back on the compute device, bit for bit (a no-op when nothing is parked)."""
        self.residency.reload()

    def io_stats(self) -> dict[str, float]:
        """What the NVMe tiers moved since `initialize`: bytes read and written, and seconds
        the engine's thread waited for I/O (all zero without an NVMe tier)."""
        if self.nvme is None:
            return {"bytes_read": 0, "bytes_written": 0, "wait_s": 0.0, "bytes_dropped": 0}
        return self.nvme.stats.snapshot()

    def close(self) -> None:
        """Remove the hooks; finish every collective in flight; wait for NVMe writes, stop
        the I/O workers and delete this rank's swap files; a process group offload started stays
        for the next engine (destroyed at exit). Idempotent; also what `with initialize(...) as
        engine:` does on exit."""
        if self not in LIVE_ENGINES:
            return  # closed already
        LIVE_ENGINES.discard(self)
        self._at_exit.detach()
        self.residency.reload()  # a closed model keeps its weights
        self.policy.close()  # the worker's updates land first
        self.reporter.close()  # monitors flush and close
        remove_hooks(self._hooks)
        if self._marked_generation:
            unmark_synced_generation(self.module)
        self.gather.drop()
        self.drain()
        if released_parameters(self.module):
            # The parameter tier kept the weights (NVMe): the closed model has none. Say so
            # on its next forward instead of torch's setStorage error.
            self.module.register_forward_pre_hook(forward_of_a_closed_model)
        self.checkpoint_staging.close()
        if self._close_nvme is not None:
            self._close_nvme()  # NVMeContext.close, once
        if self.pg.started_here and dist.is_initialized():
            # Every rank leaves the engine together; the group stays for the next engine
            # ([Note: the group offload starts] in offload/units/collectives.py).
            _dist.leave_together(self.pg, self.device)

    def drain(self) -> None:
        """Wait for every collective this engine issued asynchronously (gathers issued ahead,
        gradient reduce-scatters), then until gloo's threads let their tensors go ([Note:
        collective tensors at exit]): `close()` and the interpreter's exit call it. A
        collective: every rank issued the same ones, so each wait completes."""
        self.backward_tracker.drain()
        self.gather.free_all()  # waits for a gather in flight
        _dist.settle_collectives()  # [Note: collective tensors at exit]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
