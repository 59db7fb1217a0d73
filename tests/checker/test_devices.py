"""--device: the CPU (gloo) by default, or one GPU per rank (NCCL beside gloo). What can be checked
without a GPU is checked here: the refusals (exit 2, naming the value and the fix, before any rank
is forked), the spec, name and report of a device, and that no forward path of the library creates a
tensor on the CPU whatever the device of its inputs. The runs on GPUs are in tests/gpu (skipped
without one)."""

import ast
import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.distributed as dist

from tpcheck.api import check
from tpcheck.checker import devices
from tpcheck.checker.case import CaseSpec
from tpcheck.checker.settings import RunSettings
from tpcheck.cli import main
from tpcheck.errors import UsageError
from tpcheck.report.schema import build_report, load_schema

SRC = Path(__file__).resolve().parents[2] / "src" / "tpcheck"
FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "tensor",
    "rand",
    "randn",
    "randint",
    "eye",
    "linspace",
}


def validate(report: dict) -> None:
    jsonschema.Draft202012Validator(load_schema()).validate(report)


def _gpus(monkeypatch, count: int, built: bool = True, nccl: bool = True) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cpu_is_always_accepted_and_an_unknown_device_is_named():
    devices.check_device("cpu", 64)
    with pytest.raises(UsageError, match=r"device 'tpu' is not one of \['cpu', 'cuda'\]"):
        devices.check_device("tpu", 2)
    with pytest.raises(UsageError, match="device 'tpu'"):
        CaseSpec(device="tpu").validate()


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch is built with CUDA")
def test_cuda_on_a_cpu_build_of_torch_is_refused_naming_the_build():
    with pytest.raises(UsageError) as e:
        devices.check_device("cuda", 1)
    assert f"this torch ({torch.__version__}) is built without CUDA" in str(e.value)
    assert "leave --device out" in str(e.value)


def test_cuda_refusals_name_what_is_missing(monkeypatch):
    _gpus(monkeypatch, 0, nccl=False)
    with pytest.raises(UsageError, match="has no NCCL backend"):
        devices.check_device("cuda", 1)
    _gpus(monkeypatch, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UsageError, match=r"no GPU is visible \(CUDA_VISIBLE_DEVICES=''\)"):
        devices.check_device("cuda", 1)
    _gpus(monkeypatch, 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(UsageError) as e:
        devices.check_device("cuda", 2)
    assert "world size 2 needs 2 GPUs, this machine has 1" in str(e.value)
    assert "at most 1" in str(e.value) and "torchrun" in str(e.value)
    devices.check_device("cuda", 1)  # one GPU, one rank: accepted
    devices.check_device("cuda", 8, local_world=1)  # torchrun: 8 ranks, one on this machine
    _gpus(monkeypatch, 4)
    devices.check_device("cuda", 4)
    # this process already used the GPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(
        UsageError, match="already started CUDA, and ranks forked from it cannot use the GPU"
    ):
        devices.check_device("cuda", 2)
    # torchrun's ranks are not forked from this process
    devices.check_device("cuda", 2, forking=False)


def test_the_device_is_in_the_spec_the_name_and_the_report():
    spec = CaseSpec(block="mlp", world_size=2)
    assert spec.device == "cpu" and spec.name == "mlp/seed/tp2/float32"
    on_gpu = dataclasses.replace(spec, device="cuda")
    assert on_gpu.name == "mlp/seed/tp2/float32/cuda"
    (result,) = check([spec.with_run(steps=1)])
    assert result["verdict"] == "equivalent" and result["spec"]["device"] == "cpu"
    report = build_report([result], exit_code=0)
    assert report["environment"]["backend"] == "gloo"
    validate(report)
    gpu_result = json.loads(json.dumps(result))
    gpu_result["spec"]["device"] = "cuda"
    report = build_report([result, gpu_result], exit_code=0)
    assert report["environment"]["backend"] == "gloo+nccl"
    validate(report)
    gpu_result["spec"]["device"] = "tpu"
    with pytest.raises(Exception, match="tpu"):
        validate(build_report([gpu_result], exit_code=0))


