"""Case files that misbehave at run time, on some ranks: they spin, stop, sleep, issue a collective
alone or one of another size, interrupt themselves, spawn processes, or wait on one. The module is
a replicated linear layer, so the correct case (`ok`) is equivalent and every other outcome comes
from the misbehaviour."""

import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from tpcheck import Case, Plan, Replicate


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=dtype)

    def forward(self, x):
        return self.fc(x)


class TP(Dense):
    def __init__(self, group, how, dtype=None):
        super().__init__(dtype)
        self.rank, self.pg, self.how = group.rank, group.pg, how

    def forward(self, x):
        if self.how == "spin" and self.rank == 1:
            while True:  # SPIN
                pass
        if self.how == "stop" and self.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.how == "one_sided" and self.rank == 0:
            t = torch.ones(3)
            dist.all_reduce(t, group=self.pg)  # ONE SIDED
        if self.how == "sigint" and self.rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
        if self.how == "sleeps":
            time.sleep(600)
        if self.how == "mismatched":  # a debug all-reduce on rank 0 only, then one on every rank
            if self.rank == 0:
                dist.all_reduce(torch.ones(1024), group=self.pg)  # EXTRA
            dist.all_reduce(x.detach().clone(), group=self.pg)  # EVERY RANK
        return self.fc(x)


def spawning_tp(group, dtype):
    """Starts a long-lived process (marked by the environment the test gives), as user code may."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=dict(os.environ))
    return TP(group, "ok", dtype)


def compiling_tp(group, dtype):
    """Waits 7 s on a child process before building, as a library compiling its op on first use
    (DeepSpeed's, torch.utils.cpp_extension's `load`) does."""
    subprocess.run([sys.executable, "-c", "import time; time.sleep(7)"], check=True)  # COMPILE
    return TP(group, "ok", dtype)


def init(module, g):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def make_batch(g, dtype):
    return {"x": torch.randn(4, 8, generator=g).to(dtype)}, torch.randn(4, 8, generator=g).to(dtype)


PLAN = Plan(params={"fc.weight": Replicate(), "fc.bias": Replicate()})


def _case(how, build_tp=None):
    return Case(
        name=how,
        build_dense=Dense,
        build_tp=build_tp or (lambda group, dtype: TP(group, how, dtype)),
        plan=PLAN,
        make_batch=make_batch,
        init=init,
    )


ok = _case("ok")
spin = _case("spin")
stop = _case("stop")
one_sided = _case("one_sided")
sigint = _case("sigint")
sleeps = _case("sleeps")
mismatched = _case("mismatched")  # gloo aborts a rank: the sizes of the first all-reduce differ
spawns = _case("spawns", spawning_tp)
compiles = _case("compiles", compiling_tp)
