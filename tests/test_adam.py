"""The CPU Adam: native kernels against torch's optimizers, the torch reference and each other.

[Note: tolerances] Against torch.optim.AdamW / Adam the native step is *not* bit-exact,
on purpose: it evaluates the update in one pass with FMA (m = fma(1-b1, g-m, m),
v = fma((1-b2)*g, g, b2*v), d = fma(sqrt(v), 1/sqrt(bc2), eps), p = fma(-step, m/d, p);
csrc/adam/adam_math.h), while torch rounds after every op (sqrt(v)/sqrt(bc2) + eps,
addcdiv's (value*m)/d). Each step can therefore land one or two fp32 ulps away, and those
differences persist in p as absolute errors of a few ulp(|p|) ~ 1e-7 for |p| ~ 1 (they do
not compound: m and v never see p, except through Adam's L2 term, which is scaled by wd).
Hence rtol=1e-6 with atol=1e-6 for parameters of order 1 (randn), 100+ steps. Between our
own kernels (scalar, portable, AVX2, AVX-512) and thread counts the results must be equal
bit for bit: same operations, same order, correctly rounded IEEE ops everywhere.
"""

from __future__ import annotations

import io
import os
import threading

import pytest
import torch

from offload.optim import (
    CPUAdam,
    adam_isa,
    adam_step_flat,
    adam_step_flat_reference,
    get_num_threads,
    set_num_threads,
    supported_isas,
)

SIZES = [1, 7, 15, 16, 17, 31, 33, 1000, 4099]
ALL_ISAS = ["scalar", "portable", "avx2", "avx512"]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


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


def make_state(n, *, grad_dtype=torch.float32, moment_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    # Moments from a plausible earlier state, not zeros, so step 1 is not a special case.
    exp_avg = (0.1 * torch.randn(n, generator=gen)).to(moment_dtype)
    exp_avg_sq = (0.01 * torch.rand(n, generator=gen)).to(moment_dtype)
    return master, grad, exp_avg, exp_avg_sq


def clone_all(ts):
    return [t.clone() for t in ts]


# --- against torch.optim.AdamW / torch.optim.Adam --------------------------------------


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_cpu_adam_matches_torch_over_120_steps_with_scheduler(decoupled, weight_decay):
    torch.manual_seed(1)
    shapes = [(1,), (7,), (15,), (17,), (3, 11), (1000003,)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(params):  # two groups with their own lr and weight decay
        return [
            {"params": params[:3]},
            {"params": params[3:], "lr": 3e-3, "weight_decay": weight_decay / 2},
        ]

    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = CPUAdam(groups(ours), lr=1e-2, weight_decay=weight_decay, decoupled_weight_decay=decoupled)
    ref = torch_cls(groups(theirs), lr=1e-2, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 5e-3], total_steps=120)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=[2e-2, 5e-3], total_steps=120)
    for _ in range(120):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    # See [Note: tolerances].
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        sa, sb = opt.state[a], ref.state[b]
        assert sa["step"].dtype == torch.float32 and sa["step"].item() == sb["step"].item() == 120
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_cpu_adam_maximize_matches_torch():
    torch.manual_seed(2)
    a = torch.nn.Parameter(torch.randn(1001))
    b = torch.nn.Parameter(a.detach().clone())
    opt = CPUAdam([a], lr=1e-2, maximize=True)
    ref = torch.optim.AdamW([b], lr=1e-2, maximize=True)
    for _ in range(20):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_flat_step_matches_reference_with_changing_hyperparameters():
    master, grad, m, v = make_state(100003)
    ours = clone_all([master, m, v])
    ref = clone_all([master, m, v])
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 101):
        g = torch.randn(grad.shape, generator=gen)
        # lr, betas, weight decay and the gradient scale all move, as schedulers may.
        hyper = dict(
            step=step,
            lr=1e-2 * (1 + step % 7) / 7,
            beta1=0.9 - 0.001 * (step % 5),
            beta2=0.999 - 0.0001 * (step % 3),
            eps=1e-8,
            weight_decay=0.01 * (step % 2),
            grad_scale=0.5 + (step % 4) * 0.25,
        )
        adam_step_flat(ours[0], g, ours[1], ours[2], **hyper)
        adam_step_flat_reference(ref[0], g, ref[1], ref[2], **hyper)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # [Note: tolerances]


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_grads_match_reference(grad_dtype):
    master, grad, m, v = make_state(50001, grad_dtype=grad_dtype)
    ours, ref = clone_all([master, m, v]), clone_all([master, m, v])
    for step in range(1, 11):
        kw = dict(step=step, weight_decay=0.01, grad_scale=0.25, **HYPER)
        adam_step_flat(ours[0], grad, ours[1], ours[2], **kw)
        adam_step_flat_reference(ref[0], grad, ref[1], ref[2], **kw)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # [Note: tolerances]


