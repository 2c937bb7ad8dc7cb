"""`engine.save_pretrained(dir)`: a directory Hugging Face's `from_pretrained` loads, written
from a live engine unit by unit.

    dir/config.json               the model's config (a `transformers.PreTrainedModel`'s;
                                  its dtype set to the one written), when the model has one
    dir/generation_config.json    when the model can generate
    dir/model.safetensors         or model-0000i-of-0000N.safetensors + model.safetensors.index.json
                                  past `max_shard_size` (Hugging Face's names and index)

Every rank calls it (each unit's fp32 master is all-gathered, `full_weights.engine_units`);
rank 0 writes. Memory: one unit's full fp32 flat buffer (and its cast copy of one
parameter; of the whole unit for a model whose names are reversed: [Note: reversal memory]
in hf_names.py), whatever the model's size: every file's safetensors header is written first
(shapes and dtypes are known from the layout) and each parameter is written at its offset as
its unit arrives, as consolidation does (`consolidate.split_files` / `preallocate`).

What is written is what `PreTrainedModel.save_pretrained` writes for the same weights, also
for the architectures whose checkpoints transformers 5 renames or merges on load (its
conversion mapping: GPT-NeoX's `embed_out`, Mixtral's per-expert `w1/w2/w3`, ViT, Llava):
the mapping is reversed unit by unit (offload/checkpoint/hf_names.py), so the files hold
the checkpoint format transformers 4 and other readers know. In detail:
- a tied parameter once, under the name transformers keeps: the first of its names that no
  module lists in `_tied_weights_keys` (the names transformers re-ties on load; for GPT-2
  and Llama with tied embeddings, the embedding's), else its first name in state-dict order;
- parameters in `dtype`: None takes the model config's `dtype` (`torch_dtype` before
  transformers 5), else float32; "bf16"/"fp32"/"fp16" or a torch dtype on request;
  floating-point buffers are cast to it too, others kept; buffers only as `state_dict()`
  gives them (persistent ones);
- `config.json` with `dtype` and `architectures` set as transformers sets them.
This module does not import transformers: the model's config is used through its own
`save_pretrained` / `to_json_file`, and the name reversal (hf_names.py) imports it only for
a model that is a `transformers.PreTrainedModel`, when it is loaded already.

[Note: save_pretrained atomicity] Everything is written into a staging directory beside the
target (same filesystem) and fsynced. A new target is that directory renamed: it appears
whole or not at all. An existing target keeps its other files (a tokenizer, checkpoints):
its old index and `model.safetensors` are removed first (so it no longer looks like a
model), the new files are moved in with the index (or the single file) last, then the old
split's leftover shards are removed. A failure before that leaves the target as it was and
no staging directory. A failure on rank 0 is raised on every rank (the others after the
gathers they take part in), so no rank goes on believing the save happened.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import uuid
from typing import Any, Optional, Union

import torch

from offload.checkpoint import files, full_weights, manifest
from offload.checkpoint.hf_names import NameReversal
from offload.checkpoint.consolidate import (
    DEFAULT_MAX_SHARD_SIZE, INDEX_FILE, SINGLE_FILE, ST_DTYPES, parse_size, preallocate,
    pwrite_tensor, split_files,
)
from offload.dtypes import DTYPES, name_of
from offload.runtime.view import Location, ShardedState
from offload.units import collectives as _dist

__all__ = ["save_pretrained", "resolve_dtype", "kept_keys"]

SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
"""The weight files of a Hugging Face save (what a new save replaces in an existing dir)."""


def resolve_dtype(dtype: Union[None, str, torch.dtype], module: Any) -> torch.dtype:
    """The dtype to write: `dtype` ('bf16', 'bfloat16', torch.bfloat16, ...), or when None the
    model config's dtype, or float32."""
    given = dtype is not None
    if not given:
        config = getattr(module, "config", None)
        dtype = getattr(config, "dtype", None)
        if dtype is None and config is not None and "torch_dtype" in vars(config):
            dtype = vars(config)["torch_dtype"]  # transformers < 5 (a property warns in 5)
        if dtype is None or dtype == "auto":
            return torch.float32
    value = dtype
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        value = DTYPES.get(name, getattr(torch, name, None))
    if value not in SAVE_DTYPES:
        where = "dtype" if given else "the model config's dtype"
        raise ValueError(
            f"save_pretrained: {where} {dtype!r} is not one to save weights in; pass "
            "dtype='bf16', 'fp32' or 'fp16' (or torch.bfloat16, ...)")
    return value


