"""Model-level verification: data-parallel training with real torch DDP equals single-device
training, step by step. Model specs live in specs/models/ (kind "model", see `spec`)."""

from shardverify.features.ddp.check import ddp_rank_check, plan_tolerance, reference_trajectory, verify_model
from shardverify.features.ddp.hooks import HOOKS
from shardverify.features.ddp.plan import (DDPOptions, LayerDecl, LossDecl, ModelDecl, ModelPlan, OptimizerDecl,
                                  shard_steps)
from shardverify.features.ddp.report import ModelResult, assert_model_passed

__all__ = ["DDPOptions", "LayerDecl", "LossDecl", "ModelDecl", "ModelPlan", "OptimizerDecl",
           "shard_steps", "HOOKS", "ddp_rank_check", "plan_tolerance", "reference_trajectory",
           "verify_model", "ModelResult", "assert_model_passed"]
