"""Shared test helpers: markers, skips, and what several test files need once."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn


def arithmetic_line() -> str:
    """The arithmetic underneath this run: which CPU, which code paths torch and offload's
    Adam take on it (ATEN_CPU_CAPABILITY, MKL_CBWR, OFFLOAD_ADAM_ISA change them)."""
    from offload.optim import adam_isa

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass  # not Linux: the name is only informative
    env = " ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OFFLOAD_ADAM_ISA")
                   if k in os.environ)
    return (f"cpu: {model}, {os.cpu_count()} cores; torch {torch.__version__} kernels "
            f"{torch.backends.cpu.get_cpu_capability()}; offload Adam kernel {adam_isa()}"
            + (f"; forced by {env}" if env else ""))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """How far inside its measured bound each parity comparison landed (tests/parity.py)."""
    from tests.parity import MARGINS

    terminalreporter.write_line(arithmetic_line())
    if not MARGINS:
        return
    worst = sorted(MARGINS, key=lambda m: m.ratio, reverse=True)
    terminalreporter.write_line(
        f"parity: {len(MARGINS)} comparisons against measured bounds; the closest (distance / bound):"
    )
    for m in worst[:5]:
        terminalreporter.write_line(f"  {m.ratio:.3f}  {m.what}  ({m.worst})")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


# -- a tiny GPT ------------------------------------------------------------------------------



class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + MLP."""

    def __init__(self, d_model: int, n_head: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        # No qkv bias by default. With one (GPT-2's c_attn), the key bias has an exactly-zero
        # true gradient (softmax is invariant to it), so its "gradient" is rounding noise that
        # Adam normalises into lr-sized steps: two correct implementations disagree on it by
        # O(lr) every step. The parity scenario "gpt_qkv_bias" keeps it, on purpose.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=qkv_bias)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallEmbedding(nn.Embedding):
    """GPT-2's embedding init (normal, std 0.02) as reset_parameters, so `offload.init`
    replays it; torch's N(0, 1) with a tied head gives logits so large that training is
    chaotic and any two runs drift apart."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class TinyGPT(nn.Module):
    """Embedding + blocks in a ModuleList + final norm + LM head tied to the embedding.
    forward(idx, targets=None) returns logits, or the mean cross-entropy with targets."""

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
    ) -> None:
        super().__init__()
        self.wte = SmallEmbedding(vocab, d_model)
        self.wpe = SmallEmbedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, qkv_bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight
        self.checkpoint = checkpoint
        """'' (none), 'reentrant' or 'nonreentrant': torch.utils.checkpoint each block;
        'span': one non-reentrant checkpoint around all blocks."""

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
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
    """n (idx, targets) batches of random tokens, the same for every caller with a seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


# -- a multi-process launcher ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, outdir: str, init_group: bool, fn: Callable, args: tuple
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        _save_atomic({"ok": True, "result": result}, outdir, rank)
    except BaseException:
        _save_atomic({"ok": False, "error": traceback.format_exc()}, outdir, rank)
        raise
    finally:
        if dist.is_initialized():
            from offload.units.collectives import settle_collectives

            settle_collectives()  # nothing of ours in flight when the group goes
            try:
                dist.barrier()  # leave together (see Engine.close)
            finally:
                dist.destroy_process_group()


def _save_atomic(obj: Any, outdir: str, rank: int) -> None:
    tmp = os.path.join(outdir, f"{rank}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, os.path.join(outdir, f"{rank}.pt"))


def run_distributed(
    fn: Callable, world_size: int, *args: Any, init_group: bool = True, timeout_s: float = 300
) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` real processes (gloo over TCP on a
    free port); return each rank's result, or raise with the failing rank's traceback.
    The workers see torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    with `init_group=False` they do not start the process group themselves, so the code
    under test must. `fn` must be importable (defined at a test module's top level)."""
    import time

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _worker, args=(world_size, free_port(), outdir, init_group, fn, args),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:  # ours: started just above
                        if proc.is_alive():
                            proc.terminate()
                    raise TimeoutError(f"{fn.__name__} did not finish within {timeout_s} s")
        except Exception as exc:
            errors, done = [], 0
            for r in range(world_size):
                path = os.path.join(outdir, f"{r}.pt")
                if os.path.exists(path):
                    res = torch.load(path, weights_only=False)
                    if not res["ok"]:
                        errors.append(f"rank {r}:\n{res['error']}")
                    else:
                        done += 1
            # A process that died after returning its result (at exit) failed too.
            raise RuntimeError("\n".join(errors) or f"{exc} ({done} of {world_size} ranks "
                               "returned a result)") from None
        results = []
        for r in range(world_size):
            res = torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)
            results.append(res["result"])
        return results


def check_torchrun_exit(proc: "subprocess.CompletedProcess", results_complete: bool, what: str) -> None:
    """Assert a torchrun launch succeeded: every rank exited 0 (an abort at interpreter exit
    is a failure too: [Note: collective tensors at exit] in offload/units/collectives.py)."""
    assert proc.returncode == 0 and results_complete, (
        f"{what}: exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
