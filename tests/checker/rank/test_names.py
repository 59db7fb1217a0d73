"""TP parameter names matched to dense ones with no plan written (checker/rank/names.py): wrapper
prefixes dropped (torch's real checkpoint_wrapper and torch.compile's OptimizedModule, a DDP-like
`module`), `Case(tp_names=...)` as a dict or a function, and by values, ambiguity refused; the cases
of case_files/renamed_params.py run end to end."""

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank.names import agree, given_names, strip_wrappers
from tpcheck.checker.sync import Rendezvous
from tpcheck.errors import UsageError
from tpcheck.plan import Shard

CASES = Path(__file__).parent / "case_files" / "renamed_params.py"
ALONE = Rendezvous(None, 0, 1, 1.0)  # one rank: the exchange hands back this rank's own value


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
def test_wrapper_prefixes_are_dropped_anywhere_in_the_name():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert strip_wrappers("module.fc1._checkpoint_wrapped_module.weight") == "fc1.weight"
    assert (
        strip_wrappers("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn.qkv.weight")
        == "layers.0.attn.qkv.weight"
    )
    assert strip_wrappers("_orig_mod.tp_wrapped_module.lm_head.weight") == "lm_head.weight"
    assert strip_wrappers("modules.0.weight") == "modules.0.weight"  # a segment, not a prefix
    inner = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 2)))
    compiled = torch.compile(inner)  # an OptimizedModule, never called: nothing is compiled
    assert [strip_wrappers(n) for n, _ in compiled.named_parameters()] == [
        n for n, _ in nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).named_parameters()
    ]