def test_bf16_moments_match_reference():
    # Both sides round m and v to bf16 (nearest even) after every step. Where the fp32
    # values differ in their last bit (see [Note: tolerances]) a bf16 rounding can go the
    # other way: one bf16 ulp, 2^-8 relative, which then feeds the next steps. Hence
    # rtol=2^-7 for moments, and for p (moved by lr * m/d per step, m/d off by < 1 %) an
    # absolute tolerance of 10 steps * lr * 1 %.
    master, grad, m, v = make_state(50001, moment_dtype=torch.bfloat16)
    ours, ref = clone_all([master, m, v]), clone_all([master, m, v])
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 11):
        g = torch.randn(master.shape, generator=gen)
        kw = dict(step=step, weight_decay=0.01, **HYPER)
        adam_step_flat(ours[0], g, ours[1], ours[2], **kw)
        adam_step_flat_reference(ref[0], g, ref[1], ref[2], **kw)
    assert ours[1].dtype == torch.bfloat16
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=10 * HYPER["lr"] * 0.01)
    for a, b in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)


def test_grad_scale_equals_scaling_the_gradient_first():
    master, grad, m, v = make_state(4099)
    a, b = clone_all([master, m, v]), clone_all([master, m, v])
    adam_step_flat(a[0], grad, a[1], a[2], step=3, weight_decay=0.1, grad_scale=0.125, **HYPER)
    adam_step_flat(b[0], grad * 0.125, b[1], b[2], step=3, weight_decay=0.1, **HYPER)
    for x, y in zip(a, b):
        assert_bitwise_equal(x, y, "grad_scale")


# --- low-precision output ----------------------------------------------------------------


def special_values() -> torch.Tensor:
    """fp32 values that probe the bf16/fp16 rounding: ties, overflow, subnormals, NaN."""
    gen = torch.Generator().manual_seed(5)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int64)
    values = [
        random_bits.to(torch.int32).view(torch.float32),  # every class, incl. NaN payloads
        torch.randn(20000, generator=gen),
        torch.randn(20000, generator=gen) * 1e-6,  # fp16 subnormal range
        torch.randn(20000, generator=gen) * 3e4,  # near fp16's largest finite value
        torch.tensor(
            [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"),
             65504.0, 65519.99, 65520.0, -65520.0, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
             2.0**-25 * 1.0000001, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11,
             1.0 + 3 * 2.0**-11, 3.4028235e38, 1e-45]
        ),
    ]
    # Exact ties for bf16: the lower 16 bits exactly 0x8000, upper halves odd and even.
    ties = torch.arange(0x3F800000, 0x3F800000 + 2 * 0x10000 * 64, 0x10000, dtype=torch.int64)
    values.append((ties + 0x8000).to(torch.int32).view(torch.float32))
    return torch.cat(values)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS])
