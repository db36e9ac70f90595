"""The single-device reference of an OpCase: deterministic values, output and gradients.

Every rank builds the same reference (same seed, CPU generator, same graph), so no rank
needs another's data. Values are drawn in float64 and rounded through the dtype the check
runs in, so the reference and the sharded run start from identical numbers; the reference
itself is computed in float64. One reference per (case, dtype, device) is kept per process,
the most recent ones within :data:`REFERENCE_BYTES`; building one empties the engine's case
tables (verify/memo.py), so no value made from an earlier case's tensors outlives its use.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from shardverify.capture.meta import output_metas
from shardverify.capture.call import Locator, as_outputs, call_op, called_module, module_tensors, operand_nodes
from shardverify.capture.randomness import may_draw
from shardverify.capture.uninitialised import undefined_outputs
from shardverify.errors import VerificationError
from shardverify.spec.case import OpCase, cached
from shardverify.verify.memo import forget_cases

__all__ = ["Reference", "reference"]



@dataclass(frozen=True)
class Reference:
    """The single-device truth for one case and dtype, shared read-only by every check."""

    graph_module: fx.GraphModule     # real float64 copy of the traced harness
    node: fx.Node                    # the op's node in that copy
    values: dict                     # Locator -> float64 tensor (rounded through its check dtype)
    dtypes: dict                     # Locator -> dtype the rank uses for that operand
    outputs: tuple                   # float64 result(s), in tuple order (one for a single-tensor op)
    grad_outputs: tuple              # float64 gradient per output (rounded through its dtype); None if not
                                     # floating or undefined (capture/uninitialised.py)
    grads: dict                      # Locator -> float64 gradient (floating operands only)
    constant: frozenset = frozenset()  # Locators the op takes no gradient for (running statistics)
    out_dtypes: tuple = ()             # the dtype each output has in the check (a rank's must match)
    # Locator -> the value in its check dtype, filled on first use (every strategy's ranks
    # slice the same converted tensor instead of converting the whole operand per check)
    _typed: dict = field(default_factory=dict, compare=False, repr=False)
    #: call signature -> (FLOPs, largest numel passed in) of the ranks' local calls of the op
    #: (``verify.costs.OpMeter``), filled as the checks count them
    flops: dict = field(default_factory=dict, compare=False, repr=False)

    def typed(self, loc: Locator) -> torch.Tensor:
        """The operand at ``loc`` in the dtype the ranks compute in (shared: never modify it)."""
        found = self._typed.get(loc)
        if found is None:
            found = self._typed.setdefault(loc, self.values[loc].to(self.dtypes[loc]))
        return found

    def leaf(self, loc: Locator, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` made a leaf of the op's call at ``loc``: asking for a gradient where the op
        gives one (a floating operand, not a constant such as a running statistic)."""
        return _as_leaf(tensor, loc, self.constant)

    def leaves(self, loc: Locator, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`leaf` of each of ``tensors`` (every rank's block of one operand)."""
        return [_as_leaf(tensor, loc, self.constant) for tensor in tensors]

    @functools.cached_property
    def narrowest_input(self) -> torch.dtype | None:
        """The least precise real floating dtype among the op's inputs (None without one), whose
        precision a result computed from them is compared at (verify/rank.py): worked out once,
        not at every check of the case."""
        floating = [d for d in self.dtypes.values() if d.is_floating_point]
        return max(floating, key=lambda d: torch.finfo(d).eps) if floating else None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this reference holds now: its values in every dtype asked for so far, its
        results, gradients and module tensors."""
        return [*self._built_with(), *self._typed.values()]

    def _built_with(self) -> list[torch.Tensor]:
        """The tensors it was built with: all but the values converted since."""
        held = [*self.values.values(), *self.outputs, *self.grads.values(),
                *(g for g in self.grad_outputs if g is not None), *self.graph_module.parameters(),
                *self.graph_module.buffers()]
        return [t for t in held if isinstance(t, torch.Tensor)]

    def held_bytes(self) -> int:
        """Bytes of :meth:`tensors`, storage shared between them counted twice: what the reference
        was built with, counted once (a process keeps up to 64 references and weighs them all
        before keeping another), and the values converted since."""
        return self._built_bytes + sum(t.nbytes for t in self._typed.values())

    @functools.cached_property
    def _built_bytes(self) -> int:
        return sum(t.nbytes for t in self._built_with())

    @property
    def output(self) -> torch.Tensor:
        return self.outputs[0]

    @property
    def grad_output(self) -> torch.Tensor | None:
        return self.grad_outputs[0]


_REFERENCE_LOCK = threading.Lock()
_REFERENCES: dict = {}
#: bytes of the references kept at most: before one is kept, the oldest are let go until it fits
#: beside the others (the newest is kept whatever its size): at large shapes a reference is
#: hundreds of megabytes, and 64 of them (spec/case.py's count limit) would not fit in memory
REFERENCE_BYTES = 1 << 30


def _rounded(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` made exactly representable in ``dtype`` and held in float64 (complex128 for a complex
    dtype; as is if not floating)."""
    if dtype.is_complex:
        return value.to(dtype).to(torch.complex128)
    if not dtype.is_floating_point:
        return value.to(dtype)
    return value.to(dtype).to(torch.float64)


def _differentiable(dtype: torch.dtype) -> bool:
    """Does a value of ``dtype`` take a gradient (real floating or complex)?"""
    return dtype.is_floating_point or dtype.is_complex


def _as_leaf(tensor: torch.Tensor, loc: Locator, constant: frozenset) -> torch.Tensor:
    return tensor.requires_grad_() if _differentiable(tensor.dtype) and loc not in constant else tensor


def _check_dtype(traced: torch.dtype, override: torch.dtype | None) -> torch.dtype:
    """The dtype a traced value has in a check run in ``override``: a real floating one becomes it, a
    complex one its complex twin (complex128 in a float64 check), where torch has one."""
    if override is None:
        return traced
    if traced.is_complex:
        return _COMPLEX.get(override, traced)
    return override if traced.is_floating_point else traced


_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32}


def _profile(shape: Sequence[int]) -> torch.Tensor:
    """A ramp over a tensor's positions, in (0, 1): the mean over its dims of more than one
    element of the position's fraction along that dim. Every block a layout cuts therefore sits
    at its own place on the ramp, wherever the cut: values drawn along it give each block its own
    range, scale and counts, so a rule that lets each rank compute a global statistic
    (a histogram's range, a norm, a quantile, a count) of its own block fails on the first draw."""
    dims = [d for d, size in enumerate(shape) if size > 1]
    if not dims:   # one element, or none: the ramp's middle
        return torch.full(tuple(shape), 0.5, dtype=torch.float64)
    ramp = torch.zeros(tuple(shape), dtype=torch.float64)
    for d in dims:
        along = (torch.arange(shape[d], dtype=torch.float64) + 0.5) / shape[d]
        ramp += along.reshape([-1 if i == d else 1 for i in range(len(shape))])
    return ramp / len(dims)


def _random(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, positive: bool = False,
            values: tuple[float, float] | None = None) -> torch.Tensor:
    """Deterministic values for a tensor of ``dtype`` (CPU generator: the same on every device);
    ``positive`` for buffers such as running variances, ``values`` a spec's [low, high).

    Values follow the position ramp of :func:`_profile`: a normal draw is scaled by 0.5..1.5 along
    it (still centred on zero: operands drawn alike do not correlate, so a sum of products keeps
    its cancellation), a draw in [low, high) (and a bool's chance of True) leans toward its
    low end at the ramp's start and its high end at its end, so no two blocks of a layout share a
    range, a norm or a count by construction. Integers (ids, indices) stay uniform: an id is to
    reach every row of a table wherever it sits."""
    if dtype.is_complex:   # real and imaginary parts each drawn like a real floating value
        return torch.complex(_random(shape, torch.float64, gen, positive, values),
                             _random(shape, torch.float64, gen, positive, values))
    if not (dtype.is_floating_point or dtype == torch.bool):   # ids and indices: every value as likely anywhere
        low, high = values if values is not None else (0, 8)
        return torch.randint(int(low), int(high), tuple(shape), generator=gen, dtype=dtype)
    ramp = _profile(shape)
    if dtype == torch.bool:
        return torch.rand(tuple(shape), generator=gen, dtype=torch.float64) < 0.25 + ramp / 2
    if values is not None:
        low, high = values
        leaning = (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) + ramp) / 2   # in [0, 1)
        return leaning * (high - low) + low
    if positive:
        return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) + 0.5) * (0.5 + ramp)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * (0.5 + ramp)


