"""A rank that stops answering ends the others' wait with a clear error (issue #34).

[Note: a rank that stops answering] (offload/units/collectives.py): gloo gives up a
collective after the group's timeout (`collective_timeout_s`) with a transport message that
names neither the collective nor a rank; offload turns it into a `CollectiveTimeoutError`
naming the collective, this rank, the peer, the timeout and what to do.

The real thing: two ranks in their own processes, both paging parameters and optimizer
states through swap files in one directory (as on a node), a 5 s timeout. After two steps
rank 1 stops itself (SIGSTOP: alive, holding its connections, answering nothing, the way a
rank in a debugger or a hung data loader looks). Rank 0 must fail within the timeout plus a
margin for two busy cores, with the clear error, and exit with its swap files deleted; rank
1 is then continued and killed by the test, and rank 0's files stay gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from offload.units import collectives
from offload.units.collectives import (
    CollectiveTimeoutError, ProcessGroupInfo, _CheckedWork, lost_peer_error, peer_lost,
)
from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 5.0
MARGIN_S = 30.0  # the gloo timeout fires on time; the margin is for two busy cores' scheduling

SCRIPT = r"""
import os, signal, sys, time, torch, offload
from offload.config import Config, OffloadConfig, OptimizerConfig, ShardingConfig
from tests.conftest import TinyGPT, gpt_batches

nvme, timeout_s, group = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
config = Config(compute_device="cpu", optimizer=OptimizerConfig(lr=2e-3), collective_timeout_s=timeout_s,
                offload=OffloadConfig(param_tier="nvme", optimizer_tier="nvme", nvme_path=nvme),
                sharding=ShardingConfig(shard_group_size=group))
engine = offload.initialize(TinyGPT(n_layer=3), config)
r, n = engine.rank, engine.world_size
try:
    for i, (x, y) in enumerate(gpt_batches(6)):
        if i == 2:
            mine = sorted(f for f in os.listdir(os.path.join(nvme, "offload-swap"))
                          if f.startswith(f"rank{r}.") and f.endswith(".swap"))
            print("STOPPING", time.time(), ",".join(mine), flush=True)
            if r == n - 1:
                os.kill(os.getpid(), signal.SIGSTOP)
        b = x.shape[0] // n
        engine.backward(engine(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]))
        engine.step()
except Exception as exc:
    print("FAILED", time.time(), type(exc).__name__, flush=True)
    raise
