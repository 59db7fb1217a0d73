"""tpcheck: prove a tensor-parallel implementation computes what its dense model computes."""

from tpcheck._version import __version__
from tpcheck.api import check, exit_code
from tpcheck.checker.case import Case, CaseSpec, Injection
from tpcheck.checker.settings import RunSettings
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import AppliedOnRank, Fused, OnRank, Placement, Plan, Replicate, Shard

__all__ = [
    "Case",
    "CaseSpec",
    "RunSettings",
    "Injection",
    "check",
    "exit_code",
    "UsageError",
    "TPGroup",
    "Plan",
    "Placement",
    "Replicate",
    "Shard",
    "Fused",
    "AppliedOnRank",
    "OnRank",
    "__version__",
]
