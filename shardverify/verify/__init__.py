"""Numerical verification of sharding strategies against the single-device reference."""

from shardverify.spec.case import InputDecl, ModuleDecl, OpCase
from shardverify.verify.engine import rank_check, verify_case, verify_strategy
from shardverify.verify.report import CheckResult, Mismatch, assert_passed, format_results
from shardverify.verify.tolerance import Tolerance, tolerance_for

__all__ = ["InputDecl", "ModuleDecl", "OpCase", "rank_check", "verify_case", "verify_strategy",
           "CheckResult", "Mismatch", "assert_passed", "format_results", "Tolerance", "tolerance_for"]