"""


def _swap_files(nvme: str, rank: int) -> list[str]:
    d = os.path.join(nvme, "offload-swap")
    return sorted(f for f in os.listdir(d) if f.startswith(f"rank{rank}.") and f.endswith(".swap")) \
        if os.path.isdir(d) else []


def _stamp(out: str, word: str) -> list[str]:
    lines = [line.split(" ") for line in out.splitlines() if line.startswith(word + " ")]
    assert lines, f"no {word} line in rank 0's output:\n{out[-3000:]}"
    return lines[0]


def test_a_stopped_rank_fails_the_other_within_the_timeout_naming_rank_and_collective(tmp_path):
    nvme = str(tmp_path)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, nvme, str(TIMEOUT_S), "0"], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        out, _ = procs[0].communicate(timeout=180)
        exited = time.time()
        # 1: a Python error's exit, not a signal (gloo's threads aborting the teardown: -6)
        assert procs[0].returncode == 1, f"rank 0 exited {procs[0].returncode}:\n{out[-3000:]}"
        stopping = _stamp(out, "STOPPING")
        assert len(stopping) > 2 and stopping[2], f"rank 0 had no swap files before the stop: {stopping}"
        failed = _stamp(out, "FAILED")
        waited_s = float(failed[1]) - float(stopping[1])
        assert failed[2] == "CollectiveTimeoutError", out[-3000:]
        assert TIMEOUT_S - 1 <= waited_s <= TIMEOUT_S + MARGIN_S, f"rank 0 failed {waited_s:.1f} s after the stop"
        # and exits promptly: no wait for the silent group's threads (settle_collectives)
        assert exited - float(stopping[1]) <= TIMEOUT_S + MARGIN_S, "rank 0 took too long to exit"
        error = [line for line in out.splitlines() if "CollectiveTimeoutError:" in line][-1]
        for words in ("rank 0 of 2", "rank 1 did not answer", "collective_timeout_s=5 s",
                      "check the other ranks' logs", "raise collective_timeout_s"):
            assert words in error, (words, error)
        assert any(c in error for c in ("all-gather", "reduce-scatter", "all-reduce")), error
        assert "Timed out" in out, "torch's own error is kept as the cause"
        # rank 0 exited: its swap files went with it (rank 1, stopped, cannot have removed them)
        assert _swap_files(nvme, 0) == [], _swap_files(nvme, 0)
        assert _swap_files(nvme, 1), "rank 1 is stopped, its files are still there"
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        procs[1].kill()
        procs[1].communicate(timeout=60)
        if procs[0].poll() is None:
            procs[0].kill()
            procs[0].communicate()
    assert _swap_files(nvme, 0) == []


def test_only_a_silent_peer_becomes_a_collective_timeout():
    assert peer_lost(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms "
                                  "for send operation to complete"))
    assert peer_lost(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    assert not peer_lost(RuntimeError("output tensor size must be equal to world_size times input size"))
    assert not peer_lost(ValueError("timed out"))


def test_the_error_names_collective_rank_peers_timeout_and_fix():
    pg = ProcessGroupInfo(rank=2, world_size=4, group=None, backend="cpu:gloo", started_here=True, timeout_s=60.0)
    text = str(lost_peer_error("all-gather of 8 elements per rank", pg, RuntimeError("Timed out waiting")))
    assert "rank 2 of 4: the all-gather of 8 elements per rank" in text
    assert "one of ranks 0..3 did not answer" in text and "collective_timeout_s=60 s" in text
    died = str(lost_peer_error("barrier", pg, RuntimeError("[pair.cc:553] Connection closed by peer")))
    assert "one of ranks 0..3 closed its connection (it died or exited" in died
    assert "check the other ranks' logs" in died
    user = ProcessGroupInfo(rank=0, world_size=2, group=None, backend="cpu:gloo", started_here=False)
    assert "your process group's timeout" in str(lost_peer_error("barrier", user, RuntimeError("Timed out")))


class _Failing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def wait(self, timeout=None):
        raise self.exc


def test_waiting_an_async_collective_raises_the_clear_error_with_torchs_as_cause(monkeypatch):
    monkeypatch.setattr(collectives, "_LOST", [False])  # this process's group is not lost
    pg = ProcessGroupInfo(rank=0, world_size=2, group=None, backend="cpu:gloo", started_here=True, timeout_s=5.0)
    cause = RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    with pytest.raises(CollectiveTimeoutError, match="gradient reduce-scatter") as info:
        _CheckedWork(_Failing(cause), "gradient reduce-scatter of 64 elements", pg).wait()  # type: ignore[arg-type]
    assert info.value.__cause__ is cause
    other = RuntimeError("size mismatch")
    with pytest.raises(RuntimeError) as info2:
        _CheckedWork(_Failing(other), "all-gather", pg).wait()  # type: ignore[arg-type]
    assert info2.value is other


def test_at_4_ranks_as_2_nodes_a_stopped_rank_fails_every_other_rank(tmp_path):
    """The same at world size 4 under HSDP (2 "nodes" of 2: shard groups {0, 1} and {2, 3},
    replicate groups {0, 2} and {1, 3}). Rank 3 stops; ranks 0-2 each fail with the clear
    error within the timeout, wherever their wait was (the shard group, the replicas, or a
    peer itself stuck waiting), and exit with their swap files deleted. A rank that waited on
    rank 3 directly names it."""
    nvme, world = str(tmp_path), 4
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, nvme, str(TIMEOUT_S), "2"], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    errors = []
    try:
        for rank in range(world - 1):
            out, _ = procs[rank].communicate(timeout=150)
            assert procs[rank].returncode == 1, f"rank {rank} exited {procs[rank].returncode}:\n{out[-3000:]}"
            stopping, failed = _stamp(out, "STOPPING"), _stamp(out, "FAILED")
            assert failed[2] == "CollectiveTimeoutError", out[-3000:]
            waited_s = float(failed[1]) - float(stopping[1])
            assert waited_s <= TIMEOUT_S + MARGIN_S, f"rank {rank} failed {waited_s:.1f} s after the stop"
            error = [line for line in out.splitlines() if "CollectiveTimeoutError:" in line][-1]
            for words in (f"rank {rank}", "did not answer", "collective_timeout_s=5 s"):
                assert words in error, (rank, words, error)
            errors.append(error)
            assert _swap_files(nvme, rank) == [], (rank, _swap_files(nvme, rank))
        assert any("rank 3 did not answer" in e for e in errors), errors
        assert _swap_files(nvme, world - 1), "rank 3 is stopped, its files are still there"
    finally:
        os.kill(procs[-1].pid, signal.SIGCONT)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=60)


# -- a rank's uncaught exception ends the job in seconds (issue #43, item 3) -------------------

RAISE_SCRIPT = r"""
import os, sys, time, torch, offload
from offload.config import Config, OptimizerConfig
from tests.conftest import TinyGPT, gpt_batches

