"""The native Lion and Adagrad steps: kernels against each other, the definitions and torch.

Between our kernels (scalar reference, portable, AVX2, AVX-512) and thread counts results
must be equal bit for bit: csrc/optim/one_state_math.h is written once and instantiated per
ISA, with every FMA explicit and contraction off. Against torch (Adagrad) and the float64
definition (Lion) the tolerance is measured in the test, as tests/parity.py does: the
distance of torch's own fp32 computation from the float64 truth, times FP32_MULTIPLE.
"""

from __future__ import annotations

import pytest
import torch

from offload.optim import (
    adagrad_step_flat,
    adagrad_step_flat_reference,
    lion_step_flat,
    lion_step_flat_reference,
    supported_isas,
)
from tests.parity import FP32_MULTIPLE, FP32_ULP

SIZES = [0, 1, 7, 15, 16, 17, 31, 33, 1000, 4099]
ALL_ISAS = ["scalar", "portable", "avx2", "avx512"]
LION = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
ADAGRAD = dict(lr=1e-2, lr_decay=1e-2, weight_decay=0.1, eps=1e-10)


def isa_param(isa: str):
    """An ISA as a test parameter, skipped with the reason where this CPU lacks it."""
    marks = []
    if isa not in supported_isas():
        marks.append(pytest.mark.skip(reason=f"this CPU does not support the {isa} kernel"))
    return pytest.param(isa, marks=marks, id=isa)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns, so that comparisons are exact (and -0.0 != 0.0)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.numel()} elements differ, first at {diff[0].item()}: "
        f"{a.view(-1)[diff[0]].item()!r} vs {b.view(-1)[diff[0]].item()!r}"
    )


def step(opt: str, master, grad, state, t: int, **kw) -> None:
    """Step `t` (1-based) of the native `opt` ('lion' or 'adagrad')."""
    if opt == "lion":
        lion_step_flat(master, grad, state, step=t, **{**LION, **kw})
    else:
        adagrad_step_flat(master, grad, state, step=t, **{**ADAGRAD, **kw})


# --- our kernels against each other ----------------------------------------------------------

COMBOS = [
    # (grad dtype, state dtype, out dtype, weight decay): every dtype, and Adagrad with and
    # without its L2 term (two code paths; Lion has one).
    (torch.float32, torch.float32, None, 0.1),
    (torch.float32, torch.float32, None, 0.0),
    (torch.bfloat16, torch.float32, torch.bfloat16, 0.1),
    (torch.float16, torch.float32, torch.float16, 0.0),
    (torch.float32, torch.bfloat16, torch.bfloat16, 0.1),
    (torch.bfloat16, torch.bfloat16, torch.float16, 0.0),
    (torch.float16, torch.bfloat16, None, 0.1),
]


def run_kernel(opt, isa, combo, n, *, threads=None, steps=3):
    grad_dtype, state_dtype, out_dtype, wd = combo
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    # A state from a plausible earlier step, not zeros, so step 1 is not a special case;
    # Lion's momentum straddles 0 (sign near 0 is where kernels could disagree).
    state = (0.1 * torch.randn(n, generator=gen)).to(state_dtype)
    if opt == "adagrad":
        state = state.abs()
    out = torch.empty(n, dtype=out_dtype) if out_dtype else None
    for t in range(1, steps + 1):
        step(opt, master, grad, state, t, weight_decay=wd, grad_scale=0.75, out_lowp=out,
             isa=isa, threads=threads)
    return [x for x in (master, state, out) if x is not None]


def combo_id(c) -> str:
    return "-".join(str(x).replace("torch.", "") for x in c)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS if i != "scalar"])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize("opt", ["lion", "adagrad"])
def test_simd_kernels_equal_scalar_bit_for_bit(opt, combo, isa, threads):
    for n in SIZES:  # every tail length of the 2 x 8 and 2 x 16 lane loops
        expected = run_kernel(opt, "scalar", combo, n, threads=1)
        got = run_kernel(opt, isa, combo, n, threads=threads)
        for name, a, b in zip(["master", "state", "out"], got, expected):
            assert_bitwise_equal(a, b, f"{opt} {isa} vs scalar, n={n}, {name}")


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[5]], ids=["fp32", "lowp"])
@pytest.mark.parametrize("opt", ["lion", "adagrad"])
def test_thread_count_does_not_change_results(opt, combo):
    n = 3_000_017  # several chunks per thread, and a ragged last one
    single = run_kernel(opt, None, combo, n, threads=1, steps=2)
    for threads in (2, 3):
        multi = run_kernel(opt, None, combo, n, threads=threads, steps=2)
        for a, b in zip(multi, single):
            assert_bitwise_equal(a, b, f"{opt}, {threads} threads vs 1")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS])
