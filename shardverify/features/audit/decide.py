"""The audit's numerical decision: does an op, run on every rank's local inputs with no
communication, produce a consistent output layout, and which one?

Everything happens in one thread: one float64 reference per case, every rank's local inputs cut
from it (partial values split into random pieces that reduce to it), the op called once per rank,
the local outputs compared with the reference under each candidate output layout. No backend, no
collectives, no process: deciding a combination costs a few local op calls, which is what makes
enumerating every layout combination affordable."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardverify.features.audit.layouts import REDUCE_OPS, _shardings, _subsets
from shardverify.sharding.blocks import nested_block
from shardverify.sharding.pieces import partial_pieces
from shardverify.sharding.indexing import shift_into_shard, zero_outside_shard
from shardverify.sharding.layout import Layout
from shardverify.sharding.mesh import DeviceMesh
from shardverify.spec.case import OpCase
from shardverify.features.audit.local_call import call_with_backward, mixed_dtypes, output_scale, widened
from shardverify.capture.call import call_op, called_module
from shardverify.verify.reference import reference
from shardverify.verify.memory import check_case_memory
from shardverify.verify.tolerance import Tolerance, is_close

__all__ = ["Operand", "Problem", "Outcome", "prepare", "lone_value_draws"]

# float64 throughout: reordered sums differ by ~1e-15, a wrong layout by O(1).
RTOL = 1e-9
ATOL = 1e-9


@dataclass(frozen=True)
class Operand:
    """One tensor the op takes: its strategy name, role, call locator and shape."""

    name: str
    role: str
    locator: tuple[str, object]
    shape: tuple[int, ...]
    floating: bool
    optional: bool = False
    complex: bool = False          # a complex tensor: a partial sum, never a partial max or min
    boolean: bool = False          # a bool tensor: also decided with one True, one False element (lone_value_draws)
    constant: bool = False         # the op takes no gradient for it (a running statistic: constant_operands)

    @property
    def differentiable(self) -> bool:
        """A gradient leaf where the op runs with its backward (the DTensor harness, its repros)."""
        return self.floating and not self.constant


@dataclass(frozen=True)
class Outcome:
    """The decision for one combination: the output layouts, or why there is none."""

    outputs: tuple[Layout, ...] | None
    reason: str = ""

    @property
    def valid(self) -> bool:
        return self.outputs is not None


@dataclass
class Problem:
    """One case on one mesh, ready to decide combinations of its operands' layouts."""

    case: OpCase
    mesh: DeviceMesh
    operands: tuple[Operand, ...]
    node: object
    module: object       # a module op's module, the audit's own copy (prepare): calls swap blocks into it (owned)
    values: dict
    outputs: tuple[torch.Tensor, ...]
    out_index: tuple[int, ...] = (0,)   # the tuple elements audited (the spec's output operands)
    seed: int = 0
    # the call argument the ranks set to the first output's local shape (a view's shape) or to
    # a run of it (unflatten's sizes), and that run; None without one
    shape_arg: tuple[tuple[str, object], slice] | None = None
    # other per-rank local arguments the strategies pass (a conv's groups), tried in turn
    local_choices: list = field(default_factory=list)
    _coords: list = field(default_factory=list)
    _local: dict = field(default_factory=dict)
    _pieces: dict = field(default_factory=dict)
    _shape_errors: dict = field(default_factory=dict)
    _meta_verdicts: dict = field(default_factory=dict)
    meta_module: object = None   # a module op's module on meta tensors (prepare): what _meta_refusal calls
    _candidates: dict = field(default_factory=dict)
    _tols: tuple = ()
    _targets: dict = field(default_factory=dict)
    _groups: dict = field(default_factory=dict)
    _finiteness: dict = field(default_factory=dict)
    _blocks: dict = field(default_factory=dict)
    decided: int = 0

    def __post_init__(self) -> None:
        self._coords = [self.mesh.coordinate(r) for r in self.mesh.ranks]
        self._tols = tuple(Tolerance(RTOL, ATOL * output_scale(y)) for y in self.outputs)

    # ---- local inputs -----------------------------------------------------------------
    def _index(self, rank: int, axes: Sequence[int]) -> int:
        coord, index = self._coords[rank], 0
        for axis in axes:
            index = index * self.mesh.shape[axis] + coord[axis]
        return index

    def slices(self, layout: Layout, shape: Sequence[int], rank: int) -> tuple[slice, ...]:
        """The block ``rank`` holds, cut as DTensor cuts it (uneven blocks, any shard order)."""
        coord, out = self._coords[rank], []
        for size, axes in zip(shape, layout.dims):
            if not axes:
                out.append(slice(None))
                continue
            start, length = nested_block(size, [(self.mesh.shape[a], coord[a]) for a in axes])
            out.append(slice(start, start + length))
        return tuple(out)

    def local_shapes(self, layout: Layout, shape: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Every rank's block shape under ``layout``."""
        key = ("blocks", layout.dims, tuple(shape))
        if key not in self._candidates:
            self._candidates[key] = tuple(
                tuple(size if s.start is None else s.stop - s.start
                      for size, s in zip(shape, self.slices(layout, shape, rank)))
                for rank in self.mesh.ranks)
        return self._candidates[key]

    def _piece(self, operand: Operand, layout: Layout, rank: int) -> torch.Tensor:
        """The full-size value this rank holds before sharding: the value, zeros when absent,
        or one random piece of a partial value (the pieces of a group reduce to the value)."""
        value = self.values[operand.locator]
        if layout.absent:
            return torch.zeros_like(value)
        if not layout.partial:
            return value
        key = (operand.name, layout.partial, layout.reduce)
        if key not in self._pieces:
            n = math.prod(self.mesh.shape[a] for a in layout.partial)
            self._pieces[key] = partial_pieces(value, n, self.seed + 7919 * len(self._pieces) + 1, layout.reduce)
        return self._pieces[key][self._index(rank, layout.partial)]

    def local(self, position: int, layout: Layout) -> list[torch.Tensor]:
        """Every rank's local input for operand ``position`` in ``layout`` (cached): a contiguous
        tensor with storage of its own, as a rank holds it (and as ``verify`` passes it), not a
        view of the full value (native_group_norm refuses a strided input, which made a channel
        shard look invalid here while ``verify`` passed it; as_strided read the whole storage
        through a view, so a sharded input looked replicated)."""
        key = (position, layout)
        if key not in self._local:
            operand = self.operands[position]
            self._local[key] = [self._piece(operand, layout, r)[self.slices(layout, operand.shape, r)]
                                .clone(memory_format=torch.contiguous_format)
                                for r in self.mesh.ranks]
        return self._local[key]

    @property
    def knows_refusals(self) -> bool:
        """Whether a refusal of rank 0's local input shapes (see :meth:`run`) decides every
        combination with those shapes: not where the ranks pass arguments of their own, which
        :meth:`decide` tries in turn."""
        return self.shape_arg is None and not self.local_choices

    def refused_shapes(self, shapes: tuple[tuple[int, ...], ...]) -> str | None:
        """Why the op refused rank 0's local input ``shapes`` (:meth:`first_shape` of each
        operand), counted as a decision; None where it has not (yet)."""
        reason = self._shape_errors.get((shapes, (), ()))
        if reason is not None:
            self.decided += 1
        return reason

    def _refusal_key(self, combo: Sequence[Layout], arguments: dict, masked: Sequence[tuple[int, int, int]]) -> tuple:
        """What a refusal of the op is remembered by (rank 0's local shapes and arguments, the masking)."""
        return (tuple(self.first_shape(i, layout) for i, layout in enumerate(combo)),
                tuple(arguments.items()), tuple(masked))

    def first_shape(self, position: int, layout: Layout) -> tuple[int, ...]:
        """Rank 0's local input shape for operand ``position`` in ``layout`` (most combinations
        are refused by these shapes alone, see :meth:`run`), from the layout alone: no block is
        cut for it."""
        return self.local_shapes(layout, self.operands[position].shape)[0]

    # ---- running the op ---------------------------------------------------------------------
    def run(self, combo: Sequence[Layout], arguments: dict | None = None,
            masked: Sequence[tuple[int, int, int]] = ()) -> list[tuple[torch.Tensor, ...]] | str:
        """Every rank's local outputs for ``combo`` (one layout per operand), or why the op failed;
        ``arguments``: non-tensor call arguments every rank passes instead of the recorded ones
        (a list: each rank's own);
        ``masked``: (ids operand, table operand, table dim) whose ids each rank shifts into its
        rows of the table, zeroing the first output of the ids it does not hold (IndexShard)."""
        per_rank = arguments if isinstance(arguments, list) else [arguments or {}] * self.mesh.size
        shapes = self._refusal_key(combo, per_rank[0], masked)
        if (refused := self._shape_errors.get(shapes)) is not None:
            return refused
        locals_ = [self.local(i, layout) for i, layout in enumerate(combo)]
        results = []
        for rank in self.mesh.ranks:
            values = {op.locator: t[rank] for op, t in zip(self.operands, locals_)}
            values.update(per_rank[rank])
            outside = []
            for ids, table, dim in masked:
                rows = self.slices(combo[table], self.operands[table].shape, rank)[dim]
                size = (rows.stop if rows.stop is not None else self.operands[table].shape[dim]) - (rows.start or 0)
                loc = self.operands[ids].locator
                values[loc], mask = shift_into_shard(values[loc], rows.start or 0, size)
                outside.append(mask)
            empty = any(t[rank].numel() == 0 for t in locals_)
            try:
                if empty:   # a kernel may take an empty block forward and refuse it backward
                    out = call_with_backward(self.node, self.module, values, owned=True)
                else:
                    with torch.no_grad():
                        out = call_op(self.node, self.module, values, owned=True)
            except Exception as exc:  # the op refuses these local inputs: not a valid combination
                reason = f"the local op fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                # Rank 0 holds the first shard of every layout; what it refuses is a matter of
                # local shapes (mismatched contraction, broadcast), so every combination with
                # the same local shapes is refused without running it again.
                if rank == 0:
                    self._shape_errors[shapes] = reason
                return reason
            if (refused := self._meta_refusal(values)) is not None:
                if rank == 0:
                    self._shape_errors[shapes] = refused
                return refused
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            for mask in outside:
                out = (zero_outside_shard(out[0], mask),) + out[1:]
            results.append(out)
        return results

    def _meta_refusal(self, values: dict) -> str | None:
        """Why the op's meta kernel refuses a rank's local inputs that its CPU kernel took, None
        where it takes them too or cannot tell (no meta kernel, a value read). A CPU kernel may
        check less than its meta kernel: ``_native_batch_norm_legit`` takes a bias of 3 for 6
        channels and reads past it, so its outputs, and the combination's outcome, are whatever
        memory follows the bias. Asked once per set of local shapes and arguments."""
        key = tuple((loc, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v))
                    for loc, v in values.items())
        if key not in self._meta_verdicts:
            meta = {loc: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
                    for loc, v in values.items()}
            verdict = None
            try:
                if self.module is None or self.meta_module is not None:
                    with torch.no_grad():
                        call_op(self.node, self.meta_module, meta, owned=True)
            except Exception as exc:  # noqa: BLE001 - a shape check fails with a RuntimeError; a meta
                # decomposition's own error (instance_norm's ZeroDivisionError on an empty block) is no verdict
                if isinstance(exc, RuntimeError) and not (isinstance(exc, NotImplementedError) or
                                                          "meta" in str(exc).lower()):
                    verdict = (f"the local op's meta kernel refuses these local shapes (its CPU kernel, checking "
                               f"less, took them): {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            self._meta_verdicts[key] = verdict
        return self._meta_verdicts[key]

    def target(self, combo: Sequence[Layout]) -> tuple[torch.Tensor, ...]:
        """The full outputs the ranks must form: the reference, or with an absent (post-added)
        operand the op on the full values with zeros there (the operand is added afterwards)."""
        absent = tuple(i for i, layout in enumerate(combo) if layout.absent)
        if not absent:
            return self.outputs
        if absent not in self._targets:
            values = dict(self.values)
            for i in absent:
                loc = self.operands[i].locator
                values[loc] = torch.zeros_like(values[loc])
            with torch.no_grad():
                out = call_op(self.node, self.module, values, owned=True)
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            self._targets[absent] = tuple(widened(o) for o in out)
        return self._targets[absent]

    def post_addable(self, position: int, dims: Sequence[int] | None = None) -> bool:
        """Can operand ``position`` be left out of the op (zeros passed) and added to the first
        output afterwards? Only then is its "absent" layout meaningful: a bias is, ``mul``'s
        other factor is not (the op with zeros there gives zeros, which any layout "forms").
        Decided numerically, never taken from the spec: ``dims`` (a strategy's PostAdd) maps
        operand dim i to output dim dims[i]; without it every alignment is tried (right-aligned
        broadcasting, or a 1-D operand on any output dim of its size)."""
        operand, ref = self.operands[position], self.outputs[0]
        if not operand.floating or not ref.is_floating_point():
            return False
        try:
            without = self.target([Layout(((),) * len(operand.shape), absent=(i == position))
                                   for i in range(len(self.operands))])[0]
        except Exception:  # noqa: BLE001 - the op refuses zeros there (torch.cov's weights): nothing to add after
            return False
        value = self.values[operand.locator].to(torch.float64)
        if dims is not None:
            options = [tuple(dims)]
        else:
            options = [tuple(range(ref.dim() - value.dim(), ref.dim()))] if value.dim() <= ref.dim() else []
            if value.dim() == 1:
                options += [(d,) for d in range(ref.dim()) if ref.shape[d] == value.shape[0]]
        for option in options:
            if len(option) != value.dim() or any(not 0 <= d < ref.dim() for d in option):
                continue
            shape = [1] * ref.dim()
            for i, d in enumerate(option):
                shape[d] = value.shape[i]
            try:
                if self._close(without + value.reshape(shape), ref, 0, None):
                    return True
            except RuntimeError:   # the operand does not broadcast that way
                continue
        return False

    def decide(self, combo: Sequence[Layout], masked: Sequence[tuple[int, int, int]] = ()) -> Outcome:
        self.decided += 1
        if self.shape_arg is None:
            outcome = self._decide(combo, None, masked)
            for arguments in self.local_choices if not outcome.valid else ():
                found = self._decide(combo, arguments, masked)
                if found.valid:
                    return found
            return outcome
        # a view told its output shape: each local output shape a layout of the output can have
        # is passed in turn, and the first that the ranks' outputs form is the combination's
        outcome = Outcome(None, "no local output shape fits")
        for arguments in self._shape_arguments():
            outcome = self._decide(combo, list(arguments), masked)
            if outcome.valid:
                return outcome
        return outcome

    def shape_arguments(self, layout: Layout) -> list[dict]:
        """Each rank's shape argument when the first output is laid out ``layout``: that part of
        its own block's shape."""
        locator, part = self.shape_arg
        return [{locator: shape[part]} for shape in self.local_shapes(layout, self.outputs[0].shape)]

    def _shape_arguments(self) -> list[tuple[dict, ...]]:
        """Every distinct per-rank set of shape arguments an output layout gives."""
        if "shapes" not in self._candidates:
            ref = self.outputs[0]
            found: dict = {}
            for dims in _shardings(tuple(ref.shape), self.mesh.shape):
                arguments = self.shape_arguments(Layout(dims))
                found.setdefault(tuple(tuple(a.items()) for a in arguments), tuple(arguments))
            self._candidates["shapes"] = list(found.values())
        return self._candidates["shapes"]

    def _decide(self, combo: Sequence[Layout], arguments: dict | None,
                masked: Sequence[tuple[int, int, int]] = ()) -> Outcome:
        outs = self.run(combo, arguments, masked)
        if isinstance(outs, str):
            return Outcome(None, outs)
        found = []
        refs = self.target(combo)
        for k in self.out_index:
            mixed = mixed_dtypes([o[k] for o in outs])
            if mixed:
                which = "the output" if len(self.outputs) == 1 else f"output {k}"
                return Outcome(None, f"the ranks' blocks of {which} differ in dtype ({mixed})")
            layout = self.detect([o[k] for o in outs], k, refs[k])
            if layout is None:
                which = "the output" if len(self.outputs) == 1 else f"output {k}"
                return Outcome(None, f"{which} matches no sharded, replicated or partial layout")
            found.append(layout)
        return Outcome(tuple(found))

    # ---- output layouts --------------------------------------------------------------------
    def _close(self, actual: torch.Tensor, expected: torch.Tensor, k: int, finite: bool | None) -> bool:
        """verify's rule (``compare``), so both agree on what is correct: finite values within
        the float64 tolerance, inf and NaN exactly where the reference has them; ``finite``:
        whether ``expected`` is, when known (checked once per reference, not per rank)."""
        return is_close(actual, expected, self._tols[k], finite=finite)

    def _finite(self, ref: torch.Tensor) -> bool:
        """Is the reference ``ref`` all finite? Remembered per tensor (kept alive with its answer,
        so its id stays its own): each is checked once, not once per layout it is matched in."""
        known = self._finiteness.get(id(ref))
        if known is None or known[0] is not ref:
            known = self._finiteness[id(ref)] = (ref, bool(torch.isfinite(ref).all()))
        return known[1]

    def _block(self, ref: torch.Tensor, layout: Layout, rank: int) -> tuple[torch.Tensor, float | None]:
        """``rank``'s block of the reference ``ref`` under ``layout``'s sharding (a view) and its
        :func:`_last` element, remembered per reference (kept alive with its blocks, so its id
        stays its own): every combination's outputs are matched against the same few candidate
        layouts."""
        known = self._blocks.get(id(ref))
        if known is None or known[0] is not ref:
            known = self._blocks[id(ref)] = (ref, {})
        key = (layout.dims, rank)
        found = known[1].get(key)
        if found is None:
            block = ref[self.slices(layout, ref.shape, rank)]
            found = known[1][key] = (block, _last(block))
        return found

    def holds(self, tensors: Sequence[torch.Tensor], layout: Layout, k: int, ref: torch.Tensor,
              lasts: Sequence[float | None] | None = None) -> bool:
        """Do the ranks' local outputs ``tensors`` form ``ref`` (output ``k``) in ``layout``?
        Never where their dtypes differ: a sharded tensor has one dtype (native_dropout's mask
        comes back float, not bool, on a rank whose block is empty). ``lasts``: each tensor's
        :func:`_last` element, which rules most wrong layouts out without comparing the blocks."""
        if len(layout.dims) != ref.dim() or mixed_dtypes(tensors):
            return False
        if tuple(tuple(t.shape) for t in tensors) != self.local_shapes(layout, ref.shape):
            return False
        finite = self._finite(ref)
        if not layout.partial:
            if lasts is not None and finite and any(
                    _far(last, self._block(ref, layout, r)[1], self._tols[k]) for r, last in enumerate(lasts)):
                return False
            return all(self._close(t, self._block(ref, layout, r)[0], k, finite) for r, t in enumerate(tensors))
        if layout.partial not in self._groups:
            self._groups[layout.partial] = self.mesh.groups(layout.partial)
        groups = self._groups[layout.partial]
        if lasts is not None and finite and any(
                _far(_reduced_last(lasts, group, layout.reduce), self._block(ref, layout, group[0])[1], self._tols[k])
                for group in groups):
            return False
        for group in groups:
            stacked = torch.stack([widened(tensors[r]) for r in group])
            value = _REDUCE_STACKED[layout.reduce](stacked)
            if not self._close(value, self._block(ref, layout, group[0])[0], k, finite):
                return False
        return True

    def _candidate_dims(self, k: int, shapes: tuple[tuple[int, ...], ...]) -> list[tuple[tuple[int, ...], ...]]:
        """The output shardings whose every rank's block has the shape that rank's output has."""
        key = (k, shapes)
        if key not in self._candidates:
            ref = self.outputs[k]
            self._candidates[key] = [dims for dims in _shardings(tuple(ref.shape), self.mesh.shape)
                                     if self.local_shapes(Layout(dims), ref.shape) == shapes]
        return self._candidates[key]

    def detect(self, tensors: Sequence[torch.Tensor], k: int, ref: torch.Tensor) -> Layout | None:
        """The simplest layout the local outputs form: sharded/replicated, else a partial
        sum, max or min over the fewest free mesh axes."""
        shapes = tuple(tuple(t.shape) for t in tensors)
        if any(len(shape) != self.outputs[k].dim() for shape in shapes):
            return None
        candidates = self._candidate_dims(k, shapes)
        lasts = [_last(t) for t in tensors]
        for dims in candidates:
            if self.holds(tensors, Layout(dims), k, ref, lasts):
                return Layout(dims)
        for dims in candidates:
            free = [a for a in range(self.mesh.ndim)
                    if self.mesh.shape[a] > 1 and all(a not in axes for axes in dims)]
            for reduce in REDUCE_OPS:
                if reduce != "sum" and not tensors[0].is_floating_point():
                    continue
                for axes in _subsets(free):
                    layout = Layout(dims, axes, reduce)
                    if self.holds(tensors, layout, k, ref, lasts):
                        return layout
        return None


#: how a partial layout's group of blocks reduces to the value, as stacked tensors and as floats
_REDUCE_STACKED = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0),
                   "min": lambda s: s.amin(0)}
