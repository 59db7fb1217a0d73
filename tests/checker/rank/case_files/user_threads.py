"""Threads a training script starts beside the model, in the case's `setup` (every rank, before
the TP module is built), around examples/own_dropout.py's block: a loader's prefetch thread that
shuffles with torch's default generator when the dense forward asks it for the next batch, and a
watchdog that only waits."""

import dataclasses
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "examples"))

import own_dropout as D  # noqa: E402

STOP = threading.Event()  # set by nobody: the threads outlive their case
WANTED, READY = threading.Event(), threading.Event()


def _start(target, name):
    def setup(group):
        threading.Thread(target=target, name=name, daemon=True).start()

    return setup


def prefetch():
    """A loader's next batch, shuffled with the global RNG, made when the step asks for it."""
    while WANTED.wait():
        WANTED.clear()
        torch.randperm(64)
        READY.set()


def _asks_for_the_next_batch(dtype):
    """The dense block, whose forward asks the loader thread for the next batch and waits for it
    (an asynchronous loader kept one batch ahead): the thread's draw falls inside the pass."""
    model = D.DenseBlock(dtype, False)

    def ask(module, args, kwargs):
        WANTED.set()
        READY.wait()
        READY.clear()

    model.register_forward_pre_hook(ask, with_kwargs=True)
    return model


def watchdog():
    STOP.wait()


loader_thread = dataclasses.replace(
    D.correct,
    name="loader_thread",
    setup=_start(prefetch, "prefetch"),
    build_dense=_asks_for_the_next_batch,
)
watchdog_thread = dataclasses.replace(
    D.correct, name="watchdog_thread", setup=_start(watchdog, "watchdog")
)
dropout = dataclasses.replace(D.correct, name="dropout")
