"""Every layout combination of one op case's operands on one mesh, enumerated and decided
numerically once per orbit of the mesh's axis symmetries (the others follow by renaming axes),
with the strategies the spec offers for the case: the state the completeness audit (run.py) and
the DTensor harness share.

Over the combination limit the partial max/min layouts are left out first, then the partial sums,
then the combinations are decided on a stated sample (audit/sample.py); each is said in ``note``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from operator import getitem

import torch

from shardverify.features.audit.decide import Operand, Outcome, Problem, prepare, lone_value_draws
from shardverify.features.audit.layouts import PARTIAL_INPUTS, axis_symmetries, is_extremum, tensor_layouts
from shardverify.features.audit.offered import local_argument_choices, output_shape_argument
from shardverify.features.audit.sample import AUDIT_SAMPLE, SAMPLE_SEED, counterparts, sampled_indices
from shardverify.sharding.layout import Layout
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import OperationDataType
from shardverify.spec.limits import MAX_AUDIT_COMBINATIONS
from shardverify.verify.distinct import distinguishing_seeds

__all__ = ["CaseCombinations", "spec_handler", "offered_strategies", "outputs_hold", "outputs_text", "combo_key"]


def spec_handler(spec):
    """The HandlerDef a spec's generated module registers, built here without registering,
    so a spec on disk (or a test's planted one) is audited as written."""
    from shardverify.strategies.handlers.base import HandlerDef

    return HandlerDef(
        name=spec.name, targets=tuple(t.name for t in spec.targets), operands=spec.operands, params=spec.params,
        generator=spec.generator, rule=spec.rule, spec_file=spec.source, ignores=tuple(spec.ignores),
        overrides=tuple((t.name, t.operands, t.params) for t in spec.targets if t.aten))


def offered_strategies(spec, graph_module, node, mesh: DeviceMesh) -> tuple[dict, list]:
    """(operand data by role, strategies) that the spec's generator offers for ``node``: the
    verifier's own path (a module's attributes read as its parameters included)."""
    from shardverify.spec.names import resolve_dotted
    from shardverify.strategies.for_node import handler_strategies

    handler = spec_handler(spec)
    if node.op == "call_function":
        for target in spec.targets:
            if target.aten and resolve_dotted(target.name) is node.target:
                handler = handler.for_target(target.name)
    return handler_strategies(handler, graph_module, node, mesh)


def combo_key(combo) -> tuple[str, ...]:
    """A combination as its layouts' keys (one key per valid combination, whatever its example)."""
    return tuple(layout.key() for layout in combo)


def outputs_text(outputs: tuple[Layout, ...]) -> str:
    """Output layouts as a finding says them."""
    return ", ".join(str(layout) for layout in outputs)


class CaseCombinations:
    """The state of one case's audit on one mesh: its operands' layouts, every combination of them
    decided once per orbit of the mesh's axis symmetries, and the outcomes."""

    def __init__(self, spec, case, mesh_shape: tuple[int, ...], partial_inputs: bool,
                 extremum_inputs: bool = True) -> None:
        self.spec, self.case, self.mesh = spec, case, DeviceMesh(tuple(mesh_shape))
        graph_module, node_name = case.build()
        node = next(n for n in graph_module.graph.nodes if n.name == node_name)
        by_role, self.strategies = offered_strategies(spec, graph_module, node, self.mesh)
        # an operand may be absent (added after the reduce) when it is optional or when a
        # strategy post-adds it (addmm's `input` bias is neither optional nor a parameter)
        optional = {o.role for o in spec.operands if o.optional}
        aligned = {add.operand: add.dims for strategy in self.strategies for add in strategy.post_add}
        constant = {i.role for i in spec.verify.inputs if not i.grad}
        self.operands = tuple(
            Operand(d.name, d.role, (d.locator.kind, d.locator.key), d.shape, d.dtype.is_floating_point,
                    d.role in optional or d.name in aligned, d.dtype.is_complex, d.dtype == torch.bool,
                    d.role in constant)
            for d in by_role.values() if d.type is not OperationDataType.OUTPUT)
        outputs = [d for d in by_role.values() if d.type is OperationDataType.OUTPUT]
        self.output_roles = [d.role for d in outputs]
        self.output_names = [d.name for d in outputs]
        # one problem per seed the data needs to tell every two blocks apart (verify/distinct.py):
        # a combination is valid only where it holds on every one of them
        self.problems: list[Problem] = [
            prepare(dataclasses.replace(case, seed=seed), self.mesh, self.operands, [d.locator.key or 0 for d in outputs])
            for seed in distinguishing_seeds(case, tuple(mesh_shape)).seeds]
        self.problem = self.problems[0]
        # bool operands also drawn all False but one element (and all True): half-true data
        # saturates a reduction (decide.py)
        draws, refused = lone_value_draws(self.problem)
        self.problems += draws
        for problem in self.problems:
            problem.shape_arg = output_shape_argument(self.strategies)
            problem.local_choices = local_argument_choices(self.strategies, self.mesh)
        # ... and only when the op really is additive in it (checked numerically)
        ops = (PARTIAL_INPUTS if extremum_inputs else ("sum",)) if partial_inputs else ()
        self.choices = self._choices(ops, aligned)
        # mesh symmetry -> layout -> the layout renamed by it: each operand has few layouts, and
        # every combination is kept once per symmetry (on (2,2), 926,799 renamings of a few
        # hundred layouts took half of an attention case's audit)
        self._renamed: dict[tuple[int, ...], dict[Layout, Layout]] = {
            perm: {} for perm in axis_symmetries(self.mesh.shape)}
        self._identity = tuple(range(self.mesh.ndim))
        self.note = "; ".join(refused)
        # over the limit, the partial max/min layouts are left out first, then the partial sums:
        # no combination a spec must offer is lost but those, and an offered partial-input
        # strategy is decided on its own; said in the result
        for fewer, what in ((("sum",), "partial max/min"), ((), "partial-input")):
            count = self.count()
            if not (set(ops) - set(fewer)) or not MAX_AUDIT_COMBINATIONS.exceeded(count):
                continue
            self.choices, ops = self._choices(fewer, aligned), fewer
            self.note = "; ".join(filter(None, [self.note, (
                f"{what} layouts not enumerated: with them {count} combinations exceed the limit of "
                f"{MAX_AUDIT_COMBINATIONS.value} (raise it with {MAX_AUDIT_COMBINATIONS.env}=N)")]))
        # still over it: decided on a stated sample (audit/sample.py), never an error
        self.sample = 0
        if MAX_AUDIT_COMBINATIONS.exceeded(self.count()):
            self.sample = AUDIT_SAMPLE.value
            self.note = "; ".join(filter(None, [self.note, (
                f"decided on a sample: {self.sample} of {self.count()} combinations (seed {SAMPLE_SEED}, uniform; "
                f"absent operands' full-value counterparts decided where needed), over the limit of "
                f"{MAX_AUDIT_COMBINATIONS.value}; missing combinations are searched only in the sample, every "
                f"offered strategy is decided (sample size: {AUDIT_SAMPLE.env}=N)")]))
        self.results: dict[tuple[Layout, ...], Outcome] = {}

    def _choices(self, ops: Sequence[str], aligned: dict) -> list:
        """Each operand's layouts (partial values reducing by each of ``ops`` where the operand
        is floating; absent where it may be added after the op, which is checked numerically)."""
        return [tensor_layouts(o.shape, self.mesh.shape,
                               partial=ops if o.floating else tuple(op for op in ops if op == "sum") if o.complex else (),
                               absent=o.optional and self.problem.post_addable(i, aligned.get(o.name)))
                for i, o in enumerate(self.operands)]

    def count(self) -> int:
        """The combinations :meth:`combinations` gives: at most one partial max/min input each."""
        plain = [sum(not is_extremum(layout) for layout in c) for c in self.choices]
        return math.prod(plain) + sum((len(c) - n) * math.prod(plain[:i] + plain[i + 1:])
                                      for i, (c, n) in enumerate(zip(self.choices, plain)))

    def combinations(self):
        """Every combination of the operands' layouts with at most one partial max or min input:
        a pointwise op is monotone in one operand with the others fixed, never in two at once
        (``max(a_i) + max(b_i)`` is no ``max(a_i + b_i)``), so two are not enumerated. Over the
        combination limit, the stated sample of them."""
        choices = self.choices
        for index in self._indices():
            yield tuple(map(getitem, choices, index))

    def _indices(self):
        """:meth:`combinations`, each as its layouts' indices in ``choices``."""
        lengths = [len(c) for c in self.choices]
        indices = sampled_indices(lengths, self.sample) if self.sample else itertools.product(*map(range, lengths))
        extrema = [tuple(map(is_extremum, c)) for c in self.choices]
        if sum(map(any, extrema)) <= 1:   # at most one operand has any: every combination has at most one
            yield from indices
            return
        for index in indices:
            if sum(map(getitem, extrema, index)) <= 1:
                yield index

    def enumerate(self) -> int:
        """Decide every combination, once per orbit of the mesh's axis symmetries (the others
        take its outcome, renamed), into ``results``; how many combinations there are.

        Combinations are handled as their layouts' indices in ``choices``, a symmetry as the
        index each layout goes to: a case has hundreds of thousands of combinations (an attention
        case on (2, 2): 231,696) and few layouts, and hashing and renaming tuples of layouts
        per combination and symmetry was half of its audit."""
        choices, problem = self.choices, self.problem
        at = [{layout: i for i, layout in enumerate(c)} for c in choices]
        # each symmetry: None for the identity, else per operand the index each layout goes to
        # (tensor_layouts gives every renaming of a layout it gives)
        moves = [(perm, None if perm == self._identity else
                  [tuple(at[k][self._rename(layout, perm)] for layout in c) for k, c in enumerate(choices)])
                 for perm in axis_symmetries(self.mesh.shape)]
        # most combinations are refused by rank 0's local input shapes alone, which the first
        # refusal of those shapes already decided (Problem.refused_shapes): no op runs for them
        shapes = [[problem.first_shape(k, layout) for layout in c] for k, c in enumerate(choices)] \
            if problem.knows_refusals else None
        seen: dict[tuple[int, ...], Outcome] = {}
        refusals: dict[str, Outcome] = {}
        total = 0
        for index in self._indices():
            total += 1
            if index in seen:
                continue
            reason = None if shapes is None else problem.refused_shapes(tuple(map(getitem, shapes, index)))
            if reason is not None:
                outcome = refusals.get(reason) or refusals.setdefault(reason, Outcome(None, reason))
            else:
                outcome = self.decide(tuple(map(getitem, choices, index)))
            self._keep(seen, moves, index, outcome)
        self.results = {tuple(map(getitem, choices, index)): outcome for index, outcome in seen.items()}
        if self.sample:
            self._absent_counterparts(seen, at, moves)
            self.results = {tuple(map(getitem, choices, index)): outcome for index, outcome in seen.items()}
        return total

    def _keep(self, seen: dict, moves: list, index: tuple[int, ...], outcome: Outcome) -> None:
        """The outcome of the combination at ``index``, and of each renaming of it (``moves``:
        :meth:`enumerate`) the outcome renamed, where not decided already."""
        for perm, move in moves:
            if move is None:   # the combination itself (the only one on a mesh of unequal axes)
                seen.setdefault(index, outcome)
                continue
            key = tuple(map(getitem, move, index))
            if key not in seen:
                renamed = self._renamed[perm]
                seen[key] = outcome if outcome.outputs is None else Outcome(
                    tuple(renamed.get(layout) or self._rename(layout, perm) for layout in outcome.outputs),
                    outcome.reason)

    def _rename(self, layout: Layout, perm: tuple[int, ...]) -> Layout:
        found = self._renamed[perm][layout] = layout.permuted(perm)
        return found

    def _absent_counterparts(self, seen: dict, at: list[dict], moves: list) -> None:
        """In a sample, each valid combination with an absent operand that looks needed has its
        counterparts decided (operand passed in as a full value) until one gives its output:
        the full enumeration has them all, and without them the sample reports it missing."""
        for key, (combo, outputs) in self.needed(self.valid()).items():
            for candidate in counterparts(self.choices, combo):
                index = tuple(found[layout] for found, layout in zip(at, candidate))
                if index not in seen:
                    self._keep(seen, moves, index, self.decide(candidate))
                if seen[index].outputs == outputs:
                    break

    def decide(self, combo, masked=()) -> Outcome:
        """The combination's outcome on the first seed, kept only if every other seed's data
        gives the same (a layout mixing up two equal blocks holds on one draw, not on all)."""
        outcome = self.problem.decide(combo, masked)
        for other in self.problems[1:]:
            if not outcome.valid:
                break
            again = other.decide(combo, masked)
            # one draw's data may form two layouts (S01 and S10 of equal rows): the outcome is
            # a layout that holds on every draw
            if again.outputs == outcome.outputs or outputs_hold(other, combo, outcome.outputs, masked):
                continue
            if again.valid and self.outputs_hold(combo, again.outputs, masked):
                outcome = again
                continue
            outcome = Outcome(None, f"holds with seed {self.problem.case.seed}'s data but not with seed "
                                    f"{other.case.seed}'s ({again.reason or outputs_text(again.outputs)})")
        return outcome

    def outputs_hold(self, combo, outputs: tuple[Layout, ...], masked=()) -> bool:
        return all(outputs_hold(problem, combo, outputs, masked) for problem in self.problems)

    def valid(self) -> dict[tuple[str, ...], tuple[tuple[Layout, ...], tuple[Layout, ...]]]:
        """key -> (a combination, its outputs) for every valid combination."""
        found: dict = {}
        for combo, outcome in self.results.items():
            if outcome.valid:
                found.setdefault(combo_key(combo), (combo, outcome.outputs))
        return found

    @staticmethod
    def needed(valid: dict) -> dict:
        """The valid combinations a spec should offer: an absent (post-added) operand is only
        needed when no combination passing it in, as a full value, gives the same output."""
        present: dict = {}
        for key, (_, outputs) in valid.items():
            present.setdefault(tuple(k == "absent" for k in key), None)
        index: dict = {}
        for absent_at in present:
            if not any(absent_at):
                continue
            index[absent_at] = {}
            for key, (combo, outputs) in valid.items():
                if not any(layout.absent or layout.partial for layout, a in zip(combo, absent_at) if a):
                    masked = tuple(None if a else k for k, a in zip(key, absent_at))
                    index[absent_at].setdefault(masked, set()).add(outputs)
        kept = {}
        for key, value in valid.items():
            absent_at = tuple(k == "absent" for k in key)
            if any(absent_at):
                masked = tuple(None if a else k for k, a in zip(key, absent_at))
                if value[1] in index[absent_at].get(masked, ()):
                    continue
            kept[key] = value
        return kept

    def describe(self, combo, outputs) -> tuple[str, tuple[tuple[str, str], ...], str]:
        layouts = tuple((o.role, str(layout)) for o, layout in zip(self.operands, combo))
        out_text = outputs_text(outputs)
        outs = " ".join(f"{role}={layout}" for role, layout in zip(self.output_roles, outputs))
        line = " ".join(f"{role}={text}" for role, text in layouts) + f" -> {outs}"
        return line, layouts, out_text


def outputs_hold(problem: Problem, combo, outputs: tuple[Layout, ...], masked=(), arguments=None) -> bool:
    """Whether the ranks' local outputs of ``combo`` form ``outputs`` on ``problem``'s data."""
    # a view told its shape is run with the local shape of the layout it is asked about
    # (or, with other local arguments, each set the strategies pass in turn; or the ones given)
    choices = [arguments] if arguments is not None else [problem.shape_arguments(outputs[0])] \
        if problem.shape_arg is not None else [None, *problem.local_choices]
    refs = problem.target(combo)
    for arguments in choices:
        outs = problem.run(combo, arguments, masked)
        if not isinstance(outs, str) and all(problem.holds([o[k] for o in outs], layout, k, refs[k])
                                             for k, layout in zip(problem.out_index, outputs)):
            return True
    return False