_REDUCE_FLOATS = {"sum": sum, "avg": lambda v: sum(v) / len(v), "max": max, "min": min}


def _last(tensor: torch.Tensor) -> float | None:
    """The last element of ``tensor`` as a float; None where it has none or is complex."""
    if not tensor.numel() or tensor.is_complex():
        return None
    return float(tensor[(-1,) * tensor.dim()])


def _reduced_last(lasts: Sequence[float | None], group: Sequence[int], reduce: str) -> float | None:
    """The :func:`_last` elements of ``group``'s blocks reduced as a partial layout reduces them;
    None where a block has none."""
    values = [lasts[r] for r in group]
    return None if None in values else _REDUCE_FLOATS[reduce](values)


def _far(actual: float | None, expected: float | None, tol: Tolerance) -> bool:
    """Is ``actual`` beyond twice ``tol`` of a finite ``expected``? Then the blocks they end are not
    close (:func:`is_close`): twice, so the few ulps by which a reduction of floats may differ
    from the tensors' reduction cannot decide it. A NaN is never far: the comparison decides it."""
    if actual is None or expected is None:
        return False
    return abs(actual - expected) > 2 * (tol.atol + tol.rtol * abs(expected))


def prepare(case: OpCase, mesh: DeviceMesh, operands: Sequence[Operand],
            out_index: Sequence[int] = (0,)) -> Problem:
    """The float64 reference of ``case`` and the op's node, ready for :meth:`Problem.decide`; a
    case estimated over MAX_CASE_BYTES is refused before its reference is computed."""
    check_case_memory(case, tuple(mesh.shape))
    ref = reference(case, torch.float64, torch.device("cpu"))
    node = ref.node
    # the audit's own copy of a module op's module: each call swaps a rank's blocks into it
    # (call_op's ``owned``) instead of functional_call's swap and restore, which was a third
    # of deciding a Linear combination
    module = called_module(ref.graph_module, node)
    meta_module = None if module is None else copy.deepcopy(module).to("meta")
    module = None if module is None else copy.deepcopy(module)
    values = {loc: v.detach() for loc, v in ref.values.items()}
    outputs = tuple(widened(o) for o in ref.outputs)
    return Problem(case, mesh, tuple(operands), node, module, values, outputs, tuple(out_index), seed=case.seed,
                   meta_module=meta_module)



