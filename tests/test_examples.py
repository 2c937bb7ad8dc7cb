"""The examples run, as a user runs them: each as its own process, a few steps on a tiny model.

What each pins: train_gpt.py trains (finite loss, its progress line carries loss, tokens/s
and per-tier memory), with accumulation, clipping, a text file, `--placement auto`, and under
`torchrun` with two processes; a run saved and resumed ends
with exactly the loss of an uninterrupted run; the larger-than-RAM recipe (meta init, both
tiers on NVMe, bf16 with fp32 products) reports its state, I/O and peak RSS against the
planner and fails when over --rss-budget. plain_pytorch_oom.py reports running out of
memory under its address-space limit cleanly (exit 3, the stage, the allocator's message)
and trains when the limit allows. The Hugging Face example trains a Llama and a
GPT-2 built from configs (skipped without transformers). The DeepSpeed user's script runs.

The first hour: resuming with another --steps (another LR schedule) is refused with both
values named; each example's bad --nvme-path ends in one line naming the path (the engine's
check, no traceback, exit 2); every flag of every example has help; progress
(examples/progress.py) is one line per --log-every steps off a terminal and a bar that cuts
no field on one.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import pytest

import offload
from tests.conftest import check_torchrun_exit
from tests.scripts import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "16",
        "--batch", "2", "--device", "cpu"]


def run(script: str, *args: str, launcher: tuple[str, ...] = (), timeout_s: float = 240):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)  # a test run under a launcher must not leak it into the example
    cmd = [sys.executable, *launcher, os.path.join(EXAMPLES, script), *args]
    if launcher:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    else:  # a process of its own, forked from the suite's preloaded server (tests/scripts.py)
        out = run_python(cmd[1:], env=env, cwd=ROOT, timeout=timeout_s)
    if launcher:
        # Complete when the example printed its final summary (every rank finished).
        check_torchrun_exit(out, "done:" in out.stdout, " ".join(cmd))
    else:
        assert out.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out.stdout


def done(stdout: str) -> dict:
    line = [l for l in stdout.splitlines() if l.startswith("done: ")][-1]
    return json.loads(line[len("done: "):])


PROGRESS = re.compile(r"^step (\d+)/(\d+) loss ([0-9.]+) tok/s ([0-9.,]+) "
                      r"mem device \S+MiB host \S+MiB (?:pinned \S+MiB )?nvme \S+MiB lr \S+$", re.M)


def test_train_gpt_trains_and_reports_progress():
    out = run("train_gpt.py", *TINY, "--steps", "3", "--precision", "bf16")
    steps = PROGRESS.findall(out)
    assert [int(s[0]) for s in steps] == [1, 2, 3], out
    assert all(float(s[2]) > 0 for s in steps)
    result = done(out)
    assert result["steps"] == 3 and result["world_size"] == 1
    assert 0 < result["final_loss"] < 10 and result["memory"]["host"] > 0


def test_train_gpt_accumulation_clipping_auto_placement_and_text_file(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("offload trains models larger than memory. " * 20)
    out = run("train_gpt.py", *TINY, "--steps", "2", "--accum", "2", "--clip", "0.5",
              "--precision", "fp32", "--placement", "auto", "--data", str(text), "--init-on-meta")
    result = done(out)
    assert "vocab 256" in out  # bytes of the text file
    assert (result["param_tier"], result["optimizer_tier"]) == ("device", "cpu")  # planner's pick
    assert result["steps"] == 2


def test_train_gpt_under_torchrun_with_two_processes():
    out = run("train_gpt.py", *TINY, "--steps", "2", "--precision", "bf16",
              launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    assert "world size 2" in out
    assert done(out)["world_size"] == 2


def test_train_gpt_resume_continues_exactly(tmp_path):
    common = [*TINY, "--precision", "fp32", "--steps", "4"]
    straight = done(run("train_gpt.py", *common))
    ckpt = str(tmp_path / "ckpt")
    # Interrupted after 2 of 4 steps: the schedule still spans --steps 4.
    run("train_gpt.py", *common, "--stop-after", "2", "--save-dir", ckpt, "--save-every", "2")
    resumed_out = run("train_gpt.py", *common, "--save-dir", ckpt, "--resume")
    resumed = done(resumed_out)
    assert "resumed from" in resumed_out and resumed["start_step"] == 2
    # fp32 on the CPU, same batches (seeded by step), restored weights, moments, step counts
    # and schedule: the same arithmetic, so the same loss to the bit.
    assert resumed["final_loss"] == straight["final_loss"]
    # Another --steps is another LR schedule: refused, naming both values.
    other = _run_failing("train_gpt.py", *TINY, "--precision", "fp32", "--steps", "6",
                         "--save-dir", ckpt, "--resume")
    assert "--steps 4 (this run: 6)" in other, other


def test_train_gpt_larger_than_ram_recipe_reports_state_io_and_peak_rss(tmp_path):
    nvme = tmp_path / "swap"  # created by the script
    args = ["--size", "tiny", "--vocab", "256", "--seq", "16", "--batch", "2", "--device", "cpu",
            "--steps", "2", "--precision", "bf16", "--init-on-meta", "--param-tier", "nvme",
            "--optimizer-tier", "nvme", "--nvme-path", str(nvme), "--pinned-budget", str(8 << 20)]
    out = run("train_gpt.py", *args, "--rss-budget", "4GiB")
    result = done(out)
    assert "GPT 0.12M parameters (2 layers, d_model 64" in out
    assert re.search(r"^training state per rank: .* \(18\.\d B/param\): host", out, re.M), out
    assert re.search(r"NVMe I/O per rank [0-9.]+ GB/step \((2\d|3\d)\.\d B/param", out), out
    assert re.search(r"^peak RSS .*; planner: host .*; budget 4.00 GiB: within$", out, re.M), out
    assert result["planned"]["host"] == result["memory"]["host"]  # the planner's figure, exactly
    assert result["planned"]["nvme"] == result["memory"]["nvme"]
    assert all(b > 0 for b in result["io_bytes_per_step"]) and result["peak_rss_bytes"] > 0
    assert not (nvme / "offload-swap").exists()  # close() removed the swap files
    over = run_python([os.path.join(EXAMPLES, "train_gpt.py"), *args, "--rss-budget", "1MiB"],
                      env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=240)
    assert over.returncode == 3 and "exceeded --rss-budget 1.0 MiB" in over.stderr, over.stderr
    # --ram-budget keeps units in RAM instead of on NVMe: the planner's figures follow.
    kept = done(run("train_gpt.py", *args, "--ram-budget", "300KiB"))
    assert kept["memory"]["nvme"] < result["memory"]["nvme"] and kept["memory"]["host"] > result["memory"]["host"]
    assert kept["planned"]["host"] == kept["memory"]["host"]
    assert kept["planned"]["nvme"] == kept["memory"]["nvme"]
    assert sum(kept["io_bytes_per_step"]) < sum(result["io_bytes_per_step"])


def _plain_pytorch_oom(mem_limit: str) -> subprocess.CompletedProcess:
    """examples/plain_pytorch_oom.py on a 2-layer, d_model 512 GPT under `mem_limit`."""
    cmd = [sys.executable, os.path.join(EXAMPLES, "plain_pytorch_oom.py"), "--layers", "2",
           "--d-model", "512", "--mem-limit", mem_limit, "--steps", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_plain_pytorch_oom_reports_out_of_memory_cleanly():
    # 10.6M parameters: 0.17 GB of plain-PyTorch training state, 96 MiB of address space
    # above what the warmed-up process maps: the allocator fails in backward or the first
    # optimizer step, the script catches it and says where.
    out = _plain_pytorch_oom("+96MiB")
    assert out.returncode == 3, out.stdout + out.stderr
    assert re.search(r"^OUT OF MEMORY at stage 'step 1 (backward|optimizer)", out.stdout, re.M), out.stdout
    assert "can't allocate memory" in out.stdout and "Traceback" not in out.stderr
    assert "build the model (fp32 weights, 4 B/param): ok" in out.stdout


def test_plain_pytorch_oom_trains_when_the_limit_allows():
    out = _plain_pytorch_oom("+2GiB")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the model fits" in out.stdout and re.search(r"^  step 1 loss [0-9.]+$", out.stdout, re.M)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install 'offload[hf]')")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_causal_lm_trains(arch):
    out = run("hf_causal_lm.py", "--arch", arch, "--steps", "3", "--layers", "2", "--hidden", "32",
              "--vocab", "128", "--seq", "16", "--batch", "2")
    losses = [float(m) for m in re.findall(r"^step \d+/3 loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 3 and all(0 < l < 20 for l in losses), out
    assert "units" in out


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install 'offload[hf]')")
def test_hf_trainer_fine_tunes_a_local_checkpoint_resumes_and_saves(tmp_path):
    model, out_dir = str(tmp_path / "llama"), str(tmp_path / "out")
    size = ["--layers", "2", "--hidden", "32", "--intermediate", "64", "--heads", "2", "--kv-heads", "1"]
    run("hf_trainer.py", "--model", model, "--make-model", *size)
    assert os.path.isfile(os.path.join(model, "config.json"))
    common = ["--model", model, "--output-dir", out_dir, "--seq", "32", "--save-steps", "2"]
    first = done(run("hf_trainer.py", *common, "--steps", "4"))
    assert first["steps"] == first["engine_steps"] == 4 and first["last_loss"] < 10, first
    assert sorted(os.listdir(out_dir))[:2] == ["checkpoint-2", "checkpoint-4"]
    # Resume from checkpoint-4 to step 6: the engine's own checkpoint is loaded.
    second = done(run("hf_trainer.py", *common, "--steps", "6", "--resume"))
    assert second["steps"] == second["engine_steps"] == 6, second
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out_dir)
    assert saved.config.num_hidden_layers == 2
    lora = done(run("hf_trainer.py", "--model", model, "--output-dir", str(tmp_path / "lora"),
                    "--seq", "32", "--steps", "2", "--lora"))
    assert lora["steps"] == 2 and os.path.isfile(tmp_path / "lora" / "adapter_model.safetensors")
    # Two processes: every rank reads its slices of the checkpoint, the Trainer's DDP is left out.
    two = done(run("hf_trainer.py", "--model", model, "--output-dir", str(tmp_path / "two"), "--seq", "32",
                   "--steps", "2", "--save-steps", "2",
                   launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")))
    assert two["world_size"] == 2 and two["engine_steps"] == 2
    assert os.path.isfile(tmp_path / "two" / "checkpoint-2" / "latest")


def test_deepspeed_user_script_runs():
    out = run("deepspeed_user.py", "--steps", "2", "--layers", "1", "--d-model", "32", "--seq", "16",
              "--samples", "32")
    assert "train batch size 8 = micro 4 x accumulation 2 x world 1" in out
    assert re.search(r"^step 2 loss [0-9.]+ lr", out, re.M), out


# -- the first hour: errors, help, progress ---------------------------------------------------

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _run_failing(script: str, *args: str) -> str:
    """Run an example that must fail at the door: exit 2, no traceback, and the last line of
    stderr one `error: ...` line; returns that line."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    out = run_python([os.path.join(EXAMPLES, script), *args], env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 2, f"{script} exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), out.stderr
    return last


