"""One rule for whose code a frame is (`sourcelines.frame_kind`), shared by the three places that
name the user's line: an exception in user code (`user_frame`), a rank's traceback
(`failures.raised_in`) and a rank's live stack (`heartbeat.spot_of`); and `call_user`, the one way
user code is called."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import tpcheck
from tpcheck.checker.sourcelines import frame_kind, user_frame
from tpcheck.checker.usercode import call_user
from tpcheck.checker.verdict.failures import raised_in
from tpcheck.errors import UsageError

TORCH = os.path.dirname(torch.__file__)
TPCHECK = os.path.dirname(tpcheck.__file__)


@pytest.mark.parametrize(
    "path, kind",
    [
        (__file__, "user"),
        ("/home/me/project/tp_model.py", "user"),
        (
            "/home/me/tpcheck/examples/own_module.py",
            "user",
        ),  # a folder named like us is not our code
        (
            "/opt/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py",
            "user",
        ),
        (os.path.join(TORCH, "distributed", "distributed_c10d.py"), "torch"),
        ("/other/host/lib/python3.12/site-packages/torch/nn/modules/module.py", "torch"),
        (os.path.join(TPCHECK, "checker", "rank", "engine.py"), "tpcheck"),
        ("/other/host/lib/python3.12/site-packages/tpcheck/checker/rank/engine.py", "tpcheck"),
        (os.__file__, "python"),
        ("/other/host/lib/python3.12/threading.py", "python"),
        ("<frozen runpy>", "python"),
        ("", "python"),
    ],
)
def test_frame_kind(path, kind):
    assert frame_kind(path) == kind


def test_the_three_finders_agree_on_a_traceback_through_torch():
    def users_code():
        return torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 5))  # shapes do not fit

    with pytest.raises(RuntimeError) as info:
        users_code()
    line = users_code.__code__.co_firstlineno + 1
    assert user_frame(info.value, None) == f"{os.path.relpath(__file__)}:{line}"
    import traceback

    text = "".join(traceback.format_exception(info.value))
    assert raised_in(text).startswith(f"{os.path.relpath(__file__)}:{line} in users_code")


def test_call_user_names_the_users_line_and_lets_tpchecks_own_messages_pass():
    def broken(x):
        return 1 / x

    with pytest.raises(
        UsageError, match=r"in your loss \(.*test_user_frames.py:\d+\): ZeroDivisionError"
    ):
        call_user(broken, 0, who="your loss", path=os.path.abspath(__file__))

    def refuses():
        raise UsageError("tpcheck's own words")

    with pytest.raises(UsageError, match="^tpcheck's own words$"):
        call_user(refuses, who="your build_tp", path=None)
    with pytest.raises(
        UsageError, match=r"^importing failed \(.*\): UsageError: tpcheck's own words"
    ):
        call_user(
            refuses,
            who="your case file",
            path=None,
            failed="importing failed",
            usage_is_theirs=True,
        )

    def exits():
        sys.exit(4)

    with pytest.raises(UsageError, match=r"your init called sys.exit\(4\)"):
        call_user(exits, who="your init", path=None)
    assert call_user(lambda a, b: a + b, 2, 3, who="your make_batch", path=None) == 5
