"""Complex values are compared, drawn and split like two real ones (_fft_r2c and _fft_c2r):
a comparison looks at the real and the imaginary part, each under the real dtype's tolerance; a
partial complex value is pieces that sum to it; no partial max or min of complex numbers exists."""

from __future__ import annotations

import pytest
import torch

from shardverify.sharding.pieces import partial_pieces
from shardverify.verify.tolerance import as_real, compare, is_close, tolerance_for


def test_a_complex_dtype_has_its_real_dtypes_tolerance():
    assert tolerance_for("complex64") == tolerance_for("float32")
    assert tolerance_for(torch.complex128) == tolerance_for(torch.float64)


def test_the_imaginary_part_is_compared_too():
    expected = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
    wrong = expected.clone()
    wrong[1] = 3 + 1j                     # the same real part, another imaginary one
    tol = tolerance_for("complex64")
    assert compare(expected.to(torch.complex64), expected, tol).close
    found = compare(wrong.to(torch.complex64), expected, tol)
    assert not found.close and found.max_abs_err == pytest.approx(2.0)
    assert not is_close(wrong, expected, tol)
    assert as_real(expected).shape == (2, 2) and as_real(expected).dtype == torch.float64


def test_a_nonfinite_imaginary_part_must_agree_exactly():
    expected = torch.tensor([1 + float("inf") * 1j], dtype=torch.complex128)
    assert compare(expected.clone(), expected, tolerance_for("complex128")).close
    assert not compare(torch.tensor([1 + 5j], dtype=torch.complex128), expected, tolerance_for("complex128")).close


def test_complex_partial_pieces_sum_to_the_value_and_differ_from_it():
    value = torch.randn(4, 3, dtype=torch.complex64)
    pieces = partial_pieces(value, 3, seed=5)
    assert pieces.dtype == torch.complex128 and pieces.shape == (3, 4, 3)
    assert torch.allclose(pieces.sum(0), value.to(torch.complex128), atol=1e-6)
    assert all(not torch.allclose(piece, value.to(torch.complex128) / 3) for piece in pieces)
    assert (pieces.imag.abs() > 0).all()   # the imaginary parts are split too, not left to one piece
    with pytest.raises(ValueError, match="complex"):
        partial_pieces(value, 2, seed=0, op="max")


def test_a_copy_to_complex32_is_verified_as_two_float16s():
    """Tensor.chalf: complex32 has float16's tolerance, and its blocks are compared though torch
    has no equality kernel for it."""
    from shardverify import DeviceMesh, trace
    from shardverify.verify.on_demand import verify_node

    class Chalf(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten._to_copy.default(x, dtype=torch.complex32)

    assert tolerance_for(torch.complex32) == tolerance_for(torch.float16)
    graph_module = trace(Chalf(), {"x": torch.randn(4, 6, dtype=torch.float64)})
    node = next(n for n in graph_module.graph.nodes if n.op == "call_function")
    results = verify_node(graph_module, node, DeviceMesh((2, 2)))
    assert len(results) > 3 and all(r.passed for r in results), [r.mismatches for r in results if not r.passed]
