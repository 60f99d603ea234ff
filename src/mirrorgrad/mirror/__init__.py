"""The planning passes: the mirror policy, storage balance, balance and budget modes."""

from mirrorgrad.mirror.plan import Plan, PlanError, PlanOptions
from mirrorgrad.mirror.planner import plan
from mirrorgrad.mirror.policy import MirrorPolicy, mark, policy_for

__all__ = ["MirrorPolicy", "Plan", "PlanError", "PlanOptions", "mark", "plan", "policy_for"]
