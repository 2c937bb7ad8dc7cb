"""`offload.compat.deepspeed`: a DeepSpeed script, switched by its import, trains exactly as
`offload.initialize` with the same config.

The DeepSpeed-style path and the direct path run the same engine on the same data, so
parameters must be bit-identical (torch.equal): any difference means the wrapper changed
the config, the param groups, the schedule, the batches or the accumulation.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import offload
import offload.compat.deepspeed as deepspeed
from offload.config import load_config
from tests.conftest import TinyGPT, gpt_batches

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu"}},
}


@pytest.fixture(scope="module")
def ds_user():
    sys.path.insert(0, EXAMPLES)
    try:
        import deepspeed_user
        import train_gpt

        yield deepspeed_user, train_gpt
    finally:
        sys.path.remove(EXAMPLES)


def test_deepspeed_user_example_computes_in_fp32_on_a_cpu_and_bf16_on_a_gpu(ds_user):
    # Its built-in config once enabled bf16 everywhere: on a CPU without AMX that is tens of
    # times slower than fp32, against the README's advice.
    deepspeed_user, _ = ds_user
    cfg = load_config(deepspeed_user.ds_config(deepspeed_user.get_args([])))
    assert cfg.precision.dtype == ("bf16" if torch.cuda.is_available() else "fp32")


def test_deepspeed_script_trains_like_offload_initialize(ds_user):
    deepspeed_user, train_gpt = ds_user
    argv = ["--steps", "3", "--layers", "2", "--d-model", "32", "--vocab", "64", "--seq", "16",
            "--samples", "64"]
    ds_engine = deepspeed_user.main(argv)
    got = ds_engine.engine.full_state_dict()
    assert ds_engine.global_steps == 3 and ds_engine.global_samples == 3 * 8
    ds_engine.destroy()

    # The same run through offload.initialize: the example's DeepSpeed config, its model and
    # dataset, and DeepSpeed's batching (DistributedSampler: a seed-0 permutation per epoch).
    args = deepspeed_user.get_args(argv)
    cfg = load_config(deepspeed_user.DS_CONFIG)
    torch.manual_seed(0)
    model = train_gpt.GPT(args.vocab, args.d_model, args.layers, n_head=4, seq=args.seq, qkv_bias=True)
    engine = offload.initialize(model, cfg)
    data = deepspeed_user.make_dataset(args)
    micro = cfg.train_micro_batch_size_per_gpu
    epoch = 0
    while engine.global_steps < 3:
        # (the script never calls set_epoch, like most DeepSpeed scripts: epoch 0's order)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
        for i in range(0, len(order), micro):
            x, y = data[order[i : i + micro]]
            engine.backward(engine(x, y))
            engine.step()
            if engine.global_steps >= 3:
                break
        epoch += 1
    want = engine.full_state_dict()
    engine.close()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _gpt_and_data():
    torch.manual_seed(0)
    return TinyGPT(), gpt_batches(4, batch=4)


def _train(engine, batches):
    for x, y in batches:
        engine.backward(engine(x, y))
        engine.step()
    return engine.full_state_dict()


def test_initialize_returns_deepspeeds_four_values():
    model, _ = _gpt_and_data()
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (20, 16)))
    engine, optimizer, loader, sched = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=data,
        config={**DS, "dataloader_drop_last": True,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    assert optimizer is engine.optimizer is engine.engine.optimizer
    assert sched is engine.lr_scheduler and sched is not None
    assert loader.batch_size == 4 and len(loader) == 5  # 20 samples, drop_last
    assert engine.train_batch_size() == 8 and engine.gradient_accumulation_steps() == 2
    assert engine.train_micro_batch_size_per_gpu() == 4 and engine.zero_optimization_stage() == 3
    assert engine.global_rank == 0 and engine.world_size == 1 and engine.local_rank == 0
    assert engine.module is model and not engine.bfloat16_enabled()
    assert engine.lm_head is model.lm_head  # other attributes fall through to the model
    engine.destroy()


def test_client_optimizer_and_its_scheduler_drive_the_engine():
    def build(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)

    # The config has no optimizer section: the client optimizer's hyperparameters rule.
    cfg = {k: v for k, v in DS.items() if k != "optimizer"} | {"gradient_accumulation_steps": 1}
    model, batches = _gpt_and_data()
    ref_model = copy.deepcopy(model)
    opt, sched = build(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        engine, optimizer, _, lr_scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
        got = _train(engine, batches)
    assert lr_scheduler is sched and sched.optimizer is engine.optimizer
    assert engine.get_lr() == [1e-3 * 0.5 ** 4]
    ref_opt, _ = build(ref_model)
    ref = offload.initialize(ref_model, load_config(cfg), optimizer=ref_opt,
                             lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s))
    want = _train(ref, batches)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    engine.destroy()
    ref.close()


def test_callable_optimizer_and_scale_wrt_gas_false():
    model, batches = _gpt_and_data()
    ref_model = copy.deepcopy(model)
    cfg = {k: v for k, v in DS.items() if k != "optimizer"}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), config=cfg)
    for x, y in batches:
        engine.backward(engine(x, y), scale_wrt_gas=False)  # sum over micro-batches
        engine.step()
    got = engine.engine.full_state_dict()
    ref = offload.initialize(ref_model, load_config(cfg), optimizer=torch.optim.AdamW(ref_model.parameters(), lr=3e-3))
    for x, y in batches:
        ref.backward(ref(x, y) * 2)  # accumulation 2: the engine divides by 2 at the step
        ref.step()
    want = ref.full_state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    engine.destroy()
    ref.close()


def test_config_from_args_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    model, _ = _gpt_and_data()
    engine, *_ = deepspeed.initialize(args=args, model=model)
    assert engine.gradient_clipping() == 1.0 and engine.optimizer.param_groups[0]["lr"] == 2e-3
    engine.destroy()
    with pytest.raises(ValueError, match="both as args.deepspeed_config and as initialize"):
        deepspeed.initialize(args=args, model=TinyGPT(), config=DS)
    with pytest.raises(ValueError, match="--deepspeed_config"):
        deepspeed.initialize(model=TinyGPT())


def test_unsupported_arguments_are_named():
    with pytest.raises(NotImplementedError, match=r"mpu=\.\.\..*drop mpu"):
        deepspeed.initialize(model=TinyGPT(), config=DS, mpu=object())
    with deepspeed.zero.GatheredParameters([]):  # no engine's parameters: a no-op, as in DeepSpeed
        pass
    engine, *_ = deepspeed.initialize(model=TinyGPT(), config=DS)
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(NotImplementedError, match="lr_kwargs"):
        engine.step(lr_kwargs={"increment": 1})
    with pytest.raises(NotImplementedError, match=r"backward\(allreduce_gradients=\.\.\.\)"):
        engine.backward(engine(x, y), allreduce_gradients=False)
    engine.destroy()


def test_zero_init_builds_on_meta_like_a_plain_construction():
    torch.manual_seed(0)
    plain = TinyGPT().state_dict()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=DS):
        model = TinyGPT()
    assert all(p.is_meta for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=DS)
    built = engine.engine.full_state_dict()
    for k in plain:
        assert torch.equal(built[k], plain[k]), k
    engine.destroy()


def test_checkpoints_go_to_the_engine(tmp_path):
    model, batches = _gpt_and_data()
    engine, *_ = deepspeed.initialize(model=model, config=DS)
    _train(engine, batches[:2])
    engine.save_checkpoint(tmp_path, tag=7, client_state={"epoch": 3})  # DeepSpeed allows int tags
    before = engine.engine.full_state_dict()
    _train(engine, batches[2:])
    path, client = engine.load_checkpoint(str(tmp_path))
    assert client["epoch"] == 3 and os.path.basename(path) == "7"
    after = engine.engine.full_state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    with pytest.raises(NotImplementedError, match=r"load_checkpoint\(load_module_strict=False\) is not supported"):
        engine.load_checkpoint(str(tmp_path), load_module_strict=False)
    with pytest.raises(NotImplementedError, match=r"save_checkpoint\(save_latest=False\) is not supported"):
        engine.save_checkpoint(str(tmp_path), save_latest=False)
    engine.save_16bit_model(str(tmp_path / "weights"))
    saved = torch.load(tmp_path / "weights" / "pytorch_model.bin")
    assert saved.keys() == engine.engine.full_state_dict().keys()
    engine.destroy()


PEER_MULTIPLE = 32.0
"""For a peer's own optimizer arithmetic. Measured (DeepSpeed 0.19.8, 3 steps): torch's two
AdamWs and offload on other kernels all land within 1.2e-9 of offload on ln_f.bias (a tensor
of scale 3e-3 with small gradients), DeepSpeed's CPU Adam 1.0e-8 from it: 9x the measured
noise, a systematic difference in how it rounds the update, not noise of this machine. So a
peer gets 32x (the suite's 8x for its own runs, times 4). A wrong run (a lost micro-batch, a wrong scale) is O(lr) = 1e-3 away: 1e4x further."""


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_same_script_under_real_deepspeed_trains_to_the_same_parameters(tmp_path):
    """examples/deepspeed_user.py as written (offload.compat) and with its import line changed
    back to `import deepspeed` (DeepSpeed ZeRO-3 with parameters and optimizer offloaded to
    the CPU): the same parameters, within a bound measured in this test.

    DeepSpeed updates with torch's AdamW (`"torch_adam": true`, a DeepSpeed optimizer key,
    which offload's translation reports as an implementation choice): the comparison is of
    ZeRO-3's partitioning, offload, accumulation and clipping, and it needs no native build.
    DeepSpeed's own CPU Adam kernel is a speed peer (benchmarks/bench_adam.py) whose JIT
    build took 60 of this test's 80 s in a fresh clone.

    fp32, 3 optimizer steps. Both compute the same gradients up to summation order. The noise
    floor is measured per tensor as the largest distance from offload's run of: offload when
    torch and MKL take other CPUs' code paths (ATEN_CPU_CAPABILITY=default; =avx2 with
    MKL_CBWR=COMPATIBLE), and the same training in plain torch with its for-loop and its
    fused AdamW (other roundings of the forward, backward and optimizer arithmetic);
    DeepSpeed must land within PEER_MULTIPLE x of it (tests/parity.py, [Note: derived
    tolerances]). That covers the qkv bias, whose key third has a true gradient of 0 and so
    moves by lr-sized steps of rounding noise in any implementation: the measured noise
    carries the same amplification."""
    src = open(os.path.join(EXAMPLES, "deepspeed_user.py")).read()
    line = "import offload.compat.deepspeed as deepspeed  # was: import deepspeed"
    assert line in src  # the switch is this one line
    (tmp_path / "real_ds_user.py").write_text(src.replace(line, "import deepspeed"))
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"},
                              "stage3_gather_16bit_weights_on_model_save": True}}))
    root = os.path.dirname(EXAMPLES)
    args = ["--steps", "3", "--layers", "2", "--d-model", "32", "--vocab", "64", "--seq", "16",
            "--samples", "64", "--deepspeed_config", str(ds_json)]
    weights = {}
    offload_script = os.path.join(EXAMPLES, "deepspeed_user.py")
    runs = {}
    # The four runs are independent processes of one thread each: started together, they
    # share the machine's cores instead of running in series.
    for name, script, extra_env in (
        ("deepspeed", str(tmp_path / "real_ds_user.py"), {}),
        ("offload", offload_script, {}),
        ("offload-default-kernels", offload_script, {"ATEN_CPU_CAPABILITY": "default"}),
        ("offload-avx2-kernels", offload_script, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}),
    ):
        from tests.conftest import free_port

        # DeepSpeed's init_distributed wants a launcher's environment (else MPI discovery).
        env = {**os.environ, "PYTHONPATH": EXAMPLES + os.pathsep + root, "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **extra_env}
        runs[name] = subprocess.Popen([sys.executable, script, *args, "--save-model", str(tmp_path / name)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=str(tmp_path))
    try:
        for name, proc in runs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{name}:\n{out}\n{err[-4000:]}"
            weights[name] = torch.load(tmp_path / name / "pytorch_model.bin")
    finally:
        for proc in runs.values():  # ours, started above: none outlives a failure
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    from tests.parity import Fp32Bound, plain_loop

    # The same training in plain torch (the script's model, data order, accumulation and
    # clipping): torch's for-loop and fused AdamW are two more realisations, of the
    # optimizer's arithmetic this time.
    sys.path.insert(0, EXAMPLES)
    try:
        import deepspeed_user
        import train_gpt
    finally:
        sys.path.remove(EXAMPLES)
    ns = deepspeed_user.get_args(args[:-2])
    data = deepspeed_user.make_dataset(ns)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [data[order[i : i + 4]] for i in range(0, 6 * 4, 4)]  # 3 steps x 2 micro-batches

    def gpt():
        torch.manual_seed(0)
        return train_gpt.GPT(ns.vocab, ns.d_model, ns.layers, n_head=4, seq=ns.seq, qkv_bias=True)

    def plain(fused: bool):
        return plain_loop(gpt, batches, lr=1e-3, weight_decay=0.1, gas=2, clip=1.0, fused=fused)

    ours = weights["offload"]
    assert ours.keys() == weights["deepspeed"].keys()
    bound = Fp32Bound(ours, {
        "offload on torch's default (non-SIMD) CPU kernels": weights["offload-default-kernels"],
        "offload on torch's AVX2 kernels and MKL's compatible GEMMs": weights["offload-avx2-kernels"],
        "plain torch, for-loop AdamW": plain(False),
        "plain torch, fused AdamW": plain(True),
    }, multiple=PEER_MULTIPLE, truth_name="offload")
    bound.check(weights["deepspeed"], "DeepSpeed ZeRO-3")


LR_SCHEDULES = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}},
    {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
                                    "warmup_type": "linear"}},
    {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
                                         "total_num_steps": 6}},
]

