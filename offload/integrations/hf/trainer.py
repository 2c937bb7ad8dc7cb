"""`OffloadTrainer`: the Hugging Face Trainer with the offload engine underneath.

    from offload.integrations.hf import OffloadTrainer     # was: from transformers import Trainer
    trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                             offload_config="offload.yaml")  # or a DeepSpeed config, "auto" values too
    trainer.train()

Everything else is the Trainer's: data loading, the loop, logging, evaluation, callbacks,
`save_steps`, `resume_from_checkpoint`, `save_model`. What changes underneath, and why each
piece is correct (docs/hf.md has the user's side):

- The engine is built in `create_optimizer` (the run's length is known then, for DeepSpeed
  "auto" values) over `trainer.model`, which may have been loaded straight into shards
  (`offload.integrations.hf.from_pretrained`). The config comes from `offload_config`, else
  from `args.deepspeed` (taken out of the arguments, so that transformers and Accelerate do
  not start DeepSpeed), else offload's defaults; `trainer_config.engine_config` reconciles it
  with the arguments.
- Accelerate leaves the model and the optimizer alone: the model is marked prepared (no DDP
  wrapper, no device move: the engine's shards are already where they belong; the engine
  reduces gradients itself), and the optimizer the Trainer holds is `_EngineOptimizer`, not a
  `torch.optim.Optimizer`, which Accelerate passes through. The Accelerator runs without
  mixed precision (no autocast, no GradScaler): the engine computes in its configured dtype
  and owns the fp16 loss scale.
- [Note: the Trainer's backward] The Trainer calls `accelerator.backward(loss)` once per
  micro-batch, after telling Accelerate whether that micro-batch ends an accumulation window
  (`sync_gradients`, also True for the shorter last window of an epoch). This Trainer's
  accelerator sends that call to the engine, as Accelerate does for DeepSpeed:
  `engine.set_gradient_accumulation_boundary(sync)`, `engine.backward(loss)`,
  `engine.step()` - so at a window's end the update (with clipping, from `max_grad_norm`)
  runs there, and the Trainer's later `optimizer.step()` has nothing left to do. The Trainer
  has already divided the loss for accumulation (by the window's micro-batches, or by the
  window's token count), so it goes in with `scale_wrt_gas=False`: the engine does not
  divide it again (DeepSpeed's option of the same name).
- The learning-rate schedule: the Trainer builds its scheduler over the engine's optimizer
  and hands it to the engine, which steps it at each applied step (not at a skipped fp16
  overflow) and checkpoints it; the Trainer holds `_EngineSchedule`, whose `step()` is a
  no-op. A config with its own scheduler section uses that one.
- The grad norm the Trainer logs is `engine.get_global_grad_norm()` (before clipping, as
  torch's `clip_grad_norm_` returns it).
- Checkpoints (`save_steps`): `checkpoint-N/` gets the model as `save_model` writes it, the
  engine's checkpoint (`global_stepN/`, every rank's shards, optimizer state, scheduler,
  counters, `latest`) instead of a rank-0 `optimizer.pt`, and the Trainer's own state and RNG
  files. `resume_from_checkpoint` loads the engine's checkpoint (any world size).
- `save_model`: a directory `from_pretrained` loads (`engine.save_pretrained`, unit by unit,
  rank 0 writes); for a PEFT model the adapter only, as PEFT writes it.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from transformers import Trainer

import offload
from offload.integrations.hf.trainer_config import adamw_groups, engine_config

logger = logging.getLogger("offload.hf")

__all__ = ["OffloadTrainer", "OffloadTrainerMixin"]

_LATEST = "latest"


class _EngineOptimizer:
    """What the Trainer holds as its optimizer: the engine's param groups (schedulers and
    logs read them); `step()` checks that the engine applied (or skipped) this window's
    step, which it did inside the window's last backward ([Note: the Trainer's backward]).
    Not a `torch.optim.Optimizer`, so Accelerate's `prepare` returns it unchanged."""

    _is_accelerate_prepared = True

    def __init__(self, engine: offload.Engine) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        self._windows_seen = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.engine.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.engine.optimizer.defaults

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise NotImplementedError("OffloadTrainer's optimizer takes no closure")
        done = self.engine.global_steps + self.engine.skipped_steps
        if done <= self._windows_seen:
            raise RuntimeError(
                "optimizer.step() without an engine step since the last one: the engine applies "
                "each accumulation window's update in that window's last backward "
                "(accelerator.backward with sync_gradients=True); call the Trainer's "
                "training_step, not optimizer.step() on your own")
        self._windows_seen = done

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine starts each window's gradient sums itself."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the optimizer state is in the engine's shards: it is saved by "
                           "engine.save_checkpoint (the Trainer's checkpoints do that)")

    def load_state_dict(self, state_dict: Any) -> None:
        raise RuntimeError("the optimizer state is loaded by engine.load_checkpoint "
                           "(resume_from_checkpoint does that)")


