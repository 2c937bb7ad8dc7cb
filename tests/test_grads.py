"""Gradients as users expect (issue 17), against plain PyTorch, at world sizes 1 and 2.

- `engine.get_global_grad_norm()` (and `last_grad_norm`) equals what
  `torch.nn.utils.clip_grad_norm_` returns on a plain model, every step: fp32 and bf16,
  clipping on and off, updates during backward (partial sums taken before each unit's
  update, also from transient gradient shards) or at the step, accumulation 2.
- `engine.clip_grad_norm_(max_norm)` returns that norm and trains like a plain clipped
  loop; it refuses where it can no longer clip.
- `engine.zero_grad()` discards; `engine.optimizer.zero_grad()` inside an accumulation
  window keeps the gradients and warns once; the engine's own clearing stays silent.
- `torch.nn.utils.clip_grad_norm_` over the engine's parameters raises instead of clipping
  nothing.
- `engine.full_grad(p)` equals the plain model's `p.grad`.
- `requires_grad_(False)` after `initialize` trains like plain torch; `requires_grad_(True)` of
  a parameter frozen at `initialize`, and `add_param_group`, are refused by name.

Tolerances are measured as tests/parity.py measures them ([Note: derived tolerances]):
fp32 norms per step against a float64 run of the plain loop, the bound 8x the distance of
three fp32 runs of it; bf16 norm sequences against the plain bf16 loop, the bound 3x the
distance of the same loop with each batch split in 2 and 4. Negative control: the norms of
the same loop on half of each batch land far outside. The same norm check on a tiny Llama and
GPT-2 from transformers configs: tests/test_grads_hf.py.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Optional

import pytest
import torch

import offload
import offload.compat.deepspeed as deepspeed
from offload.config import PrefetchConfig
from tests.conftest import gpt_batches, run_distributed
from tests.parity import (
    FP32_MULTIPLE,
    FP32_ULP,
    LOWP_MULTIPLE,
    MARGINS,
    Fp32Bound,
    Margin,
    plain_loop,
)
from tests.test_engine import LOWP, LR, STEPS, WD, fp32_bound, make_config, make_model, reference_train

GAS = 2
CLIP = 0.05  # below the norms of this model and data: clipping is active (checked)


def _config(dtype: str = "fp32", gas: int = GAS, clip: float = 0.0, in_backward: bool = True, **kw: Any):
    kw.setdefault("nonfinite_loss", "off" if in_backward else "skip")  # the guard updates at step()
    return make_config(dtype=dtype, gas=gas, clip=clip,
                       prefetch=PrefetchConfig(optimizer_in_backward=in_backward), **kw)


# -- the norm of every step ----------------------------------------------------------------------

SCENARIOS: dict[str, dict[str, Any]] = {
    "fp32 optimizer in backward": dict(dtype="fp32", gas=GAS, clip=0.0, in_backward=True),
    "fp32 updates at step": dict(dtype="fp32", gas=GAS, clip=0.0, in_backward=False),
    # gas 1 on a CPU, updates in backward: gradient shards are released after each update
    "fp32 transient shards": dict(dtype="fp32", gas=1, clip=0.0, in_backward=True),
    "fp32 clipping": dict(dtype="fp32", gas=GAS, clip=CLIP, in_backward=True),
    "fp32 engine.clip_grad_norm_": dict(dtype="fp32", gas=GAS, clip=CLIP, in_backward=False, call=True),
    "bf16 optimizer in backward": dict(dtype="bf16", gas=GAS, clip=0.0, in_backward=True),
    "bf16 clipping": dict(dtype="bf16", gas=GAS, clip=CLIP, in_backward=True),
}


def train_reporting(sc: dict[str, Any], rank: int = 0, world_size: int = 1,
                    before_forward: Optional[Callable[[torch.nn.Module, int], None]] = None) -> dict[str, Any]:
    """Train the GPT as the scenario says; rank r takes its share of every batch. Returns the
    norm reported after every optimizer step, what clip_grad_norm_ returned, whether each
    step's updates ran during backward, and the weights."""
    torch.manual_seed(0)
    model = make_model("gpt")
    call = sc.get("call", False)
    engine = offload.initialize(model, _config(sc["dtype"], sc["gas"], 0.0 if call else sc["clip"],
                                               sc["in_backward"]))
    norms, returned, in_backward = [], [], []
    for i, (x, y) in enumerate(gpt_batches(STEPS)):
        if before_forward is not None:
            before_forward(model, i)
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        if engine.is_gradient_accumulation_boundary():
            in_backward.append(bool(engine.policy.updated))
            if call:
                returned.append(engine.clip_grad_norm_(sc["clip"]))
        engine.step()
        if (i + 1) % sc["gas"] == 0:
            norms.append(engine.get_global_grad_norm())
            assert engine.last_grad_norm == norms[-1]
    out = {"norms": norms, "returned": returned, "in_backward": in_backward,
           "transient": engine.policy.transient_grads, "sd": engine.full_state_dict()}
    engine.close()
    return out


