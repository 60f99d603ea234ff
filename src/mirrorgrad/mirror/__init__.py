"""The planning passes: the mirror policy, storage balance, peak-aware budgets."""

from mirrorgrad.mirror.budget_search import Plan, PlanError, PlanOptions, plan
from mirrorgrad.mirror.policy import MirrorPolicy, mark, policy_for

__all__ = ["MirrorPolicy", "Plan", "PlanError", "PlanOptions", "mark", "plan", "policy_for"]
