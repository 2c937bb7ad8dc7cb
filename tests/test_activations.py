"""ZeRO-R's CPU checkpointing: `offload.checkpointing.checkpoint` with `cpu_offload`.

What it must keep: torch's own (non-reentrant) activation checkpointing, exactly — the same
loss, gradients and trained weights bit for bit — while the checkpointed inputs wait for
the recomputation on the host ([Note: activation regions] in offload/runtime/activations.py).
On this CPU machine the regions take the same path as on a GPU (host copies, brought back
before the recompute); what they save on a GPU is measured by the cuda-marked test.

Also: DeepSpeed's `activation_checkpointing` block translates (cpu_checkpointing -> the
config's cpu_offload; partition_activations and the rest reported as not honoured, with the
reason), and `offload.compat.deepspeed.checkpointing` works as DeepSpeed's.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch
from torch import nn

import offload
import offload.checkpointing as ckpt
from offload.models.gpt import GPT, gpt_batches, lm_loss
from tests.conftest import run_distributed
from tests.test_engine import make_config


@pytest.fixture(autouse=True)
def _reset_activation_settings():
    ckpt.reset()
    yield
    ckpt.reset()


class CountingBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        self.calls += 1
        return x + scale * self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def _grads(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(CountingBlock(16) for _ in range(3))
    x = torch.randn(4, 8, 16, requires_grad=True)
    h = x
    for b in blocks:
        if mode == "none":
            h = b(h, 0.5)
        elif mode == "torch":
            h = torch.utils.checkpoint.checkpoint(b, h, 0.5, use_reentrant=False)
        else:
            h = ckpt.checkpoint(b, h, 0.5, cpu_offload=True)
    loss = h.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in blocks.named_parameters()}
    grads["input"] = x.grad.clone()
    return loss.detach(), grads, [b.calls for b in blocks]


def test_cpu_offloaded_checkpoint_equals_torch_checkpoint_bit_for_bit() -> None:
    loss0, g0, calls0 = _grads("none")
    loss1, g1, calls1 = _grads("torch")
    loss2, g2, calls2 = _grads("offload")
    assert calls0 == [1, 1, 1] and calls1 == calls2 == [2, 2, 2]  # each region recomputed once
    assert torch.equal(loss2, loss1) and torch.equal(loss1, loss0)
    for k in g0:
        assert torch.equal(g2[k], g1[k]), k
        assert torch.equal(g1[k], g0[k]), k
    # Negative control: another scale changes every gradient.
    torch.manual_seed(0)
    blocks = nn.ModuleList(CountingBlock(16) for _ in range(3))
    x = torch.randn(4, 8, 16, requires_grad=True)
    h = x
    for b in blocks:
        h = ckpt.checkpoint(b, h, 0.25, cpu_offload=True)
    h.square().mean().backward()
    assert not torch.equal(x.grad, g2["input"])


def test_configure_sets_the_default_and_reentrant_is_refused() -> None:
    assert not ckpt.is_configured()
    ckpt.configure(cpu_offload=True)
    assert ckpt.is_configured()
    b = CountingBlock(8)
    x = torch.randn(2, 8, requires_grad=True)
    ckpt.checkpoint(b, x, 1.0).sum().backward()
    assert b.calls == 2
    with pytest.raises(ValueError, match="non-reentrant"):
        ckpt.checkpoint(b, x, 1.0, use_reentrant=True)
    with torch.no_grad():  # no backward will come: a plain call, nothing kept
        ckpt.checkpoint(b, x, 1.0)
    assert b.calls == 3


class OffloadCheckpointedGPT(GPT):
    """The suite's GPT with each block under offload.checkpointing.checkpoint (its default
    from the engine's config)."""

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = ckpt.checkpoint(blk, x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else lm_loss(logits, targets)


def _train(rank: int, world_size: int, kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = OffloadCheckpointedGPT(n_layer=3) if kind == "offload" else GPT(n_layer=3, checkpoint="nonreentrant")
    cfg = make_config(gas=2, clip=1.0)
    if kind == "offload":
        cfg = offload.Config.from_dict({**_as_dict(cfg), "activation_checkpointing": {"cpu_offload": True}})
    engine = offload.initialize(model, cfg)
    for x, y in gpt_batches(4):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()
    assert engine.global_steps == 2
    sd = engine.full_state_dict(rank0_only=False)
    engine.close()
    return sd


def _as_dict(cfg: Any) -> dict[str, Any]:
    import dataclasses

    out = {}
    for f in dataclasses.fields(cfg):
        if f.name in ("ignored_keys", "notes"):
            continue
        v = getattr(cfg, f.name)
        out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return out


def _both(rank: int, world_size: int) -> tuple[dict, dict, bool]:
    a = _train(rank, world_size, "offload")
    configured = ckpt.is_configured()
    ckpt.reset()
    b = _train(rank, world_size, "torch")
    return a, b, configured


@pytest.mark.parametrize("world_size", [1, 2])
def test_through_the_engine_equals_torch_checkpointing(world_size: int) -> None:
    results = [_both(0, 1)] if world_size == 1 else run_distributed(_both, 2)
    for got, want, configured in results:
        assert not configured  # the engine's config is its own: nothing process-wide (issue #32)
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
    torch.manual_seed(0)
    initial = GPT(n_layer=3).state_dict()
    assert not torch.equal(results[0][0]["blocks.0.qkv.weight"], initial["blocks.0.qkv.weight"])


class _Probe(torch.nn.Module):
    """Records offload.checkpointing's settings in force while its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(ckpt.in_force().cpu_offload)
        for layer in self.layers:
            x = ckpt.checkpoint(layer, x)
        return x.square().mean()


def test_an_engines_activation_settings_hold_during_its_forward_only() -> None:
    """Issue #32: an engine with activation_checkpointing.cpu_offload used to set the
    process-wide default at initialize, so every other model's checkpoints (another engine's,
    a plain torch model's) offloaded too, for the rest of the process."""
    ckpt.reset()
    cfg = {"offload": {"param_tier": "cpu", "optimizer_tier": "cpu"}, "precision": {"dtype": "fp32"}}
    on = offload.initialize(_Probe(), {**cfg, "activation_checkpointing": {"cpu_offload": True}})
    off = offload.initialize(_Probe(), cfg)
    plain = _Probe()
    x = torch.randn(2, 4, requires_grad=True)
    def run(model: Any) -> None:
        if model is plain:
            model(x).backward()
        else:
            model.backward(model(x))
            model.step()

    for model in (on, off, plain, on, plain):
        run(model)
    assert on.module.seen == [True, True]
    assert off.module.seen == [False] and plain.seen == [False, False]
    assert not ckpt.is_configured() and not ckpt.in_force().cpu_offload
    ckpt.configure(cpu_offload=True)  # the process-wide default (DeepSpeed's configure) still works
    run(off)
    assert off.module.seen == [False, True]
    ckpt.reset()
    on.close()
    off.close()


def test_deepspeed_activation_checkpointing_block_translates() -> None:
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                       "contiguous_memory_optimization": False, "number_checkpoints": 4,
                                       "synchronize_checkpoint_boundary": False, "profile": False}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = offload.config.load_config(ds, world_size=1)
    assert cfg.activation_checkpointing.cpu_offload
    assert "activation_checkpointing.partition_activations" in cfg.ignored_keys
    assert any("model-parallel" in str(w.message) for w in caught)
    off = offload.config.load_config({**ds, "activation_checkpointing": {"cpu_checkpointing": False}},
                                     world_size=1)
    assert not off.activation_checkpointing.cpu_offload
    # offload's own format has the section too
    assert offload.config.load_config({"activation_checkpointing": {"cpu_offload": True}}).activation_checkpointing.cpu_offload
    with pytest.raises(offload.config.ConfigError, match="cpu_ofload"):
        offload.config.load_config({"activation_checkpointing": {"cpu_ofload": True}})


def test_compat_deepspeed_checkpointing() -> None:
    import offload.compat.deepspeed as deepspeed

    deepspeed.checkpointing.configure(None, deepspeed_config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "activation_checkpointing": {"cpu_checkpointing": True}})
    assert deepspeed.checkpointing.is_configured()
    b = CountingBlock(8)
    x = torch.randn(2, 8, requires_grad=True)
    deepspeed.checkpointing.checkpoint(b, x, 1.0).sum().backward()
    assert b.calls == 2 and x.grad is not None
    with pytest.raises(NotImplementedError, match="model parallelism"):
        deepspeed.checkpointing.configure(object())
    deepspeed.checkpointing.reset()
    assert not deepspeed.checkpointing.is_configured()