def plain_norms(dtype: str, gas: int, clip: float, half: bool = False, **o: Any) -> list[float]:
    """The norms `clip_grad_norm_` returns in the plain loop (tests/parity.py), per step;
    `half`: on the first half of every batch (the negative control)."""
    norms: list[float] = []
    batches = gpt_batches(STEPS)
    if half:
        batches = [(x[: x.shape[0] // 2], y[: y.shape[0] // 2]) for x, y in batches]
    plain_loop(lambda: make_model("gpt"), batches, lr=LR, weight_decay=WD, gas=gas, clip=clip,
               compute_dtype=LOWP.get(dtype), norms=norms, **o)
    return norms


class NormBound:
    """A bound on a run's reported norms, measured from plain runs of the same loop.

    fp32: per step, |got - truth| <= 8 x max(the largest distance of the fp32 references
    (torch's for-loop and fused AdamW, the batch split in 2) from the float64 truth, one fp32
    ulp of the norm). bf16: ||got - ref|| / ||ref|| over the steps <= 3 x the same distance
    of the loop with each batch split in 2 and in 4."""

    def __init__(self, dtype: str, gas: int, clip: float,
                 run: Optional[Callable[..., list[float]]] = None) -> None:
        """`run(**overrides)`: the norms of the plain loop with tests/parity.py's `plain_loop`
        overrides (master_dtype, fused, split); by default the GPT's (`plain_norms`)."""
        self.dtype, self.gas, self.clip = dtype, gas, clip
        run = run or functools.partial(plain_norms, dtype, gas, clip)
        if dtype == "fp32":
            self.ref = run(master_dtype=torch.float64)
            refs = [run(), run(fused=True), run(split=2)]
            self.bound = [
                FP32_MULTIPLE * max(max(abs(r[i] - t) for r in refs), FP32_ULP * abs(t))
                for i, t in enumerate(self.ref)
            ]
        else:
            self.ref = run()
            noise = max(_relative(run(split=s), self.ref) for s in (2, 4))
            self.bound = [LOWP_MULTIPLE * noise]

    def ratio(self, got: list[float]) -> float:
        """The run's distance from the reference / the bound (<= 1 passes)."""
        assert len(got) == len(self.ref), (len(got), len(self.ref))
        if self.dtype == "fp32":
            return max(abs(g - t) / b for g, t, b in zip(got, self.ref, self.bound))
        return _relative(got, self.ref) / self.bound[0]

    def check(self, got: list[float], what: str) -> None:
        ratio = self.ratio(got)
        MARGINS.append(Margin(what, ratio, "grad norm per step"))
        assert ratio <= 1, (
            f"{what}: reported norms {got} are {ratio:.3g}x their bound from the plain loop's "
            f"clip_grad_norm_ {self.ref} (see [Note: derived tolerances] in tests/parity.py)"
        )


def _relative(a: list[float], b: list[float]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)) / sum(y * y for y in b))


@functools.lru_cache(maxsize=None)
def norm_bound(dtype: str, gas: int, clip: float) -> NormBound:
    return NormBound(dtype, gas, clip)


def check_norms(name: str, got: dict[str, Any], what: str) -> None:
    sc = SCENARIOS[name]
    bound = norm_bound(sc["dtype"], sc["gas"], sc["clip"])
    bound.check(got["norms"], f"{what} {name}")
    # the path this scenario is about ran: updates during backward from the second step on
    # (the first one learns how many backward passes a step runs; with transient shards they
    # run in backward from the first: [Note: several backward passes per step])
    in_backward = got["in_backward"] if got["transient"] else got["in_backward"][1:]
    assert all(in_backward) == (sc["in_backward"] and not sc["clip"]), got["in_backward"]
    assert not any(got["in_backward"]) or all(in_backward)
    assert got["transient"] or not got["in_backward"][0]
    assert got["transient"] == (name == "fp32 transient shards")
    if sc["clip"]:
        assert max(got["norms"]) > sc["clip"]  # clipping was active
    if sc.get("call"):
        # clip_grad_norm_ returned torch's kind of value: an fp32 tensor of the norm reported
        assert all(t.dtype == torch.float32 and t.dim() == 0 for t in got["returned"])
        assert [float(t) for t in got["returned"]] == [float(torch.tensor(n, dtype=torch.float32))
                                                       for n in got["norms"]]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_norm_of_every_step_is_plain_clip_grad_norm_world_size_1(name):
    check_norms(name, train_reporting(SCENARIOS[name]), "engine")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_norm_bound_catches_the_norm_of_half_a_batch(dtype):
    """Negative control: the norms of the plain loop on half of every batch (as a norm that
    missed one rank's shards or micro-batch would be) land far outside the bound."""
    ratio = norm_bound(dtype, GAS, 0.0).ratio(plain_norms(dtype, GAS, 0.0, half=True))
    assert ratio > (100 if dtype == "fp32" else 10), ratio


def test_clip_grad_norm_trains_like_plain_clipping():
    """engine.clip_grad_norm_ at every boundary trains like the plain loop that calls
    torch.nn.utils.clip_grad_norm_ (the measured fp32 bound of tests/test_engine.py), and
    bit-identically to config.gradient_clipping (the same norm, the same coefficient)."""
    called = train_reporting(SCENARIOS["fp32 engine.clip_grad_norm_"])
    fp32_bound("gpt", GAS, CLIP).check(called["sd"], "engine.clip_grad_norm_")
    config = train_reporting(SCENARIOS["fp32 clipping"])
    assert all(torch.equal(called["sd"][k], config["sd"][k]) for k in called["sd"])
    assert called["norms"] == config["norms"]


# -- world size 2 --------------------------------------------------------------------------------


def _ws2(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: train_reporting(sc, rank, world_size) for name, sc in SCENARIOS.items()}
    out["full_grad"] = {ib: _full_grads(rank, world_size, ib) for ib in (True, False)}
    out["frozen later"] = train_reporting(SCENARIOS["fp32 optimizer in backward"], rank, world_size,
                                          before_forward=_freeze_later)
    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), _config())
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]))  # not a boundary
    try:
        engine.clip_grad_norm_(1.0)
    except RuntimeError as exc:
        out["clip before the boundary"] = str(exc)
    engine.step()
    # The first window's boundary learns how many backward passes a micro-batch runs (its
    # update runs at step()); then the second window's first micro-batch.
    for _ in range(2):
        engine.backward(engine(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]))
        engine.step()
    engine.backward(engine(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]))  # updates in backward
    try:
        engine.clip_grad_norm_(1.0)
    except RuntimeError as exc:
        out["clip after updates in backward"] = str(exc)
    engine.step()
    engine.close()
    return out


