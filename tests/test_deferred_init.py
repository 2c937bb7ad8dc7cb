"""`offload.init` / `zero.Init` with construction-time semantics (issue #29, item 3).

A model built under `offload.init` must have bit-identical weights to the same model built
eagerly from the same seed, whatever its constructor does: `reset_parameters()`, a parent's
`self.apply(fn)`, in-place edits, `nn.init.trunc_normal_` (whose rejection loop reads
values) and `orthogonal_` (a QR of a fresh random matrix), writes under
`GatheredParameters(modifier_rank=0)`, Hugging Face's `post_init`; nested contexts and
`initialize` inside an open one. The random numbers are drawn at construction, so what the
program draws afterwards is what it would draw after an eager construction, and building
the engine draws nothing from the user's stream. Exactness is `torch.equal`: no tolerance.

Before (the replay of `reset_parameters()` at `initialize`), the parent's `apply`, the
edits and the GatheredParameters writes were lost, `torch.randn` parameters were refused,
`initialize` inside an open `zero.Init` failed, and a draw between construction and
`initialize` changed the weights: `test_negative_control_meta_replay_loses_the_init` shows
the same comparison failing on that path.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import offload
import offload.units.deferred as deferred
from offload.compat.deepspeed import zero
from tests.conftest import TinyGPT, run_distributed
from tests.test_engine import make_config


class Inits(nn.Module):
    """Every way a constructor sets values that the replay of reset_parameters() missed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5))                   # a random factory
        self.lin = nn.Linear(5, 7)
        self.emb = nn.Embedding(11, 5, padding_idx=0)
        self.rnn = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.rnn)                              # QR of a fresh random matrix
        self.t = nn.Parameter(torch.empty(40, 8))
        nn.init.trunc_normal_(self.t, std=0.02)                    # reads values (rejection loop)
        self.apply(self._init)                                      # a parent's apply
        with torch.no_grad():
            self.lin.weight[0].mul_(3.0)                           # an in-place edit of a view
            self.lin.bias.copy_(torch.arange(7.0))                 # a copy from a real tensor
        self.register_buffer("pos", torch.arange(10).float() / 3)  # a computed buffer

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(0, 0.5)
        if isinstance(m, nn.Embedding):
            m.weight.data[m.padding_idx].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) + self.pos[:7]).pow(2).mean() + self.w.sum() * 0 + self.rnn.sum() * 0 \
            + self.t.sum() * 0 + self.emb.weight.sum() * 0


