"""The user's own training step, written as public TP codebases write it
(case_files/megatron_style.py): their optimizer wrappers (float32 masters stepped by an inner
AdamW, an AdamW over one flat buffer, a hand-written SGD), their gradient clipping, and loaders that
replace the module's parameters. Each correct one is equivalent at every step; each planted bug is
caught at its first step, at the check that names it; checker mutants of the new paths lose what
they catch."""

import pytest
import torch

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.rank import stepped, training
from tpcheck.checker.rank.optimizer import Replay

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "megatron_style.py"


def spec(name, world=2, **run):
    return CaseSpec(
        block=f"file:{FILE}:{name}", world_size=world, run=RunSettings(**run) if run else None
    )


def first(r):
    return r["first_divergence"] or {}


@pytest.fixture(scope="module")
def results():
    specs = [
        spec("fp32_master"),
        spec("fp32_master", dtype="bfloat16"),
        spec("flat_buffer"),
        spec("flat_buffer", dtype="bfloat16"),
        spec("fp32_master_copy_back_skipped", dtype="bfloat16"),
        spec("flat_buffer_grads_misplaced"),
        spec("hand_written_sgd"),
        spec("hand_written_sgd", dtype="bfloat16", optimizer="sgd", lr=0.05, master_weights=False),
        spec("hand_written_sgd_wrong_lr"),
        spec("clip_default"),
        spec("clip_correct"),
        spec("clip_local"),
        spec("clip_replicated_twice"),
        spec("clip_local", dtype="bfloat16", clip_grad_norm=0.05),
        spec("assign_loader"),
        spec("meta_loader"),
        spec("new_parameter_loader"),
        spec("assign_loader", dtype="float64"),
    ]
    return {s: r for s, r in zip(specs, check(specs))}


@pytest.mark.parametrize(
    "case,run",
    [
        ("fp32_master", {}),
        ("fp32_master", {"dtype": "bfloat16"}),
        ("flat_buffer", {}),
        ("flat_buffer", {"dtype": "bfloat16"}),
    ],
)
def test_an_optimizer_wrapper_with_float32_masters_is_equivalent(results, case, run):
    """The state is found through the wrapper (masters by values, or segments of the flat buffer):
    checked bitwise against the replay at every step, never reported as zeros."""
    r = results[spec(case, **run)]
    assert r["verdict"] == "equivalent", r["summary"]
    names = {c["name"] for c in r["checks"]}
    assert "state:fc1.weight.exp_avg" in names and "update:fc1.weight" in names
    assert not r.get("notes")
    if run.get("dtype") == "bfloat16":  # the wrapper's copy back into the module, held bitwise
        assert "weight:fc1.weight" in names


def test_a_wrapper_that_skips_a_copy_back_is_caught_at_step_1(results):
    r = results[spec("fp32_master_copy_back_skipped", dtype="bfloat16")]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert (first(r)["stage"], first(r)["step"], first(r)["name"]) == (
        "optimizer",
        1,
        "weight:fc1.bias",
    )
    assert r["diagnosis"]["signature"] == "mismatch"  # a bitwise check is never "near the bound"


def test_a_flat_buffer_with_misplaced_grads_is_caught_at_step_1(results):
    r = results[spec("flat_buffer_grads_misplaced")]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert (first(r)["stage"], first(r)["step"]) in (("optimizer", 1), ("replicas", 1))


def test_an_optimizer_tpcheck_cannot_see_into_is_checked_by_its_weights(results):
    r = results[spec("hand_written_sgd")]
    assert r["verdict"] == "equivalent", r["summary"]
    assert any("update of 6 parameter(s)" in n for n in r["notes"]), r.get("notes")
    assert "not checked: optimizer update of 6 parameter(s)" in r["summary"]
    from tpcheck.report.html_case import _case_section

    assert "Not checked: optimizer update of 6 parameter(s)" in _case_section(0, r)
    assert not any(c["name"].startswith(("state:", "update:")) for c in r["checks"])
    pure = results[
        spec("hand_written_sgd", dtype="bfloat16", optimizer="sgd", lr=0.05, master_weights=False)
    ]
    assert pure["verdict"] == "equivalent", pure["summary"]
    wrong = results[spec("hand_written_sgd_wrong_lr")]
    assert wrong["verdict"] == "not equivalent", wrong["summary"]
    assert (first(wrong)["stage"], first(wrong)["step"]) == ("optimizer", 1)
    assert first(wrong)["name"].startswith("param:")


@pytest.mark.parametrize("case", ["clip_default", "clip_correct"])
def test_correct_tp_clipping_is_equivalent(results, case):
    r = results[spec(case)]
    assert r["verdict"] == "equivalent", r["summary"]
    assert sum(c["name"] == "clip:grad_norm" and c["stage"] == "optimizer" for c in r["checks"])


@pytest.mark.parametrize(
    "case,run,signature",
    [
        ("clip_local", {}, "clip_local_norm"),
        ("clip_local", {"dtype": "bfloat16", "clip_grad_norm": 0.05}, "clip_local_norm"),
        ("clip_replicated_twice", {}, "clip_replicated_counted"),
    ],
)
def test_a_clipping_bug_is_caught_at_the_step_and_named(results, case, run, signature):
    r = results[spec(case, **run)]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert (first(r)["stage"], first(r)["step"], first(r)["name"]) == (
        "optimizer",
        1,
        "clip:grad_norm",
    )
    assert r["diagnosis"]["signature"] == signature, r["summary"]


