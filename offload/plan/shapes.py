"""A model's shape for the step-time model: per unit, its parameters, its forward FLOPs, the
memory traffic of its non-matmul operations, and its activations.

Three sources, each one unit per transformer block plus the root (embeddings, final norm,
LM head), as the engine wraps them (`unit_modules=("Block",)`-style policies):
- `shape_from_dims`: layers, d_model, heads, vocab, sequence, batch (`--layers/--d-model/...`);
- `shape_from_hf_config`: a transformers `config.json` (GPT-2, Llama, Mistral, Qwen names);
- `shape_from_model`: a model (on the meta device too): the engine's own units
  (`plan_units`), each unit's FLOPs from its `nn.Linear` modules (attention's score and value
  products are not seen: known to be low for long sequences).

[Note: FLOPs and traffic of a block]
Forward matmul FLOPs per token of a block = 2 x its Linear parameters (qkv 3d^2, proj d^2,
fc 4 f d... with f = the MLP width); attention's two products 2 x 2 x seq x d per token
(QK^T and PV), halved by the causal mask (SDPA skips the masked half). Backward = 2 x the
forward FLOPs (a gradient for the input and one for the weight), plus the forward again when
the block is recomputed. The non-matmul work (norms, GELU, residual adds, the attention's
layout copies, softmax) is memory-bound: `BLOCK_PASSES` passes over tokens x d activations
forward, twice that backward, at the host memory bandwidth on a CPU. The root's LM head adds
its matmul (2 x d x vocab per token) and the loss's passes over the logits (`LOGIT_PASSES`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

__all__ = ["UnitShape", "ModelShape", "shape_from_dims", "shape_from_hf_config", "shape_from_model",
           "BLOCK_PASSES", "LOGIT_PASSES"]

BLOCK_OPS = (10, 30)
"""A block's non-matmul kernel launches forward and backward (besides its 4 and 8 matmuls),
counted with torch.profiler on the engine's step of bench_train's GPT (the ops over a few
microseconds: layer norms, adds, the q/k/v and output copies, SDPA, GELU; backward also the
engine's gradient copies and zero fills)."""
ROOT_OPS = (5, 12)
"""The root's (embeddings, final norm, log-softmax and loss), besides its 1 and 2 matmuls."""

BLOCK_PASSES = 30
"""Forward passes over a block's tokens x d activations outside its matmuls: layer norms
(2 x 2), the q/k/v and output layout copies (8), attention's reads and write (4), residual
adds (2 x 3), GELU over the 4d-wide MLP (8): [Note: FLOPs and traffic of a block]."""
LOGIT_PASSES = 4
"""Forward passes over the tokens x vocab logits: the head's write, log-softmax's read and
write, the loss's gather; backward as many again."""


@dataclass(frozen=True)
class UnitShape:
    name: str
    params: int
    """Parameters the unit owns (its shard's numel over all ranks)."""
    fwd_flops: float
    """Forward matmul FLOPs for the whole batch."""
    fwd_traffic_elems: float
    """Forward non-matmul memory traffic, in activation elements (x the compute dtype's size)."""
    act_elems: float
    """Activation elements saved for backward (without recompute)."""
    input_elems: float
    """The unit's input (what recompute keeps instead of `act_elems`)."""
    d_model: int
    """The width its matmuls are (for the matmul rate at that size)."""
    matmuls: int = 0
    """Matmul calls in its forward (backward: twice as many)."""
    ops_fwd: int = 0
    """Other kernel launches in its forward large enough to run on several threads (norms,
    adds, GELU, layout copies, attention): each costs the profile's `parallel_op` latency."""
    ops_bwd: int = 0
    """The same in its backward (the engine's gradient copies and zeroing included)."""


@dataclass(frozen=True)
class ModelShape:
    units: tuple[UnitShape, ...]
    """Index 0 is the root, as in the engine."""
    tokens: int
    """Tokens per optimizer step per rank (batch x sequence x accumulation)."""
    recompute: bool = False
    """Activation checkpointing per block: backward recomputes the forward."""
    source: str = ""

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)

    def activation_elems(self) -> float:
        """Elements held for backward at the end of forward: every unit's activations, or
        with recompute every unit's input plus the largest unit's activations (recomputed
        one at a time)."""
        if not self.recompute:
            return sum(u.act_elems for u in self.units)
        return sum(u.input_elems for u in self.units) + max((u.act_elems for u in self.units), default=0)