def lone_value_draws(problem: Problem) -> tuple[list[Problem], list[str]]:
    """``problem`` with every bool operand redrawn all False but one True element, and all True
    but one False (none without a bool operand), and a note for each draw the op refuses.

    Drawn half True, a bool operand saturates a reduction: ``any`` over every block of ten or
    more elements is True (``all`` False), so each rank's local ``any`` over a sharded reduced
    dim equals the whole one and the combination looks valid with a replicated output (any_dims
    on (2, 3)). With one True element, every block without it gives False: such a combination
    fails, while a valid one holds on any data, so it must hold on these draws too."""
    flags = [o for o in problem.operands if o.boolean]
    if not flags:
        return [], []
    gen = torch.Generator().manual_seed(problem.seed + 104729)
    lone = {o.locator: int(torch.randint(0, max(1, math.prod(o.shape)), (1,), generator=gen)) for o in flags}
    draws: list[Problem] = []
    notes: list[str] = []
    for rest in (False, True):
        values = dict(problem.values)
        for operand in flags:
            value = torch.full(operand.shape, rest, dtype=torch.bool)
            value.view(-1)[lone[operand.locator]] = not rest
            values[operand.locator] = value
        try:
            with torch.no_grad():
                out = call_op(problem.node, problem.module, values, owned=True)
        except Exception as exc:  # the op refuses this data: decided on the others, and said
            notes.append(f"the op refuses bool operands all {rest} but one element, so combinations are decided "
                         f"without that draw ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        draws.append(Problem(problem.case, problem.mesh, problem.operands, problem.node, problem.module, values,
                             tuple(widened(o) for o in out), problem.out_index, seed=problem.seed))
    return draws, notes
