"""Whole-model plans: a strategy per node, resharding between nodes, end-to-end verification."""

from shardverify.plan.build import build_plan
from shardverify.plan.graph import node_options
from shardverify.plan.model import GENERIC, NodePlan, Plan, PlanCost, PlanGoals, Reshard
from shardverify.plan.solver import PlanInfeasible, Solver, solve_plan
from shardverify.plan.verify import PlanResult, describe_plan, make_plan, run_plan, verify_plan

__all__ = ["GENERIC", "NodePlan", "Plan", "PlanCost", "PlanGoals", "Reshard", "build_plan", "node_options", "PlanInfeasible",
           "Solver", "solve_plan", "PlanResult", "describe_plan", "make_plan", "run_plan", "verify_plan"]