@pytest.mark.parametrize("case", ["assign_loader", "meta_loader", "new_parameter_loader"])
def test_a_loader_that_replaces_parameters_is_equivalent_at_every_step(results, case):
    r = results[spec(case)]
    assert r["verdict"] == "equivalent", r["summary"]
    assert {c["step"] for c in r["checks"] if c["stage"] == "optimizer"} == {1, 2, 3}


def test_a_loader_in_a_float64_run_gets_float64_weights(results):
    """The loader is handed the dense weights at the run's precision (float32 rounding would put
    every later step 1e-8 off a float64 dense model)."""
    r = results[spec("assign_loader", dtype="float64")]
    assert r["verdict"] == "equivalent", r["summary"]


def test_a_blind_clip_check_loses_the_local_norm_bug(monkeypatch):
    """Checker mutant: the clip check compares the dense norm with itself; the local-norm bug is
    then not named at the clip (AdamW is nearly blind to a per-rank grad scale)."""
    compare = training.clip_grads

    def blind(e, step):
        clip = e.case.tp_clip_grad_norm
        object.__setattr__(e.case, "tp_clip_grad_norm", None)  # the default, correct clipping
        try:
            compare(e, step)
        finally:
            object.__setattr__(e.case, "tp_clip_grad_norm", clip)

    monkeypatch.setattr(training, "clip_grads", blind)
    (r,) = check([spec("clip_local")])
    assert not (r["verdict"] == "not equivalent" and first(r).get("name") == "clip:grad_norm")


def test_a_state_finder_that_finds_nothing_reports_the_state_unobservable(monkeypatch):
    """Checker mutant: the wrapper's masters are not found; the state is then said to be not
    observable (never compared as zeros) and the update is not held bitwise."""
    monkeypatch.setattr(training, "map_stepped", lambda module, optimizers: {})
    (r,) = check([spec("fp32_master")])
    assert not any(c["name"].startswith("state:") for c in r["checks"]), r["summary"]
    assert any("not observable" in n for n in r["notes"])


def test_state_found_in_a_flat_buffer_is_the_parameters_segment():
    import torch
    from torch import nn

    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    opt = torch.optim.AdamW([flat])
    found = training.map_stepped(m, [opt])
    assert set(found) == {n for n, _ in m.named_parameters()}
    for name, p in m.named_parameters():
        assert torch.equal(found[name].value, p.detach())
    flat.grad = torch.arange(flat.numel(), dtype=torch.float32)
    opt.step()
    offset = 0
    for name, p in m.named_parameters():
        exp_avg = found[name].state()["exp_avg"]
        assert exp_avg.shape == p.shape
        assert torch.equal(
            exp_avg.reshape(-1), opt.state[flat]["exp_avg"][offset : offset + p.numel()]
        )
        offset += p.numel()


def test_replay_runs_on_what_it_is_handed():
    import torch

    w = {"a": torch.ones(3)}
    r = Replay(w, lambda named: torch.optim.SGD([p for _, p in named], lr=0.5))
    r.run({"a": torch.full((3,), 2.0)}, {"a": torch.ones(3)})
    assert torch.equal(r.update("a"), torch.full((3,), -0.5))
    assert r.grads["a"] is not None


def test_bad_clip_settings_name_the_value():
    from tpcheck.errors import UsageError

    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(UsageError, match="clip_grad_norm"):
            RunSettings(clip_grad_norm=bad)


def test_a_skipped_clip_check_ends_in_error(monkeypatch):
    """Checker mutant: the step clips but compares no norm. The manifest of a clipping run (a
    clip:grad_norm check on every rank at every step) turns the buggy case into "error"."""

    def clips_only(e, step):
        torch.nn.utils.clip_grad_norm_(list(e.dense.parameters()), e.settings.clip_grad_norm)

    monkeypatch.setattr(training, "clip_grads", clips_only)
    (r,) = check([spec("clip_local")])
    assert r["verdict"] == "error", r["summary"]
    assert "no check of clip:grad_norm" in r["summary"]


def test_a_state_finder_pairing_the_wrong_tensors_ends_in_error(monkeypatch):
    """Checker mutant: the finder pairs each parameter with the first stepped tensor of its shape
    (not its values); the check of what it found raises, and the case ends in "error"."""

    def by_shape(module, optimizers):
        tensors = [t for o in optimizers for g in o.param_groups for t in g["params"]]
        found = {}
        for name, p in module.named_parameters():
            t = next((t for t in tensors if t.shape == p.shape), None)
            if t is not None:
                found[name] = stepped.Stepped(optimizers[0], t, p.shape)
        return found

    monkeypatch.setattr(training, "map_stepped", by_shape)
    (r,) = check([spec("fp32_master")])
    assert r["verdict"] == "error", r["summary"]
    assert "state finder" in r["summary"]


def test_the_users_mistakes_are_named_and_setup_runs_before_the_tp_build():
    detached, setup = check([spec("detached_output"), spec("with_setup")])
    # a TP output without a graph cannot train: its forward is checked alone, and the report
    # says why, at the forward's line
    assert detached["verdict"] == "equivalent", detached["summary"]
    assert "not checked: training: the TP module's output has no grad_fn" in detached["summary"]
    assert "megatron_style.py" in detached["summary"]  # its forward, named
    assert setup["verdict"] == "equivalent", setup["summary"]


def test_a_module_with_a_complex_output_is_left_out_of_the_module_checks():
    (r,) = check([spec("complex_module_output")])
    assert r["verdict"] == "equivalent", r["summary"]
    assert not any("rotary" in c["name"] for c in r["checks"])
