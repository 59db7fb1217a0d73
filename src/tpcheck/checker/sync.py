"""Meeting the other ranks through the rendezvous store, never through a collective.

The checker must be able to stop every rank before a collective that would pair wrongly (gloo aborts
on a size mismatch) or wait forever (a rank that failed to build its module, or issued a collective
the others did not). So its checkpoints exchange small strings through the store the process group
was built on: each rank posts its value under a key of the round, then waits (bounded by the
timeout) until every rank has posted. Every rank runs the same checkpoints in the same order, so the
round numbers agree without coordination.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

SOON_S = 0.05  # how long a checkpoint polls the store itself before the store's own wait takes over


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives, or some never reached a checkpoint (a hang).
    `checkpoint` names the checkpoint this rank waited at (the launcher reports it)."""

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class RendezvousTimeout(RuntimeError):
    """Some ranks did not post within the timeout; `missing` names them."""

    def __init__(self, missing: list[int]) -> None:
        super().__init__(f"rank(s) {missing} did not arrive")
        self.missing = missing


class Rendezvous:
    """This rank's view of the store: `exchange(tag, value)` returns every rank's value."""

    def __init__(
        self, store: dist.Store | None, rank: int, world_size: int, timeout_s: float
    ) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.rounds = 0  # checkpoints passed: proof of life for the launcher
        # the checkpoint this rank waits at now (its heartbeat says so)
        self.waiting_at: str | None = None

    @property
    def active(self) -> bool:
        return self.world_size > 1 and self.store is not None

    def exchange(
        self, tag: str, value: str, *, wait: bool = True, label: str | None = None
    ) -> list[str]:
        """Post `value`, wait for every rank's; raises RendezvousTimeout past the timeout. With
        wait=False only post (a rank that is about to stop tells the others why). `label` names the
        checkpoint in this rank's heartbeat while it waits."""
        if not self.active:
            return [value]
        self.rounds += 1
        key = f"tpcheck/{tag}{self.rounds}"
        self.store.set(f"{key}/{self.rank}", value)
        if not wait:
            return []
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        self.waiting_at = label or tag
        try:
            if not self._arrived_soon(keys):
                self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - a store wait past its timeout: some rank is stuck
            raise RendezvousTimeout(
                [r for r, k in enumerate(keys) if not self.store.check([k])]
            ) from None
        self.waiting_at = None
        return [self.store.get(k).decode() for k in keys]

    def _arrived_soon(self, keys: list[str]) -> bool:
        """Whether every key is posted within SOON_S, polled at sub-millisecond intervals: ranks in
        step post within a millisecond of each other, and a FileStore's own wait polls far more
        coarsely (a checkpoint then costs its poll interval, several per micro-batch). Past SOON_S
        the store's wait, with the timeout, takes over."""
        deadline = time.monotonic() + SOON_S
        pause = 5e-5
        while time.monotonic() < deadline:
            if self.store.check(keys):
                return True
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return False

    def setup_failed(self, message: str) -> None:
        """This rank's setup failed: tell the others
        (their `setup_done` stops them), do not wait."""
        self.exchange("setup", f"failed\n{message}", wait=False)

    def setup_done(self) -> None:
        """After the TP module is built and loaded on this rank: wait until every rank got here, or
        stop (PeerFailed) if one reports its setup failed, before any collective is issued."""
        try:
            said = self.exchange("setup", "ok", label="building the TP module")
        except RendezvousTimeout as e:
            raise CollectiveMismatch(
                f"hang detected: rank(s) {e.missing} did not finish building the TP module "
                f"within {self.timeout_s:g} s",
                checkpoint="building the TP module",
            ) from None
        for r, text in enumerate(said):
            status, _, msg = text.partition("\n")
            if status == "failed":
                raise PeerFailed(
                    f"rank {r} failed, so this rank stopped before its first collective: {msg}"
                )


class PeerFailed(RuntimeError):
    """Another rank failed in its setup; this one stopped before its first collective (a knock-on
    failure: the verdict follows the other rank's)."""
