"""Uninitialised memory is never compared: ``torch.empty_like(x)`` returns whatever the allocator
held, different on every rank and on the single device, so a plan check leaves its output out
(counted in the coverage report) and compares the consumers that write into it and read it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardverify.plan import verify_plan


class FilledBuffer(nn.Module):
    """An output buffer made with empty_like and written by copy_ (the MoE experts' pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 64)

    def forward(self, x):
        h = self.up(x)
        out = torch.empty_like(h)
        out.copy_(torch.relu(h))
        return (out * h).sum()


@pytest.mark.parametrize("plan", [{"up": "S0R = S0R x RR_0"}, {"up": "RS0 = RR x RS0"}])
def test_an_empty_like_buffer_is_not_compared_its_consumers_are(sv_backend, plan):
    """Before uninitialised nodes were left out, both plans failed at empty_like (max abs error
    3e+291: the allocator's leftovers on a rank against the single device's)."""
    torch.manual_seed(0)
    model, x = FilledBuffer(), torch.randn(32, 8)
    result = verify_plan(model, x, (2,), plan, backend=sv_backend((2,), "simulated"))
    assert result.passed, result.summary()
    assert not result.shards_nothing
    assert result.coverage is not None and result.coverage.uninitialised == ("empty_like",)
    assert any("1 node(s) of uninitialised memory" in line and "empty_like" in line
               for line in result.coverage.lines())
    assert result.coverage.to_json()["uninitialised_not_compared"] == ["empty_like"]
