"""DeepSpeed's training API over the offload engine: switch by changing one import.

    import offload.compat.deepspeed as deepspeed      # was: import deepspeed

    deepspeed.init_distributed()
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(),
        training_data=dataset, config="ds_config.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)

The config is DeepSpeed's (dict or JSON/YAML path, or `args.deepspeed_config`), translated
by `offload.config.deepspeed` (docs/config.md: which keys are mapped, reported as ignored, or
rejected). `initialize` returns DeepSpeed's four values; the engine is a thin
`DeepSpeedEngine` wrapper that adds DeepSpeed's accessor methods (`train_batch_size()`,
`gradient_accumulation_steps()`, `local_rank`, `save_16bit_model`, ...) around
`offload.Engine`, which does the work. Arguments offload cannot honour (`mpu`, a pipeline
model, scheduler `lr_kwargs`, ...) raise `NotImplementedError` naming them; nothing is
silently dropped.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

import offload
from offload.compat.deepspeed_checkpointing import checkpointing
from offload.config import Config, load_config, read_config_file
from offload.dtypes import DTYPES
from offload.units.collectives import select_local_gpu, uses_nccl

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "zero", "checkpointing",
           "utils", "is_compile_supported"]

logger = logging.getLogger("offload")

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------------------
# Process group and argument parsing
# --------------------------------------------------------------------------------------


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """`deepspeed.init_distributed`: start torch.distributed from torchrun's (or the
    `deepspeed` launcher's) environment, gloo on CPU and NCCL on CUDA unless `dist_backend`
    says otherwise. Already initialized: nothing to do. No launcher environment and no
    `init_method`: a single process, no group (offload runs world size 1 without one;
    DeepSpeed would try MPI discovery here, which offload does not do)."""
    if dist_init_required is False or (dist.is_available() and dist.is_initialized()):
        return
    have_env = all(k in os.environ for k in _TORCHRUN_ENV)
    if not have_env and init_method is None:
        if verbose:
            logger.info("init_distributed: no launcher environment (RANK, WORLD_SIZE, "
                        "MASTER_ADDR, MASTER_PORT); running as a single process")
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if uses_nccl(backend):  # "nccl", or a per-device map such as "cpu:gloo,cuda:nccl"
        select_local_gpu()
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout,
                              "init_method": init_method or "env://"}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(**kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`deepspeed.add_config_arguments`: --deepspeed, --deepspeed_config (and the
    deprecated --deepscale, --deepscale_config), as DeepSpeed adds them."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (offload.compat)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated: --deepspeed_config")
    return parser


def is_compile_supported() -> bool:
    return True  # torch >= 2.4 (offload's floor) always has torch.compile


# --------------------------------------------------------------------------------------
# initialize
# --------------------------------------------------------------------------------------


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Optional[Iterable[Any]] = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: Union[str, os.PathLike, Mapping[str, Any], Config, None] = None,
               mesh_param: Any = None, config_params: Any = None):
    """`deepspeed.initialize`, returning `(engine, optimizer, training_dataloader,
    lr_scheduler)` as DeepSpeed does.

    config (or config_params, or args.deepspeed_config): a DeepSpeed config dict or
        JSON/YAML path (an offload config works too). Exactly one source, as in DeepSpeed.
    optimizer: None (the config's `optimizer` section over `model_parameters`), a
        `torch.optim.Adam`/`AdamW` instance (its groups and hyperparameters), or a callable
        `params -> optimizer` (called with `model_parameters`, as DeepSpeed does).
    model_parameters: the parameters (or torch-style param groups) to optimise; None = all
        of the model's. Parameters in no group are not trained.
    training_data: a torch Dataset: the returned loader batches it by
        `train_micro_batch_size_per_gpu`, each rank reading its part (DistributedSampler,
        DeepSpeed's default), with `collate_fn` and the config's `dataloader_drop_last`.
    lr_scheduler: a callable `optimizer -> scheduler` (built on the engine's optimizer), or
        a scheduler object built on the `optimizer` passed here (re-pointed at the engine's
        optimizer, whose param groups mirror it); None = the config's `scheduler`.
    Not supported (NotImplementedError): mpu (model parallelism), mesh_param (sequence
    parallelism), a DeepSpeed PipelineModule.
    """
    unsupported = [name for name, value in (("mpu", mpu), ("mesh_param", mesh_param)) if value is not None]
    if unsupported:
        raise NotImplementedError(
            f"deepspeed.initialize({', '.join(f'{n}=...' for n in unsupported)}): offload does "
            "data-parallel ZeRO-3 only (no tensor, pipeline or sequence parallelism); drop "
            f"{' and '.join(unsupported)}")
    if model is None:
        raise ValueError("deepspeed.initialize requires a model (model=...)")
    if type(model).__name__ == "PipelineModule":
        raise NotImplementedError("model is a DeepSpeed PipelineModule: offload has no pipeline "
                                  "parallelism; pass the plain nn.Module")
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port, verbose=False)
    ds_config = _one_config(args, config, config_params)
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(ds_config, world_size=world_size)

    params = None if model_parameters is None else list(model_parameters)
    client_optimizer = optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable params -> "
                            f"optimizer, got {type(optimizer).__name__}")
        client_optimizer = optimizer(params if params is not None else model.parameters())
    engine_optimizer: Any = client_optimizer
    if client_optimizer is None and params is not None:
        if params and isinstance(params[0], Mapping):
            engine_optimizer = [dict(g) for g in params]
        else:
            engine_optimizer = [{"params": params}]

    scheduler_arg = lr_scheduler
    if lr_scheduler is not None and hasattr(lr_scheduler, "step"):
        if getattr(lr_scheduler, "optimizer", None) is not client_optimizer or client_optimizer is None:
            raise TypeError("lr_scheduler is a scheduler object built on an optimizer that was not "
                            "passed as optimizer=; pass a callable optimizer -> scheduler instead")
        sched = lr_scheduler
        scheduler_arg = lambda opt: _repoint_scheduler(sched, client_optimizer, opt)  # noqa: E731

    inner = offload.initialize(model, cfg, optimizer=engine_optimizer, lr_scheduler=scheduler_arg)
    engine = DeepSpeedEngine(inner, cfg, _raw(ds_config), collate_fn=collate_fn)
    loader = engine.deepspeed_io(training_data) if training_data is not None else None
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _one_config(args: Any, config: Any, config_params: Any) -> Any:
    """DeepSpeed's rules: config, else config_params; args.deepspeed_config (or the
    deprecated deepscale_config) only when neither is given."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("a DeepSpeed config was given both as args.deepspeed_config and as "
                             "initialize(config=...); give one")
        config = from_args
    if config is None:
        raise ValueError("no DeepSpeed config: pass initialize(config=<dict or path>) or "
                         "--deepspeed_config <path> (add_config_arguments)")
    return config


def _raw(config: Any) -> Mapping[str, Any]:
    """The config as a mapping, for the few keys read here (dataloader_drop_last)."""
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)
    return {}


