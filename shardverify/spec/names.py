"""Resolving dotted names ("torch.nn.functional.linear", "torch.Tensor.sum",
"pkg.module:factory") to objects: one resolver for spec targets, harness cases, collective
implementations and model factories, so they all accept and reject the same names."""

from __future__ import annotations

import importlib

from shardverify.errors import InvalidArgument

__all__ = ["UnresolvedName", "resolve_dotted", "resolve_torch", "MAX_NAME_CHARS"]

#: Longest dotted name accepted (no real module path comes near it).
MAX_NAME_CHARS = 200


class UnresolvedName(InvalidArgument, LookupError):
    """A dotted name that names no importable object (a LookupError too, for callers that
    treat any failed lookup alike)."""


def resolve_dotted(name: str) -> object:
    """The object named ``name``: the longest importable module prefix, then attributes.
    ``"package.module:attr.sub"`` names the module explicitly."""
    if isinstance(name, str) and len(name) > MAX_NAME_CHARS:
        raise UnresolvedName(f"a dotted name of {len(name)} characters is longer than {MAX_NAME_CHARS}: "
                             f"{name[:60]!r}...")
    module_part, colon, attr_part = name.partition(":") if isinstance(name, str) else ("", "", "")
    parts = module_part.split(".") + (attr_part.split(".") if colon else [])
    if not isinstance(name, str) or any(not p.isidentifier() for p in parts):
        raise UnresolvedName(f"expected a dotted name such as 'torch.sum' or 'package.module:attr', got {name!r}")
    cuts = [len(module_part.split("."))] if colon else range(len(parts), 0, -1)
    for cut in cuts:
        prefix = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(prefix)
        except ModuleNotFoundError as exc:
            if colon or not (exc.name == prefix or prefix.startswith(f"{exc.name}.")):
                raise UnresolvedName(f"{name!r} does not name an importable object: cannot import "
                                     f"{prefix!r}: {exc}") from None
            continue
        except Exception as exc:  # noqa: BLE001 - a module that fails while importing names nothing usable
            raise UnresolvedName(f"{name!r} does not name an importable object: importing {prefix!r} "
                                 f"failed: {type(exc).__name__}: {exc}") from None
        for index, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                raise UnresolvedName(f"{name!r} does not name an importable object: "
                                     f"{'.'.join(parts[:index])!r} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise UnresolvedName(f"{name!r} does not name an importable object")


def resolve_torch(name: str) -> object:
    """The object a name under ``torch`` names, reached by attribute from the imported torch:
    no module is imported by its name, so a name under a module torch does not itself import
    (``torch.utils.model_dump.__main__``, whose import runs a command line) names nothing.
    A lazy attribute of torch's own packages may load one of them; nothing outside torch runs."""
    import torch

    parts = name.split(".") if isinstance(name, str) else []
    if not parts or parts[0] != "torch" or any(not p.isidentifier() for p in parts) or len(name) > MAX_NAME_CHARS:
        raise UnresolvedName(f"expected a dotted name under 'torch' such as 'torch.sum', got {name!r}")
    if "__main__" in parts:
        raise UnresolvedName(f"{name!r} names a module's __main__, a command line, not an op")
    obj: object = torch
    for index, attr in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, attr)
        except Exception:  # noqa: BLE001 - AttributeError, or a lazy attribute that failed to load
            raise UnresolvedName(f"{name!r} does not resolve: {'.'.join(parts[:index])!r} has no attribute "
                                 f"{attr!r} (a module torch does not import is never imported for a spec)") from None
    return obj