@pytest.mark.cuda
def test_device_memory_saved_on_a_gpu() -> None:
    """Between forward and backward the device holds no checkpointed input: the peak
    allocated memory drops by about layers x the input's bytes, and the gradients equal
    torch's checkpoint's."""
    dev = torch.device("cuda")
    d, layers = 1024, 8
    torch.manual_seed(0)
    blocks = nn.ModuleList(CountingBlock(d) for _ in range(layers)).to(dev)
    x0 = torch.randn(8, 512, d, device=dev)
    act_bytes = x0.numel() * x0.element_size()

    def run(offload_inputs: bool) -> tuple[int, dict[str, torch.Tensor]]:
        blocks.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        h = x
        for b in blocks:
            h = ckpt.checkpoint(b, h, 0.5, cpu_offload=offload_inputs)
        loss = h.float().square().mean()
        held = torch.cuda.memory_allocated() - base  # what waits for backward
        loss.backward()
        torch.cuda.synchronize()
        return held, {n: p.grad.detach().clone() for n, p in blocks.named_parameters()}

    held_torch, g_torch = run(False)
    held_off, g_off = run(True)
    for k in g_torch:
        assert torch.equal(g_off[k], g_torch[k]), k
    saved = held_torch - held_off
    assert saved >= 0.8 * (layers - 1) * act_bytes, (held_torch, held_off, act_bytes)
