"""Real reports for the report tests: produced once per session by the `tpcheck` command itself."""

import pytest

from report_helpers import MATRIX_ARGS, REPO, SEED_ARGS, Run, run_with_reports, tpcheck  # noqa: F401


@pytest.fixture(scope="session")
def seed_run(tmp_path_factory) -> Run:
    return run_with_reports(tmp_path_factory.mktemp("seed"), SEED_ARGS)


@pytest.fixture(scope="session")
def matrix_run(tmp_path_factory) -> Run:
    return run_with_reports(tmp_path_factory.mktemp("matrix"), MATRIX_ARGS)