@pytest.fixture(scope="module")
def ws2_results():
    return run_distributed(_ws2, 2)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_norm_of_every_step_is_plain_clip_grad_norm_world_size_2(name, ws2_results):
    rank0, rank1 = ws2_results
    check_norms(name, rank0[name], "engine ws2")
    assert rank1[name]["norms"] == rank0[name]["norms"]  # one global norm, on every rank


def test_clip_grad_norm_trains_like_plain_clipping_world_size_2(ws2_results):
    called = ws2_results[0]["fp32 engine.clip_grad_norm_"]
    fp32_bound("gpt", GAS, CLIP).check(called["sd"], "engine ws2 engine.clip_grad_norm_")
    config = ws2_results[0]["fp32 clipping"]
    assert all(torch.equal(called["sd"][k], config["sd"][k]) for k in called["sd"])


def test_clip_grad_norm_refuses_where_it_cannot_clip_world_size_2(ws2_results):
    for rank in ws2_results:
        assert "micro-batch 1 of an accumulation window of 2" in rank["clip before the boundary"]
        msg = rank["clip after updates in backward"]
        assert "already ran during backward" in msg and "gradient_clipping" in msg
        assert "optimizer_in_backward=false" in msg


# -- clip_grad_norm_: refusals ---------------------------------------------------------------------


