"""Analysis of a loop body: dependence classes, roles, the associativity checker, update rules."""
from .associativity import Analysis, Blocker, StateAnalysis, analyze, role_phrase
from .dependence import Dep, Dependence, analyze_dependence
from .roles import assign_roles, final_products, kernel_parameters
from .rules import match_newton_schulz, match_norm, update_rules

__all__ = ["Analysis", "Blocker", "StateAnalysis", "analyze", "role_phrase", "Dep", "Dependence",
           "analyze_dependence", "assign_roles", "final_products", "kernel_parameters",
           "match_newton_schulz", "match_norm", "update_rules"]
