"""Read-only views of a joint forward+backward graph: roles, liveness, cost."""

from mirrorgrad.graph.joint import JointGraph, JointGraphError

__all__ = ["JointGraph", "JointGraphError"]
