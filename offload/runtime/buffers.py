"""A model's buffers on the compute device, and in which dtype.

Buffers are not sharded: each rank keeps them whole on the compute device. Their dtype is
chosen once, at `initialize` ([Note: buffer dtypes]):

- `precision.buffer_dtype` 'keep' (the default) leaves a floating buffer in the dtype the
  model gave it, as DeepSpeed (data_types.buffer_dtype unset) and FSDP2 do. Llama's RoPE
  `inv_freq` stays fp32 under bf16 (cast, it is off by up to 2**-9 relative: every rotary
  frequency moves). 'compute' casts it to precision.dtype as `model.to(dtype)` would; a
  named dtype casts it to that one (DeepSpeed's data_types.buffer_dtype).
- Tensors the model names for fp32 (transformers' `_keep_in_fp32_modules_strict`, and
  `_keep_in_fp32_modules` under fp16; or `precision.keep_in_fp32_modules`) are honoured for
  buffers, which stay (or become) fp32 whatever buffer_dtype says, as DeepSpeed's
  keep_in_fp32.py does. For parameters they cannot be: a unit's parameters live in one flat
  buffer of one dtype, so `check_keep_in_fp32` refuses them at initialize with the fixes.
- A BatchNorm's running statistics follow its parameters, which the engine holds in the
  compute dtype: torch's batch_norm takes weight, bias and running statistics in one dtype
  (bf16 weights with fp32 statistics raise "expected scalar type BFloat16 but found Float").

`place_buffers` returns, per new buffer, the dtype the model gave it: checkpoints and
`full_state_dict` save buffers in that dtype.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["check_keep_in_fp32", "place_buffers"]

# torch's own BatchNorm classes (subclasses, e.g. timm's BatchNormAct2d, are included).
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_LOWP = (torch.float16, torch.bfloat16)

# [Note: buffer dtypes]
# Why 'keep' is the default, and what it costs a model that mixes a buffer into its
# activations. A floating buffer is usually a constant computed in fp32 on purpose (rotary
# frequencies, sinusoidal tables, routing biases), which the model casts where it meets the
# activations (Llama's rotary embedding computes cos/sin in fp32 and casts them to the
# activations' dtype); casting it at initialize loses precision the model asked for. A
# model that instead adds an fp32 buffer to bf16 activations gets fp32 activations, and
# its next bf16 layer raises torch's dtype error ("mat1 and mat2 must have the same
# dtype"): precision.buffer_dtype 'compute' restores the old cast, or the model casts the
# buffer itself (`x + self.pe.to(x.dtype)`), which is what the 'compute' cast did.


def _glob(pattern: str) -> str:
    """transformers' rule (core_model_loading.build_glob_alternation): `*` is any
    characters, the rest is a regular expression, found anywhere in the full name."""
    return pattern.replace("*", ".*")


def _model_lists(model: nn.Module, dtype: torch.dtype) -> tuple[list[str], list[str]]:
    """The model's own fp32 lists that apply under `dtype`: (regex parts, where they came
    from, e.g. "T5ForConditionalGeneration._keep_in_fp32_modules = ['wo']")."""
    parts: list[str] = []
    seen: dict[tuple[str, tuple[str, ...]], list[str]] = {}  # (attr, names) -> where, in order
    for module_name, module in model.named_modules():
        attrs = ["_keep_in_fp32_modules_strict"]
        if dtype == torch.float16:  # transformers: the plain list is for fp16 only
            attrs.append("_keep_in_fp32_modules")
        for attr in attrs:
            names = getattr(module, attr, None)
            if not isinstance(names, (list, tuple, set, frozenset)) or not names:
                continue
            names = tuple(sorted(str(n) for n in names))
            seen.setdefault((attr, names), []).append(
                f"{type(module).__name__}{f' ({module_name!r})' if module_name else ''}")
            for name in names:
                # A submodule's list names tensors inside it (DeepSpeed's prefix rule).
                prefix = rf"^{re.escape(module_name)}\..*" if module_name else ""
                parts.append(prefix + _glob(name))
    # transformers copies a child's list onto its parents: name each list once.
    sources = [f"{where[0]}.{attr} = {list(names)}"
               + (f" (also on {len(where) - 1} submodule(s))" if len(where) > 1 else "")
               for (attr, names), where in seen.items()]
    return parts, sources


def _pattern(model: nn.Module, precision: Any, dtype: torch.dtype) -> tuple[Optional["re.Pattern[str]"], list[str]]:
    """The compiled keep-in-fp32 pattern under `dtype` (None: nothing to keep) and its sources."""
    if dtype not in _LOWP:
        return None, []
    if precision.keep_in_fp32_modules is not None:
        listed = list(precision.keep_in_fp32_modules)
        parts = [_glob(p) for p in listed]
        sources = [f"precision.keep_in_fp32_modules = {listed}"] if listed else []
    else:
        parts, sources = _model_lists(model, dtype)
    if not parts:
        return None, []
    return re.compile("|".join(f"(?:{p})" for p in sorted(set(parts)))), sources


def check_keep_in_fp32(model: nn.Module, precision: Any, dtype: torch.dtype) -> Optional["re.Pattern[str]"]:
    """The pattern of buffers to keep in fp32 (None: none). Raises `ValueError` when it names
    a parameter: every parameter of a unit lives in the unit's one low-precision buffer."""
    pattern, sources = _pattern(model, precision, dtype)
    if pattern is None:
        return None
    named = [n for n, _ in model.named_parameters(remove_duplicate=False) if pattern.search(n)]
    if not named:
        return pattern
    dname = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    from_model = precision.keep_in_fp32_modules is None
    other = ""
    if from_model and dtype == torch.float16 and not any("_strict" in s for s in sources):
        other = " or bf16 (precision.dtype='bf16': transformers applies _keep_in_fp32_modules to fp16 only)"
    optout = ("set precision.keep_in_fp32_modules to [] (DeepSpeed: data_types.keep_in_fp32_modules: []), "
              "or to patterns that name only buffers" if from_model else
              "remove the parameters' patterns from precision.keep_in_fp32_modules")
    raise ValueError(
        f"precision.dtype = {dname!r}, but {'; '.join(sources)} asks to keep {len(named)} "
        f"parameter(s) in fp32, e.g. {named[0]!r}: offload cannot, because each unit holds its "
        f"parameters in one {dname} buffer, so they would be computed in {dname}. Train in fp32 "
        f"(precision.dtype='fp32'){other}; or, to compute them in {dname} knowingly, {optout}"
    )