def reference(case: OpCase, override: torch.dtype | None, device: torch.device) -> Reference:
    """The case's reference for a check run in ``override`` (None: the traced dtypes) on
    ``device``; built once per process, under a lock so simulated ranks share one."""
    with _REFERENCE_LOCK:
        return cached(_REFERENCES, (case, override, str(device)), lambda: _built(case, override, device))


def _built(case: OpCase, override: torch.dtype | None, device: torch.device) -> Reference:
    """The reference :func:`reference` has not kept yet: for a check run in ``override`` that
    keeps every traced dtype, the traced dtypes' own (built once for both; asked only on a miss,
    not at every lookup)."""
    if override is not None and _keeps_dtypes(case, override):
        return cached(_REFERENCES, (case, None, str(device)), lambda: _new(case, None, device))
    return _new(case, override, device)


def _new(case: OpCase, override: torch.dtype | None, device: torch.device) -> Reference:
    """:func:`_buildreference`, after emptying the case tables (what they hold was made from the
    tensors of references built before), with room made for it among those kept."""
    forget_cases()
    ref = _buildreference(case, override, device)
    _make_room(ref.held_bytes())
    return ref


def _make_room(size: int) -> None:
    """Let the oldest references go until those left and one of ``size`` bytes fit
    :data:`REFERENCE_BYTES` (a reference kept under two keys counts once)."""
    def held() -> int:
        return sum(ref.held_bytes() for ref in {id(ref): ref for ref in _REFERENCES.values()}.values())

    while _REFERENCES and held() + size > REFERENCE_BYTES:
        _REFERENCES.pop(next(iter(_REFERENCES)))


