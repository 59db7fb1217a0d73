"""Beyond one machine: a check under `torchrun --nnodes 2`, two agents meeting through a c10d
rendezvous on 127.0.0.1 (as two hosts would at the first host's address). Every rank runs every
case; the rank that is global rank 0 writes the report; every agent exits with
the verdict's code."""

import json
import socket
import subprocess
import sys

import pytest

from paths import REPO

CASE = REPO / "examples" / "own_module.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_through_a_c10d_rendezvous(tmp_path):
    port = _free_port()
    agents = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"127.0.0.1:{port}",
            "--rdzv_id",
            f"tpcheck-{port}",
            "-m",
            "tpcheck",
            "verify",
            f"{CASE}:correct",
            f"{CASE}:buggy",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--json",
            str(tmp_path / f"node{node}.json"),
        ]
        agents.append(
            subprocess.Popen(
                cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [a.communicate(timeout=300) for a in agents]
    codes = [a.returncode for a in agents]
    assert codes == [1, 1], outs  # the buggy case is not equivalent: the same code on every node
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("node*.json"))]
    assert len(reports) == 1  # written once, by global rank 0
    verdicts = {c["name"]: c["verdict"] for c in reports[0]["cases"]}
    assert verdicts == {
        "own_mlp/tp2/float32": "equivalent",
        "own_mlp_bias_before_reduce/tp2/float32": "not equivalent",
    }