@pytest.mark.parametrize("opt", ["lion", "adagrad"])
def test_lowp_out_is_the_updated_master_rounded(opt, isa, out_dtype):
    # The copy-out of the same pass must be exactly torch's round-to-nearest-even of the
    # fp32 result (the conversions are adam_math.h's, tested exhaustively in test_adam.py).
    master, _, out = run_kernel(opt, isa, (torch.float32, torch.float32, out_dtype, 0.1), 4099)
    assert_bitwise_equal(out, master.to(out_dtype), f"{opt} {isa} {out_dtype} output")


@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS])
def test_lion_sign_of_zero_and_nan_is_zero(isa):
    # sign(0) = 0 (and sign(NaN) = 0, as torch.sign on the CPU): a zero momentum with a zero
    # or NaN gradient leaves only the decay, p * (1 - lr * wd), in every kernel's lanes and
    # its scalar tail (37 elements: two AVX-512 vectors and a tail).
    n = 37
    master = torch.randn(n, generator=torch.Generator().manual_seed(9))
    grad = torch.zeros(n)
    grad[::3] = float("nan")
    grad[1::5] = -0.0
    m = torch.zeros(n)
    expected = master * (1.0 - LION["lr"] * LION["weight_decay"])
    lion_step_flat(master, grad, m, isa=isa, **LION)
    assert_bitwise_equal(master, expected, "master after a zero update")
    assert torch.equal(torch.isnan(m), torch.isnan(grad)), "a NaN gradient must reach the momentum"


# --- against the definitions and torch -------------------------------------------------------


def _trajectory(n: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    return master, grads


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _bound(noise: float, truth: torch.Tensor) -> float:
    return FP32_MULTIPLE * max(noise, FP32_ULP * float(truth.abs().max()))


def _lion_runs(swap_betas: bool = False):
    """Lion over 10 steps: the float64 truth, torch's fp32 (the reference's ops), ours."""
    n, steps, grad_scale = 100_003, 10, 0.5
    master, grads = _trajectory(n, steps, seed=11)
    m0 = 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(12))
    truth = [master.double(), m0.double()]
    ref = [master.clone(), m0.clone()]
    ours = [master.clone(), m0.clone()]
    b1, b2 = LION["beta1"], LION["beta2"]
    ours_hyper = {**LION, "beta1": b2, "beta2": b1} if swap_betas else LION
    c_truth, c_noise = [], 0.0
    for g in grads:
        # The interpolation sign() sees, in float64 and as torch computes it in fp32.
        c64 = truth[1] * b1 + (1 - b1) * (g.double() * grad_scale)
        c32 = ref[1].mul(b1).add(g * grad_scale, alpha=1 - b1)
        c_noise = max(c_noise, _max_abs(c32, c64))
        c_truth.append(c64.abs())
        lion_step_flat_reference(truth[0], g, truth[1], grad_scale=grad_scale, **LION)
        lion_step_flat_reference(ref[0], g, ref[1], grad_scale=grad_scale, **LION)
        lion_step_flat(ours[0], g, ours[1], grad_scale=grad_scale, isa="scalar", **ours_hyper)
    # Where |c| is within the fp32 noise of 0 at some step, fp32 and float64 may take
    # opposite signs there: an lr-sized step each way (2 lr apart), legitimately.
    near_zero = torch.zeros(n, dtype=torch.bool)
    for c in c_truth:
        near_zero |= c <= FP32_MULTIPLE * c_noise
    return truth, ref, ours, near_zero, steps


def test_lion_matches_the_float64_definition_within_torchs_fp32_noise():
    truth, ref, ours, near_zero, steps = _lion_runs()
    assert int(near_zero.sum()) <= truth[0].numel() // 1000, "the sign exemption must stay rare"
    far = ~near_zero
    # Lion's momentum never sees p: its error is fp32 rounding alone.
    bound_m = _bound(_max_abs(ref[1], truth[1]), truth[1])
    assert _max_abs(ours[1], truth[1]) <= bound_m
    bound_p = _bound(_max_abs(ref[0][far], truth[0][far]), truth[0])
    assert _max_abs(ours[0][far], truth[0][far]) <= bound_p
    if near_zero.any():
        assert _max_abs(ours[0][near_zero], truth[0][near_zero]) <= bound_p + 2 * LION["lr"] * steps


def test_lion_negative_control_swapped_betas_is_far_outside_the_bound():
    truth, ref, ours, near_zero, _ = _lion_runs(swap_betas=True)
    far = ~near_zero
    bound_p = _bound(_max_abs(ref[0][far], truth[0][far]), truth[0])
    assert _max_abs(ours[0][far], truth[0][far]) > 100 * bound_p