def _block(i: int, d: int, heads: int, kv_heads: int, ffn: int, seq: int, tokens: int, bias: bool,
           gated: bool) -> UnitShape:
    mlp = (3 if gated else 2) * d * ffn
    attn = 2 * d * d + 2 * d * (d // heads) * kv_heads  # q and out; k and v (fewer heads: GQA)
    params = attn + mlp + (5 * d + ffn if bias else 0) + 4 * d  # biases (qkv, proj, fc, out) + two norms
    fwd = 2 * tokens * (attn + mlp) + 2 * tokens * seq * d  # causal: half of 4 s d
    # saved for backward per token (elements): Korthikanti et al. 2022 (arXiv:2205.05198) 34 s b h
    # bytes at 2 B = 17 s b h elements with a flash-style attention (no s^2 scores kept), the
    # MLP's width ffn instead of 4d.
    act = tokens * (9 * d + 2 * ffn + (ffn if gated else 0))
    passes = BLOCK_PASSES * d + (8 * (ffn - 4 * d) if ffn != 4 * d else 0)
    return UnitShape(f"block{i}", params, float(fwd), float(tokens * passes), float(act),
                     float(tokens * d), d, 7 if gated else 4, *BLOCK_OPS)  # q, k, v, o + 3; fused qkv + 3


def shape_from_dims(*, layers: int, d_model: int, heads: int, vocab: int, seq: int, batch: int,
                    ffn: Optional[int] = None, tied: bool = True, bias: bool = True, gated: bool = False,
                    recompute: bool = False, accumulation: int = 1, positions: Optional[int] = None,
                    kv_heads: Optional[int] = None) -> ModelShape:
    """A decoder-only transformer: `layers` blocks of width `d_model` (MLP width `ffn`,
    default 4 d; `gated`: SwiGLU's three matrices), `vocab` tokens, a tied LM head or not,
    `batch` x `seq` tokens per micro-batch, `accumulation` micro-batches per step, `kv_heads`
    key/value heads (grouped-query attention; default `heads`)."""
    for name, v in (("layers", layers), ("d_model", d_model), ("heads", heads), ("vocab", vocab),
                    ("seq", seq), ("batch", batch), ("accumulation", accumulation)):
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} {v}: it must be at least 1")
    if d_model % heads:
        raise ValueError(f"--d-model {d_model} is not a multiple of --heads {heads}")
    f = ffn or 4 * d_model
    tokens = batch * seq * accumulation
    root_params = vocab * d_model * (1 if tied else 2) + (positions or 0) * d_model + 2 * d_model
    root = UnitShape("root", root_params, float(2 * tokens * d_model * vocab),
                     float(tokens * (3 * d_model + 2 * d_model + LOGIT_PASSES * vocab)),
                     float(tokens * (2 * d_model + 2 * vocab)), float(tokens * d_model), d_model, 1, *ROOT_OPS)
    blocks = tuple(_block(i, d_model, heads, kv_heads or heads, f, seq, tokens, bias, gated) for i in range(layers))
    return ModelShape((root,) + blocks, tokens, recompute,
                      f"{layers} layers, d_model {d_model}, {heads} heads, vocab {vocab}, MLP {f}"
                      f"{' (gated)' if gated else ''}, {batch} x {seq} tokens x {accumulation}")


def shape_from_hf_config(path: str, *, seq: Optional[int], batch: int, recompute: bool = False,
                         accumulation: int = 1) -> ModelShape:
    """A transformers `config.json`: GPT-2 names (n_layer, n_embd, n_head, n_inner) or
    Llama-style ones (num_hidden_layers, hidden_size, num_attention_heads,
    intermediate_size: a gated MLP), tie_word_embeddings; `seq` defaults to the config's
    longest sequence."""
    try:
        with open(path) as f:
            c: dict[str, Any] = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--hf-config {path}: cannot read it as JSON ({e})") from None

    def pick(*names: str, default: Any = None) -> Any:
        for n in names:
            if c.get(n) is not None:
                return c[n]
        if default is None:
            raise ValueError(f"--hf-config {path}: none of {', '.join(names)} is set")
        return default

    llama = "intermediate_size" in c
    longest = pick("max_position_embeddings", "n_positions", "n_ctx", default=2048)
    return shape_from_dims(
        layers=int(pick("num_hidden_layers", "n_layer")), d_model=int(pick("hidden_size", "n_embd", "d_model")),
        heads=int(pick("num_attention_heads", "n_head")), vocab=int(pick("vocab_size")),
        seq=int(seq or longest), batch=batch,
        ffn=int(c["intermediate_size"]) if llama else (c.get("n_inner") or None),
        tied=bool(c.get("tie_word_embeddings", True)), bias=not llama, gated=llama, recompute=recompute,
        accumulation=accumulation, positions=None if llama else int(longest),
        kv_heads=c.get("num_key_value_heads"))


def shape_from_model(model: nn.Module, *, tokens: int, unit_modules: tuple[str, ...] = (),
                     leaf_modules: tuple[str, ...] = (), recompute: bool = False) -> ModelShape:
    """The engine's units of `model` (any device, meta included), each with its Linear
    modules' FLOPs for `tokens` tokens; non-matmul traffic as `BLOCK_PASSES` over the unit's
    widest input per token. Attention products are not seen."""
    from offload.units.partition import plan_units

    plans = plan_units(model, unit_modules, leaf_modules)
    unit_of = {id(rec.param): i for i, p in enumerate(plans) for rec in p.params}
    flops = [0.0] * len(plans)
    width = [0] * len(plans)
    linears = [0] * len(plans)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            i = unit_of.get(id(m.weight))
            if i is not None:
                flops[i] += 2.0 * tokens * m.in_features * m.out_features
                linears[i] += 1
                width[i] = max(width[i], min(m.in_features, m.out_features))
    units = []
    for i, p in enumerate(plans):
        n = sum(rec.param.numel() for rec in p.params)
        d = width[i] or 1
        units.append(UnitShape(p.name if hasattr(p, "name") else f"unit{i}", n, flops[i],
                               float(tokens * BLOCK_PASSES * d) if flops[i] else 0.0,
                               float(tokens * 17 * d) if flops[i] else 0.0, float(tokens * d), d,
                               linears[i], *(BLOCK_OPS if linears[i] else (0, 0))))
    return ModelShape(tuple(units), tokens, recompute, f"{type(model).__name__}, {len(units)} units")