class _EngineSchedule:
    """What the Trainer holds as its scheduler: the engine steps the real one at each
    applied optimizer step, so the Trainer's `step()` does nothing; the rest reads it."""

    _is_accelerate_prepared = True

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Stepped by the engine (at applied steps only)."""

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


# The mixin goes before a Trainer class in the bases; the type checker reads it as a Trainer,
# so that what it uses of the trainer (args, state, model, super()'s methods) is checked.
if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class OffloadTrainerMixin(_TrainerBase):
    """The engine underneath any `transformers.Trainer` subclass (module docstring):
    `class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer): pass`. It goes first in
    the bases, so that its methods wrap the trainer's. `offload_config`: an `offload.Config`,
    a dict or a JSON/YAML path (offload's format or a DeepSpeed config with "auto" values);
    None: `args.deepspeed`, else the defaults. Every other argument is the trainer's.
    `trainer.engine` is the engine once training (or evaluation) started."""

    _step_lr: Optional[float] = None
    """The learning rate of the last applied update (None before the first)."""

    def __init__(self, *trainer_args: Any, offload_config: Any = None, **kwargs: Any) -> None:
        # [Note: arguments by keyword] Trainer subclasses order their arguments differently
        # (TRL's DPOTrainer(model, ref_model, args, ...), GRPOTrainer(model, reward_funcs,
        # args, ...)): the positional ones are named by the trainer's own signature, and
        # everything goes on by keyword, so `args` is found (and replaced) wherever it sits.
        kwargs = _by_keyword(super().__init__, trainer_args, kwargs)
        args = kwargs.get("args")
        if args is not None and getattr(args, "deepspeed", None):
            if offload_config is not None:
                raise ValueError(
                    "OffloadTrainer got both offload_config and TrainingArguments(deepspeed=...): "
                    "pass the config once (offload_config=... reads DeepSpeed configs too)")
            offload_config = args.deepspeed
            args = _without_deepspeed(args)
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[1] is not None:
            raise ValueError(
                "OffloadTrainer(optimizers=(..., scheduler)): a scheduler built over another "
                "optimizer cannot drive the engine's; set lr_scheduler_type in the "
                "TrainingArguments, or a scheduler section in the offload config")
        if args is not None and getattr(args, "auto_find_batch_size", False):
            raise ValueError("OffloadTrainer does not support auto_find_batch_size (each retry would "
                             "rebuild the engine); set per_device_train_batch_size, and see "
                             "python -m offload.plan for what fits")
        self.offload_config = offload_config
        self.engine: Optional[offload.Engine] = None
        self.ref_engine: Optional[offload.Engine] = None  # [Note: the reference model]
        args = _distributed_on_cpu(args)
        if isinstance(kwargs.get("ref_model"), torch.nn.Module):
            # Accelerate's prepare leaves it where it is: its engine places it (a whole-model
            # move to the GPU first would need the whole reference there; [Note: the reference model])
            kwargs["ref_model"]._is_accelerate_prepared = True
        if "args" in kwargs or args is not None:
            kwargs["args"] = args
        super().__init__(**kwargs)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.args.world_size:
            raise ValueError(
                f"launched as {launched} processes (WORLD_SIZE) but the TrainingArguments see "
                f"{self.args.world_size}: each rank would train on the same batches. On a machine "
                "without GPUs pass TrainingArguments(use_cpu=True) (Hugging Face distributes CPU "
                "processes only then); otherwise check the launcher's environment")
        if self.args.n_gpu > 1:
            raise ValueError(
                f"OffloadTrainer sees {self.args.n_gpu} GPUs in one process: the engine uses "
                "one GPU per process; launch with torchrun --nproc_per_node=<GPUs> (or set "
                "CUDA_VISIBLE_DEVICES to one GPU)")

    # -- Accelerate: no mixed precision of its own, backward through the engine --------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        built["mixed_precision"] = "no"  # the engine computes in its dtype, owns the loss scale
        return built

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # [Note: the Trainer's backward]: this Trainer's own accelerator object only.
        self.accelerator.backward = self._backward

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise NotImplementedError(f"accelerator.backward({', '.join(kwargs)}=...) is not "
                                      "supported under OffloadTrainer")
        engine = self._engine_or_raise("accelerator.backward")
        boundary = bool(self.accelerator.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)  # the Trainer normalised it for its window
        if boundary:  # the rate this window's update uses (the scheduler moves at the step)
            self._step_lr = float(engine.optimizer.param_groups[0]["lr"])
        engine.step()

    def _get_learning_rate(self) -> float:
        """The rate of the last update, as the Trainer logs it (its scheduler steps after)."""
        lr = self._step_lr
        return lr if lr is not None else super()._get_learning_rate()

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """The engine places the model (its shards on their tiers, buffers on the compute
        device): a whole-model move first would need the whole model in device memory."""

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if self.engine is None and not training and any(p.is_meta for p in model.parameters()):
            # evaluate()/predict() before train() on a model loaded into shards
            # (from_pretrained): its weights exist only once the engine streams them in.
            self._build_engine(model)
        return model  # no DataParallel / DDP: the engine shards and reduces itself

    # -- the engine: built with the optimizer -------------------------------------------------

    def create_optimizer(self, model: Any = None) -> Any:
        if self.engine is None:
            self._build_engine(model if model is not None else self.model)
        return self.optimizer

    def _build_engine(self, model: Any) -> None:
        # The run's length (DeepSpeed's "auto" total_num_steps): known once train() started.
        steps = int(self.state.max_steps or 0) or (self.args.max_steps if self.args.max_steps > 0 else None)
        config, own_optimizer = engine_config(self.offload_config, self.args, num_training_steps=steps,
                                              model=model)
        groups: Union[torch.optim.Optimizer, list[dict[str, Any]], None]
        if own_optimizer:
            groups = None if self.optimizer is None else self.optimizer
        elif self.optimizer is not None:
            groups = self.optimizer  # optimizers=(torch AdamW over the model, None)
        else:
            groups = adamw_groups(model, self.args, self.get_decay_parameter_names(model))
        self.engine = offload.initialize(model, config, optimizer=groups)
        self._reference_under_engine(config)
        model._is_accelerate_prepared = True  # prepare() returns it as it is
        # The Trainer's optimizer slot holds a stand-in, deliberately not a torch Optimizer
        # (Accelerate passes it through): see _EngineOptimizer.
        self.optimizer = _EngineOptimizer(self.engine)  # type: ignore[assignment]

    def _reference_under_engine(self, config: offload.Config) -> None:
        """[Note: the reference model] TRL's DPOTrainer (GRPOTrainer with beta > 0 too) keeps
        a frozen reference model in `ref_model`, as large as the policy; under DeepSpeed
        ZeRO-3 TRL wraps it in an inference engine of its own (`trl.models.prepare_deepspeed`).
        Here it goes under a second offload engine with the policy's config: its weights are
        sharded and paged as the policy's are, and it is frozen (`requires_grad` off: no
        gradients, no optimizer state). The trainer keeps calling the module itself; the
        engine's hooks gather each unit for the forward. `trainer.ref_engine` is the engine."""
        ref = getattr(self, "ref_model", None)
        if not isinstance(ref, torch.nn.Module):
            return  # no reference model (SFT, a PEFT policy's adapter-off reference, beta=0)
        if getattr(self.args, "sync_ref_model", False):
            raise NotImplementedError(
                "sync_ref_model=True under the offload engine: the reference's weights are in its "
                "engine's shards, which TRL's SyncRefModelCallback cannot mix into; set "
                "sync_ref_model=False")
        ref.requires_grad_(False)
        self.ref_engine = offload.initialize(ref, config)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        engine = self._engine_or_raise("create_scheduler")
        if self.lr_scheduler is None:
            if engine.config.scheduler is None:  # no scheduler section: the Trainer's schedule
                # (built again for each train() call, as the Trainer does, for its length)
                scheduler = super().create_scheduler(num_training_steps, optimizer=engine.optimizer)
                if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    raise ValueError(
                        "lr_scheduler_type='reduce_lr_on_plateau' is not supported by "
                        "OffloadTrainer (its steps follow evaluations, not optimizer steps); use a "
                        "schedule over steps")
                engine.lr_scheduler = scheduler
            # A stand-in the engine steps, not the Trainer (see _EngineSchedule).
            self.lr_scheduler = _EngineSchedule(engine.lr_scheduler)  # type: ignore[assignment]
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _engine_or_raise(self, what: str) -> "offload.Engine":
        if self.engine is None:
            raise RuntimeError(f"{what} before the engine exists: it is built by create_optimizer "
                               "(trainer.train() does that)")
        return self.engine

    # -- gradient norm: the engine's ---------------------------------------------------------

    def _clip_grad_norm(self, model: Any) -> Optional[float]:
        return self.engine.get_global_grad_norm() if self.engine is not None else None

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Optional[float]:
        return self.engine.get_global_grad_norm() if self.engine is not None else grad_norm

    # -- saving and resuming ------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """A directory `from_pretrained` loads (every rank calls it; rank 0 writes); the
        adapter only for a PEFT model. Before training: the Trainer's own save."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        assert output_dir is not None, "TrainingArguments.__post_init__ sets output_dir"
        if _is_peft(self.model):
            self._save_adapter(self.engine, output_dir)
        else:
            self.engine.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_adapter(self, engine: offload.Engine, output_dir: str) -> None:
        model: Any = self.model  # a PeftModel (`_is_peft`): its save_pretrained writes the adapter
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with engine.gathered([p for _, p in named]):
            state = {n: p.detach().to("cpu", copy=True) for n, p in named}
        model.save_pretrained(output_dir, state_dict=state, is_main_process=self.args.should_save)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir)  # output_dir/global_stepN + latest, every rank

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Called by `train()` before the engine exists: the weights come with the engine's
        checkpoint in `_load_optimizer_and_scheduler`, once it is built."""
        _check_engine_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        _check_engine_checkpoint(checkpoint)
        self._engine_or_raise("resume_from_checkpoint").load_checkpoint(checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        assert best is not None, "the Trainer loads the best model only once it has one"
        _check_engine_checkpoint(best)
        self._engine_or_raise("load_best_model_at_end").load_checkpoint(best)


class OffloadTrainer(OffloadTrainerMixin, Trainer):
    """`transformers.Trainer` with the offload engine underneath: a Trainer script switches
    by changing the class name and passing `offload_config=` (OffloadTrainerMixin)."""


def _by_keyword(init: Any, positional: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`positional` named by `init`'s signature and merged into `kwargs` ([Note: arguments
    by keyword]); too many, or one given both ways, is the TypeError Python would raise."""
    if not positional:
        return dict(kwargs)
    names = []
    for p in inspect.signature(init).parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            raise TypeError(f"{init.__qualname__} takes *args: pass its arguments to the offload "
                            "mixin by keyword")
    if len(positional) > len(names):
        raise TypeError(f"{init.__qualname__} takes {len(names)} positional arguments "
                        f"({', '.join(names)}), {len(positional)} were given")
    out = dict(zip(names, positional))
    both = sorted(set(out) & set(kwargs))
    if both:
        raise TypeError(f"{init.__qualname__} got multiple values for {', '.join(both)}")
    out.update(kwargs)
    return out


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _check_engine_checkpoint(path: str) -> None:
    if not os.path.isfile(os.path.join(path, _LATEST)):
        raise FileNotFoundError(
            f"{path} has no offload engine checkpoint ('{_LATEST}' is missing): OffloadTrainer "
            "resumes from the checkpoints it saves (save_only_model=False). To start from a "
            "model saved elsewhere, load its weights (offload.integrations.hf.from_pretrained) "
            "and train without resume_from_checkpoint")


def _distributed_on_cpu(args: Any) -> Any:
    """Under torchrun on a machine without a GPU, Hugging Face shards the data across the
    processes only with `use_cpu=True`; without it every rank trained on the same batches
    while the engine averaged their gradients (issue #33). The engine runs on the CPU there
    anyway, so set it (and say so, once)."""
    if (args is None or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or getattr(args, "use_cpu", False)
            or torch.cuda.is_available()):
        return args
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning("OffloadTrainer: %s processes on a machine without GPUs: setting "
                       "TrainingArguments(use_cpu=True) so that each trains on its own share of the "
                       "data", os.environ["WORLD_SIZE"])
    return dataclasses.replace(args, use_cpu=True)


def _without_deepspeed(args: Any) -> Any:
    """A copy of `args` with `deepspeed` unset: Accelerate must not start DeepSpeed (its
    state was set up by the arguments' own __post_init__, through an environment variable
    that the copy's must not see)."""
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    return dataclasses.replace(args, deepspeed=None)