def _matching_buffers(model: nn.Module, pattern: "re.Pattern[str]"):
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and pattern.search(prefix + name):
                yield b


def place_buffers(model: nn.Module, device: torch.device, dtype: torch.dtype, precision: Any,
                  keep_fp32: Optional["re.Pattern[str]"]) -> dict[int, torch.dtype]:
    """Move every buffer to `device` in its chosen dtype (module docstring); a buffer shared
    by several modules stays one tensor. Returns id(new buffer) -> the dtype the model gave
    it. `keep_fp32` is `check_keep_in_fp32`'s pattern."""
    from offload.dtypes import DTYPES

    mode = precision.buffer_dtype
    cast_to = None if mode == "keep" else dtype if mode == "compute" else DTYPES[mode]
    kept = set() if keep_fp32 is None else {id(b) for b in _matching_buffers(model, keep_fp32)}
    follows_params = {
        id(b) for m in model.modules() if isinstance(m, _BATCH_NORMS) and m.weight is not None
        for b in (m.running_mean, m.running_var) if b is not None
    }
    buffer_dtypes: dict[int, torch.dtype] = {}
    new_of: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            if id(b) not in new_of:
                if b.is_meta:
                    raise ValueError(
                        f"buffer {name!r} of {type(m).__name__} is still on the meta device; "
                        "give the module a reset_parameters() that re-creates it, or build "
                        "the model outside offload.init"
                    )
                target = b.dtype
                if b.is_floating_point():
                    if id(b) in kept:
                        target = torch.float32 if b.dtype in _LOWP else b.dtype
                    elif id(b) in follows_params:
                        target = dtype
                    elif cast_to is not None:
                        target = cast_to
                nb = b.detach().to(device=device, dtype=target)
                new_of[id(b)] = nb
                buffer_dtypes[id(nb)] = b.dtype
            m._buffers[name] = new_of[id(b)]
    return buffer_dtypes