def _adagrad_runs(ours_lr_decay: float):
    """Adagrad over 10 steps: torch.optim.Adagrad in float64 (the truth) and fp32 (for-loop
    and fused: the noise), and ours (scalar kernel) with grad_scale = 0.5 where torch gets
    the gradient halved (exact: a power of two)."""
    n, steps, grad_scale = 100_003, 10, 0.5
    master, grads = _trajectory(n, steps, seed=13)
    init = 0.1
    hyper = dict(lr=ADAGRAD["lr"], lr_decay=ADAGRAD["lr_decay"],
                 weight_decay=ADAGRAD["weight_decay"], eps=ADAGRAD["eps"],
                 initial_accumulator_value=init)
    runs = {}
    for name, dtype, kw in [("truth", torch.float64, {"foreach": False}),
                            ("torch for-loop", torch.float32, {"foreach": False}),
                            ("torch fused", torch.float32, {"fused": True})]:
        p = torch.nn.Parameter(master.to(dtype, copy=True))  # never master itself
        opt = torch.optim.Adagrad([p], **hyper, **kw)
        for g in grads:
            p.grad = (g * grad_scale).to(dtype)
            opt.step()
        runs[name] = (p.detach(), opt.state[p]["sum"])
    p, s = master.clone(), torch.full((n,), init)
    for t, g in enumerate(grads, start=1):
        adagrad_step_flat(p, g, s, step=t, grad_scale=grad_scale, isa="scalar",
                          **{**ADAGRAD, "lr_decay": ours_lr_decay})
    truth = runs.pop("truth")
    bounds = [_bound(max(_max_abs(r[k], truth[k]) for r in runs.values()), truth[k]) for k in (0, 1)]
    return (p, s), truth, bounds


def test_adagrad_matches_torch_within_its_fp32_noise():
    ours, truth, bounds = _adagrad_runs(ADAGRAD["lr_decay"])
    for k, name in enumerate(["master", "sum"]):
        err = _max_abs(ours[k], truth[k])
        assert err <= bounds[k], f"{name}: |ours - float64 torch| = {err:.3g} > bound {bounds[k]:.3g}"


def test_adagrad_negative_control_without_lr_decay_is_far_outside_the_bound():
    ours, truth, bounds = _adagrad_runs(0.0)
    assert _max_abs(ours[0], truth[0]) > 100 * bounds[0]


def test_adagrad_reference_is_torchs_update_bit_for_bit():
    # The Python reference is the definition the docstrings cite: torch.optim.Adagrad's own
    # single-tensor arithmetic, op for op.
    n, init = 4099, 0.1
    master, grads = _trajectory(n, 4, seed=14)
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.Adagrad([p], lr=ADAGRAD["lr"], lr_decay=ADAGRAD["lr_decay"],
                              weight_decay=ADAGRAD["weight_decay"], eps=ADAGRAD["eps"],
                              initial_accumulator_value=init, foreach=False)
    ref_p, ref_s = master.clone(), torch.full((n,), init)
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        adagrad_step_flat_reference(ref_p, g, ref_s, step=t, **ADAGRAD)
    assert_bitwise_equal(ref_p, p.detach(), "reference vs torch.optim.Adagrad, master")
    assert_bitwise_equal(ref_s, opt.state[p]["sum"], "reference vs torch.optim.Adagrad, sum")


@pytest.mark.parametrize("opt", ["lion", "adagrad"])
def test_bf16_state_matches_the_reference_within_one_bf16_rounding(opt):
    # Both sides compute in fp32 and round the state to bf16; where their fp32 values
    # differ in the last bit (Adagrad's fused sum) a bf16 rounding may go the other way:
    # one bf16 ulp, 2^-8 relative. Lion's fp32 arithmetic is the reference's, so equal.
    n = 50_001
    gen = torch.Generator().manual_seed(15)
    master, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    state = (0.1 * torch.randn(n, generator=gen)).abs().to(torch.bfloat16)
    ours, ref = [master.clone(), state.clone()], [master.clone(), state.clone()]
    step(opt, ours[0], grad, ours[1], 1)
    if opt == "lion":
        lion_step_flat_reference(ref[0], grad, ref[1], **LION)
    else:
        adagrad_step_flat_reference(ref[0], grad, ref[1], step=1, **ADAGRAD)
    assert ours[1].dtype == torch.bfloat16
    torch.testing.assert_close(ours[1].float(), ref[1].float(), rtol=2**-8, atol=0)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-6)


# --- errors ----------------------------------------------------------------------------------


