"""Run one op call on DTensor, on every rank at once, forward and backward, and compare every
rank's values with the single-device reference.

The inputs are the audit's own per-rank blocks (:class:`shardverify.features.audit.decide.Problem`):
sharded as DTensor cuts (uneven blocks, either shard order), partial sums made of real
per-rank contributions (random pieces, never zeros or equal shares). Each becomes a DTensor with
the placements of :mod:`shardverify.features.dtensor.placements`; DTensor's own reading of it
(``full_tensor()``) must give back the full value, or the layout is not expressible and nothing
is claimed about the op.

What one execution records: the forward's output placements and collectives, every rank's
output as ``full_tensor()`` gives it compared with the reference (values and shapes), then the
backward of ``sum(output * g)`` for a random ``g`` and every rank's input gradients likewise;
and, for the aten op the call dispatches to, what DTensor's sharding rule says (run locally or
redistribute first, and into which output placement) beside whether the runtime redistributed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from shardverify.sharding.layout import Layout
from shardverify.backends.signals import deadline
from shardverify.capture.call import call_op
from shardverify.features.dtensor.hooks import (AtenCalls, counting_collectives, entered_nodes, fresh_sharding_cache,
                                      quiet_dtensor, reuse_propagation, tracing, watch_redistribution)
from shardverify.features.dtensor.placements import placements_of, placements_text
from shardverify.features.dtensor.rule import RuleVerdict, error_text, rule_verdict, with_redistributed
from shardverify.verify.tolerance import Tolerance, compare, tolerance_for

__all__ = ["RuleVerdict", "Execution", "CaseRunner", "quiet_dtensor", "simulator_failed"]

GRAD_SEED = 4099


@dataclass(frozen=True)
class Execution:
    """One combination executed on DTensor.

    ``failed``: "" (values and gradients right), "inputs" (the layout is not expressible),
    "forward-raises", "forward-wrong", "forward-late" (the op returned a DTensor whose
    ``full_tensor()`` raises), "backward-raises", "backward-late" (a gradient's ``full_tensor()``
    raises), "backward-wrong", "too-slow", "died" (the process died on it: a native crash in torch),
    "not-simulated" (LocalTensorMode itself failed: :func:`simulator_failed`).
    """

    failed: str
    detail: str = ""                        # the exception, or the wrong tensor/rank/error
    output: str = ""                        # output placements DTensor gave
    forward_comms: tuple[tuple[str, int], ...] = ()
    backward_comms: tuple[tuple[str, int], ...] = ()
    resharded: tuple[str, ...] = ()         # input placement changes the forward's runtime made ("[R] -> [S(0)]")
    rule: RuleVerdict | None = None
    raised_in: str = ""                     # the autograd node whose backward raised ("SelectScatterBackward0")

    @property
    def moved_data(self) -> bool:
        """DTensor ran a collective or changed an input's placements in the forward (a view's
        arguments rewritten to the local shape is neither)."""
        return bool(self.forward_comms) or bool(self.resharded)


def _comm_counts(comm) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((getattr(op, "__name__", str(op)).split(".")[-1], n)
                        for op, n in comm.get_comm_counts().items() if n))


@dataclass
class CaseRunner:
    """One case of an op on one mesh: its reference (outputs and input gradients, float64), and
    DTensor executions of input combinations."""

    problem: object                     # shardverify.features.audit.decide.Problem
    operands: tuple                     # shardverify.features.audit.decide.Operand, in combo order
    mesh: object                        # a DeviceMesh made in ``mode``
    mode: object                        # the LocalTensorMode
    grad_outputs: tuple = ()
    ref_grads: dict = field(default_factory=dict)      # operand position -> reference gradient
    backward: bool = True
    budget: float | None = None          # CPU seconds one combination may take (main thread only)
    aten: tuple | None = None            # (op, args, kwargs) of the one aten op the call is, or None
    _inputs: dict = field(default_factory=dict)         # (position, layout) -> DTensor or why not
    _held: list = field(default_factory=list)
    _passed: dict = field(default_factory=dict)
    _rebuilt: dict = field(default_factory=dict)         # (position, partial layout) -> DTensor's sum of the pieces
    _full_outputs: list = field(default_factory=list)    # the last execution's outputs gathered to replicated
    _dirty: bool = True                                  # the sharding cache is cleared before the next run
    _tracer: object = None                               # an OpTrace while culprit() runs

    def __post_init__(self) -> None:
        self._reference_gradients()

    # ---- the reference -----------------------------------------------------------------
    def _reference_gradients(self) -> None:
        problem = self.problem
        values = dict(problem.values)
        leaves = {}
        for i, operand in enumerate(self.operands):
            if operand.differentiable:
                leaves[i] = values[operand.locator] = problem.values[operand.locator].clone().requires_grad_()
        # the tensors the call takes, by identity: the recorded aten call names them
        self._held = [values[o.locator] for o in self.operands]
        self._passed = {id(t): i for i, t in enumerate(self._held)}
        with AtenCalls() as calls:
            out = call_op(problem.node, problem.module, values)
        tensor_calls = [c for c in calls.calls if not str(c[0]).startswith(("aten.detach", "aten.alias"))]
        self.aten = tensor_calls[0] if len(tensor_calls) == 1 else None
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        picked = [outs[k] for k in problem.out_index]
        differentiable = [o for o in picked if o.requires_grad and o.is_floating_point()]
        if not differentiable or not leaves:
            self.backward = False
            return
        generator = torch.Generator().manual_seed(GRAD_SEED)
        self.grad_outputs = tuple(torch.randn(o.shape, generator=generator, dtype=torch.float64)
                                  if o.requires_grad and o.is_floating_point() else None for o in picked)
        try:
            self.ref_grads = _input_grads(picked, self.grad_outputs, leaves)
        except RuntimeError:   # the op has no derivative on one device either: forward only
            self.backward = False

    # ---- inputs -------------------------------------------------------------------------
    def _input(self, position: int, layout: Layout):
        """The DTensor of operand ``position`` in ``layout``, or a str saying why DTensor cannot
        hold it (its placements read the blocks back as another value)."""
        key = (position, layout)
        if key in self._inputs:
            return self._inputs[key]
        from torch.distributed._local_tensor import LocalTensor
        from torch.distributed.tensor import DTensor

        operand = self.operands[position]
        full = self.problem.values[operand.locator]
        blocks = self.problem.local(position, layout)
        placements = placements_of(layout, self.problem.mesh.shape)
        try:
            with self.mode:
                local = LocalTensor({r: b.clone() for r, b in enumerate(blocks)})
                made = DTensor.from_local(local, self.mesh, placements, run_check=False, shape=full.shape,
                                          stride=full.contiguous().stride())
                per_rank = dict(made.full_tensor()._local_tensors)
        except Exception as exc:  # noqa: BLE001 - DTensor cannot even gather these blocks
            found = (f"DTensor cannot read {placements_text(placements)} back from these blocks "
                     f"({error_text(exc)}): the layout {layout} is not expressible so")
            self._inputs[key] = found
            return found
        scale = float(full.abs().max()) if full.numel() and full.is_floating_point() else 0.0
        tol = Tolerance(1e-9, 1e-9 * scale)
        bad = [r for r, t in sorted(per_rank.items()) if t.shape != full.shape or not compare(t, full, tol).close]
        if bad:
            found = (f"DTensor reads {placements_text(placements)} back as another value on rank(s) {bad}: "
                     f"the layout {layout} is not expressible so")
        else:
            found = made
            if layout.partial:   # the value its pieces sum to, rounding and all
                self._rebuilt[key] = per_rank[0]
        self._inputs[key] = found
        return found

    # ---- one execution ---------------------------------------------------------------------
    def run(self, combo: tuple[Layout, ...]) -> Execution:
        """Execute ``combo``; "too-slow" when DTensor has not finished within ``self.budget``
        seconds of CPU time (its sharding propagation of attention with a mask takes minutes a
        combination; a loaded machine's waits are no work and do not count)."""
        if self._dirty:    # a failure may have left DTensor's cached placements holding state
            fresh_sharding_cache()
        try:
            with deadline(self.budget, TooSlow, cpu=True):
                found = self._run(combo)
        except TooSlow:
            found = Execution("too-slow", f"DTensor did not finish within {self.budget:g} s of CPU time")
        self._dirty = found.failed not in ("", "inputs")
        return found

    def _run(self, combo: tuple[Layout, ...]) -> Execution:
        from torch.distributed.tensor.debug import CommDebugMode

        problem = self.problem
        values: dict = {}
        leaves: dict = {}
        for i, (operand, layout) in enumerate(zip(self.operands, combo)):
            made = self._input(i, layout)
            if isinstance(made, str):
                return Execution("inputs", made)
            if operand.differentiable and self.backward:
                with self.mode:
                    made = made.detach().requires_grad_()
                leaves[i] = made
            values[operand.locator] = made
        answers: dict = {}
        rule = rule_verdict(self.aten, self._passed, self.operands, values, self.mode, answers)
        tracer = self._tracer
        with self.mode:
            try:
                with counting_collectives() as comm, watch_redistribution() as watch, tracing(tracer, "forward", watch), \
                        reuse_propagation(answers):
                    out = call_op(problem.node, problem.module, values)
            except Exception as exc:  # DTensor refuses: its own error, reported
                failed = "not-simulated" if simulator_failed(exc) else "forward-raises"
                return Execution(failed, _phase_said(failed, "forward", exc), rule=with_redistributed(rule, watch.ops))
            rule = with_redistributed(rule, watch.ops)
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            picked = [outs[k] for k in problem.out_index]
            gathered = self._gather_outputs(picked)
        shown = ", ".join(placements_text(o.placements) if hasattr(o, "placements") else type(o).__name__
                          for o in picked)
        base = dict(output=shown, forward_comms=_comm_counts(comm), resharded=tuple(watch.ops), rule=rule)
        if isinstance(gathered, _Late):
            return Execution("forward-late", gathered.text, **base)
        # compared outside the mode: plain tensor ops under LocalTensorMode cost 10x
        alt = functools.cache(lambda: self._at_rebuilt(combo))   # asked only where a value is off
        wrong = gathered if isinstance(gathered, str) else self._compare_outputs(gathered, alt)
        if wrong:
            return Execution("forward-wrong", wrong, **base)
        if not self.backward:
            return Execution("", **base)
        with self.mode:
            fulls, seeds = self._seeds(picked)   # shardverify's own gather of the outputs: not counted
            nodes = entered_nodes(fulls)         # which autograd node raised, if one does
            try:
                with CommDebugMode() as comm, watch_redistribution() as watch, tracing(tracer, "backward", watch), \
                        nodes:
                    if fulls:
                        torch.autograd.backward(fulls, seeds)
            except Exception as exc:  # noqa: BLE001 - DTensor's backward refuses after the op returned
                failed = "not-simulated" if simulator_failed(exc) else "backward-raises"
                return Execution(failed, _phase_said(failed, "backward", exc), raised_in=nodes.last, **base)
            grads = {}
            for i, leaf in leaves.items():
                if leaf.grad is None:
                    grads[i] = None
                    continue
                try:
                    grads[i] = (placements_text(leaf.grad.placements), dict(leaf.grad.full_tensor()._local_tensors))
                except Exception as exc:  # noqa: BLE001 - the gradient's metadata does not fit its locals
                    return Execution("backward-late", f"gradient of {self.operands[i].role} "
                                     f"{placements_text(leaf.grad.placements)}: full_tensor() raises {error_text(exc)}",
                                     backward_comms=_comm_counts(comm), **base)
        base["backward_comms"] = _comm_counts(comm)
        wrong = self._compare_grads(grads, alt)
        return Execution("backward-wrong" if wrong else "", wrong, **base)

    def _gather_outputs(self, picked) -> "list | str | _Late":
        """Every output's placements and each rank's ``full_tensor()`` of it (inside the mode),
        or what is wrong with an output before its values are looked at (a :class:`_Late` when
        the op returned a DTensor whose ``full_tensor()`` raises)."""
        from torch.distributed.tensor import DTensor, Replicate

        found = []
        self._full_outputs = []
        for k, (item, expected) in enumerate(zip(picked, self.problem.outputs)):
            if not isinstance(item, DTensor):
                return f"output {k} is a {type(item).__name__}, not a DTensor"
            if tuple(item.shape) != tuple(expected.shape):
                return f"output {k} claims global shape {tuple(item.shape)}, the reference has {tuple(expected.shape)}"
            try:
                # full_tensor(), kept in the autograd graph: the backward's loss is made of this
                # same gather (a MaskPartial output reduces once; a second gather asserts)
                full = item.redistribute(self.mesh, [Replicate()] * self.mesh.ndim)
                per_rank = dict(full.to_local()._local_tensors)
            except Exception as exc:  # noqa: BLE001 - the output's metadata does not fit its locals
                return _Late(f"output {k} {placements_text(item.placements)}: full_tensor() raises {error_text(exc)}")
            found.append((placements_text(item.placements), per_rank))
            self._full_outputs.append(full)
        return found

    def _at_rebuilt(self, combo) -> tuple | None:
        """(outputs, input gradients) of the op at the values DTensor's partial inputs sum to, or
        None without partial inputs. A partial sum comes back with the rounding of its own sum:
        where the op is discontinuous (amax's gradient split among tied maxima) that rounding
        moves the result, and DTensor cannot do better than the op at the value it was given."""
        rebuilt = {i: self._rebuilt[(i, layout)] for i, layout in enumerate(combo) if (i, layout) in self._rebuilt}
        if not rebuilt:
            return None
        values = dict(self.problem.values)
        leaves = {}
        for i, operand in enumerate(self.operands):
            value = rebuilt.get(i, self.problem.values[operand.locator])
            if operand.differentiable and self.backward:
                value = leaves[i] = value.clone().requires_grad_()
            values[operand.locator] = value
        out = call_op(self.problem.node, self.problem.module, values)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        picked = [outs[k] for k in self.problem.out_index]
        return tuple(o.detach() for o in picked), _input_grads(picked, self.grad_outputs, leaves)

    def _compare_outputs(self, gathered: list, alt=lambda: None) -> str:
        """"" when every rank's full value of every output is the reference (or the op at the
        values DTensor's partial inputs sum to); else the first output, rank and error that is not."""
        for k, ((shown, per_rank), expected, tol) in enumerate(zip(gathered, self.problem.outputs,
                                                                     self.problem._tols)):
            problem = _first_mismatch(per_rank, expected, tol)
            if problem and alt() is not None and not _first_mismatch(per_rank, alt()[0][k], tol):
                problem = ""
            if problem:
                return f"output {k} {shown}: {problem}"
        return ""

    def _seeds(self, picked) -> tuple[list, list]:
        """The outputs as :meth:`_gather_outputs` gathered them to replicated (this check's own
        collective, made before the backward's are counted) and ``g`` for each, as replicated
        DTensors: the backward of ``sum(output * g)`` without running the mul and sum on DTensor."""
        from torch.distributed.tensor import DTensor, Replicate

        fulls, seeds = [], []
        for item, full, g in zip(picked, self._full_outputs, self.grad_outputs):
            if g is None or not isinstance(item, DTensor) or not item.requires_grad:
                continue
            fulls.append(full)
            seeds.append(DTensor.from_local(_replicated(g.to(full.dtype), self.mesh.size()), self.mesh,
                                            [Replicate()] * self.mesh.ndim, run_check=False))
        return fulls, seeds

    def _compare_grads(self, grads: dict, alt=lambda: None) -> str:
        for i, found in grads.items():
            expected = self.ref_grads.get(i)
            if expected is None:
                continue
            role = self.operands[i].role
            if found is None:
                if bool(expected.abs().max() > 0):
                    return f"no gradient reached {role}"
                continue
            shown, per_rank = found
            tol = Tolerance(1e-7, 1e-7 * max(float(expected.abs().max()), 1.0))
            problem = _first_mismatch(per_rank, expected, tol)
            if problem and alt() is not None and i in alt()[1] and not _first_mismatch(per_rank, alt()[1][i], tol):
                problem = ""
            if problem:
                return f"gradient of {role} {shown}: {problem}"
        return ""

    def culprit(self, combo: tuple[Layout, ...]):
        """Executes ``combo`` again with every aten op DTensor runs held to the op on its inputs'
        full values: the first wrong one (an attribute.Step: its placements, who is to blame),
        or None when no single op is found wrong (:mod:`shardverify.features.dtensor.attribute`)."""
        from shardverify.features.dtensor.attribute import OpTrace

        self._tracer = OpTrace()
        try:
            self.run(combo)
            found = self._tracer.culprit
        finally:
            self._tracer = None
            self._dirty = True
        return found

@dataclass(frozen=True)
class _Late:
    """The op returned, but reading its output (``full_tensor()``) raises."""

    text: str


class TooSlow(BaseException):
    """Raised into DTensor when a combination's time is up (not an ``Exception``: DTensor's own
    handlers re-raise those as its errors)."""


def simulator_failed(exc: BaseException) -> bool:
    """The error arose where LocalTensorMode combines the ranks' results of one op into one value
    (``_combine_rank_results``), a step real processes do not have: the ranks' results differ in
    structure (``torch.chunk`` of uneven local blocks gives each rank another number of pieces),
    which it asserts against or fails on. Nothing is then known of DTensor in process; on real
    gloo processes the same combination runs (select_scatter's on (2, 3))."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name.startswith("_combine_") and "_local_tensor" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _phase_said(failed: str, phase: str, exc: BaseException) -> str:
    if failed != "not-simulated":
        return error_text(exc)
    return f"{phase}: LocalTensorMode fails combining the ranks' results ({error_text(exc)})"


def _input_grads(outputs, grad_outputs, leaves: dict) -> dict:
    """position -> gradient of ``sum(output * g)`` for each leaf (zeros where none reaches it)."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
    if not pairs or not leaves:
        return {}
    found = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [g for _, g in pairs],
                                allow_unused=True)
    return {i: (g.detach() if g is not None else torch.zeros_like(leaves[i])) for i, g in zip(leaves, found)}


