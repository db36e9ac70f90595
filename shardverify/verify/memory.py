"""What one case's check will hold, estimated before anything is allocated.

A spec declares shapes, but an op's parameters can create far larger tensors
(``Tensor.new_ones((12000, 12000))`` from a 2x2 input): the case's traced harness already knows
every tensor's shape from its meta-device run (`OpCase.build`), so the estimate is the bytes of
every tensor the harness makes (inputs, the op's output, a predecessor's, the module's state), in
float64 (the reference's dtype, the widest a check uses), times the copies a check holds at once:
the single-device reference and each rank's (a replicated layout holds the whole tensor on every
rank), each with its gradient. Seeds run one after another and add no copy. Over
MAX_CASE_BYTES the case is refused with its estimate, naming the setting that raises it.
"""

from __future__ import annotations

import math

import torch

from shardverify.capture.meta import output_metas
from shardverify.errors import VerificationError
from shardverify.spec.case import OpCase
from shardverify.spec.limits import MAX_CASE_BYTES

__all__ = ["case_tensor_bytes", "check_case_memory"]

_FLOAT64 = 8


def case_tensor_bytes(case: OpCase) -> int:
    """Bytes, in float64, of every tensor the case's harness creates: each traced node's value and
    the harness's parameters and buffers, read from the meta-device trace (nothing allocated)."""
    graph_module, _ = case.build()
    total = 0
    for node in graph_module.graph.nodes:
        if node.op == "output":   # the op's node, already counted
            continue
        for item in output_metas(node) or ():
            if item is not None:
                total += math.prod(item.shape) * _FLOAT64
    for tensor in (*graph_module.parameters(), *graph_module.buffers()):
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * _FLOAT64
    return total


def check_case_memory(case: OpCase, mesh_shape: tuple[int, ...]) -> None:
    """Refuse (VerificationError) a case whose check is estimated above MAX_CASE_BYTES on this mesh,
    before any tensor of it is allocated; the message gives the estimate and how it was made."""
    ranks = math.prod(mesh_shape)
    tensors = case_tensor_bytes(case)
    estimate = tensors * (1 + ranks) * 2
    limit = MAX_CASE_BYTES.value
    if estimate > limit:
        raise VerificationError(
            f"{case.op}: case {case.describe()} on mesh {list(mesh_shape)} is refused before it runs: its check "
            f"is estimated at {_size(estimate)} ({_size(tensors)} of float64 tensors in the traced harness x "
            f"{1 + ranks} copies (reference and {ranks} ranks) x 2 (values and gradients)), over the limit of "
            f"{_size(limit)} (raise it with {MAX_CASE_BYTES.env}=BYTES)")


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"