def _call(opt, *tensors, **kw):
    t = list(tensors) if tensors else [torch.zeros(8), torch.zeros(8), torch.zeros(8)]
    step(opt, *t, kw.pop("t", 1), **kw)


@pytest.mark.parametrize("opt,state", [("lion", "exp_avg"), ("adagrad", "state_sum")])
def test_bad_tensors_raise_naming_the_argument(opt, state):
    p, g, s = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="master is not contiguous"):
        _call(opt, torch.zeros(16)[::2], g, s)
    with pytest.raises(ValueError, match=f"{state} is not contiguous"):
        _call(opt, p, g, torch.zeros(16)[::2])
    with pytest.raises(TypeError, match="master has dtype torch.float64"):
        _call(opt, torch.zeros(8, dtype=torch.float64), g, s)
    with pytest.raises(TypeError, match="grad has dtype torch.int32"):
        _call(opt, p, torch.zeros(8, dtype=torch.int32), s)
    with pytest.raises(TypeError, match=f"{state} has dtype torch.float16"):
        _call(opt, p, g, torch.zeros(8, dtype=torch.float16))
    with pytest.raises(ValueError, match=f"{state} has 9 elements but master has 8"):
        _call(opt, p, g, torch.zeros(9))
    with pytest.raises(ValueError, match="grad has 7 elements but master has 8"):
        _call(opt, p, torch.zeros(7), s)
    with pytest.raises(TypeError, match="out_lowp has dtype torch.float32"):
        _call(opt, p, g, s, out_lowp=torch.zeros(8))
    with pytest.raises(ValueError, match="out_lowp has 7 elements"):
        _call(opt, p, g, s, out_lowp=torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="grad is on meta"):
        _call(opt, p, torch.zeros(8, device="meta"), s)
    with pytest.raises(TypeError, match=f"{state} must be a torch.Tensor"):
        _call(opt, p, g, [0.0] * 8)
    buf = torch.zeros(12)
    with pytest.raises(ValueError, match=f"master and {state} share memory"):
        _call(opt, buf[:8], g, buf[4:12])
    with pytest.raises(TypeError, match="master has dtype torch.float64"):  # checked when empty too
        _call(opt, torch.zeros(0, dtype=torch.float64), torch.zeros(0), torch.zeros(0))


@pytest.mark.parametrize("opt", ["lion", "adagrad"])
def test_bad_hyperparameters_raise_naming_them(opt):
    with pytest.raises(ValueError, match=r"lr=-1 is invalid"):
        _call(opt, lr=-1.0)
    with pytest.raises(ValueError, match=r"weight_decay=nan is invalid"):
        _call(opt, weight_decay=float("nan"))
    with pytest.raises(ValueError, match=r"grad_scale=inf is invalid"):
        _call(opt, grad_scale=float("inf"))
    with pytest.raises(ValueError, match=r"step=0 must be >= 1"):
        _call(opt, t=0)
    with pytest.raises(ValueError, match=r"isa='sse9' is not a kernel name"):
        _call(opt, isa="sse9")
    with pytest.raises(ValueError, match=r"threads=0 must be an int >= 1"):
        _call(opt, threads=0)
    if opt == "lion":
        with pytest.raises(ValueError, match=r"beta1=1 is invalid"):
            _call(opt, beta1=1.0)
        with pytest.raises(ValueError, match=r"beta2=-0.5 is invalid"):
            _call(opt, beta2=-0.5)
    else:
        with pytest.raises(ValueError, match=r"lr_decay=-1 is invalid"):
            _call(opt, lr_decay=-1.0)
        with pytest.raises(ValueError, match=r"eps=nan is invalid"):
            _call(opt, eps=float("nan"))


@pytest.mark.parametrize("opt,name", [("lion", "Lion"), ("adagrad", "Adagrad")])
def test_forcing_an_unsupported_isa_says_which_one_runs_here(opt, name):
    missing = [i for i in ALL_ISAS if i not in supported_isas()]
    if not missing:
        pytest.skip("this CPU supports every kernel, so none can be refused here")
    with pytest.raises(ValueError, match=f"the '{missing[0]}' {name} kernel cannot run on this CPU"):
        _call(opt, isa=missing[0])


@pytest.mark.parametrize("opt", ["lion", "adagrad"])
def test_offload_adam_isa_forces_these_kernels_too(opt, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ADAM_ISA", "sse9")
    with pytest.raises(ValueError, match=r"OFFLOAD_ADAM_ISA='sse9' is not an Adam kernel"):
        _call(opt)
    monkeypatch.setenv("OFFLOAD_ADAM_ISA", "scalar")
    _call(opt)  # the forced kernel runs (results equal any other kernel's, tested above)
