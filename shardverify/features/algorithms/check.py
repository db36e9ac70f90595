"""SPMD verification of a collective implementation.

One :class:`CollectiveCase` names an implementation ``fn(comm, t, axes, **params)``, the
:mod:`reference <shardverify.features.algorithms.references>` it must agree with, a mesh and axes,
the local input shape and dtype. :func:`check_collective` runs :func:`rank_check` on every
rank of a backend; each rank regenerates every group member's input from the seed, so it
can compute its own expected result without communicating, then checks

* the forward result against the reference (``None`` where the reference defines none),
* on a real process group, the forward result against the ``torch.distributed`` builtin,
* the backward: the gradient of ``sum over ranks <out_r, w_r>`` (``w_r`` seeded cotangents)
  against the same quantity differentiated through the reference by autograd,
* for impossible calls (dim out of range, size not divisible...), that it raises
  ``CollectiveError``.

:func:`gradcheck_collective` additionally runs ``torch.autograd.gradcheck`` on the function
of *all* ranks' inputs that the backend computes, with the SPMD backward as its gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from shardverify.features.algorithms.references import Reference, get_reference
from shardverify.errors import CollectiveError, InvalidArgument
from shardverify.spec.names import UnresolvedName
from shardverify.spec.allow import project_of, resolve_allowed
from shardverify.spec.fields import dtype_from_name
from shardverify.verify.tolerance import Tolerance, compare, tolerance_for

__all__ = ["CollectiveCase", "CollectiveReport", "resolve_implementation", "make_input",
           "make_cotangent", "rank_check", "check_collective", "gradcheck_collective"]


@dataclass(frozen=True)
class CollectiveCase:
    """One grid point of a collective spec (a picklable literal in generated tests)."""

    collective: str                     # spec name
    implementation: str                 # dotted name of fn(comm, t, axes, **params)
    reference: str                      # key of REFERENCES
    mesh_shape: tuple[int, ...]
    axes: tuple[int, ...]
    shape: tuple[int, ...]              # local input shape, the same on every rank
    dtype: str = "float32"
    params: tuple[tuple[str, object], ...] = ()
    backward: bool = True
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def differentiable(self) -> bool:
        return self.backward and self.torch_dtype.is_floating_point

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) or "0d"
        mesh = "x".join(map(str, self.mesh_shape))
        params = "".join(f"-{k}={v}" for k, v in self.params)
        return f"{self.collective}[mesh {mesh} axes {list(self.axes)}, {shape} {self.dtype}{params}]"


@dataclass(frozen=True)
class CollectiveReport:
    case: CollectiveCase
    mismatches: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def assert_ok(self) -> None:
        """Fail with every mismatch, one per line (pytest shows the message, not this frame)."""
        __tracebackhide__ = True
        if self.mismatches:
            lines = "\n".join(f"  {m}" for m in self.mismatches)
            raise AssertionError(f"{self.case.describe()} ({self.case.implementation}):\n{lines}")


def resolve_implementation(dotted: str) -> Callable:
    """The callable ``package.module.function`` names (a LookupError when it names none)."""
    try:   # only what spec/allow.py allows, judged before the import and again on the object
        return resolve_allowed(dotted, project_of(None))  # type: ignore[return-value]
    except InvalidArgument as error:
        raise UnresolvedName(str(error)) from None


def _generator(case: CollectiveCase, rank: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(case.seed * 1_000_003 + salt * 10_007 + rank)


def make_input(case: CollectiveCase, rank: int) -> Tensor:
    """The input of global ``rank`` (deterministic: every rank can rebuild everyone's)."""
    gen, dtype = _generator(case, rank, 1), case.torch_dtype
    if dtype.is_floating_point:
        return torch.randn(case.shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-8, 9, case.shape, generator=gen, dtype=torch.int64).to(dtype)


def make_cotangent(case: CollectiveCase, rank: int, shape: tuple[int, ...]) -> Tensor:
    """The output gradient ``w_rank`` of the backward check, in float64 but representable in
    the case's dtype (so the implementation and the reference see the same numbers)."""
    w = torch.randn(shape, generator=_generator(case, rank, 2), dtype=torch.float64)
    return w.to(case.torch_dtype).to(torch.float64) if case.torch_dtype.is_floating_point else w


def _params(case: CollectiveCase) -> tuple[Reference, dict, dict]:
    ref = get_reference(case.reference)
    given = dict(case.params)
    return ref, given, ref.resolve(given)


def _compare(label: str, actual: object, expected: Tensor | None, dtype: torch.dtype,
             tol: Tolerance) -> str | None:
    """A mismatch message, or None when ``actual`` is ``expected`` (in float64, or None) to
    ``tol`` and has ``dtype``."""
    if expected is None:
        return None if actual is None else f"{label}: expected None (no result on this rank), got {_show(actual)}"
    if not isinstance(actual, Tensor):
        return f"{label}: expected a tensor of shape {tuple(expected.shape)}, got {_show(actual)}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"{label}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != dtype:
        return f"{label}: dtype {actual.dtype}, expected {dtype}"
    found = compare(actual, expected, tol)
    if not found.close:
        return (f"{label}: values differ: max abs err {found.max_abs_err:.3g}, max rel err "
                f"{found.max_rel_err:.3g} ({tol}); shape {tuple(actual.shape)} {actual.dtype}")
    return None


def _show(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} {value.dtype}"
    return repr(value) if value is None else type(value).__name__


def rank_check(comm, case: CollectiveCase) -> tuple[str, ...]:
    """The SPMD check of ``case`` on this rank; returns its mismatches (module-level, so the
    process backend's workers can import it)."""
    impl = resolve_implementation(case.implementation)
    ref, given, params = _params(case)
    mesh, rank = comm.mesh, comm.rank
    ranks = tuple(mesh.group_ranks(rank, case.axes))
    pos, p = ranks.index(rank), len(ranks)
    where = f"rank {rank} (position {pos} of group {list(ranks)})"
    dtype = case.torch_dtype
    tol = tolerance_for(dtype, case.rtol, case.atol)
    device = torch.device(comm.device)
    mine = make_input(case, rank).to(device)

    reason = ref.invalid(case.shape, p, params)
    if reason is not None:
        try:
            with torch.no_grad():
                got = impl(comm, mine.clone(), case.axes, **given)
        except CollectiveError:
            return ()
        return (f"{where}: expected CollectiveError ({reason}), got {_show(got)}",)

    problems: list[str | None] = []
    # The reference in float64 (exact for every dtype the inputs are drawn from).
    leaves = [make_input(case, r).to(torch.float64) for r in ranks]
    if case.differentiable:
        leaves = [leaf.requires_grad_() for leaf in leaves]
    expected_all = [ref.expected(leaves, q, params) for q in range(p)]
    expected = expected_all[pos]

    with torch.no_grad():
        out = impl(comm, mine.clone(), case.axes, **given)
    problems.append(_compare(f"{where}: output", out, None if expected is None else expected.detach(),
                             dtype, tol))

    group = comm.process_group(case.axes) if hasattr(comm, "process_group") else None
    if group is not None:
        builtin = ref.builtin(mine.clone(), group, ranks, pos, params)
        problems.append(_compare(f"{where}: output vs torch.distributed builtin", out, builtin, dtype, tol))

    if case.differentiable:
        x = mine.clone().requires_grad_()
        out = impl(comm, x, case.axes, **given)
        if isinstance(out, Tensor) and out.requires_grad:
            weight = make_cotangent(case, rank, tuple(out.shape)) if expected is not None else \
                torch.zeros(out.shape, dtype=torch.float64)
            torch.autograd.backward(out, weight.to(out.dtype).to(out.device))
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        loss = sum(((e * make_cotangent(case, r, tuple(e.shape))).sum()
                    for r, e in zip(ranks, expected_all) if e is not None), torch.zeros((), dtype=torch.float64))
        want = torch.autograd.grad(loss, leaves[pos], allow_unused=True)[0] if loss.requires_grad else None
        want = torch.zeros(case.shape, dtype=torch.float64) if want is None else want
        problems.append(_compare(f"{where}: grad of input", grad, want, dtype, tol))
    return tuple(problem for problem in problems if problem)


def check_collective(backend, case: CollectiveCase, *, timeout: float | None = None) -> CollectiveReport:
    """Run :func:`rank_check` on every rank of ``backend`` (whose mesh must be the case's)."""
    if tuple(backend.mesh.shape) != tuple(case.mesh_shape):
        raise CollectiveError(f"{case.describe()} needs mesh {case.mesh_shape}, the backend has "
                              f"{tuple(backend.mesh.shape)}")
    results = backend.run(rank_check, case, timeout=timeout)
    return CollectiveReport(case, tuple(m for found in results for m in found))


# --------------------------------------------------------------------------- gradcheck


def _forward_all(comm, case: CollectiveCase, xs: list[Tensor]) -> Tensor | None:
    impl = resolve_implementation(case.implementation)
    with torch.no_grad():
        return impl(comm, xs[comm.rank].detach().clone(), case.axes, **dict(case.params))


def _backward_all(comm, case: CollectiveCase, xs: list[Tensor], grads: list[Tensor | None]) -> Tensor:
    impl = resolve_implementation(case.implementation)
    x = xs[comm.rank].detach().clone().requires_grad_()
    out = impl(comm, x, case.axes, **dict(case.params))
    grad = grads[comm.rank]
    torch.autograd.backward(out, torch.zeros_like(out) if grad is None else grad.to(out.dtype))
    return x.grad if x.grad is not None else torch.zeros_like(x)


class _Spmd(torch.autograd.Function):
    """All ranks' outputs as one function of all ranks' inputs: forward runs the collective on
    the backend, backward runs every rank's autograd backward on the backend (so the
    collectives of the backward pass meet), returning each rank's input gradient."""

    @staticmethod
    def forward(ctx, backend, case, *xs):
        ctx.backend, ctx.case = backend, case
        ctx.save_for_backward(*xs)
        outs = backend.run(_forward_all, case, [x.detach() for x in xs])
        ctx.present = tuple(o is not None for o in outs)
        return tuple(o for o in outs if o is not None)

    @staticmethod
    def backward(ctx, *grads):
        xs = ctx.saved_tensors
        it = iter(grads)
        per_rank = [next(it) if present else None for present in ctx.present]
        found = ctx.backend.run(_backward_all, ctx.case, [x.detach() for x in xs], per_rank)
        return (None, None, *found)


def gradcheck_collective(backend, case: CollectiveCase, **gradcheck_kwargs) -> bool:
    """``torch.autograd.gradcheck`` of the implementation as a function of every rank's
    float64 input (finite differences of the SPMD forward against the SPMD backward)."""
    if case.torch_dtype != torch.float64:
        raise CollectiveError(f"gradcheck needs float64 inputs, {case.describe()} is {case.dtype}")
    world = len(backend.mesh.ranks)
    xs = tuple(make_input(case, r).requires_grad_() for r in range(world))
    options = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3, **gradcheck_kwargs}
    return torch.autograd.gradcheck(lambda *inputs: _Spmd.apply(backend, case, *inputs), xs, **options)
