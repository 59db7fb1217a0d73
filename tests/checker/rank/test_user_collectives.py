"""The code under test's own torch.distributed collectives are counted in the ledger (phase, op,
bytes), never twice for tpcheck's own, and only while the TP side runs a phase."""

import torch
import torch.distributed as dist

from tpcheck.checker.pool.spawn import run_on_ranks
from tpcheck.checker.rank.ledger import USER_SITE, CollectiveTap, count_user_collectives


def _on_rank(group):
    tap = CollectiveTap(group.rank)
    count_user_collectives(lambda: tap)
    t = torch.ones(4)
    dist.all_reduce(t)  # no phase: not the TP side's
    with tap.tp_phase("forward"):
        dist.all_reduce(t)
        torch.distributed.distributed_c10d.broadcast(t, src=0)
        # tpcheck's own: inside the tap
        tap.performing(("all_reduce", "mine", "forward"), dist.all_reduce, t)
    with tap.tp_phase("backward"):
        if group.rank == 0:
            dist.barrier()
        else:
            dist.barrier()
    return [(e.phase, e.op, e.site, e.nbytes) for e in tap.ledger], float(t[0])


def test_user_collectives_are_counted_once_in_their_phase():
    results = run_on_ranks(_on_rank, 2)
    for ledger, value in results:
        assert ledger == [
            ("forward", "all_reduce", USER_SITE, 16),
            ("forward", "broadcast", USER_SITE, 16),
            ("backward", "barrier", USER_SITE, 0),
        ]
        assert value == 8.0  # the collectives still ran: 1 -> 2 -> 4 (broadcast keeps 4) -> 8
