"""Accelerate: a loop of `accelerator.prepare`, `accelerator.backward`, `optimizer.step()`
trained by the offload engine, with one changed line (docs/accelerate.md):

    from offload.integrations.accelerate import prepare
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler,
                                                  config="offload.yaml")  # was: accelerator.prepare(...)

The rest of the loop stays as it is. It behaves as Accelerate's DeepSpeed plugin makes it
behave ([Note: Accelerate's DeepSpeed wiring]):
- `accelerator.backward(loss)` tells the engine whether the micro-batch ends an accumulation
  window (`accelerator.sync_gradients`, which `accelerator.accumulate` and the end of the
  dataloader set), runs the engine's backward (which divides the loss by the window's
  micro-batches, as plain Accelerate does) and, at a window's end, the engine's step
  (clipping from the config's `gradient_clipping`, the update, the schedule);
- `optimizer.step()` and `optimizer.zero_grad()` do nothing (the update ran in backward);
  `scheduler.step()` does nothing (the engine stepped the schedule once per applied update);
- `accelerator.clip_grad_norm_(params, max_norm)` returns the window's gradient norm before
  clipping; `max_norm` must equal the config's `gradient_clipping` (the clipping already ran);
- `accelerator.save_state(dir)` / `load_state(dir)` save and load the engine's checkpoint in
  `dir` (every rank's shards, optimizer state, schedule, counters) beside Accelerate's own
  (RNG states, dataloader positions, step); `accelerator.get_state_dict(model)` gives the full
  weights (gathered unit by unit) and `accelerator.unwrap_model(model)` the model itself.
Dataloaders and other objects go through `accelerator.prepare` unchanged.

[Note: Accelerate's DeepSpeed wiring]
Under its DeepSpeed plugin Accelerate returns the DeepSpeed engine as the model, an optimizer
and a scheduler whose step() and zero_grad() are no-ops, and sends `accelerator.backward` to
the engine: `set_gradient_accumulation_boundary(sync_gradients)`, `engine.backward(loss)`
(DeepSpeed divides by its gradient_accumulation_steps, Accelerate does not), and at a
boundary `engine.step()`. `prepare` here wires the same on this accelerator object: the
model is returned as it is (the engine's hooks are on it; Accelerate's prepare_model would
move it whole to the device and wrap it in DDP, which the engine does not need: it reduces
gradients itself), `backward` and `clip_grad_norm_` of this accelerator are the engine's,
and the checkpoint goes through Accelerate's save/load state hooks. The engine's
`gradient_accumulation_steps` is the accelerator's.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import torch

import offload
from offload.config import ConfigError, load_config

__all__ = ["prepare"]


def _refuse(what: str, fix: str) -> str:
    """The two lines of a refusal: what Accelerate call cannot work, and the fix."""
    return f"{what} under offload.integrations.accelerate.prepare\n  fix: {fix}"


class EngineOptimizer:
    """What the loop holds as its optimizer (Accelerate's DeepSpeedOptimizerWrapper's part):
    the engine's param groups; `step()` and `zero_grad()` do nothing, the engine updated in
    the window's last `accelerator.backward`."""

    def __init__(self, engine: offload.Engine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise NotImplementedError(_refuse("optimizer.step(closure)", "call optimizer.step() without a closure"))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine starts each window's gradient sums itself."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(_refuse("optimizer.state_dict()", "save with accelerator.save_state(dir): "
                                   "the optimizer state is in the engine's shards, saved on every rank"))

    def load_state_dict(self, state_dict: Any) -> None:
        raise RuntimeError(_refuse("optimizer.load_state_dict()", "load with accelerator.load_state(dir)"))


class EngineSchedule:
    """What the loop holds as its scheduler: `step()` does nothing (the engine steps the
    schedule at each applied update, as DeepSpeed does); the rest reads it."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Stepped by the engine."""

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


class _FollowSchedule:
    """The user's scheduler, built over their torch optimizer, driving the engine's: at each
    step it steps the original and copies each group's rate across. Its state_dict is the
    original's (the engine's checkpoint carries it)."""

    def __init__(self, scheduler: Any, source: torch.optim.Optimizer, target: Any) -> None:
        if len(source.param_groups) != len(target.param_groups):
            raise ValueError(_refuse(
                f"a scheduler over {len(source.param_groups)} param groups for an engine of "
                f"{len(target.param_groups)}", "pass the optimizer the scheduler was built on"))
        self.scheduler, self.source, self.target = scheduler, source, target
        self._copy()

    def _copy(self) -> None:
        # The scheduler's last rates, not the source groups': a loaded state_dict restores
        # the schedule's position but writes no rate into the optimizer.
        for lr, dst in zip(self.scheduler.get_last_lr(), self.target.param_groups):
            dst["lr"] = lr

    def step(self) -> None:
        with warnings.catch_warnings():  # torch's "scheduler.step() before optimizer.step()":
            warnings.simplefilter("ignore", UserWarning)  # the engine's optimizer stepped
            self.scheduler.step()
        self._copy()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        self._copy()

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())