def test_lowp_out_equals_torch_rounding_of_master(isa, out_dtype):
    # lr = 0 and no weight decay leave master exactly as it was, so the output must be
    # exactly torch's own round-to-nearest-even conversion of these probing values.
    master = special_values()
    n = master.numel()
    before = master.clone()
    out = torch.empty(n, dtype=out_dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    adam_step_flat(master, torch.ones(n), m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999,
                   eps=1e-8, weight_decay=0.0, out_lowp=out, isa=isa)
    nan = torch.isnan(master)
    assert torch.equal(nan, torch.isnan(before))  # arithmetic may quiet a signalling NaN
    assert_bitwise_equal(master[~nan], before[~nan], "master with lr=0")
    expected = master.to(out_dtype)
    assert torch.isnan(out[nan]).all(), "NaN must stay NaN"
    assert_bitwise_equal(out[~nan], expected[~nan], f"{out_dtype} output")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lowp_out_equals_rounding_the_fp32_result(out_dtype):
    master, grad, m, v = make_state(100003)
    out = torch.empty(master.numel(), dtype=out_dtype)
    adam_step_flat(master, grad, m, v, step=7, weight_decay=0.01, out_lowp=out, **HYPER)
    assert_bitwise_equal(out, master.to(out_dtype), f"{out_dtype} output")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS])
def test_every_lowp_gradient_value_converts_exactly(isa, grad_dtype):
    # With beta1 = 0 and zero moments the new exp_avg is exactly grad * 1.0: every one of
    # the 65536 bf16/fp16 bit patterns must arrive as torch's own conversion to fp32.
    grad = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = grad.numel()
    m, v = torch.zeros(n), torch.zeros(n)
    adam_step_flat(torch.zeros(n), grad, m, v, step=1, lr=0.0, beta1=0.0, beta2=0.999,
                   eps=1e-8, weight_decay=0.0, isa=isa)
    expected = grad.float()
    nan = torch.isnan(expected)
    assert torch.isnan(m[nan]).all()
    # fma(1, -0 - 0, +0) is +0: the sign of a zero gradient does not survive, its value does.
    zero = expected == 0
    assert (m[zero] == 0).all()
    keep = ~nan & ~zero
    assert_bitwise_equal(m[keep], expected[keep], f"{grad_dtype} gradients")


# --- our kernels against each other ------------------------------------------------------

COMBOS = [
    # (grad dtype, moment dtype, out dtype, decoupled weight decay)
    (torch.float32, torch.float32, None, True),
    (torch.float32, torch.float32, None, False),
    (torch.bfloat16, torch.float32, torch.bfloat16, True),
    (torch.float16, torch.float32, torch.float16, False),
    (torch.float32, torch.bfloat16, torch.bfloat16, True),
    (torch.bfloat16, torch.bfloat16, torch.float16, False),
    (torch.float16, torch.bfloat16, None, True),
]


def run_kernel(isa, combo, n, *, threads=None, steps=3):
    grad_dtype, moment_dtype, out_dtype, decoupled = combo
    master, grad, m, v = make_state(n, grad_dtype=grad_dtype, moment_dtype=moment_dtype, seed=n)
    out = torch.empty(n, dtype=out_dtype) if out_dtype else None
    for step in range(1, steps + 1):
        adam_step_flat(master, grad, m, v, step=step, weight_decay=0.02,
                       decoupled_weight_decay=decoupled, grad_scale=0.75, out_lowp=out,
                       isa=isa, threads=threads, **HYPER)
    return [t for t in (master, m, v, out) if t is not None]


@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS if i != "scalar"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_simd_kernels_equal_scalar_bit_for_bit(isa, combo):
    for n in SIZES:
        expected = run_kernel("scalar", combo, n)
        got = run_kernel(isa, combo, n)
        for name, a, b in zip(["master", "exp_avg", "exp_avg_sq", "out"], got, expected):
            assert_bitwise_equal(a, b, f"{isa} vs scalar, n={n}, {name}")