LR_SCRIPT = r"""
import json, logging, os, sys
import torch
if sys.argv[1] == "deepspeed":
    import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
else:
    import offload.compat.deepspeed as deepspeed
deepspeed.init_distributed(dist_backend="gloo")
out = []
for sched in json.loads(sys.argv[2]):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = {"lr": 1e-3}
    if sys.argv[1] == "deepspeed":
        opt["torch_adam"] = True  # no native build: the schedule is what is compared
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": opt}, "scheduler": sched,
           "zero_optimization": {"stage": 0 if sys.argv[1] == "deepspeed" else 3}}
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    seen = [[float(x) for x in engine.get_lr()]]
    for _ in range(10):  # 5 optimizer steps of 2 micro-batches
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
        seen.append([float(x) for x in engine.get_lr()] + [float(x) for x in scheduler.get_last_lr()]
                    + [engine.global_steps])
    out.append(seen)
print("LR " + json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_get_lr_per_micro_batch_under_accumulation_matches_real_deepspeed(tmp_path):
    """engine.get_lr() and the scheduler's get_last_lr() after each micro-batch's step(), under
    gradient accumulation 2, for DeepSpeed's warmup schedules: what real DeepSpeed prints,
    value for value (the rate of the update just taken, which changes on the micro-batch
    after each boundary), and the step counter with them."""
    from tests.conftest import free_port

    script = tmp_path / "lr.py"
    script.write_text(LR_SCRIPT)
    got = {}
    for side in ("deepspeed", "offload"):
        env = {**os.environ, "PYTHONPATH": os.path.dirname(EXAMPLES), "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        run = subprocess.run([sys.executable, str(script), side, json.dumps(LR_SCHEDULES)], capture_output=True,
                             text=True, timeout=600, env=env, cwd=str(tmp_path))
        assert run.returncode == 0, run.stdout + run.stderr
        got[side] = json.loads(next(l for l in run.stdout.splitlines() if l.startswith("LR "))[3:])
    for sched, ds, ours in zip(LR_SCHEDULES, got["deepspeed"], got["offload"]):
        assert len(ours) == len(ds) and all(o == pytest.approx(d, rel=1e-12, abs=0) for o, d in zip(ours, ds)), (
            f"{sched}:\nDeepSpeed {ds}\noffload   {ours}")
    # negative control: the schedules move (a constant rate would match anything constant)
    assert len({tuple(s[0:1]) for s in got["deepspeed"][0]}) >= 3


def test_zero_optimization_stage_is_the_configured_stage():
    """It said 3 whatever the config said (issue #33)."""
    for stage in (1, 2, 3):
        model, _ = _gpt_and_data()
        zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
        cfg = {**DS, "zero_optimization": zero}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        assert engine.zero_optimization_stage() == stage
        engine.engine.close()