def test_clip_grad_norm_refusals():
    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), _config())  # optimizer in backward
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="micro-batch 1 of an accumulation window of 2"):
        engine.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        engine.clip_grad_norm_(0.0)
    with pytest.raises(NotImplementedError, match="2-norm"):
        engine.clip_grad_norm_(1.0, norm_type=1.0)
    engine.step()
    # The first boundary learns how many backward passes a micro-batch runs, and whether the
    # user clips: its update runs at step(), so clip_grad_norm_ can clip it, and having been
    # called there, later boundaries update at step() too ([Note: several backward passes per step]).
    engine.backward(engine(x, y))
    assert not engine.policy.updated
    engine.clip_grad_norm_(1.0)
    engine.step()
    engine.backward(engine(x, y))
    engine.step()
    engine.backward(engine(x, y))
    assert not engine.policy.updated  # learned: the user clips
    engine.clip_grad_norm_(1.0)
    engine.step()
    assert engine.global_steps == 2
    engine.close()
    # Transient gradient shards (gas 1, CPU) update during the first backward from the start:
    # clipping after it is refused, with the fix.
    engine = offload.initialize(make_model("gpt"), _config(gas=1))
    engine.backward(engine(x, y))
    assert engine.policy.updated
    with pytest.raises(RuntimeError, match=r"already ran during backward, unclipped.*gradient_clipping="):
        engine.clip_grad_norm_(1.0)
    engine.step()
    engine.close()


def test_torch_clip_grad_norm_over_engine_parameters_raises_with_the_fix():
    """torch's clip_grad_norm_ would find no .grad on the engine's parameters and clip
    nothing; it raises, pointing at engine.clip_grad_norm_ and config.gradient_clipping.
    Other readers of .grad (module.zero_grad, a plain `p.grad is None`) are untouched."""
    torch.manual_seed(0)
    model = make_model("gpt")
    engine = offload.initialize(model, _config(in_backward=False))
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.backward(engine(x, y))  # the window's last micro-batch
    for clip in (lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
                 lambda ps: torch.nn.utils.clip_grad_value_(ps, 1.0)):
        with pytest.raises(RuntimeError, match=r"engine.clip_grad_norm_\(max_norm\).*gradient_clipping"):
            clip(engine.parameters())
        with pytest.raises(RuntimeError, match="offload engine"):
            clip(list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    model.zero_grad()
    assert isinstance(next(model.parameters()), torch.nn.Parameter)
    norm = engine.clip_grad_norm_(1.0)  # the supported way, in the same step
    engine.step()
    assert float(norm) == float(torch.tensor(engine.get_global_grad_norm(), dtype=torch.float32))
    plain = torch.nn.Linear(2, 2)  # a plain model is not affected
    plain(torch.ones(1, 2)).sum().backward()
    assert float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)) > 0
    engine.close()


# -- zero_grad ---------------------------------------------------------------------------------------


def _zero_grad_run(calls: Callable[[Any, int], None], steps: int = 3, skip_first_micro_batch: bool = False,
                   after_step: Callable[[Any], None] = lambda e: None):
    """gas 2, updates at the step; `calls(engine, micro_batch)` runs after each backward,
    `after_step(engine)` after each engine.step()."""
    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), _config(in_backward=False))
    for i, (x, y) in enumerate(gpt_batches(steps * GAS)):
        if not (skip_first_micro_batch and i % GAS == 0):
            engine.backward(engine(x, y))
            calls(engine, i)
        engine.step()
        after_step(engine)
    sd = engine.full_state_dict()
    engine.close()
    return sd


