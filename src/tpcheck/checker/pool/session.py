"""Run a list of CaseSpecs to case results, in this process's pool or under torchrun; or in
`Lanes`: several launchers (each with its own pools) running the specs side by side."""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Sequence

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.pool.launch import MAX_LIVE_RANKS, Launcher, TorchrunLauncher
from tpcheck.checker.usercode import NO_GRAPH
from tpcheck.checker.verdict.float64_run import float64_spec, merge_float64
from tpcheck.checker.verdict.result import CaseResult, merge

# (cases done, cases planned, the last one's report case)
Progress = Callable[[int, int, dict], None]
# a float64 run's spec -> (the name of the case that ran it, its result)
Float64Runs = dict[CaseSpec, tuple[str, CaseResult]]


class Lanes:
    """Launchers that run one list of specs side by side, each case on one of them (`run_specs`):
    while a case's ranks wait for one another (rank 0's float64 truth, a collective) another case's
    ranks compute on the idle CPUs. Each launcher keeps its own pools, so a pool never serves two
    cases at once, and an equal share of MAX_LIVE_RANKS alive. Closed and aborted together; specs
    are prepared by the first one's resolver."""

    def __init__(self, launchers: Sequence[Launcher]) -> None:
        if not launchers:
            raise ValueError("Lanes needs at least one launcher")
        self.launchers = list(launchers)
        self.resolver = self.launchers[0].resolver
        for launcher in self.launchers:  # the ranks alive at once stay within one launcher's cap
            launcher.max_live_ranks = max(1, MAX_LIVE_RANKS // len(self.launchers))
        self.stop = threading.Event()  # set: no lane takes another case
        self.threads: list[threading.Thread] = []

    def close(self) -> None:
        self._stop_lanes()
        for launcher in self.launchers:
            launcher.close()

    def abort(self) -> None:
        """Stop every rank of every lane now; a lane inside a case sees its ranks die and stops."""
        self.stop.set()
        for launcher in self.launchers:
            launcher.abort()
        self._stop_lanes()
        for launcher in self.launchers:  # a pool a lane forked while it was being stopped
            launcher.abort()

    def _stop_lanes(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=5.0)
        self.threads = []


def run_specs(
    specs: Sequence[CaseSpec],
    launcher: Launcher | TorchrunLauncher | Lanes,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Case results in the order of `specs` (empty on torchrun ranks other than 0). Each spec is
    first prepared by the launcher's resolver (a fault's own settings). With `on_result`, each
    result is handed to it as its case finishes (what the caller keeps if the run is interrupted)
    and none is kept here: a sweep of thousands of cases holds one copy of them, the caller's."""
    results = []
    ran: Float64Runs = {}  # the float64 runs of this list, shared by the cases that want the same
    if isinstance(launcher, Lanes):
        cases = _run_in_lanes(specs, launcher, ran)
    else:
        cases = (run_case(spec, launcher, ran) for spec in specs)
    for result in cases:
        if result is None:
            continue
        if on_result is not None:
            on_result(result)  # the caller keeps what it needs of it (the report's case)
        else:
            results.append(result)
    return results


def run_case(
    spec: CaseSpec, launcher: Launcher | TorchrunLauncher, ran: Float64Runs | None = None
) -> CaseResult | None:
    """One case: its run in the working dtype, then, where its settings want one, its float64 run,
    merged in (checker/verdict/float64_run.py). None on torchrun ranks other than 0. `ran`: the
    float64 runs done so far in this list of cases, by spec: a case whose float64 run is one of
    them (a bfloat16 and a float16 case of one spec want the same: the float64 run does not depend
    on the working dtype) takes that result instead of running it again (`float64_run.same_as`)."""
    spec = launcher.resolver.prepare(spec)
    payloads = launcher.run(spec)
    result = None if payloads is None else merge(spec, payloads)
    torchrun = isinstance(launcher, TorchrunLauncher)
    if not torchrun and spec.settings.train and (why := _untrainable(result)) is not None:
        return _forward_only(run_case(spec.with_run(train=False), launcher, ran), why)
    follow = result and float64_spec(spec, result)
    if torchrun:  # every rank runs what rank 0's results decide
        follow = launcher.share(follow)
    if follow is None:
        return result
    if not torchrun and ran is not None and follow in ran:
        first, f64 = ran[follow]
        return merge_float64(result, copy.deepcopy(f64), same_as=first)
    key, follow = follow, launcher.resolver.prepare(follow)
    payloads = launcher.run(follow)  # on every torchrun rank
    if result is None:
        return None
    f64 = merge(follow, payloads)
    if ran is not None:
        ran[key] = (result.name, f64)
    return merge_float64(result, f64)


def _untrainable(result: CaseResult | None) -> str | None:
    """Why the TP side cannot train (its forward's output carries no graph: `torch.no_grad()` or
    `torch.inference_mode()` inside it, usercode.require_graph), or None."""
    if result is None or result.verdict != "invalid":
        return None
    said = next((p.get("message", "") for p in result.problems or () if p.get("message")), "")
    return said if said.startswith(f"the TP {NO_GRAPH}") else None


def _forward_only(result: CaseResult | None, why: str) -> CaseResult | None:
    """A case run again forward only because its TP side cannot train: said in its notes and
    summary, the forward checked alone (nothing of the training step is)."""
    if result is None:
        return None
    note = (
        "training: " + why.split("; for inference-only code")[0] + "; its forward is checked "
        "alone, as with --forward-only"
    )
    result.notes = [note, *(result.notes or ())]
    result.summary += f"; not checked: {note}"
    return result


def _run_in_lanes(specs: Sequence[CaseSpec], lanes: Lanes, ran: Float64Runs):
    """The results of `specs` in their order, each case run on whichever launcher is free (a thread
    per launcher: it only waits on its ranks' pipes). A failure of the checker itself in a lane is
    raised here, in the caller's thread, as it would be in one lane; the lanes then take no other
    case."""
    launchers = lanes.launchers
    if len(launchers) == 1 or len(specs) < 2:
        yield from (run_case(spec, launchers[0], ran) for spec in specs)
        return
    lanes.stop.clear()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for item in enumerate(specs):
        todo.put(item)
    done: queue.SimpleQueue = queue.SimpleQueue()

    def lane(launcher: Launcher) -> None:
        while not lanes.stop.is_set():
            try:
                i, spec = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((i, run_case(spec, launcher, ran), None))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                done.put((i, None, e))
                return

    lanes.threads = [
        threading.Thread(target=lane, args=(launcher,), daemon=True)
        for launcher in launchers[: len(specs)]
    ]
    for thread in lanes.threads:
        thread.start()
    finished: dict[int, CaseResult | None] = {}
    try:
        for next_i in range(len(specs)):
            while next_i not in finished:
                try:  # a timeout, so a signal's handler runs in this thread while it waits
                    i, result, error = done.get(timeout=0.5)
                except queue.Empty:
                    continue
                if error is not None:
                    raise error
                finished[i] = result
            yield finished.pop(next_i)
    finally:
        lanes.stop.set()  # an error, an interrupt or the caller stopping: no lane takes another