BAD_NVME = "/proc/offload-test"  # no directory can be created under /proc, even by root


@pytest.mark.parametrize("script,args", [
    ("train_gpt.py", (*TINY, "--param-tier", "nvme")),
    pytest.param("hf_causal_lm.py", ("--param-tier", "nvme"), marks=pytest.mark.skipif(
        not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'offload[hf]')")),
    ("deepspeed_user.py", ()),
])
def test_bad_nvme_path_is_one_line_naming_the_path(script, args):
    line = _run_failing(script, *args, "--nvme-path", BAD_NVME)
    assert f"--nvme-path '{BAD_NVME}'" in line and "point --nvme-path at" in line, line


def flags_without_help(help_text: str) -> list[str]:
    """Options in argparse's --help output that have no help text: an option line with no
    text after its invocation and no indented help line below it."""
    lines = help_text.splitlines()
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if m is None or m.group(2):
            continue
        below = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.match(r"^ {3,}[^ -]", below):
            missing.append(m.group(1))
    return missing


def test_flags_without_help_sees_a_missing_help():
    # Negative control: argparse's own output for a flag with help and one without.
    import argparse

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--with-help", help="something")
    p.add_argument("--without-help-and-a-long-name-here")
    p.add_argument("--bare")
    assert flags_without_help(p.format_help()) == ["--without-help-and-a-long-name-here "
                                                   "WITHOUT_HELP_AND_A_LONG_NAME_HERE",
                                                   "--bare BARE"]


@pytest.mark.parametrize("script", [
    "train_gpt.py",
    pytest.param("hf_causal_lm.py", marks=pytest.mark.skipif(
        not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'offload[hf]')")),
    pytest.param("hf_trainer.py", marks=pytest.mark.skipif(
        not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'offload[hf]')")),
    "deepspeed_user.py",
    "plain_pytorch_oom.py",
])
def test_every_flag_has_help(script):
    out = run(script, "--help", timeout_s=60)
    assert out.count("\n  -") >= 5, out  # the option list was read
    assert flags_without_help(out) == [], out


def _progress(**kw):
    sys.path.insert(0, EXAMPLES)
    try:
        from progress import Progress  # examples/progress.py
    finally:
        sys.path.remove(EXAMPLES)
    return Progress(**kw)


FIELDS = ["loss 4.1234", "tok/s 12,345", "mem device 0.0MiB host 18.2MiB nvme 0.0MiB",
          "lr 3.00e-04"]


def test_progress_off_a_terminal_is_one_line_per_n_steps():
    buf = io.StringIO()
    progress = _progress(total=5, every=2, file=buf)
    assert progress.bar is None  # StringIO is not a terminal
    for step in range(1, 6):
        progress.update(step, FIELDS)
    progress.close()
    assert buf.getvalue().splitlines() == [  # steps 2, 4 and the last; no carriage returns
        f"step {n}/5 " + " ".join(FIELDS) for n in (2, 4, 5)]


@pytest.mark.parametrize("ncols", [200, 60])
def test_progress_bar_on_a_terminal_cuts_no_field(ncols):
    buf = io.StringIO()
    progress = _progress(total=3, every=3, file=buf, terminal=True, ncols=ncols)
    for step in range(1, 4):
        progress.update(step, FIELDS)
    progress.close()
    screens = [s for s in re.split(r"[\r\n]", buf.getvalue()) if s.strip()]
    bars = [s for s in screens if "|" in s and "<" in s]
    assert bars and all(len(s) <= ncols for s in bars), screens
    final = bars[-1]
    assert final.startswith("step 3/3 ")
    shown = [f for f in FIELDS if f in final]
    assert shown == FIELDS[:len(shown)] and shown, final  # whole fields, most important first
    for f in FIELDS:  # no field appears cut: each token of it present or the field absent
        assert f in final or f.split()[0] + " " not in final, final
    if len(shown) < len(FIELDS):  # what did not fit came out in full above the bar
        assert "step 3/3 " + " ".join(FIELDS) in screens, screens


# -- interruptions and checkpoint retention (issue #36) ------------------------------------------


def _standalone_env(**extra: str) -> dict:
    """os.environ without any launcher's variables (an earlier test in this process may have
    left torchrun's, or DeepSpeed's init_distributed its own), for a one-process example."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "GROUP_RANK", "ROLE_RANK", "OFFLOAD_DEBUG") and not k.startswith("TORCHELASTIC_")}
    return {**env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **extra}


def _default_signals() -> None:
    """In the child: SIGINT and SIGTERM at their defaults, whatever this process had."""
    import signal as signals

    signals.signal(signals.SIGINT, signals.SIG_DFL)
    signals.signal(signals.SIGTERM, signals.SIG_DFL)


@pytest.mark.parametrize("sig,status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_train_gpt_interrupted_ends_with_one_line(tmp_path, sig, status):
    """Ctrl-C (or a scheduler's SIGTERM) mid-run: one line naming the step, the cleanup and
    the last complete checkpoint with how to resume; the signal's exit status; no traceback;
    the swap files gone."""
    import signal as signals

    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    env = _standalone_env()
    cmd = [sys.executable, os.path.join(EXAMPLES, "train_gpt.py"), *TINY, "--steps", "100000",
           "--param-tier", "nvme", "--optimizer-tier", "nvme", "--nvme-path", str(swap),
           "--pinned-budget", "4MiB", "--save-dir", str(ckpt), "--save-every", "2", "--keep-last", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=_default_signals)
    saves = 0
    for line in proc.stdout:  # off a terminal: a line per step, one per save
        saves += line.startswith("saved ")
        if saves == 2:
            break
    proc.send_signal(getattr(signals, sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.match(rf"interrupted \({sig}\) after \d+ of 100000 steps: engine closed, swap files removed; "
                    rf"last complete checkpoint {re.escape(str(ckpt))}/global_step\d+; resume with the same "
                    r"command plus --resume$", last), last
    assert not [f for _, _, fs in os.walk(swap) for f in fs], "swap files left behind"
    tags = [t for t in os.listdir(ckpt) if t.startswith("global_step")]
    # --keep-last 1: one complete checkpoint, or two when the signal landed between a save
    # and the removal of the one before (removal only after the new one is complete)
    assert 1 <= len(tags) <= 2, tags


def test_train_gpt_interrupted_with_debug_shows_the_traceback(tmp_path):
    import signal as signals

    env = _standalone_env(OFFLOAD_DEBUG="1")
    cmd = [sys.executable, os.path.join(EXAMPLES, "train_gpt.py"), *TINY, "--steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=_default_signals)
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(signals.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Traceback" in err and "KeyboardInterrupt" in err
    assert err.strip().splitlines()[-1].endswith("no checkpoints (--save-dir DIR --save-every N keeps progress)")


def test_keep_last_prunes_only_complete_older_checkpoints(tmp_path):
    """`prune` keeps the newest N complete checkpoints and always the one `latest` names; a
    save in progress (a temporary directory) is not its business."""
    from offload.checkpoint import files
    from offload.checkpoint.retention import prune

    for i, tag in enumerate(["global_step1", "global_step2", "global_step3"]):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / files.MANIFEST).write_text("{}")
        os.utime(tmp_path / tag / files.MANIFEST, (1000 + i, 1000 + i))
    (tmp_path / ".tmp-global_step4-ab").mkdir()  # a save in progress
    (tmp_path / "latest").write_text("global_step1")  # (an older one marked latest: kept)
    assert prune(str(tmp_path), 1) == ["global_step2"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-global_step4-ab", "global_step1", "global_step3", "latest"]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune(str(tmp_path), 0)


def test_an_unused_nvme_path_is_named(tmp_path):
    """--nvme-path with every tier in memory was silently ignored (issue #36)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    out = run_python([os.path.join(EXAMPLES, "train_gpt.py"), *TINY, "--steps", "1",
                      "--nvme-path", str(tmp_path / "swap")], env=env, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr
    assert f"note: --nvme-path {tmp_path / 'swap'} is not used: no tier is on NVMe" in out.stderr
    assert not (tmp_path / "swap").exists()


def test_examples_fork_from_the_preloaded_server_after_deepspeed_was_imported():
    """`import deepspeed` sets PYTORCH_NVML_BASED_CUDA_CHECK for the rest of the process; the
    suite's forks must not take that for an import-time setting and fall back to fresh
    interpreters for every later test ([Note: scripts forked from the preloaded server]).
    Judged from the server's own environment, not os.environ, so what earlier tests set
    cannot decide it ([Note: each test's environment] keeps them from leaking anyway)."""
    from tests.conftest import forkserver_env_diff, server_environment

    nvml = "PYTORCH_NVML_BASED_CUDA_CHECK"
    without = {k: v for k, v in server_environment().items() if k != nvml}
    # the server took its environment with or without it: both must fork
    for env in (without, {**without, nvml: "1"}):
        differ = forkserver_env_diff(env)
        assert not differ, f"these names differ from the preloaded server's environment: {differ}"
    # an import-time one does not fork, and is named
    isa = "sse" if without.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    assert forkserver_env_diff({**without, "ATEN_CPU_CAPABILITY": isa}) == ["ATEN_CPU_CAPABILITY"]


def test_a_test_that_sets_an_environment_variable_leaves_it_to_itself():
    """[Note: each test's environment]: what a test sets, changes or removes in os.environ
    is put back after it (the autouse fixture in tests/conftest.py calls this)."""
    from tests.conftest import restore_environment

    before = dict(os.environ)
    name = "OFFLOAD_TEST_LEAK_PROBE"
    assert name not in before
    os.environ[name] = "1"
    removed = next(iter(k for k in sorted(before) if k not in ("PATH", "PYTEST_CURRENT_TEST")), None)
    if removed is not None:
        del os.environ[removed]
    changed = restore_environment(before)
    assert name in changed and name not in os.environ
    if removed is not None:
        assert removed in changed and os.environ[removed] == before[removed]
    assert dict(os.environ) == before