def eager(make, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The eager model's state and the first draw after its constructor returned."""
    torch.manual_seed(seed)
    model = make()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, torch.randn(4)


def assert_identical(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    differ = [k for k in want if not torch.equal(got[k].to(want[k].dtype), want[k])]
    assert not differ, f"not bit-identical to the eager construction: {differ}"


def test_every_init_is_bit_identical_and_draws_at_construction():
    want, draw_after = eager(Inits)
    cfg = make_config()
    torch.manual_seed(0)
    with offload.init(cfg):
        model = Inits()
    assert all(deferred.is_deferred(p) for p in model.parameters())
    assert torch.equal(torch.randn(4), draw_after)  # the generator advanced as eagerly
    state = torch.get_rng_state()
    engine = offload.initialize(model, cfg)
    assert torch.equal(torch.get_rng_state(), state)  # initialize drew nothing from it
    assert_identical(engine.full_state_dict(), want)
    engine.backward(engine(torch.randn(2, 5)))  # and it trains
    engine.step()
    engine.close()


def test_negative_control_meta_replay_loses_the_init():
    """The same comparison on the meta-device replay (what offload.init was): it fails."""
    class NoRandn(Inits):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.lin = nn.Linear(5, 7)
            self.apply(self._init)
            with torch.no_grad():
                self.lin.weight[0].mul_(3.0)

        def forward(self, x):
            return self.lin(x).sum()

    want, _ = eager(NoRandn)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = NoRandn()
    engine = offload.initialize(model, make_config())
    got = engine.full_state_dict()
    engine.close()
    with pytest.raises(AssertionError, match="lin.weight"):
        assert_identical(got, want)


class Gathered(nn.Module):
    """DeepSpeed's pattern: edit a parameter in __init__ under GatheredParameters(modifier_rank=0)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        for layer in self.layers:
            with zero.GatheredParameters(layer.weight, modifier_rank=0):
                layer.weight.data.copy_(torch.eye(6) + 0.01 * layer.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


@pytest.mark.filterwarnings("ignore:DeepSpeed config translated")
def test_gathered_parameters_edits_nested_init_and_initialize_inside():
    want, draw_after = eager(Gathered)
    cfg = make_config()
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
        with offload.init(cfg):  # nested: joins the open context
            model = Gathered()
        assert torch.equal(torch.randn(4), draw_after)
        engine = offload.initialize(model, cfg)  # inside the open Init: the engine is real
        assert all(not p.is_meta for u in engine.units for p in [u.shard] if p is not None)
        assert_identical(engine.full_state_dict(), want)
        engine.backward(engine(torch.ones(2, 6)))
        engine.step()
        engine.close()
    assert torch.zeros(1).device.type == "cpu"  # the context is gone with its exit


def test_init_fn_runs_as_model_apply_after_the_constructor():
    def init_fn(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def make():
        m = TinyGPT(n_layer=2)
        m.apply(init_fn)
        return m

    want, draw_after = eager(make)
    cfg = make_config()
    torch.manual_seed(0)
    with offload.init(cfg, init_fn=init_fn):
        model = TinyGPT(n_layer=2)
    assert torch.equal(torch.randn(4), draw_after)
    engine = offload.initialize(model, cfg)
    assert_identical(engine.full_state_dict(), want)
    engine.close()


def test_hugging_face_post_init_is_bit_identical():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   initializer_range=0.5)  # large: a skipped init would show
    make = lambda: transformers.LlamaForCausalLM(cfg)  # noqa: E731
    want, draw_after = eager(make)
    ocfg = make_config()
    torch.manual_seed(0)
    with offload.init(ocfg):
        model = make()
    assert torch.equal(torch.randn(4), draw_after)
    engine = offload.initialize(model, ocfg)
    assert_identical(engine.full_state_dict(), want)
    engine.close()


def test_unwritten_empty_parameter_is_named():
    class Unset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))
            self.lin = nn.Linear(3, 3)

    with offload.init(make_config()):
        model = Unset()
    with pytest.raises(ValueError, match=r"\['w'\].*torch.empty"):
        offload.initialize(model, make_config())


def test_a_deferred_value_written_into_a_real_tensor_is_refused():
    real = torch.zeros(3)
    with offload.init(make_config()):
        lin = nn.Linear(3, 3)
        with pytest.raises(RuntimeError, match="into a real tensor"):
            with torch.no_grad():
                real.copy_(lin.bias)
    del lin


def test_values_are_computed_one_unit_at_a_time(monkeypatch):
    """At most one unit's values (and the transient tensors they are made from) are alive at
    once while initialize fills the shards: the model is never whole in memory."""
    live: dict[int, int] = {}
    peak = [0]
    real = deferred.evaluate

    def tracking(t, session):
        v = real(t, session)
        key = id(v)
        live[key] = v.numel()
        weakref.finalize(v, live.pop, key, None)
        peak[0] = max(peak[0], sum(live.values()))
        return v

    monkeypatch.setattr(deferred, "evaluate", tracking)
    cfg = make_config()
    torch.manual_seed(0)
    with offload.init(cfg):
        model = TinyGPT(n_layer=6)
    total = sum(p.numel() for p in model.parameters())
    engine = offload.initialize(model, cfg)
    largest_unit = max(sum(p.numel() for p in u.params) for u in engine.units)
    engine.close()
    assert 0 < peak[0] <= largest_unit < total / 3, (peak[0], largest_unit, total)


def _ws2_gathered(rank: int, world_size: int) -> dict:
    cfg = make_config()
    torch.manual_seed(0)
    with offload.init(cfg):
        model = Gathered()
    engine = offload.initialize(model, cfg)
    sd = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return sd


def test_world_size_2_bit_identical():
    want, _ = eager(Gathered)
    for sd in run_distributed(_ws2_gathered, 2):
        assert_identical(sd, want)