def _keeps_dtypes(case: OpCase, override: torch.dtype) -> bool:
    """Whether a check run in ``override`` holds every value in its traced dtype (a float32
    case's float32 budget): then its reference is the one the traced dtypes give, built once."""
    traced, _ = case.build()
    dtypes = [t.dtype for t in (*traced.parameters(), *traced.buffers())] + [d.torch_dtype for d in case.inputs]
    for node in traced.graph.nodes:
        dtypes += [m.dtype for m in output_metas(node) or () if m is not None]
    return all(_check_dtype(dtype, override) == dtype for dtype in dtypes)


def _buildreference(case: OpCase, override: torch.dtype | None, device: torch.device) -> Reference:
    traced, node_name = case.build()
    gen = torch.Generator().manual_seed(case.seed)
    # the graph's own tensors are drawn anew in a copy; a graph holding none is only read
    real = copy.deepcopy(traced) if next(traced.parameters(), None) is not None or \
        next(traced.buffers(), None) is not None else traced
    with torch.no_grad():
        buffers = dict(real.named_buffers())
        for name, tensor in [*real.named_parameters(), *buffers.items()]:
            dtype = _check_dtype(tensor.dtype, override)
            value = _rounded(_random(tensor.shape, dtype, gen, positive=name in buffers), dtype)
            _set_tensor(real, name, value if dtype.is_floating_point else value.to(tensor.dtype))
    real = real.to(device)
    inputs = []
    for decl in case.inputs:
        dtype = _check_dtype(decl.torch_dtype, override)
        drawn = _random(decl.shape, dtype, gen, values=decl.values) if decl.data is None else \
            torch.tensor(decl.data, dtype=torch.float64 if dtype.is_floating_point else dtype).reshape(decl.shape)
        inputs.append(_rounded(drawn, dtype).to(device))
    interpreter = fx.Interpreter(real, garbage_collect_values=False)
    with torch.no_grad():
        interpreter.run(*inputs)
    node = next(n for n in real.graph.nodes if n.name == node_name)
    module = called_module(real, node)

    values, dtypes = {}, {}
    for loc, arg in operand_nodes(node).items():
        dtypes[loc] = _check_dtype(_meta_dtype(traced, arg.name), override)
        values[loc] = _rounded(interpreter.env[arg], dtypes[loc])
    traced_module = called_module(traced, node)
    for loc, tensor in module_tensors(module).items():
        dtypes[loc] = _check_dtype(module_tensors(traced_module)[loc].dtype, override)
        values[loc] = tensor.detach()

    # inputs declared without a gradient, and module state a captured call reads that takes none
    # (a buffer used as a weight: verify/call_case.py's ``constant_names``)
    no_grad = {i.name for i in case.inputs if not i.grad} | set(getattr(case, "constant_names", ()))
    # a placeholder is named by its input's declared name, which fx may rename (``input`` -> ``input_1``)
    constant = frozenset(loc for loc, arg in operand_nodes(node).items()
                         if arg.name in no_grad or (arg.op == "placeholder" and arg.target in no_grad))
    # a call that draws random numbers draws others in float64 than in the check's dtype: its
    # reference runs in the ranks' dtypes, on the generator state they draw from (capture/randomness.py)
    drawn = may_draw(node, module)
    leaves = {loc: _as_leaf(v.to(dtypes[loc]) if drawn else v.clone(), loc, constant) for loc, v in values.items()}
    with torch.random.fork_rng(devices=[]):
        _seed(case.seed, device)
        outputs = as_outputs(node, call_op(node, module, leaves))
        _refuse_random(case, node, module, {loc: leaf.detach() for loc, leaf in leaves.items()}, outputs, device)
    out_dtypes = [_check_dtype(dtype, override) for dtype in _meta_dtypes(traced, node_name)]
    undefined = undefined_outputs(node)   # no result: no gradient flows back through it
    grad_outputs = tuple(_rounded(_random(out.shape, dtype, gen), dtype).to(device)
                         if _differentiable(dtype) and i not in undefined else None
                         for i, (out, dtype) in enumerate(zip(outputs, out_dtypes)))
    grads = {}
    differentiable = [loc for loc, leaf in leaves.items() if leaf.requires_grad]
    carrying = [(out, g) for out, g in zip(outputs, grad_outputs) if g is not None and out.requires_grad]
    if differentiable and carrying:
        found = torch.autograd.grad([out for out, _ in carrying], [leaves[loc] for loc in differentiable],
                                    [g.to(out.dtype) for out, g in carrying], allow_unused=True)
        grads = {loc: (torch.zeros_like(leaves[loc]) if g is None else g.detach())
                 for loc, g in zip(differentiable, found)}
    # in the traced dtypes the ranks' outputs have the traced ones: the shapes' propagation ran
    # the op on meta tensors of those dtypes already
    result_dtypes = tuple(out_dtypes) if override is None else _result_dtypes(node, module, values, dtypes, out_dtypes)
    return Reference(real, node, values, dtypes, tuple(out.detach() for out in outputs), grad_outputs, grads,
                     constant, result_dtypes)