def test_engine_zero_grad_discards_the_window_so_far():
    """engine.zero_grad() after a window's first micro-batch: the step sees only the second
    (bit-identical to a window whose first micro-batch ran no backward); without it, the
    result differs (the negative control)."""
    discarded = _zero_grad_run(lambda e, i: e.zero_grad() if i % GAS == 0 else None)
    without_first = _zero_grad_run(lambda e, i: None, skip_first_micro_batch=True)
    assert all(torch.equal(discarded[k], without_first[k]) for k in discarded)
    whole = _zero_grad_run(lambda e, i: None)
    assert any(not torch.equal(discarded[k], whole[k]) for k in discarded)


def test_optimizer_zero_grad_inside_a_window_keeps_gradients_and_warns_once():
    """A loop written for plain torch calls optimizer.zero_grad() at every micro-batch: the
    gradients are kept (training bit-identical to a loop without the call), one warning
    says so and how to discard on purpose. Called where nothing is held (right after a
    step), and the engine's own clearing at each step: silent."""
    whole = _zero_grad_run(lambda e, i: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = _zero_grad_run(lambda e, i: e.optimizer.zero_grad())
    assert all(torch.equal(kept[k], whole[k]) for k in kept)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "kept, not discarded" in msgs[0] and "engine.zero_grad()" in msgs[0], msgs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the step's own clearing; and zero_grad right after each optimizer step
        silent = _zero_grad_run(
            lambda e, i: None,
            after_step=lambda e: e.optimizer.zero_grad() if e.micro_steps % GAS == 0 else None,
        )
    assert all(torch.equal(silent[k], whole[k]) for k in silent)


def test_engine_zero_grad_after_updates_in_backward_is_refused():
    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), _config(gas=1))
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="cannot be discarded any more"):
        engine.zero_grad()
    engine.step()
    engine.zero_grad()  # after the step: nothing held, nothing to refuse
    engine.close()


# -- full_grad --------------------------------------------------------------------------------------


def _full_grads(rank: int, world_size: int, in_backward: bool) -> dict[str, Any]:
    """engine.full_grad of every parameter at the first boundary (gas 2), by name; plus the
    checks that need an engine on every rank."""
    torch.manual_seed(0)
    model = make_model("gpt")
    engine = offload.initialize(model, _config(in_backward=in_backward))
    names = [n for n, _ in model.named_parameters()]
    out: dict[str, Any] = {"before": engine.full_grad(names[0])}
    for i, (x, y) in enumerate(gpt_batches(GAS)):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        if i < GAS - 1:
            engine.step()  # the window goes on
    out["grads"] = {name: engine.full_grad(name) for name in names}
    p = dict(model.named_parameters())["blocks.1.fc.weight"]
    out["by parameter"] = torch.equal(engine.full_grad(p), out["grads"]["blocks.1.fc.weight"])
    out["compat"] = torch.equal(deepspeed.utils.safe_get_full_grad(p), out["grads"]["blocks.1.fc.weight"])
    engine.step()
    out["after step"] = engine.full_grad(names[0])
    engine.close()
    return out


