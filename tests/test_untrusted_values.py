"""Values a user hands shardverify that would make it do unbounded work, touch storage, echo a
megabyte back, or leave a half-written file: each refused or bounded in one line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from shardverify.errors import SpecError

REPO = Path(__file__).resolve().parents[1]

MODEL = """\
name: tiny
model:
  layers:
    - {module: torch.nn.Linear, args: [4, 2]}
data:
  input: [8, 4]
  target: [8, 2]
loss: mse
steps: 2
meshes: [[2]]
plans:
  - {accumulate: ACCUMULATE}
"""


def _model_spec(accumulate: str):
    from shardverify.ddp.spec import parse_model_spec
    from shardverify.spec.loader import load_yaml_text

    return parse_model_spec(load_yaml_text(MODEL.replace("ACCUMULATE", accumulate), "specs/models/tiny.yaml"))


def test_a_model_plans_micro_batches_are_bounded_naming_accumulate():
    """`accumulate: 1000000000` was accepted: a thousand million forward and backward passes."""
    assert _model_spec("[1, 2048]").plans[-1].options.accumulate == 2048
    with pytest.raises(SpecError) as info:
        _model_spec("1000000000")
    message = str(info.value)
    assert message.startswith("specs/models/tiny.yaml:12") and "accumulate=1000000000 x steps=2" in message
    assert "exceed the limit of 4096" in message and "SHARDVERIFY_MAX_MICRO_BATCHES" in message