def test_auto_isa_is_the_widest_supported():
    isas = supported_isas()
    assert {"scalar", "portable"} <= set(isas)
    widest = "avx512" if "avx512" in isas else "avx2" if "avx2" in isas else "portable"
    # OFFLOAD_ADAM_ISA forces a path (the suite is run so on purpose, docs/testing.md)
    assert adam_isa() == (os.environ.get("OFFLOAD_ADAM_ISA") or widest)


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[5]], ids=["fp32", "lowp"])
def test_thread_count_does_not_change_results(combo):
    n = 3_000_017  # several chunks per thread, and a ragged last one
    single = run_kernel(None, combo, n, threads=1, steps=2)
    for threads in (2, 3, 8):
        multi = run_kernel(None, combo, n, threads=threads, steps=2)
        for a, b in zip(multi, single):
            assert_bitwise_equal(a, b, f"{threads} threads vs 1")


def test_default_thread_count_and_setter():
    before = get_num_threads()
    assert before >= 1
    try:
        set_num_threads(3)
        assert get_num_threads() == 3
        with pytest.raises(ValueError, match="threads=0 must be an int >= 1"):
            set_num_threads(0)
    finally:
        set_num_threads(before)


def test_concurrent_callers_share_the_pool_safely():
    # The engine may step several partitions from different Python threads; the GIL is
    # released, so the calls really overlap in the pool's submit queue.
    combo = COMBOS[0]
    expected = run_kernel(None, combo, 400_003, steps=2)
    results, errors = [None] * 4, []

    def worker(i):
        try:
            results[i] = run_kernel(None, combo, 400_003, threads=2, steps=2)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for r in results:
        for a, b in zip(r, expected):
            assert_bitwise_equal(a, b, "concurrent call")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_can_step_after_parent_started_the_pool(tmp_path):
    # After fork() the child has none of the parent's pool threads; the pool must notice
    # (pthread_atfork) and start afresh instead of waiting forever for workers that do
    # not exist. The child calls nothing in torch but data_ptr(): torch's own OpenMP
    # runtime is not fork-safe once the parent used it, which is not what this tests.
    n = 200_003
    master, grad, m, v = make_state(n)
    run_kernel(None, COMBOS[0], n, threads=2, steps=1)  # the parent's pool is running
    expected = clone_all([master, m, v])
    adam_step_flat(*expected[:1], grad, *expected[1:], step=1, weight_decay=0.0, threads=1, **HYPER)
    out_file = tmp_path / "child_master.bin"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            adam_step_flat(master, grad, m, v, step=1, weight_decay=0.0, threads=2, **HYPER)
            master.numpy().tofile(str(out_file))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    got = torch.from_numpy(__import__("numpy").fromfile(str(out_file), dtype="float32"))
    assert_bitwise_equal(got, expected[0], "master updated in the forked child")


@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS])
def test_empty_buffers_are_a_no_op(isa):
    # Zero-length views inside live buffers: a kernel that touched even one element (a
    # vector tail computed for n = 0) would change the bytes around them.
    flat = torch.randn(4 * 64)
    grad = torch.randn(64)
    before, grad_before = flat.clone(), grad.clone()
    for at in (0, 17, 64):  # at a buffer's start, mid-vector, at an aligned boundary
        master, m, v = flat[at:at], flat[64 + at : 64 + at], flat[128 + at : 128 + at]
        adam_step_flat(master, grad[at:at], m, v, step=1, weight_decay=0.1, isa=isa, **HYPER)
    assert_bitwise_equal(flat, before, "buffers around the empty views")
    assert_bitwise_equal(grad, grad_before, "gradient around the empty views")
    # an empty call still checks its arguments
    with pytest.raises(TypeError, match="master"):
        e = torch.empty(0, dtype=torch.float64)
        adam_step_flat(e, torch.empty(0), torch.empty(0), torch.empty(0), step=1, weight_decay=0.0, **HYPER)


def test_views_into_a_larger_buffer_update_only_their_range():
    flat = torch.randn(4 * 1000)
    grad_flat = torch.randn(1000)
    before = flat.clone()
    master, m, v = flat[10:1000], flat[1000:1990], flat[2000:2990]
    adam_step_flat(master, grad_flat[10:], m, v, step=1, weight_decay=0.0, **HYPER)
    assert torch.equal(flat[:10], before[:10])
    assert torch.equal(flat[1990:2000], before[1990:2000])
    assert torch.equal(flat[2990:], before[2990:])
    assert not torch.equal(master, before[10:1000])