torch.manual_seed(0)
# the default collective_timeout_s (1800 s): the exit must not depend on it
engine = offload.initialize(TinyGPT(n_layer=3), Config(compute_device="cpu", optimizer=OptimizerConfig(lr=2e-3)))
r, n = engine.rank, engine.world_size
try:
    for i, (x, y) in enumerate(gpt_batches(6)):
        if i == 2 and r == n - 1:
            print("RAISING", time.time(), flush=True)
            raise ValueError("a bad batch")  # uncaught: the process ends on it
        b = x.shape[0] // n
        engine.backward(engine(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]))
        engine.step()
except ValueError:
    raise
except Exception as exc:
    print("FAILED", time.time(), type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
    raise
"""
EXIT_WITHIN_S = 10.0
"""The issue's bound: the raising rank is gone within 10 s of its raise."""


def _raise_times(out: str, word: str) -> list[float]:
    return [float(line.split(" ")[1]) for line in out.splitlines() if line.startswith(word + " ")]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_ranks_uncaught_exception_ends_every_rank_in_seconds(tmp_path, world_size):
    """Before (1750db6) the raising rank sat in the exit-time barrier of the group offload
    started (its peers were in a gather), for collective_timeout_s: 30 minutes."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
        procs.append(subprocess.Popen([sys.executable, "-c", RAISE_SCRIPT], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs, exited = [""] * world_size, [0.0] * world_size
    try:
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if p.poll() is not None and not exited[i]:
                    exited[i] = time.time()
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if p.poll() is not None and not exited[i]:
                exited[i] = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for i, p in enumerate(procs):
            outs[i] = p.communicate(timeout=60)[0]
    last = world_size - 1
    raised = _raise_times(outs[last], "RAISING")
    assert raised, outs[last][-3000:]
    assert all(exited), [p.returncode for p in procs]  # every rank ended (none killed by the test)
    assert exited[last] - raised[0] <= EXIT_WITHIN_S, f"the raising rank took {exited[last] - raised[0]:.1f} s"
    assert "ValueError: a bad batch" in outs[last]
    for rank in range(last):
        assert procs[rank].returncode == 1, (rank, procs[rank].returncode, outs[rank][-3000:])
        failed = [line for line in outs[rank].splitlines() if line.startswith("FAILED ")]
        assert failed and "closed its connection" in failed[0], outs[rank][-3000:]
        assert exited[rank] - raised[0] <= EXIT_WITHIN_S + MARGIN_S, (rank, exited[rank] - raised[0])


def test_under_torchrun_a_ranks_uncaught_exception_ends_the_job_in_seconds(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RAISE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                             "--master-port", str(free_port()), str(script)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun's SIGTERM handler ends its workers too: none left behind
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise AssertionError("torchrun did not end within 240 s of its start: a rank is held at exit") from None
    ended = time.time()
    raised = _raise_times(out, "RAISING")
    assert raised and proc.returncode != 0, (proc.returncode, out[-2000:], err[-3000:])
    assert ended - raised[0] <= EXIT_WITHIN_S + MARGIN_S, f"torchrun ended {ended - raised[0]:.1f} s after the raise"
    assert "a bad batch" in err + out
    assert ended - start < 240