def plain_grads(dtype: torch.dtype = torch.float32, split: int = 1) -> dict[str, torch.Tensor]:
    """The plain model's .grad after the first window (each loss divided by gas), in
    `dtype`; `split`: every micro-batch in that many chunks."""
    model = make_model("gpt").to(dtype)
    for x, y in gpt_batches(GAS):
        n = x.shape[0] // split
        for s in range(split):
            (model(x[s * n : (s + 1) * n], y[s * n : (s + 1) * n]) / (GAS * split)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def grad_bound() -> Fp32Bound:
    return Fp32Bound(plain_grads(torch.float64),
                     {"fp32": plain_grads(), "batch split in 2": plain_grads(split=2)},
                     truth_name="float64 plain .grad")


def check_full_grads(got: dict[str, Any], what: str) -> None:
    assert got["before"] is None and got["after step"] is None
    assert got["by parameter"] and got["compat"]
    grad_bound().check(got["grads"], what)
    assert all(g.dtype == torch.float32 for g in got["grads"].values())


@pytest.mark.parametrize("in_backward", [True, False])
def test_full_grad_is_the_plain_models_grad_world_size_1(in_backward):
    check_full_grads(_full_grads(0, 1, in_backward), f"full_grad, optimizer in backward {in_backward}")


@pytest.mark.parametrize("in_backward", [True, False])
def test_full_grad_is_the_plain_models_grad_world_size_2(in_backward, ws2_results):
    for rank, res in enumerate(ws2_results):
        check_full_grads(res["full_grad"][in_backward], f"full_grad ws2 rank {rank}, in backward {in_backward}")


def test_full_grad_bound_catches_a_missed_micro_batch():
    """Negative control: the gradient of one micro-batch of the two (divided by gas) is far
    outside the bound."""
    model = make_model("gpt")
    x, y = gpt_batches(1)[0]
    (model(x, y) / GAS).backward()
    ratio, key, _ = grad_bound().worst({n: p.grad for n, p in model.named_parameters()})
    assert ratio > 100, (key, ratio)


def test_full_grad_refusals():
    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), _config(gas=1))  # transient gradient shards
    assert engine.policy.transient_grads
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match=r"consumed by the unit's optimizer update.*optimizer_in_backward=false"):
        engine.full_grad("blocks.0.fc.weight")
    with pytest.raises(KeyError, match="no parameter named 'blocks.0.fc.weigth'"):
        engine.full_grad("blocks.0.fc.weigth")
    with pytest.raises(ValueError, match="not a parameter of this engine"):
        engine.full_grad(torch.nn.Parameter(torch.zeros(3)))
    engine.step()
    engine.close()


# -- changing the model after initialize -------------------------------------------------------------


def _freeze_later(model: torch.nn.Module, micro_batch: int) -> None:
    """From step 3 on (gas 2), two parameters are frozen, one of the root and one of a block."""
    if micro_batch == 3 * GAS:
        model.get_parameter("wpe.weight").requires_grad_(False)
        model.get_parameter("blocks.1.fc.weight").requires_grad_(False)


@functools.lru_cache(maxsize=None)
def frozen_later_bound() -> Fp32Bound:
    return Fp32Bound.measure(lambda **o: reference_train("gpt", gas=GAS, before_forward=_freeze_later, **o))


def test_freezing_after_initialize_trains_like_plain_torch():
    """requires_grad_(False) after initialize: the parameter gets no gradient and the step
    skips it, as torch's AdamW skips a .grad of None (no decay, no moments); negative
    control: the run that never freezes is far outside the bound."""
    got = train_reporting(SCENARIOS["fp32 optimizer in backward"], before_forward=_freeze_later)
    frozen_later_bound().check(got["sd"], "frozen after initialize")
    never = train_reporting(SCENARIOS["fp32 optimizer in backward"])
    ratio, key, _ = frozen_later_bound().worst(never["sd"])
    assert ratio > 100, (key, ratio)


def test_freezing_after_initialize_trains_like_plain_torch_world_size_2(ws2_results):
    frozen_later_bound().check(ws2_results[0]["frozen later"]["sd"], "ws2 frozen after initialize")


def test_unfreezing_a_parameter_frozen_at_initialize_is_refused_by_name():
    torch.manual_seed(0)
    model = make_model("gpt")
    model.get_parameter("blocks.0.fc.bias").requires_grad_(False)
    engine = offload.initialize(model, _config())
    x, y = gpt_batches(1)[0]
    model.get_parameter("blocks.0.fc.bias").requires_grad_(True)
    with torch.no_grad():
        engine(x, y)  # no gradients: nothing to refuse (evaluation, generation)
    with pytest.raises(RuntimeError, match=r"'blocks.0.fc.bias' had requires_grad=False at offload.initialize"):
        engine(x, y)
    model.get_parameter("blocks.0.fc.bias").requires_grad_(False)
    engine.backward(engine(x, y))
    engine.step()
    engine.close()


def test_add_param_group_is_refused_and_initialize_groups_still_work():
    torch.manual_seed(0)
    model = make_model("gpt")
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    engine = offload.initialize(model, _config(), optimizer=groups)
    assert len(engine.optimizer.param_groups) == 2  # torch's __init__ added the engine's groups
    with pytest.raises(ValueError, match=r"never be trained.*offload.initialize\(model, config, optimizer="):
        engine.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1.0})
    assert len(engine.optimizer.param_groups) == 2
    engine.close()