# --- state_dict compatibility ------------------------------------------------------------


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("direction", ["ours->torch", "torch->ours"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_state_dict_moves_between_cpu_adam_and_torch(direction, decoupled):
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch.manual_seed(6)
    start = [torch.randn(33), torch.randn(5, 7)]

    def fresh(cls, **kw):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        return params, cls(params, lr=5e-3, weight_decay=0.02, **kw)

    def make_ours():
        return fresh(CPUAdam, decoupled_weight_decay=decoupled)

    def make_torch():
        return fresh(torch_cls)

    first_make, second_make = (make_ours, make_torch) if direction == "ours->torch" else (make_torch, make_ours)
    # Phase 1 on the first optimizer, then its checkpoint continues on the second; a
    # control run of the second kind does all steps itself.
    params_a, opt_a = first_make()
    _train(opt_a, params_a, 5, seed=7)
    state = _roundtrip(opt_a.state_dict())
    params_b, opt_b = second_make()
    with torch.no_grad():
        for pb, pa in zip(params_b, params_a):
            pb.copy_(pa)
    opt_b.load_state_dict(state)
    _train(opt_b, params_b, 5, seed=8)

    params_c, opt_c = make_torch()
    _train(opt_c, params_c, 5, seed=7)
    _train(opt_c, params_c, 5, seed=8)
    for pb, pc in zip(params_b, params_c):
        torch.testing.assert_close(pb, pc, rtol=1e-6, atol=1e-6)  # [Note: tolerances]

    # The checkpoint is torch's own format, key for key and type for type.
    ours = (opt_b if direction == "torch->ours" else opt_a).state_dict()
    theirs = opt_c.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for k, s in ours["state"].items():
        t = theirs["state"][k]
        assert s.keys() == t.keys()
        for key in s:
            assert type(s[key]) is type(t[key]) and s[key].dtype == t[key].dtype
            assert s[key].shape == t[key].shape


def test_state_dict_group_keys_are_torchs():
    p = torch.nn.Parameter(torch.zeros(3))
    ours = CPUAdam([p]).state_dict()["param_groups"][0]
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]).state_dict()["param_groups"][0]
    assert list(ours) == list(theirs)
    assert ours == theirs


# --- errors ------------------------------------------------------------------------------


def _flat_args(n=8):
    return [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)]


def _step(*tensors, **kw):
    args = dict(step=1, weight_decay=0.0, **HYPER)
    args.update(kw)
    adam_step_flat(*tensors, **args)


def test_flat_step_rejects_bad_tensors_with_clear_errors():
    p, g, m, v = _flat_args()
    with pytest.raises(ValueError, match="master is not contiguous"):
        _step(torch.zeros(16)[::2], g, m, v)
    with pytest.raises(ValueError, match="grad is on meta"):
        _step(p, torch.zeros(8, device="meta"), m, v)
    with pytest.raises(TypeError, match="master has dtype torch.float64"):
        _step(torch.zeros(8, dtype=torch.float64), g, m, v)
    with pytest.raises(TypeError, match="exp_avg has dtype torch.float16"):
        _step(p, g, torch.zeros(8, dtype=torch.float16), v)
    with pytest.raises(TypeError, match="exp_avg is torch.bfloat16 but exp_avg_sq is torch.float32"):
        _step(p, g, torch.zeros(8, dtype=torch.bfloat16), v)
    with pytest.raises(ValueError, match="grad has 9 elements but master has 8"):
        _step(p, torch.zeros(9), m, v)
    with pytest.raises(TypeError, match="out_lowp has dtype torch.float32"):
        _step(p, g, m, v, out_lowp=torch.zeros(8))
    with pytest.raises(ValueError, match="out_lowp has 7 elements"):
        _step(p, g, m, v, out_lowp=torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="layout torch.sparse_coo"):
        _step(p, torch.zeros(8).to_sparse(), m, v)
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        _step(p, [0.0] * 8, m, v)
    buf = torch.zeros(12)
    with pytest.raises(ValueError, match="share memory"):
        _step(buf[:8], g, buf[4:12], v)
    with pytest.raises(ValueError, match="share memory"):
        _step(p, g, m, m)