@pytest.mark.skipif(
    torch.backends.cuda.is_built() and torch.cuda.device_count() > 0, reason="a GPU is present"
)
@pytest.mark.parametrize(
    "argv",
    [["run", "--block", "mlp", "--world-size", "2"], ["verify", "examples/own_module.py:correct"]],
)
def test_device_cuda_without_a_gpu_exits_2_before_any_rank(argv, capsys, monkeypatch):
    monkeypatch.chdir(SRC.parents[1])
    assert main([*argv, "--device", "cuda", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpcheck: error: --device cuda: ") and "Traceback" not in err


def test_device_cuda_with_too_few_gpus_exits_2_naming_the_count(capsys, monkeypatch):
    _gpus(monkeypatch, 1)
    assert main(["run", "--block", "mlp", "--world-size", "1", "2", "--device", "cuda", "-q"]) == 2
    err = capsys.readouterr().err
    assert "world size 2 needs 2 GPUs, this machine has 1" in err and "Traceback" not in err


def test_an_unknown_device_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--device", "tpu"])
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


def test_a_spec_on_cuda_through_the_api_is_an_invalid_case_when_refused(monkeypatch):
    _gpus(monkeypatch, 0)
    (result,) = check(
        [CaseSpec(block="mlp", world_size=2, run=RunSettings(steps=1), device="cuda")]
    )
    assert result["verdict"] == "invalid" and "no GPU is visible" in result["summary"]


def test_hf_architectures_are_refused_on_cuda(monkeypatch):
    from tpcheck.resolve import RESOLVER

    _gpus(monkeypatch, 2)
    with pytest.raises(UsageError, match="HuggingFace architectures are checked on the CPU only"):
        RESOLVER.validate(CaseSpec(block="hf:llama", world_size=2, device="cuda"))


def _factory_calls_without_device(path: Path, root: Path = SRC):
    """torch factory calls with no device= in `path`, outside `__init__` (modules are built on the
    CPU and moved) and outside draws from a seeded generator (those draw on the CPU by design)."""
    found = []

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and isinstance(child.func.value, ast.Name)
                and child.func.value.id == "torch"
                and child.func.attr in FACTORIES
            ):
                kws = {k.arg for k in child.keywords}
                if (
                    "device" not in kws
                    and "generator" not in kws
                    and getattr(fn, "name", "") != "__init__"
                ):
                    found.append(
                        f"{path.relative_to(root)}:{child.lineno} torch.{child.func.attr} "
                        f"in {fn.name}"
                    )
            visit(child, inner)

    visit(ast.parse(path.read_text()), None)
    return found


def test_no_forward_path_creates_a_tensor_on_the_cpu():
    """The GPU bug class a CPU run cannot show: a tensor made in a forward or backward without
    device= lands on the CPU beside CUDA inputs (RoPE tables, a causal mask, a gather buffer)."""
    files = [
        *(SRC / "models").glob("*.py"),
        *(SRC / "parallel").glob("*.py"),
        SRC / "adapters" / "dtensor.py",
    ]
    found = [f for path in sorted(files) for f in _factory_calls_without_device(path)]
    assert found == []


def test_the_scan_sees_a_cpu_tensor_in_a_forward(tmp_path):
    """The scan's own mutant: a causal mask made without device= in a forward is found."""
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import torch\n\ndef forward(q):\n    return torch.ones(3, 3, "
        "dtype=torch.bool).triu(1)\n\n\n"
        "def fine(q, g):\n    return torch.ones(3, device=q.device) + torch.randn(3, generator=g)\n"
    )
    assert _factory_calls_without_device(bad, tmp_path) == ["probe.py:4 torch.ones in forward"]


def test_the_pytest_fixture_passes_the_device(monkeypatch):
    from tpcheck.pytest_plugin import TPCheckFixture

    _gpus(monkeypatch, 0)
    with pytest.raises(AssertionError, match="no GPU is visible"):
        TPCheckFixture(timeout_s=20, world_sizes=(2,)).verify("mlp", steps=1, device="cuda")