def prepare(accelerator: Any, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
            *others: Any, config: Any = None) -> Any:
    """`accelerator.prepare(model, optimizer, *others)` with the offload engine underneath
    (module docstring). `optimizer`: a torch optimizer built over `model` (AdamW, Adam,
    Adagrad; its type, groups and hyperparameters are taken over) or None (the config's).
    `others`: dataloaders (prepared by Accelerate) and at most one LR scheduler built over
    `optimizer`. `config`: an `offload.Config`, a dict or a JSON/YAML path (offload's format
    or DeepSpeed's). Returns the prepared objects in the order given."""
    _check_accelerator(accelerator)
    cfg = _engine_config(config, accelerator)
    schedulers = [o for o in others if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
    if len(schedulers) > 1:
        raise ValueError(_refuse(f"{len(schedulers)} LR schedulers", "pass one (the engine steps one schedule)"))
    scheduler = schedulers[0] if schedulers else None
    if scheduler is not None and scheduler.optimizer is not optimizer:
        raise ValueError(_refuse("a scheduler built over another optimizer than the one passed",
                                 "build the scheduler over the optimizer you pass to prepare"))
    follow = None
    if scheduler is not None:
        assert optimizer is not None, "checked above: the scheduler's optimizer is the one passed"
        source = optimizer

        def follow(engine_optimizer: Any) -> _FollowSchedule:
            return _FollowSchedule(scheduler, source, engine_optimizer)

    engine = offload.initialize(model, cfg, optimizer=optimizer, lr_scheduler=follow)
    if engine.world_size != accelerator.num_processes:
        # torchrun on a machine without GPUs and Accelerator() without cpu=True: Accelerate
        # sees one process and gives each rank the whole data, while the engine averages
        # the ranks' gradients
        engine.close()
        raise ValueError(_refuse(
            f"an Accelerator of {accelerator.num_processes} process(es) in a launch of {engine.world_size}",
            "on a machine without GPUs use Accelerator(cpu=True) (Accelerate distributes CPU "
            "processes only then); otherwise check the launcher's environment"))
    model._is_accelerate_prepared = True  # type: ignore[assignment]  # a later prepare() leaves it
    _wire(accelerator, engine)
    out: list[Any] = [model]
    if optimizer is not None:
        out.append(EngineOptimizer(engine))
    for obj in others:
        out.append(EngineSchedule(engine.lr_scheduler) if obj is scheduler else accelerator.prepare(obj))
    return tuple(out) if len(out) > 1 else out[0]


def _check_accelerator(accelerator: Any) -> None:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise ValueError(_refuse(
            f"an Accelerator set up for {kind.value}",
            "launch without Accelerate's DeepSpeed/FSDP plugin (accelerate config: distributed_type "
            "MULTI_GPU or MULTI_CPU); give offload the DeepSpeed config as config=..."))
    if accelerator.mixed_precision != "no":
        raise ValueError(_refuse(
            f"Accelerator(mixed_precision={accelerator.mixed_precision!r})",
            "use Accelerator(mixed_precision='no') and set the engine's precision in its config "
            "(precision: {dtype: bf16}); the engine computes in that dtype and owns the loss scale"))
    if getattr(accelerator, "_offload_engine", None) is not None:
        raise ValueError(_refuse("a second model on one Accelerator",
                                 "use one Accelerator per engine (its backward is that engine's)"))


def _engine_config(config: Any, accelerator: Any) -> offload.Config:
    cfg = load_config(config)
    steps = int(accelerator.gradient_accumulation_steps)
    if cfg.gradient_accumulation_steps not in (1, steps):
        raise ConfigError(
            "gradient_accumulation_steps",
            f"= {cfg.gradient_accumulation_steps} in the offload config, but "
            f"Accelerator(gradient_accumulation_steps={steps})",
            "set one of the two (the accelerator's decides the windows: accelerator.accumulate)")
    return dataclasses.replace(cfg, gradient_accumulation_steps=steps)


def _wire(accelerator: Any, engine: offload.Engine) -> None:
    """This accelerator's backward, clip_grad_norm_ and state hooks, the engine's
    ([Note: Accelerate's DeepSpeed wiring])."""
    accelerator._offload_engine = engine

    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise NotImplementedError(_refuse(f"accelerator.backward(loss, {', '.join(kwargs)}=...)",
                                              "call accelerator.backward(loss)"))
        boundary = bool(accelerator.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss)  # divided by the window's micro-batches, as Accelerate divides it
        if boundary:
            engine.step()

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Optional[float]:
        if float(norm_type) != 2.0:
            raise NotImplementedError(_refuse(f"accelerator.clip_grad_norm_(norm_type={norm_type})",
                                              "clip by the 2-norm (norm_type=2)"))
        if float(max_norm) != float(engine.config.gradient_clipping):
            raise ValueError(_refuse(
                f"accelerator.clip_grad_norm_(max_norm={max_norm}) with the config's gradient_clipping "
                f"= {engine.config.gradient_clipping}",
                f"set gradient_clipping: {max_norm} in the offload config (the engine clipped in "
                "accelerator.backward, as with Accelerate's DeepSpeed plugin)"))
        return engine.get_global_grad_norm()

    def clip_grad_value_(parameters: Any, clip_value: float) -> None:
        raise NotImplementedError(_refuse("accelerator.clip_grad_value_",
                                          "clip by norm: gradient_clipping in the offload config"))

    accelerator.backward = backward
    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: engine.save_checkpoint(output_dir))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: engine.load_checkpoint(input_dir))
