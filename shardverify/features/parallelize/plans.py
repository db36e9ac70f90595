"""How a model is parallelized, in the forms people have their plan: a PyTorch parallelize plan
(module-name patterns to ParallelStyles, applied by ``parallelize_module`` on the mesh's ``tp``
axis), their own ``parallelize(model, mesh)`` function (torchtitan's form: it gets the whole named
mesh, ``("tp",)`` or ``("dp", "tp")``), or the plan a transformers config ships, applied exactly as
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=...))`` applies it
(``maybe_distribute_model`` on transformers' own mesh), with the user's overrides."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from shardverify.errors import InvalidArgument

__all__ = ["Plan", "styles_plan", "function_plan", "transformers_plan", "mesh_names", "styles_unmatched",
           "transformers_unmatched"]


def mesh_names(shape: tuple[int, ...]) -> tuple[str, ...]:
    """A 1-D mesh is tensor parallel; a 2-D one is data parallel by tensor parallel (dp, tp)."""
    if len(shape) == 1:
        return ("tp",)
    if len(shape) == 2:
        return ("dp", "tp")
    raise InvalidArgument(f"mesh {shape}: a parallelize plan takes a 1-D (tp) or 2-D (dp, tp) mesh")


@dataclass(frozen=True)
class Plan:
    """``apply(model, mesh_shape)`` parallelizes ``model`` in place (or returns the model that
    replaces it) inside a world of the mesh's size; ``loss_parallel`` takes the loss and its
    backward under ``torch.distributed.tensor.parallel.loss_parallel()``."""

    name: str
    apply: Callable[[nn.Module, tuple[int, ...]], nn.Module]
    loss_parallel: bool = False
    styles: Mapping | None = None          # the plan's entries, where it has them (shown and blamed by)
    #: the plan's rules that name no module of a model (applied to nothing: said, never silent);
    #: None where the plan is code that shows no rules (a user's parallelize function)
    unmatched: Callable[[nn.Module], tuple[str, ...]] | None = None


def styles_unmatched(styles: Mapping, model: nn.Module) -> tuple[str, ...]:
    """The keys of a parallelize plan that ``parallelize_module`` resolves to no submodule: it
    matches a key's dotted atoms one level at a time with ``fnmatch``, and warns and skips a key
    that matches nothing."""
    from fnmatch import fnmatchcase

    def found(module: nn.Module, atoms: list[str]) -> bool:
        if not atoms:
            return True
        return any(fnmatchcase(name, atoms[0]) and found(child, atoms[1:]) for name, child in module.named_children())

    return tuple(key for key in styles if key != "" and not found(model, key.split(".")))


def _device_mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=mesh_names(shape))


def styles_plan(styles: Mapping, name: str = "parallelize plan", loss_parallel: bool = False) -> Plan:
    """``parallelize_module(model, mesh["tp"], styles)``, then FSDP2 ``fully_shard`` over ``mesh["dp"]``
    on a 2-D mesh (how torchtitan composes a TP plan with data parallelism)."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    for key, style in styles.items():
        if not isinstance(key, str) or not isinstance(style, ParallelStyle):
            raise InvalidArgument(f"{name}: entry {key!r} -> {type(style).__name__}: a parallelize plan maps "
                                  "module-name patterns to ParallelStyle objects (ColwiseParallel(), ...)")

    def apply(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
        mesh = _device_mesh(shape)
        model = parallelize_module(model, mesh["tp"], dict(styles))
        if "dp" in mesh.mesh_dim_names:
            from torch.distributed.fsdp import fully_shard
            fully_shard(model, mesh=mesh["dp"])
        return model

    return Plan(name, apply, loss_parallel, styles, lambda model: styles_unmatched(styles, model))


def function_plan(fn: Callable, name: str | None = None, loss_parallel: bool = False) -> Plan:
    """A user's ``parallelize(model, mesh)``; its return value replaces the model when it is one."""
    def apply(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
        returned = fn(model, _device_mesh(shape))
        return returned if isinstance(returned, nn.Module) else model

    return Plan(name or getattr(fn, "__qualname__", "parallelize"), apply, loss_parallel)


def _untie(model: nn.Module) -> bool:
    """Tied weights (an lm_head sharing the embedding's) as separate copies, as ``from_pretrained``
    builds the model it parallelizes (under ``no_tie_weights``) and ties them after loading; True
    when there were any, for the caller to tie again after the plan is applied."""
    keys = dict(getattr(model, "all_tied_weights_keys", None) or {})
    params = dict(model.named_parameters(remove_duplicate=False))
    untied = False
    for target, source in keys.items():
        if target in params and source in params and params[target] is params[source]:
            owner, _, name = target.rpartition(".")
            module = model.get_submodule(owner)
            module._parameters[name] = nn.Parameter(params[source].detach().clone(),
                                                    requires_grad=params[source].requires_grad)
            untied = True
    return untied


def transformers_plan(overrides: Mapping[str, str] | None = None) -> Plan:
    """The config's ``base_model_tp_plan`` (with ``overrides`` merged as ``DistributedConfig(tp_plan=...)``
    merges them) through transformers' ``maybe_distribute_model``: TP on the ``tp`` axis, FSDP2 on
    a ``dp`` axis."""
    def apply(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.utils import initialize_distributed_mesh

        if not hasattr(type(model), "maybe_distribute_model"):
            raise InvalidArgument(f"{type(model).__name__} is not a transformers model: its shipped plan cannot apply")
        dp, tp = (1, shape[0]) if len(shape) == 1 else shape
        config = DistributedConfig(tp_size=tp, fsdp_size=dp, tp_plan=dict(overrides) if overrides else None)
        _, manager = initialize_distributed_mesh(config)
        tied = _untie(model)
        model = type(model).maybe_distribute_model(model, config, manager)
        if tied:
            model.tie_weights()
        return model

    name = "transformers' shipped tp_plan" + (f" with {dict(overrides)}" if overrides else "")
    return Plan(name, apply, styles=overrides, unmatched=lambda model: transformers_unmatched(model, overrides))


def transformers_unmatched(model: nn.Module, overrides: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The rules of the model's tensor-parallel plan (its config's, with ``overrides`` merged) that
    name no module or parameter, layer numbers read as ``*``: transformers logs them on rank 0
    ("match nothing ... and will not be applied") and goes on."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    plan = {**dict(getattr(model, "tp_plan", None) or {}), **dict(overrides or {})}
    names = {replace_layer_number_by_wildcard(n) for n, _ in model.named_modules()}
    names |= {replace_layer_number_by_wildcard(n) for n, _ in model.named_parameters()}
    return tuple(sorted(key for key in plan if key not in names))
