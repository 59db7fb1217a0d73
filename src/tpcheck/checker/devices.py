"""Where the ranks compute: the CPU (gloo, the default) or one CUDA GPU per rank (NCCL).

A rank on "cuda" computes on GPU `rank` of its machine (under torchrun: `LOCAL_RANK`) and joins a
group with two backends, `cpu:gloo,cuda:nccl`: the model's collectives (CUDA tensors) run on NCCL,
the checker's own small ones (CPU tensors: the replica comparison, the activation probe) and the
rendezvous store stay on gloo. NCCL refuses two ranks on one GPU, so a world needs that many GPUs.

The parent forks the pool's ranks, so it must never initialise CUDA itself (a CUDA runtime started
before fork is unusable in the children): it counts GPUs with `torch.cuda.device_count()`, which
asks NVML and leaves the runtime alone.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tpcheck.errors import UsageError

DEVICES = ("cpu", "cuda")
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def _visible() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f" (CUDA_VISIBLE_DEVICES={value!r})"


def check_device(
    device: str, world: int, *, local_world: int | None = None, forking: bool = True
) -> None:
    """Refuse a device this machine cannot run `world` ranks on, naming the value and the fix.
    `local_world`: the ranks on this machine (under torchrun, LOCAL_WORLD_SIZE), else all of them.
    `forking`: this process is about to fork the ranks (not so under torchrun)."""
    if device not in DEVICES:
        raise UsageError(f"device {device!r} is not one of {list(DEVICES)}")
    if device == "cpu":
        return
    # a library's torch.cuda.is_available() in this
    # process then asks NVML too, instead of starting CUDA
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not torch.backends.cuda.is_built():
        raise UsageError(
            f"--device cuda: this torch ({torch.__version__}) is built without CUDA; install a "
            "CUDA build of torch to check on GPUs, or leave --device out (the CPU, gloo)"
        )
    if not dist.is_nccl_available():
        raise UsageError(
            f"--device cuda: this torch ({torch.__version__}) has no NCCL backend, which the "
            "ranks' collectives on GPUs need; install a torch build with NCCL, "
            "or leave --device out"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise UsageError(
            f"--device cuda: no GPU is visible{_visible()}; leave --device out to check on the CPU"
        )
    if forking and torch.cuda.is_initialized():
        raise UsageError(
            "--device cuda: this process has already started CUDA, and ranks forked from it cannot "
            "use the GPU (CUDA does not survive a fork); run the check in a process that has not "
            "touched CUDA (the tpcheck command, a new python process, a pytest process whose other "
            "tests do not use the GPU), or under torchrun"
        )
    here = world if local_world is None else local_world
    if here > count:
        raise UsageError(
            "--device cuda runs one rank per GPU and NCCL refuses two ranks on one GPU: world size "
            f"{here} needs {here} GPUs, this machine has {count}{_visible()}; choose a world size "
            f"of at most {count}, or run under torchrun on more machines"
        )


def rank_device(device: str, local_rank: int) -> torch.device:
    """This rank's device; for CUDA, GPU `local_rank`, made the current one (before the group is
    joined, so NCCL binds to it), with deterministic kernels: replicated tensors are compared across
    ranks bitwise, and a kernel that adds in a run-dependent order (atomics, cuBLAS's split
    workspaces) would make equal computations on two GPUs differ. Ops with no deterministic kernel
    warn and still run."""
    if device == "cpu":
        return torch.device("cpu")
    # read when cuBLAS starts, in this rank
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend(device: str) -> str:
    return CUDA_BACKEND if device == "cuda" else "gloo"


def rng_states(device: torch.device) -> tuple:
    """The default generators' states a forward could
    draw from on `device`: the CPU's, and the GPU's."""
    if device.type == "cuda":
        return torch.random.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.random.get_rng_state(),)


def seed_rng(device: torch.device, seed: int) -> None:
    """Seed the default generators of the CPU and of
    `device`, as a training script's `torch.manual_seed`."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index].manual_seed(seed)
