"""Which specs may not stand together: a name defined twice per kind, or one op target claimed
by two specs the handler registry could not tell apart at a call. Found while loading, before
anything is rendered, so each is an error naming both files."""

from __future__ import annotations

from shardverify.errors import SpecError

__all__ = ["conflicts", "rivals"]


def conflicts(parsed: list[tuple],
               others: list[tuple]) -> list[SpecError]:
    """A spec name defined twice per kind, or an op target claimed by two specs that are not
    bound to disjoint values of one parameter there: each is an error naming both files (the
    registry could not tell which rule serves a call)."""
    errors = []
    names: dict[tuple[str, str], str] = {}
    targets: dict[object, tuple[str, str, object, object]] = {}
    for index, (source, spec) in enumerate([*others, *parsed]):
        mine = index >= len(others)
        key = (source.kind.name, spec.name)  # type: ignore[attr-defined]
        if key in names and mine:
            errors.append(SpecError(f"{source.kind.name} {spec.name!r} is also defined in {names[key]}",  # type: ignore[attr-defined]
                                    file=source.display))
        names.setdefault(key, source.display)
        for target in getattr(spec, "targets", ()):
            name = getattr(target, "name", None)
            if not isinstance(name, str):
                continue
            claimed = _target_identity(name)
            if claimed in targets and targets[claimed][0] != source.display and mine and \
                    not _bound_apart(spec, target, *targets[claimed][2:]):
                other_file, other_name = targets[claimed][:2]
                errors.append(SpecError(f"target {name!r} is already handled by {other_file} "
                                        f"({other_name!r}); one op target, one spec, unless both are "
                                        f"bound to disjoint values of a parameter (batch_norm.yaml) "
                                        f"or they read a call apart (a tensor where the other takes a number "
                                        f"or nothing, a flag where the other a number, a tuple result where "
                                        f"the other one tensor)",
                                        file=source.display, field="targets"))
            targets.setdefault(claimed, (source.display, name, spec, target))
    return errors


def rivals(parsed: list[tuple], claims: list[tuple]) -> list:
    """The sources, of ``claims`` ((source, its `spec.claims.Claim` or None)), that `conflicts`
    may set against ``parsed``: the same kind and name, or an op target of the same identity. A
    source without a claim is kept (parsing it in full tells). The others cannot conflict with
    ``parsed``, and `conflicts` finds the same errors without them."""
    if not parsed:
        return []
    names = {(source.kind.name, spec.name) for source, spec in parsed}  # type: ignore[attr-defined]
    claimed = {_target_identity(target.name) for _, spec in parsed for target in getattr(spec, "targets", ())
               if isinstance(getattr(target, "name", None), str)}
    return [source for source, claim in claims
            if claim is None or (source.kind.name, claim.name) in names
            or any(_target_identity(name) in claimed for name in claim.targets)]


def _bound_apart(spec: object, target: object, other_spec: object, other_target: object) -> bool:
    """Do the two specs serve ``target`` only for disjoint values of some parameter?"""
    from shardverify.strategies.handlers.base import bound_apart, flags_apart, signature_apart   # the registry's tests

    def bindings(owner: object, of: object) -> dict:
        return dict(owner.bindings(of)) if hasattr(owner, "bindings") else {}  # type: ignore[attr-defined]

    def signature(owner: object, of: object) -> tuple:
        if not hasattr(owner, "operands_for"):
            return (), ()
        return owner.operands_for(of), owner.params_for(of)  # type: ignore[attr-defined]

    return bound_apart(bindings(spec, target), bindings(other_spec, other_target)) or \
        signature_apart(*signature(spec, target), *signature(other_spec, other_target)) or \
        flags_apart(signature(spec, target)[1], bindings(spec, target),
                    signature(other_spec, other_target)[1], bindings(other_spec, other_target))


def _target_identity(name: str) -> object:
    """What the handler registry keys a target by (so torch.nn.Linear and its full module
    path, or two names of one function, count as the same target)."""
    from shardverify.strategies.handlers.base import target_key
    from shardverify.spec.fields import lookup

    try:
        return target_key(lookup(name))   # by attribute under torch: reading specs imports nothing
    except (LookupError, TypeError):
        return name