def _replicated(value: torch.Tensor, world: int):
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor({r: value.clone() for r in range(world)})


def _first_mismatch(per_rank: dict, expected: torch.Tensor, tol: Tolerance) -> str:
    """"" when every rank's value matches ``expected``; else the first rank's shape or error."""
    for rank, got in sorted(per_rank.items()):
        if tuple(got.shape) != tuple(expected.shape):
            return f"rank {rank} holds shape {tuple(got.shape)}, the reference {tuple(expected.shape)}"
        if got.is_floating_point() and got.dtype != torch.float64:
            # an output cast down (x.to(float32)) is held to its own dtype's rounding: a partial
            # sum cast piece by piece rounds each piece, which is no corruption
            own = tolerance_for(got.dtype)
            tol = Tolerance(max(tol.rtol, own.rtol), max(tol.atol, own.atol))
        found = compare(got, expected, tol)
        if not found.close:
            return (f"rank {rank} differs from the reference (max abs error {found.max_abs_err:.3g}"
                    f"{', ' + found.nonfinite if found.nonfinite else ''}{_ulps(got, expected, found)})")
    return ""


def _ulps(got: torch.Tensor, expected: torch.Tensor, found) -> str:
    """How a low-precision output's error reads in its dtype's units in the last place at the
    reference's largest value, when it is within a few of them (rootcause.FEW_ULPS): rounding,
    which the report does not count as corruption; "" otherwise."""
    from shardverify.features.dtensor.rootcause import FEW_ULPS, ROUNDING_MARK

    if not got.is_floating_point() or got.dtype == torch.float64 or found.nonfinite or not expected.numel():
        return ""
    top = float(expected.abs().max())
    if not math.isfinite(top) or top == 0.0:
        return ""
    ulp = torch.finfo(got.dtype).eps * 2.0 ** math.floor(math.log2(top))
    ulps = found.max_abs_err / ulp
    return f", {ulps:.2g} {str(got.dtype).removeprefix('torch.')} {ROUNDING_MARK}" if ulps <= FEW_ULPS else ""
