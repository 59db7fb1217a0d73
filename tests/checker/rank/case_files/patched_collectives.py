"""A trainer that replaces `torch.distributed.all_reduce` with its own wrapper, as logging,
profiling and gradient-compression code does, installed in the case's `setup` (on every rank,
before the TP module is built) around the Megatron-style block of
tests/training/case_files/megatron_style.py: a wrapper that always sums (it drops `op`: correct for
the block's sums), and one that averages (a TP bug: every all-reduce divided by the world size)."""

import dataclasses
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "training" / "case_files"))

import megatron_style as M  # noqa: E402


def _install(wrapper):
    def setup(group):
        torch_all_reduce = dist.all_reduce

        def replacement(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            return wrapper(torch_all_reduce, tensor, group, async_op)

        dist.all_reduce = replacement

    return setup


def sums(all_reduce, tensor, group, async_op):
    """Compression-style: the reduction is always a sum, whatever `op` says."""
    return all_reduce(tensor, group=group, async_op=async_op)


def averages(all_reduce, tensor, group, async_op):
    out = all_reduce(tensor, group=group, async_op=async_op)
    tensor.div_(dist.get_world_size(group))
    return out


sum_wrapper = dataclasses.replace(M.assign_loader, name="sum_wrapper", setup=_install(sums))
mean_wrapper = dataclasses.replace(M.assign_loader, name="mean_wrapper", setup=_install(averages))
plain = dataclasses.replace(M.assign_loader, name="plain")