def tied_patterns(module: Any) -> list[str]:
    """The names (regular expressions, as transformers reads them) of parameters that
    `module`'s submodules declare re-tied on load (`_tied_weights_keys`, a dict in
    transformers 5, a list before), prefixed with the submodule's path."""
    out = []
    for name, sub in module.named_modules():
        for key in getattr(sub, "_tied_weights_keys", None) or ():
            out.append(f"{name}.{key}" if name else key)
    return out


def kept_keys(module: Any, groups: dict[Any, list[str]]) -> set[str]:
    """Of each group of names of one parameter (`full_weights.param_keys`), the one written."""
    patterns = tied_patterns(module)

    def retied(key: str) -> bool:
        for pattern in patterns:
            try:
                if re.search(pattern, key):
                    return True
            except re.error:
                if pattern == key:
                    return True
        return False

    kept = set()
    for keys in groups.values():
        kept.add(next((k for k in keys if not retied(k)), keys[0]) if len(keys) > 1 else keys[0])
    return kept


@torch.no_grad()
def save_pretrained(
    sharded: ShardedState,
    save_directory: str,
    dtype: Union[None, str, torch.dtype] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    safe_serialization: bool = True,
) -> str:
    """`engine.save_pretrained`: see the module docstring. Returns the directory's path."""
    if not safe_serialization:
        raise NotImplementedError(
            "save_pretrained(safe_serialization=False): only safetensors is written (what "
            "from_pretrained prefers); drop the argument")
    limit = parse_size(max_shard_size)
    out_dtype = resolve_dtype(dtype, sharded.module)
    target = os.path.abspath(os.fspath(save_directory))
    signature = manifest.model_signature(sharded)
    slots = {(u["index"], si): s for u in signature["units"] for si, s in enumerate(u["slots"])}
    kept = kept_keys(sharded.module, full_weights.param_keys(signature))
    itemsize = out_dtype.itemsize
    plan, buffers, n_params = [], {}, 0
    groups: dict[Any, dict[str, torch.Tensor]] = {}  # what arrives together, as meta tensors
    for entry in sharded.state_dict_index:
        if entry.location is Location.PARAM and entry.key in kept:
            s = slots[entry.where]
            plan.append((entry.key, ST_DTYPES[name_of(out_dtype)], s["shape"], s["numel"] * itemsize))
            groups.setdefault(entry.where[0], {})[entry.key] = torch.empty(s["shape"], dtype=out_dtype, device="meta")
            n_params += s["numel"]
        elif entry.location is Location.BUFFER:  # planned on every rank: errors before any gather
            value = entry.where.detach().to(
                "cpu", dtype=sharded.buffer_dtypes.get(id(entry.where), entry.where.dtype))
            value = value.to(out_dtype) if value.is_floating_point() else value
            code = ST_DTYPES.get(name_of(value.dtype))
            if code is None:
                raise ValueError(f"buffer {entry.key!r} has dtype {value.dtype}, which safetensors cannot store")
            if sharded.rank == 0:
                buffers[entry.key] = value
            plan.append((entry.key, code, list(value.shape), value.numel() * value.element_size()))
            groups.setdefault("buffers", {})[entry.key] = value.to("meta")
    # transformers' checkpoint names where its conversion mapping renamed them on load.
    reversal = NameReversal.of(sharded.module, groups)
    if reversal is not None:
        plan = [(key, ST_DTYPES[name_of(dt)], list(shape), math.prod(shape) * dt.itemsize)
                for items in reversal.plan.values() for key, shape, dt in items]

    writer = PretrainedWriter(target, plan, limit, n_params) if sharded.rank == 0 else None
    error: Optional[BaseException] = None
    try:
        if writer is not None:
            writer.open()
    except Exception as exc:
        error = exc

    def put(keys: list[str], value: torch.Tensor) -> None:
        # Rank 0 only. After a failure it keeps taking part in the gathers (the other ranks
        # are in them) and writes nothing more.
        nonlocal error
        if error is not None:
            return
        assert writer is not None, "only a rank with a writer keeps the weights (keep=)"
        try:
            # A copy when reversing: the group is written once complete ([Note: reversal memory]).
            value = value.to(out_dtype, copy=reversal is not None)
            for key in keys:
                if key in kept:
                    write(key, value)
        except Exception as exc:
            error = exc

    def write(key: str, value: torch.Tensor) -> None:
        assert writer is not None
        if reversal is None:
            writer.write(key, value)
            return
        for name, converted in reversal.add(key, value):
            writer.write(name, converted.contiguous())

    full_weights.stream_full_weights(
        signature, full_weights.engine_units(sharded, keep=writer is not None), put)
    if writer is not None:
        try:
            if error is None:
                for key, value in buffers.items():
                    write(key, value)
                if reversal is not None and reversal.pending:  # never a file with a hole
                    raise RuntimeError(f"save_pretrained: groups {sorted(map(str, reversal.pending))} "
                                       "never completed, so their tensors were not written")
                writer.write_configs(sharded.module, out_dtype)
                writer.commit()
        except Exception as exc:
            error = exc
        if error is not None:
            writer.abort()
    failure = None if error is None else f"{type(error).__name__}: {error}"
    if sharded.world_size > 1:
        failure = _dist.broadcast_object(failure, sharded.pg, sharded.device)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(
            f"engine.save_pretrained({target!r}) failed on rank 0, which writes the files: "
            f"{failure}; the directory was left as it was")
    return target


