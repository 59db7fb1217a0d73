"""How many threads a rank computes on. libgomp is not fork-safe: a process forked from one that ran
an OpenMP region on several threads hangs in its first parallel region. The `tpcheck` command keeps
its own process to one thread, so its ranks share the CPUs; any other parent (this pytest process)
gives its ranks one thread each."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tpcheck.checker.pool import spawn

CPUS = len(os.sched_getaffinity(0))


def test_a_parent_that_did_not_keep_to_one_thread_gives_its_ranks_one(monkeypatch):
    monkeypatch.setattr(spawn, "_PARENT_KEPT_TO_ONE_THREAD", False)
    assert [spawn.rank_threads(w) for w in (1, 2, 4)] == [1, 1, 1]


def test_a_parent_kept_to_one_thread_shares_the_cpus(monkeypatch):
    monkeypatch.setattr(spawn, "_PARENT_KEPT_TO_ONE_THREAD", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [spawn.rank_threads(w) for w in (1, 2, 4, 16, 32)] == [16, 8, 4, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert [spawn.rank_threads(w) for w in (1, 2, 16)] == [2, 2, 1]
    # the parent went back to several threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert spawn.rank_threads(1) == 1


def test_the_rank_others_wait_for_may_use_the_whole_groups_cpus(monkeypatch):
    monkeypatch.setattr(spawn, "_PARENT_KEPT_TO_ONE_THREAD", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [spawn.threads_while_others_wait(w) for w in (1, 2, 3, 4, 16, 32)] == [
        16,
        16,
        15,
        16,
        16,
        16,
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a cap on any one process's threads
    assert [spawn.threads_while_others_wait(w) for w in (1, 2, 16)] == [2, 2, 2]
    # libgomp: one thread, waiting or not
    monkeypatch.setattr(spawn, "_PARENT_KEPT_TO_ONE_THREAD", False)
    assert [spawn.threads_while_others_wait(w) for w in (1, 2, 4)] == [1, 1, 1]


THREADS_CASE = textwrap.dedent("""
    import json, os
    import torch
    from torch import nn
    from tpcheck import Case, Plan, Replicate

    class Block(nn.Module):
        def __init__(self, dtype=None):
            super().__init__()
            self.fc = nn.Linear(8, 8, dtype=dtype)

        def forward(self, x):
            with open(os.environ["THREADS_LOG"], "a") as f:  # each forward: dtype and threads
                f.write(json.dumps([str(self.fc.weight.dtype), torch.get_num_threads()]) + "\\n")
            return self.fc(x)

    def make_batch(g, dtype):
        x, target = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        return {"x": x.to(dtype)}, target.to(dtype)

    case = Case(name="threads", build_dense=Block, build_tp=lambda group, dtype: Block(dtype),
                plan=Plan(params={"fc.weight": Replicate(), "fc.bias": Replicate()}),
                make_batch=make_batch)
""")


def test_the_float64_truth_runs_on_the_cpus_of_the_ranks_that_wait_for_it(tmp_path):
    """Through the `tpcheck` command at world 2: the dense and TP passes on the rank's own share of
    the CPUs, rank 0's float64 passes (the other rank blocked at the TP side's first
    collective) on the group's."""
    (tmp_path / "threads_case.py").write_text(THREADS_CASE)
    log = tmp_path / "threads.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpcheck",
            "verify",
            f"{tmp_path / 'threads_case.py'}:case",
            "--world-size",
            "2",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "THREADS_LOG": str(log)},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    seen: dict[str, set[int]] = {}
    for line in log.read_text().splitlines():
        dtype, threads = json.loads(line)
        seen.setdefault(dtype, set()).add(threads)
    mine = max(1, CPUS // 2)
    assert seen == {"torch.float32": {mine}, "torch.float64": {min(CPUS, 2 * mine)}}


RANKS_IN_A_FRESH_PROCESS = textwrap.dedent("""
    import json, sys, torch
    from tpcheck.checker.pool import spawn
    if sys.argv[1] == "kept":
        spawn.keep_parent_to_one_thread()
    x = torch.randn(800, 800)
    (x @ x).softmax(-1)  # large enough for a parallel region, were the parent on several threads

    def work(group):
        y = torch.randn(800, 800)
        # the rank's own parallel region: hangs if the parent started a thread team
        (y @ y).softmax(-1)
        return torch.get_num_threads()

    print(json.dumps(spawn.run_on_ranks(work, 1, timeout_s=60)))
""")


@pytest.mark.parametrize("parent", ["kept", "not kept"])
def test_ranks_forked_after_large_ops_in_the_parent_complete(parent):
    out = subprocess.run(
        [sys.executable, "-c", RANKS_IN_A_FRESH_PROCESS, parent],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (f"[{CPUS}]" if parent == "kept" else "[1]")


def test_the_tpcheck_command_keeps_its_process_to_one_thread():
    """The command (`entry()`) runs its command on one thread: the `faults` command's own main,
    replaced, reports what it runs on."""
    code = (
        "import sys, torch; from tpcheck.checker.pool import spawn; "
        "import tpcheck.cli.faults as f; "
        "f.main = lambda args: print(torch.get_num_threads(), spawn._PARENT_KEPT_TO_ONE_THREAD) "
        "or 0; sys.argv = ['tpcheck', 'faults']; from tpcheck.cli import entry; entry()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1", "True"], out.stderr[-2000:]


def test_a_thread_cap_holds_every_rank_to_it_and_is_lifted_after(monkeypatch):
    monkeypatch.setattr(spawn, "_PARENT_KEPT_TO_ONE_THREAD", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with spawn.rank_thread_cap(1):
        assert [spawn.rank_threads(w) for w in (1, 2, 4)] == [1, 1, 1]
        assert [spawn.threads_while_others_wait(w) for w in (1, 2, 4)] == [1, 1, 1]
        with spawn.rank_thread_cap(3):  # nested: the inner cap, then the outer one again
            assert [spawn.rank_threads(w) for w in (1, 2, 8)] == [3, 3, 2]
        assert spawn.threads_while_others_wait(2) == 1
    assert [spawn.rank_threads(w) for w in (1, 2)] == [16, 8]
    assert spawn.threads_while_others_wait(2) == 16
    with pytest.raises(TypeError, match="threads must be an int"):
        with spawn.rank_thread_cap("2"):
            pass
