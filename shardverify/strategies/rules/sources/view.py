"""The view source: ``view: reshape`` (factors matched by the input and output shapes; with
``shape_param`` the call parameter holding the output shape, which each rank passes as its
local output shape, or with ``shape_dim_param`` too only the sizes that the input dim it names
splits into: torch.unflatten's ``dim`` and ``sizes``), ``view: permute`` with ``dims_param``
(the order) and ``view: transpose`` with ``dim0_param`` and ``dim1_param``. A view reads
sizes from its local input (squeeze drops every size-1 dim), so each layout is probed."""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.strategies.rules import derive
from shardverify.strategies.rules.derive import normalize_dims
from shardverify.strategies.rules.sources.base import PARAM, Derived, OptionError, RuleCall, Source, opt, text
from shardverify.strategies.rules.sources.registry import register_source

__all__ = ["View"]

VIEWS = ("reshape", "permute", "transpose")


def _view(key: str, value: object) -> str:
    if value not in VIEWS:
        raise OptionError(f"rule option 'view' must be one of {', '.join(VIEWS)}, got {value!r}", key)
    return str(value)


@register_source
@dataclass(frozen=True)
class View(Source):
    key = "view"
    probes_local_shapes = True
    view: str = opt("view", _view, "")
    shape_param: str = opt("shape_param", text, "", kind=PARAM, draw="shape")
    shape_dim_param: str = opt("shape_dim_param", text, "", kind=PARAM, draw="dims")
    dims_param: str = opt("dims_param", text, "", kind=PARAM, draw="permutation")
    dim0_param: str = opt("dim0_param", text, "", kind=PARAM, draw="dims")
    dim1_param: str = opt("dim1_param", text, "", kind=PARAM, draw="dims")

    def check(self) -> None:
        if self.view == "permute" and not self.dims_param:
            raise OptionError("view: permute needs dims_param (the parameter holding the order)", "view")
        if self.view == "transpose" and not (self.dim0_param and self.dim1_param):
            raise OptionError("view: transpose needs dim0_param and dim1_param", "view")
        if self.shape_param and self.view != "reshape":
            raise OptionError("rule option 'shape_param' (the output shape a rank passes locally) "
                              "applies to view: reshape and to pointwise (expand)", "shape_param")
        if self.shape_dim_param and not self.shape_param:
            raise OptionError("rule option 'shape_dim_param' (the input dim whose split sizes shape_param "
                              "holds) needs shape_param", "shape_dim_param")
        for key, value, view in (("dims_param", self.dims_param, "permute"), ("dim0_param", self.dim0_param,
                                 "transpose"), ("dim1_param", self.dim1_param, "transpose")):
            if value and self.view != view:
                raise OptionError(f"rule option {key!r} applies to view: {view}", key)

    def equation(self, call: RuleCall, whole_at: tuple[int, ...]) -> Derived:
        shape = call.inputs[0]
        if self.view == "reshape":
            eq, whole, sizes = derive.reshape(shape, call.outputs[0])
            return Derived(eq, frozenset(whole), (), tuple(sizes.items()))
        if self.view == "permute":
            return Derived(derive.permute(len(shape), list(call.param(self.dims_param))))  # type: ignore[call-overload]
        rank = len(shape)
        d0, d1 = (int(call.param(p)) % max(rank, 1) for p in (self.dim0_param, self.dim1_param))  # type: ignore[call-overload]
        order = list(range(rank))
        if rank:                      # a 0-d tensor takes dim 0 (or -1) as its one "dim": nothing moves
            order[d0], order[d1] = order[d1], order[d0]
        return Derived(derive.permute(rank, order))

    def local_shape_part(self, call: RuleCall) -> slice:
        """All of a rank's local output shape, or with ``shape_dim_param`` the sizes that the
        named input dim splits into (``x.unflatten(1, (4, -1))`` on a ``[8, 16]`` input: output
        dims 1 and 2)."""
        if not self.shape_dim_param:
            return slice(None)
        value = call.param(self.shape_dim_param)
        input_shape = call.inputs[0] if call.inputs else ()
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"call parameter {self.shape_dim_param!r} must be one dim (an int), got {value!r}")
        (dim,) = normalize_dims(value, len(input_shape), self.shape_dim_param)
        parts = len(call.outputs[0]) - len(input_shape) + 1
        if parts < 1:
            raise InvalidArgument(f"an output of shape {list(call.outputs[0])} does not split a dim of an input of "
                                  f"shape {list(input_shape)}")
        return slice(dim, dim + parts)