class PretrainedWriter:
    """Rank 0's files of one save: written into a staging directory beside `target`, then
    moved in by `commit` ([Note: save_pretrained atomicity])."""

    def __init__(self, target: str, plan: list[tuple], limit: int, n_params: int) -> None:
        self.target = target
        self.plan = plan
        self.n_params = n_params
        self.names, self.shards = split_files(plan, limit)
        parent, base = os.path.split(target)
        self.staging = os.path.join(parent, f".{base}.save_pretrained-{uuid.uuid4().hex[:12]}")
        self.fds: list[int] = []
        self.where: dict[str, tuple[int, int]] = {}
        """key -> (file descriptor, absolute byte offset of its data)."""

    def open(self) -> None:
        """Create the staging directory and every weight file, headers written and sized."""
        if os.path.exists(self.target) and not os.path.isdir(self.target):
            raise FileExistsError(f"save_pretrained: {self.target!r} exists and is not a directory; name a directory")
        os.makedirs(os.path.dirname(self.target), exist_ok=True)
        os.mkdir(self.staging)
        for name, items in zip(self.names, self.shards):
            fd = os.open(os.path.join(self.staging, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self.fds.append(fd)
            for key, offset in preallocate(fd, items, {"format": "pt"}).items():
                self.where[key] = (fd, offset)

    def write(self, key: str, value: torch.Tensor) -> None:
        fd, offset = self.where[key]
        pwrite_tensor(fd, value, offset)

    def write_configs(self, module: Any, dtype: torch.dtype) -> None:
        """config.json (and generation_config.json) of a Hugging Face model, duck-typed: a
        `config` with `save_pretrained` or `to_json_file`. A copy is changed, not the model's."""
        config = getattr(module, "config", None)
        if config is None or not (hasattr(config, "save_pretrained") or hasattr(config, "to_json_file")):
            return
        config = copy.deepcopy(config)
        config.dtype = name_of(dtype)  # as transformers records the dtype it saved
        if "torch_dtype" in vars(config):  # transformers < 5
            config.torch_dtype = name_of(dtype)
        if hasattr(config, "architectures"):
            config.architectures = [type(module).__name__]
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(self.staging)
        else:
            config.to_json_file(os.path.join(self.staging, "config.json"))
        generation = getattr(module, "generation_config", None)
        can_generate = getattr(module, "can_generate", None)
        if generation is not None and hasattr(generation, "save_pretrained") and (
                can_generate is None or can_generate()):
            generation.save_pretrained(self.staging)

    def commit(self) -> None:
        for fd in self.fds:
            os.fsync(fd)
        self._close()
        if len(self.names) > 1:
            index = {
                "metadata": {"total_parameters": self.n_params,
                             "total_size": sum(item[3] for item in self.plan)},
                "weight_map": {key: self.names[i] for i, items in enumerate(self.shards) for key, *_ in items},
            }
            data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            files.write_file_durably(os.path.join(self.staging, INDEX_FILE), data)
        ours = sorted(os.listdir(self.staging))
        for name in ours:
            files.fsync_path(os.path.join(self.staging, name))  # the configs, too
        files.fsync_path(self.staging)
        if not os.path.exists(self.target):
            os.rename(self.staging, self.target)
            files.fsync_path(os.path.dirname(self.target))
            return
        old = [f for f in os.listdir(self.target) if _WEIGHT_FILE.fullmatch(f)]
        for name in (INDEX_FILE, SINGLE_FILE):
            if name in old:
                os.unlink(os.path.join(self.target, name))
        last = INDEX_FILE if INDEX_FILE in ours else SINGLE_FILE
        for name in sorted(ours, key=lambda n: n == last):
            os.replace(os.path.join(self.staging, name), os.path.join(self.target, name))
        for name in old:
            if name not in ours and os.path.exists(os.path.join(self.target, name)):
                os.unlink(os.path.join(self.target, name))
        os.rmdir(self.staging)
        files.fsync_path(self.target)

    def abort(self) -> None:
        self._close()
        shutil.rmtree(self.staging, ignore_errors=True)

    def _close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
