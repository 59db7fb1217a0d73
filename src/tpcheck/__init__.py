"""tpcheck: prove a tensor-parallel implementation computes what its dense model computes."""
from tpcheck.check.case import Case, CaseSpec
from tpcheck.check.session import check, exit_code
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Fused, Placement, Plan, Replicate, Shard

__version__ = "0.1.0"

__all__ = ["Case", "CaseSpec", "check", "exit_code", "UsageError", "TPGroup", "Plan", "Placement", "Replicate",
           "Shard", "Fused", "__version__"]