def _result_dtypes(node: fx.Node, module, values: dict, dtypes: dict,
                   fallback: Sequence[torch.dtype]) -> tuple[torch.dtype, ...]:
    """The dtype each output of the op has on a rank in this check: the op run on meta
    tensors of the operands' check dtypes (``x.to(float32)`` stays float32 in a bfloat16
    check, a matmul follows its inputs); the traced dtypes where the op cannot run on meta."""
    meta = {loc: torch.empty(v.shape, dtype=dtypes[loc], device="meta") for loc, v in values.items()}
    try:
        with torch.no_grad():
            return tuple(out.dtype for out in as_outputs(node, call_op(node, module, meta)))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: the traced dtypes
        return tuple(fallback)


def _seed(seed: int, device: torch.device) -> None:
    """Seed the generator an op on ``device`` draws from: for a CPU reference the CPU's alone
    (``fork_rng`` restores it), as ``torch.manual_seed`` would seed it, without the seeds that
    call queues for every other device type (a stack trace formatted for each, 0.2 ms a call)."""
    if torch.device(device).type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def _refuse_random(case: OpCase, node: fx.Node, module, values: dict, outputs: Sequence[torch.Tensor],
                   device: torch.device) -> None:
    """Raise if the op gives another result under another random state: a call that draws runs
    on one fixed generator state (capture/randomness.py), so this is one that draws where that
    state does not reach (a generator of its own, an op not known to draw). A rank's numbers would
    not be the reference's, and the gap between two draws would be taken for rounding, so a wrong
    rule would pass."""
    _seed(case.seed + 1, device)
    with torch.no_grad():
        again = as_outputs(node, call_op(node, module, {loc: v.clone() for loc, v in values.items()}))
    for first, second in zip(outputs, again):   # close, not equal: a GPU's atomic adds may reorder sums
        same = torch.isclose(first.detach(), second, rtol=1e-6, atol=1e-9, equal_nan=True) \
            if first.is_floating_point() else first.detach() == second
        if not bool(same.all()):
            raise VerificationError(f"{case.describe()}: the op is random (two runs on the same values differ "
                                    f"at {int((~same).sum())} of {same.numel()} elements, and not from the "
                                    "generator state the check fixes), so no layout can be checked against it; "
                                    "verify it where it is deterministic and bind the rule to those values")


def _meta_dtypes(graph_module: fx.GraphModule, node_name: str) -> list[torch.dtype]:
    """The dtype of each tensor the node returns (one, or one per tuple element)."""
    node = next(n for n in graph_module.graph.nodes if n.name == node_name)
    metas = output_metas(node)
    if not metas or None in metas:
        raise VerificationError(f"node {node_name!r} has no tensor shape metadata for its result(s); "
                                "the verifier checks ops that return tensors or tuples of tensors")
    return [m.dtype for m in metas]


def _meta_dtype(graph_module: fx.GraphModule, node_name: str) -> torch.dtype:
    return _meta_dtypes(graph_module, node_name)[0]


def _set_tensor(module: torch.nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner_name, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attr in owner._parameters:
        owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=owner._parameters[attr].requires_grad)
    else:
        owner._buffers[attr] = value