def _repoint_scheduler(sched: Any, client: torch.optim.Optimizer, opt: torch.optim.Optimizer) -> Any:
    """Make a torch scheduler built on the client optimizer drive the engine's optimizer.

    The engine's param groups were built from the client's (same order, same current lr, so
    the rate the scheduler set at construction carries over); DeepSpeed's stage 3 steps the
    client's groups directly, here the scheduler is pointed at the engine's. torch tracks
    "optimizer.step() ran before scheduler.step()" by wrapping the optimizer's step at
    scheduler construction; the same flag is set on the engine's optimizer so that check
    holds."""
    if len(client.param_groups) != len(opt.param_groups):
        raise ValueError(f"lr_scheduler's optimizer has {len(client.param_groups)} param groups, "
                         f"the engine's {len(opt.param_groups)}; pass a callable instead")
    for mine, theirs in zip(opt.param_groups, client.param_groups):
        for key in ("initial_lr", "lr"):
            if key in theirs:
                mine[key] = theirs[key]
    sched.optimizer = opt
    if not hasattr(opt.step, "_wrapped_by_lr_sched"):
        step = opt.step

        def tracked_step(*a: Any, **kw: Any) -> Any:
            opt._opt_called = True  # type: ignore[attr-defined]
            return step(*a, **kw)

        tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.step = tracked_step  # type: ignore[method-assign]
    return sched