def test_flat_step_rejects_bad_hyperparameters():
    p, g, m, v = _flat_args()
    with pytest.raises(ValueError, match=r"step=0 must be >= 1"):
        _step(p, g, m, v, step=0)
    with pytest.raises(ValueError, match=r"step=1.5 must be a whole number"):
        _step(p, g, m, v, step=1.5)
    with pytest.raises(ValueError, match=r"beta1=1 is invalid"):
        _step(p, g, m, v, beta1=1.0)
    with pytest.raises(ValueError, match=r"lr=-1 is invalid"):
        _step(p, g, m, v, lr=-1.0)
    with pytest.raises(ValueError, match=r"grad_scale=inf is invalid"):
        _step(p, g, m, v, grad_scale=float("inf"))
    with pytest.raises(ValueError, match=r"isa='sse9' is not a kernel name"):
        _step(p, g, m, v, isa="sse9")
    with pytest.raises(ValueError, match=r"threads=0 must be an int >= 1"):
        _step(p, g, m, v, threads=0)


def test_forcing_an_unsupported_isa_says_which_one_runs_here(monkeypatch):
    missing = [i for i in ALL_ISAS if i not in supported_isas()]
    if not missing:
        pytest.skip("this CPU supports every Adam kernel, so none can be refused here")
    with pytest.raises(ValueError, match=f"the '{missing[0]}' Adam kernel cannot run on this CPU"):
        _step(*_flat_args(), isa=missing[0])
    monkeypatch.setenv("OFFLOAD_ADAM_ISA", missing[0])
    with pytest.raises(ValueError, match=f"cannot run the {missing[0]} Adam kernel; it runs"):
        adam_isa()


def test_cpu_adam_rejects_unsupported_parameters():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], lr=-1.0)
    cases = [
        (torch.zeros(4, 4).t(), ValueError, "not contiguous"),
        (torch.zeros(4, dtype=torch.bfloat16), TypeError, "dense fp32 parameters"),
        (torch.zeros(4, dtype=torch.complex64), TypeError, "dense fp32 parameters"),
        (torch.zeros(4, device="meta"), ValueError, "on meta"),
    ]
    for data, exc, msg in cases:
        p = torch.nn.Parameter(data)
        p.grad = torch.zeros_like(data)
        with pytest.raises(exc, match=msg):
            CPUAdam([p]).step()
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(TypeError, match="SparseAdam"):
        CPUAdam([p]).step()


def test_cpu_adam_refuses_amsgrad_from_a_loaded_checkpoint():
    p = torch.nn.Parameter(torch.zeros(4))
    state = torch.optim.Adam([torch.nn.Parameter(torch.zeros(4))], amsgrad=True).state_dict()
    opt = CPUAdam([p])
    opt.load_state_dict(state)
    p.grad = torch.ones(4)
    with pytest.raises(NotImplementedError, match="amsgrad=True"):
        opt.step()


def test_cpu_adam_accepts_non_contiguous_gradients():
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(a.detach().clone())
    grad = torch.randn(5, 6).t()
    a.grad, b.grad = grad, grad.contiguous()
    CPUAdam([a]).step()
    torch.optim.AdamW([b]).step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- forcing the kernel for the whole process (OFFLOAD_ADAM_ISA) --------------------------------


