"""A GPT-2-style decoder: the one model the tests, the benchmarks and the examples train.

    model = GPT()                                        # the tests' tiny default
    model = GPT(8192, 256, 4, 4, 128, qkv_bias=True)     # examples/train_gpt.py's default
    n_layer, d_model, n_head = GPT_PRESETS["4b"]         # named sizes

Token + position embeddings, `n_layer` pre-norm blocks in a ModuleList (each one offload
unit), a final LayerNorm and an LM head tied to the token embedding. forward(idx) returns
logits; forward(idx, targets) the mean cross-entropy (`lm_loss`). The options default to the
tests' model; the examples and benchmarks turn on what they need (`qkv_bias`, `checkpoint`,
`fp32_matmul`).

This module imports only torch: it is a bottom layer of offload (tools/import_graph.py),
a model any layer's tests may build, never a user of the engine.

[Note: bit-identical model] The parity tests compare runs of this model against each other
and against numbers they pinned, so its arithmetic is part of its contract: for the same
constructor arguments and `torch.manual_seed`, it must create the same parameters in the
same order (wte, wpe, each block's ln1 qkv proj ln2 fc out, ln_f, lm_head), initialise
them the same way (torch's defaults; the embeddings' `reset_parameters`) and run the same
forward ops in the same order. A new option must leave the default path untouched.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPT_PRESETS", "CHECKPOINT_MODES", "Block", "Linear", "SmallEmbedding", "lm_loss",
           "gpt_batches"]

# (n_layer, d_model, n_head) by name. Parameters ~ 12 x n_layer x d_model^2 + (vocab + seq) x
# d_model; at vocab 8192 (examples/train_gpt.py's default) these land on their names. "4b"
# is deep and thin on purpose: a unit (one block) holds 79M parameters, so with both tiers on
# NVMe one unit's working set in the staging pool (fp32 master + 2 moments + bf16 shard,
# 14 B/param) is 1.1 GB, and a 2.2 GB pool overlaps one unit's reads with the previous
# one's writes.
GPT_PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 64, 2),
    "125m": (12, 768, 12),
    "500m": (18, 1536, 12),
    "1b": (20, 2048, 16),
    "4b": (52, 2560, 20),
    "7b": (32, 4096, 32),
}

CHECKPOINT_MODES = ("", "reentrant", "nonreentrant", "span")
"""GPT(checkpoint=...): '' none; 'reentrant' / 'nonreentrant': torch.utils.checkpoint around
each block; 'span': one non-reentrant checkpoint around all blocks."""


class _Fp32Matmul(torch.autograd.Function):
    """y = x @ w.T + b for low-precision x, w, b, with the products computed in fp32.

    [Note: CPU bf16 matmuls] Without AMX / AVX512-BF16, torch's bf16 GEMMs on the CPU fall
    back to slow kernels, and how slow depends on the layout: on a 2-core AVX2 EPYC, for
    x (32 x 3072) and w (12288 x 3072), the forward x @ w.T takes 0.46 s in bf16 vs 0.20 s in
    fp32, and the backward's dy @ w 17 s vs 0.13 s. Upcasting the operands of each product
    (a transient fp32 copy of one weight, at most 4 x d_model^2 x 4 bytes) keeps bf16 training
    at fp32 speed. Only the low-precision x and w are saved for backward (as F.linear saves
    them), so no fp32 copy outlives its product; parameters, gradients and everything the
    engine stores stay in the compute dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        with torch.autocast("cpu", enabled=False):  # under autocast: the product stays fp32
            y = F.linear(x.float(), w.float(), None if b is None else b.float())
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        with torch.autocast("cpu", enabled=False):
            dy32 = dy.float()
            if ctx.needs_input_grad[0]:
                dx = (dy32 @ w.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = (dy32.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy32.reshape(-1, dy.shape[-1]).sum(0).to(w.dtype)
        return dx, dw, db, None


class Linear(nn.Linear):
    """nn.Linear whose product runs in fp32 when `fp32_matmul` is set and the layer computes
    in bf16/fp16 on the CPU — low-precision input, or under `torch.autocast("cpu")` (plain
    PyTorch mixed precision) — see [Note: CPU bf16 matmuls]; otherwise exactly nn.Linear
    (same parameters, same init, same product). The output has the dtype nn.Linear would
    give (the input's, or autocast's)."""

    fp32_matmul = False
    """Set per instance by GPT(fp32_matmul=True); a class default so that offload.init's
    replay of reset_parameters and copies of the module need nothing more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_matmul and x.device.type == "cpu":
            if torch.is_autocast_enabled("cpu"):
                return _Fp32Matmul.apply(x, self.weight, self.bias, torch.get_autocast_dtype("cpu"))
            if x.dtype in (torch.bfloat16, torch.float16):
                return _Fp32Matmul.apply(x, self.weight, self.bias, x.dtype)
        return super().forward(x)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP. The class name is what
    `config.unit_modules=("Block",)` names."""

    def __init__(self, d_model: int, n_head: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        # No qkv bias by default. With one (GPT-2's c_attn), the key bias has an exactly-zero
        # true gradient (softmax is invariant to it), so its "gradient" is rounding noise that
        # Adam normalises into lr-sized steps: two correct implementations disagree on it by
        # O(lr) every step. The parity scenario "gpt_qkv_bias" keeps it, on purpose; the
        # examples and benchmarks have it, as GPT-2 does.
        self.qkv = Linear(d_model, 3 * d_model, bias=qkv_bias)
        self.proj = Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = Linear(d_model, 4 * d_model)
        self.out = Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallEmbedding(nn.Embedding):
    """GPT-2's embedding init (normal, std 0.02) as reset_parameters, so `offload.init`
    replays it when the model is built on the meta device; torch's N(0, 1) with a tied head
    gives logits so large that training is chaotic and any two runs drift apart."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class GPT(nn.Module):
    """Embedding + blocks in a ModuleList + final norm + LM head tied to the embedding.
    forward(idx, targets=None) returns logits, or the mean cross-entropy with targets.

    The defaults are the tests' tiny model; see [Note: bit-identical model] before changing
    what any of them computes."""

    def __init__(
        self,
        vocab: int = 64,
        d_model: int = 32,
        n_layer: int = 2,
        n_head: int = 2,
        seq: int = 16,
        tie: bool = True,
        checkpoint: str = "",
        qkv_bias: bool = False,
        fp32_matmul: bool = False,
    ) -> None:
        """vocab: tokens; d_model: width; n_layer: blocks; n_head: attention heads (divides
        d_model); seq: the longest sequence (position embeddings); tie: the LM head shares
        the token embedding's weight; checkpoint: one of CHECKPOINT_MODES; qkv_bias: a bias
        on the attention's input projection; fp32_matmul: bf16/fp16 products on the CPU in
        fp32 ([Note: CPU bf16 matmuls])."""
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} must be a multiple of n_head {n_head}: each "
                             f"head gets d_model / n_head channels")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint {checkpoint!r} is not one of {CHECKPOINT_MODES}")
        self.wte = SmallEmbedding(vocab, d_model)
        self.wpe = SmallEmbedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, qkv_bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = Linear(d_model, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight
        self.checkpoint = checkpoint
        """One of CHECKPOINT_MODES."""
        if fp32_matmul:
            for m in self.modules():
                if isinstance(m, Linear):
                    m.fp32_matmul = True

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        if self.checkpoint == "span":
            # one non-reentrant region over all blocks: recomputation re-enters every unit
            x = torch.utils.checkpoint.checkpoint(self._blocks, x, use_reentrant=False)
        for blk in self.blocks if self.checkpoint != "span" else ():
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(
                    blk, x, use_reentrant=self.checkpoint == "reentrant"
                )
            else:
                x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy, computed in at least fp32: bf16/fp16 logits are cast up, float64
    logits (the float64 truth of tests/parity.py) stay float64."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_batches(n: int, batch: int = 8, seq: int = 16, vocab: int = 64, seed: int = 1234):
    """n (idx, targets) batches of random tokens, each (batch, seq) int64, targets the
    inputs shifted by one; the same for every caller with a seed (a private generator:
    the global RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out