def test_tp_modules_under_wrappers_or_other_names_stand_for_their_dense_modules():
    """Module outputs are compared by dense name: a wrapped TP module stands for its dense module
    (the outermost of a name, whose forward runs once: a checkpoint wrapper runs the module it wraps
    again in backward), a renamed layer through its matched parameters; a TP module of the dense
    name as it is keeps it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tpcheck.checker.rank.names import module_names

    def block(fc1, fc2):
        m = nn.Module()
        m.norm, m.fc1, m.fc2 = nn.LayerNorm(4), fc1, fc2
        return m

    dense = block(nn.Linear(4, 8), nn.Linear(8, 4))
    tp = nn.Module()
    tp.module = block(checkpoint_wrapper(nn.Linear(4, 4)), nn.Linear(4, 4))
    tp.module.up_proj = tp.module.fc1  # the same layer under a second name: not a new module
    assert module_names(tp, dense, {}) == {
        "module.norm": "norm",
        "module.fc1": "fc1",
        "module.fc2": "fc2",
    }
    renamed = block(nn.Linear(4, 4), nn.Linear(4, 4))
    renamed.down_proj = renamed.fc2
    del renamed.fc2
    tp_names = {"fc2.weight": "down_proj.weight", "fc2.bias": "down_proj.bias"}
    assert module_names(renamed, dense, tp_names) == {"down_proj": "fc2"}


def _dense():
    g = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(8, 4, generator=g),
        "fc2.weight": torch.randn(4, 8, generator=g),
        "norm.weight": torch.ones(4),
        "out_norm.weight": torch.ones(4),
    }


def test_names_are_matched_by_wrapper_prefixes_then_by_values():
    dense = _dense()
    tp = {
        "module.fc1._checkpoint_wrapped_module.weight": dense["fc1.weight"],
        "down_proj.weight": dense["fc2.weight"],
        "norm.weight": dense["norm.weight"],
        "ln_f.weight": dense["out_norm.weight"],
    }
    names, by_values = agree(tp, dense, {}, ALONE, 0, 1)
    assert names == {
        "fc1.weight": "module.fc1._checkpoint_wrapped_module.weight",
        "fc2.weight": "down_proj.weight",
        "out_norm.weight": "ln_f.weight",
    }
    assert by_values == {"fc2.weight": "down_proj.weight", "out_norm.weight": "ln_f.weight"}


def test_values_that_fit_several_tp_parameters_are_refused_naming_them():
    dense = _dense()
    tp = {
        "up_proj.weight": dense["fc1.weight"],
        "down_proj.weight": dense["fc2.weight"],
        "ln_1.weight": torch.ones(4),
        "ln_f.weight": torch.ones(4),
    }
    with pytest.raises(UsageError) as e:
        agree(tp, dense, {}, ALONE, 0, 1)
    assert str(e.value) == (
        "dense parameter 'norm.weight' has no TP parameter of its name, and its values fit "
        "several: ['ln_1.weight', 'ln_f.weight']; say which with "
        "Case(tp_names={'norm.weight': <TP name>})"
    )
    given = given_names({"norm.weight": "ln_1.weight"}, list(dense))
    names, by_values = agree(tp, dense, given, ALONE, 0, 1)
    assert names["norm.weight"] == "ln_1.weight" and by_values["out_norm.weight"] == "ln_f.weight"


def test_a_tp_parameter_left_over_or_a_dense_one_unmatched_is_refused():
    dense = _dense()
    tp = {n: t for n, t in dense.items()} | {"extra.weight": torch.randn(3)}
    with pytest.raises(UsageError, match=r"parameter\(s\) \['extra.weight'\] on rank 0 that match"):
        agree(tp, dense, {}, ALONE, 0, 1)
    tp = {n: t for n, t in dense.items() if n != "fc2.weight"}
    with pytest.raises(UsageError, match="TP module has no parameter for dense parameter 'fc2.wei"):
        agree(tp, dense, {}, ALONE, 0, 1)


def test_tp_names_as_a_dict_or_a_function_of_the_dense_name():
    names = ["fc1.weight", "fc2.weight"]
    assert given_names({"fc1.weight": "up.weight"}, names) == {"fc1.weight": "up.weight"}
    assert given_names(lambda n: n.replace("fc", "mlp.fc"), names) == {
        "fc1.weight": "mlp.fc1.weight",
        "fc2.weight": "mlp.fc2.weight",
    }
    assert given_names(lambda n: n, names) == {}  # a name mapped to itself: no rename
    with pytest.raises(UsageError, match=r"\['fc1.weigth'\] .* \(did you mean 'fc1.weight'"):
        given_names({"fc1.weigth": "up.weight"}, names)


def test_tp_names_on_a_case_are_checked():
    from tpcheck import Plan
    from tpcheck.checker.casefile import load_module
    from tpcheck.checker.usercode import guard_user_case

    base = load_module(str(CASES)).renamed
    with pytest.raises(UsageError, match=r"with a written plan; put them in Plan\(tp_names=...\)"):
        dataclasses.replace(
            base, plan=Plan(params={"x": Shard(0)}), tp_names={"fc1.weight": "up_proj.weight"}
        )
    with pytest.raises(UsageError, match=r"tp_names must be a dict .* not 'fc1.weight': 3"):
        dataclasses.replace(base, tp_names={"fc1.weight": 3})
    guarded = guard_user_case(dataclasses.replace(base, tp_names=lambda n: None), str(CASES))
    with pytest.raises(UsageError, match=r"your tp_names \(.*\) returned None; expected the TP"):
        guarded.tp_names("fc1.weight")


def _run(names, world=2):
    return {r["name"]: r for r in check([file_spec(f"{CASES}:{n}", world) for n in names])}


def test_renamed_and_wrapped_tp_modules_are_checked_with_no_plan_written():
    names = [
        "checkpointed",
        "renamed",
        "renamed_mapping",
        "renamed_function",
        "ambiguous",
        "ambiguous_named",
        "renamed_bias_twice",
    ]
    r = _run(names)
    for good in (
        "checkpointed",
        "renamed",
        "renamed_mapping",
        "renamed_function",
        "ambiguous_named",
    ):
        assert r[f"{good}/tp2/float32"]["verdict"] == "equivalent", r[f"{good}/tp2/float32"]
    for good in ("checkpointed", "renamed"):  # module outputs compared under the dense names
        acts = {c["name"] for c in r[f"{good}/tp2/float32"]["checks"] if c["stage"] == "forward"}
        assert {"act:norm", "act:fc1", "act:fc2", "act:out_norm"} <= acts, acts
    wrapped = r["checkpointed/tp2/float32"]["inferred_plan"]
    assert "'fc1.weight': 'module.fc1._checkpoint_wrapped_module.weight'," in wrapped
    assert "'fc1.weight': Shard(0)," in wrapped and "matched by values" not in wrapped
    renamed = r["renamed/tp2/float32"]["inferred_plan"]
    assert "'fc1.weight': 'up_proj.weight'," in renamed and "'fc2.weight': Shard(1)," in renamed
    assert (
        "\n# matched by values" in renamed and "\n#   'fc1.weight' -> 'up_proj.weight'" in renamed
    )
    for named in ("renamed_mapping", "renamed_function"):
        plan = r[f"{named}/tp2/float32"]["inferred_plan"]
        assert "'fc2.bias': 'down_proj.bias'," in plan and "matched by values" not in plan
    # the checks use the matched TP names: every parameter compared at every stage
    grads = {c["name"] for c in r["renamed/tp2/float32"]["checks"] if c["stage"] == "grads"}
    assert grads == {
        f"grad:{d}.{p}" for d in ("norm", "fc1", "fc2", "out_norm") for p in ("weight", "bias")
    }

    ambiguous = r["ambiguous/tp2/float32"]
    assert ambiguous["verdict"] == "invalid"
    assert (
        "dense parameter 'norm.weight' has no TP parameter of its name, and its values fit "
        "several: ['ln_1.weight', 'ln_f.weight']; say which with Case(tp_names="
    ) in ambiguous["summary"]
    bad = r["renamed_bias_twice/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    f = bad["first_divergence"]
    assert (f["stage"], f["step"], f["name"]) == ("forward", 1, "act:fc2")  # named at its layer
    assert bad["diagnosis"]["signature"] == "offset"


def test_a_wrong_match_of_alike_values_is_never_equivalent(monkeypatch):
    """Checker mutant: the norms, whose loaded values are the same, matched the wrong way round
    (as a matcher that guessed instead of refusing would). Nothing at the weights stage can tell,
    but the checks downstream use the matched names (module outputs, then gradients): the case is
    not equivalent."""
    names_mod = importlib.import_module("tpcheck.checker.rank.names")
    real = names_mod.agree

    def swapped(*args):
        names, by_values = real(*args)
        swap = {"ln_1": "ln_f", "ln_f": "ln_1"}
        for d, t in names.items():
            layer, param = t.split(".")
            names[d] = f"{swap.get(layer, layer)}.{param}"
        return names, by_values

    monkeypatch.setattr(names_mod, "agree", swapped)
    r = _run(["ambiguous_named"])
    result = r["ambiguous_named/tp2/float32"]
    assert result["verdict"] == "not equivalent", result["summary"]
    f = result["first_divergence"]
    # the outputs of the swapped norms, compared under the dense names, first
    assert (f["stage"], f["step"], f["name"]) == ("forward", 1, "act:out_norm")