@pytest.mark.parametrize("isa", [isa_param(i) for i in ALL_ISAS])
def test_offload_adam_isa_forces_the_default_kernel(isa, monkeypatch):
    p, g, m, v = make_state(4099)
    want = [t.clone() for t in (p, m, v)]
    adam_step_flat(*want[:1], g, *want[1:], step=3, weight_decay=0.1, isa=isa, **HYPER)
    monkeypatch.setenv("OFFLOAD_ADAM_ISA", isa)
    assert adam_isa() == isa
    adam_step_flat(p, g, m, v, step=3, weight_decay=0.1, **HYPER)  # isa=None: the forced one
    for got, exp, name in zip((p, m, v), want, ("master", "exp_avg", "exp_avg_sq")):
        assert_bitwise_equal(got, exp, name)


def test_offload_adam_isa_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("OFFLOAD_ADAM_ISA", "sse9")
    with pytest.raises(ValueError, match=r"OFFLOAD_ADAM_ISA='sse9' is not an Adam kernel"):
        adam_isa()
    with pytest.raises(ValueError, match=r"OFFLOAD_ADAM_ISA='sse9'"):
        adam_step_flat(*make_state(8), step=1, weight_decay=0.0, **HYPER)
    monkeypatch.delenv("OFFLOAD_ADAM_ISA")
    best = adam_isa()
    assert best in supported_isas() and best != "scalar"
    monkeypatch.setenv("OFFLOAD_ADAM_ISA", "AUTO")  # 'auto', any case: the best, as unset
    assert adam_isa() == best


def test_large_steps_take_the_prefetch_and_streamed_copy_out_paths_bit_for_bit():
    """Steps of >= 4M elements run the kernels' large-step loop (software prefetch, streamed
    bf16/fp16 copy-out: [Note: large steps] in csrc/adam/kernels.h): equal to the scalar kernel
    for every dtype combination, ISA, thread count, an unaligned output, and special values
    (ties, NaN payloads, subnormals, overflow) through the streamed copy-out and bf16 moments."""
    n = (1 << 22) + 1057

    def run(isa, combo, threads, misalign):
        gd, md, od, dec = combo
        master, grad, m, v = make_state(n, grad_dtype=gd, moment_dtype=md, seed=7)
        out = (torch.empty(n + 1, dtype=od)[1:] if misalign else torch.empty(n, dtype=od)) if od else None
        for step in (1, 2):
            adam_step_flat(master, grad, m, v, step=step, weight_decay=0.02, decoupled_weight_decay=dec,
                           grad_scale=0.75, out_lowp=out, isa=isa, threads=threads, **HYPER)
        return [t for t in (master, m, v, out) if t is not None]

    isas = [i for i in ("avx512", "avx2", "portable") if i in supported_isas()]
    for combo in COMBOS:
        want = run("scalar", combo, 1, False)
        for isa in isas:
            for threads in (1, 2):
                for misalign in ((False, True) if combo[2] is not None else (False,)):
                    for name, a, b in zip(["master", "m", "v", "out"], run(isa, combo, threads, misalign), want):
                        assert_bitwise_equal(a, b, f"{isa} {combo} threads={threads} misalign={misalign} {name}")
    sv = special_values()
    base = sv.repeat(-(-n // sv.numel()))[:n].contiguous()
    for od in (torch.bfloat16, torch.float16):
        outs = {}
        for isa in ["scalar", *isas]:
            out = torch.empty(n, dtype=od)
            adam_step_flat(base.clone(), torch.ones(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0,
                           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, out_lowp=out, isa=isa,
                           threads=2)
            outs[isa] = out.view(torch.int16)
        for isa in isas:
            assert torch.equal(outs[isa], outs["scalar"]), (isa, od)
    for isa in isas:
        res = []
        for k in ("scalar", isa):
            master = torch.randn(n, generator=torch.Generator().manual_seed(3))
            m, v = base.to(torch.bfloat16), base.abs().to(torch.bfloat16)
            adam_step_flat(master, base.clone(), m, v, step=2, weight_decay=0.01, isa=k, threads=2, **HYPER)
            res.append((master.view(torch.int32), m.view(torch.int16), v.view(torch.int16)))
        for a, b in zip(*res):
            assert torch.equal(a, b), isa