# --------------------------------------------------------------------------------------
# The engine wrapper
# --------------------------------------------------------------------------------------


class DeepSpeedEngine:
    """DeepSpeed's engine surface over `offload.Engine` (`self.engine`).

    Forward, backward and step are the offload engine's; the rest are DeepSpeed's accessors.
    Any other attribute is looked up on the offload engine, then on the model (as
    DeepSpeed's engine forwards unknown attributes to its module)."""

    def __init__(self, engine: "offload.Engine", config: Config, raw_config: Mapping[str, Any],
                 collate_fn: Optional[Callable] = None) -> None:
        self.engine = engine
        self.config = config
        self._raw_config = raw_config
        self.collate_fn = collate_fn
        self.training_dataloader: Any = None
        self.global_samples = 0
        self._step_applied = False

    # -- the loop ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True,
                 **kwargs: Any) -> torch.Tensor:
        """DeepSpeed divides the loss by the accumulation steps here (scale_wrt_gas); the
        offload engine divides the gradients at the step instead, which is the same update.
        scale_wrt_gas=False (sum, not mean, over micro-batches) is the engine's own option."""
        if kwargs:
            raise NotImplementedError(f"engine.backward({', '.join(kwargs)}=...) is not supported "
                                      "by offload; drop the argument")
        self.engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: Optional[Mapping[str, Any]] = None) -> None:
        if lr_kwargs:
            raise NotImplementedError("engine.step(lr_kwargs=...): offload steps the scheduler "
                                      "without arguments; drop lr_kwargs")
        boundary = self.engine.is_gradient_accumulation_boundary()
        before = self.engine.global_steps
        self.engine.step()
        self._step_applied = boundary and self.engine.global_steps > before
        if boundary:
            self.global_samples += self.train_batch_size()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_grad(self) -> None:
        self.engine.zero_grad()  # DeepSpeed's discards the accumulated gradients too

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.engine.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    # -- DeepSpeed's accessors ----------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.engine.rank))

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    dp_world_size = world_size

    def train_micro_batch_size_per_gpu(self) -> int:
        micro = self.config.train_micro_batch_size_per_gpu
        if micro is None:
            raise ValueError("the config sets no batch size; add train_micro_batch_size_per_gpu "
                             "(or train_batch_size) to it")
        return micro

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.world_size

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_global_grad_norm(self) -> Optional[float]:
        return self.engine.get_global_grad_norm()

    @property
    def cur_scale(self) -> float:
        return self.engine.loss_scale

    def fp16_enabled(self) -> bool:
        return self.config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.dtype == "bf16"

    def zero_optimization(self) -> bool:
        return True

    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_stage)

    def zero_offload_param(self) -> bool:
        return TierKind.of(self.config.offload.param_tier) is not TierKind.DEVICE

    def zero_offload_optimizer(self) -> bool:
        """False only with every unit's optimizer state on the GPU (offload_optimizer.device 'none')."""
        return self.config.offload.optimizer_tier != "device"

    # -- data ---------------------------------------------------------------------------

    def deepspeed_io(self, dataset: Any, batch_size: Optional[int] = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None,
                     collate_fn: Optional[Callable] = None,
                     num_local_io_workers: Optional[int] = None) -> torch.utils.data.DataLoader:
        """A DataLoader over this rank's part of `dataset` (DeepSpeed's `deepspeed_io`):
        DistributedSampler (shuffled for training, in order for route 'eval'/'predict')
        unless `data_sampler` is given, micro-batch size from the config."""
        if not isinstance(dataset, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
            raise ValueError(f"training data must be a torch Dataset, got {type(dataset).__name__}")
        batch = batch_size if batch_size is not None else self.train_micro_batch_size_per_gpu()
        if data_sampler is None and not isinstance(dataset, torch.utils.data.IterableDataset):
            data_sampler = torch.utils.data.DistributedSampler(
                dataset, num_replicas=self.world_size, rank=self.global_rank,
                shuffle=route == "train")
        return torch.utils.data.DataLoader(
            dataset, batch_size=batch, sampler=data_sampler,
            collate_fn=collate_fn or self.collate_fn,
            drop_last=bool(self._raw_config.get("dataloader_drop_last", False)),
            pin_memory=pin_memory and self.device.type == "cuda",
            num_workers=num_local_io_workers or 0)

    # -- checkpoints and weights ----------------------------------------------------------

    def save_checkpoint(self, save_dir: Union[str, os.PathLike], tag: Any = None,
                        client_state: Optional[Mapping[str, Any]] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> Any:
        _refuse_non_default("save_checkpoint", save_latest=(save_latest, True),
                            exclude_frozen_parameters=(exclude_frozen_parameters, False))
        return self.engine.save_checkpoint(os.fspath(save_dir), tag=None if tag is None else str(tag),
                                           client_state=dict(client_state or {}))

    def load_checkpoint(self, load_dir: Union[str, os.PathLike], tag: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[Any, Any]:
        """Returns (load_path, client_state), as DeepSpeed; the `load_*` flags keep what
        DeepSpeed's keep (`offload.checkpoint.load`)."""
        _refuse_non_default("load_checkpoint", load_module_strict=(load_module_strict, True),
                            custom_load_fn=(custom_load_fn, None))
        latest = os.path.join(os.fspath(load_dir), "latest")
        if tag is None and not os.path.isfile(latest):
            # DeepSpeed's behaviour: a warning and (None, None), nothing loaded (a first run
            # that "resumes" from an empty directory goes on from scratch).
            logger.warning("Unable to find latest file at %s, if trying to load latest checkpoint please "
                           "ensure this file exists or pass an explicit checkpoint tag when loading a "
                           "checkpoint.", latest)
            return None, None
        return self.engine.load_checkpoint(os.fspath(load_dir), tag=None if tag is None else str(tag),
                                           load_optimizer_states=load_optimizer_states,
                                           load_lr_scheduler_states=load_lr_scheduler_states,
                                           load_module_only=load_module_only)

    def save_16bit_model(self, save_dir: Union[str, os.PathLike],
                         save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The consolidated weights in the compute dtype (rank 0 writes; every rank calls)."""
        sd = self.engine.full_state_dict()
        if self.global_rank != 0:
            return True
        # fp32 weights are written as they are; bf16/fp16 ones cast to the compute dtype.
        precision = self.config.precision.dtype
        dtype = None if precision == "fp32" else DTYPES[precision]
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        if dtype is not None:
            sd = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in sd.items()}
        os.makedirs(save_dir, exist_ok=True)
        torch.save(sd, os.path.join(save_dir, save_filename))
        return True

    def destroy(self) -> None:
        self.engine.close()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined here: the offload engine, then the model.
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        if hasattr(engine, name):
            return getattr(engine, name)
        return getattr(engine.module, name)


def _refuse_non_default(method: str, **given: tuple[Any, Any]) -> None:
    """Raise for an argument of a DeepSpeed engine method that offload cannot honour and
    that was given a non-default value (never drop it silently)."""
    for key, (value, default) in given.items():
        if value != default:
            raise NotImplementedError(
                f"{method}({key}={value!r}) is not supported by offload; leave it at its default "
                f"({default!r}): an offload checkpoint always holds the module, the optimizer "
                "and the schedule of every rank"
            )


from offload.compat.deepspeed_utils import utils  # noqa: E402 - the documented path: offload.compat.deepspeed.utils
from offload.compat.deepspeed_zero import zero  # noqa: E402 - offload.compat.deepspeed.zero
from offload.storage.tier_kind import TierKind
