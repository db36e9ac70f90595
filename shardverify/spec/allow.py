"""Which callables a spec may have called: allowed by what they are, never denied by name.

A deny list of modules cannot be complete (``timeit.timeit(stmt=...)``, ``cProfile.run``,
``pydoc.pipepager(cmd=...)`` each ran a spec's code), so a factory (plan and model specs,
``shardverify plan pkg.make``), a collective implementation and a custom DTensor op's module
are called or imported only when they are one of:

* a ``torch.nn.Module`` class (``torch.nn.Linear``; one of a module already imported);
* a function or class defined in a module of the spec's *project*: a Python file under the
  folder that holds the spec's ``specs`` folder (for ``specs/plans/x.yaml``, the repository;
  for a spec outside a ``specs`` folder, its own folder; for a name on the command line, the
  current folder), never one under Python's or an installed package's folders;
* one of shardverify's zoos (:data:`ZOO_MODULES`), or defined under a module the machine trusts
  (``SHARDVERIFY_TRUSTED_TARGETS``, matched by object: see :func:`trust.trusted_object`).

Everything else (the standard library, installed packages, shardverify's own machinery) is
refused before it is imported or called, with this rule in the message. The check runs twice:
on the name, before any import (where the module's file lies, found without importing it), and
on the object imported, before the call (an alias such as ``from pydoc import pipepager`` in a
project module is judged where it is defined). A spec's arguments stay data only.
"""

from __future__ import annotations

import site
import sys
import sysconfig
import types
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from shardverify.errors import InvalidArgument
from shardverify.spec.names import UnresolvedName, resolve_dotted, resolve_torch
from shardverify.spec.trust import (TRUSTED_ENV, _source_of, _split, build_checked, trusted_modules, trusted_object,
                                    under)

__all__ = ["ZOO_MODULES", "RULE", "reading", "project_of", "name_refusal", "object_refusal", "resolve_allowed", "call_factory"]

#: shardverify's own modules of models and collectives that specs may name
ZOO_MODULES = ("shardverify.plan.zoo", "shardverify.ddp.zoo", "shardverify.algorithms.implementations",
               "shardverify.collectives.functional")

RULE = ("a spec may have called only a torch.nn.Module class, a function or class defined in a module of the "
        "spec's project (a Python file under the folder holding its specs folder), one of shardverify's zoos "
        f"({', '.join(ZOO_MODULES)}) or one under a module the machine trusts ({TRUSTED_ENV})")


#: the real path of each spec being read, by the name its messages give it (relative to a --root)
_READING: ContextVar[tuple[tuple[str, Path], ...]] = ContextVar("_READING", default=())


@contextmanager
def reading(display: str, path: Path):
    """While a spec shown as ``display`` (its nodes' file) is parsed, ``path`` is where it lies."""
    token = _READING.set((*_READING.get(), (display, Path(path))))
    try:
        yield
    finally:
        _READING.reset(token)


def project_of(spec_file: str | Path | None) -> Path:
    """The project of a spec: the folder holding the nearest ``specs`` folder above it, else the
    spec's own folder; the current folder for a name given on the command line."""
    if spec_file is None:
        return Path.cwd().resolve()
    path = dict(_READING.get()).get(str(spec_file), Path(spec_file))
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    for parent in path.parents:
        if parent.name == "specs":
            return parent.parent
    return path.parent


def _installed() -> tuple[Path, ...]:
    """Folders of Python itself, installed packages and shardverify: never the project's."""
    paths = [*(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")),
             *site.getsitepackages(), site.getusersitepackages(), str(Path(__file__).resolve().parents[1])]
    return tuple(Path(p).resolve() for p in paths if p)


def _in_project(file: str | None, project: Path) -> bool:
    if not file:
        return False
    path = Path(file).resolve()
    parts = set(path.parts)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return path.is_relative_to(project) and not any(path.is_relative_to(p) for p in _installed())


def _refused(name: str, why: str) -> str:
    return f"{name!r} {why}: {RULE}"


def object_refusal(name: str, obj: object, project: Path) -> str:
    """"" when ``obj`` (what ``name`` resolved to) may be called for a spec of ``project``;
    otherwise why not, with the rule. Judged where ``obj`` is defined, not how it was reached."""
    import torch

    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return ""
    if not isinstance(obj, (type, types.FunctionType)):
        return _refused(name, f"is a {type(obj).__name__}, not a Python function or class")
    module = getattr(obj, "__module__", None) or ""
    if under(module, ZOO_MODULES) or trusted_object(obj):
        return ""
    loaded = sys.modules.get(module)
    if _in_project(getattr(loaded, "__file__", None), project):
        return ""
    return _refused(name, f"is defined in {module or 'no module'!r}, outside the project {str(project)!r}")


def name_refusal(name: str, project: Path) -> str:
    """The check before any import: "" when ``name`` may be imported and called for a spec of
    ``project``; otherwise why not, with the rule. Torch's objects are reached by attribute and
    a module already imported is judged by object; any other module by where its file lies."""
    if not isinstance(name, str) or not all(p.isidentifier() for p in name.replace(":", ".").split(".")):
        return _refused(str(name), "is not a dotted name such as 'package.module:function'")
    if "__main__" in name.replace(":", ".").split("."):
        return _refused(name, "names a module's __main__ (a command line)")
    if name.split(".")[0].split(":")[0] == "torch":
        try:
            obj = resolve_torch(name.replace(":", "."))
        except UnresolvedName as error:
            return f"{error}; {RULE}"
        return object_refusal(name, obj, project)
    for module, attribute in _split(name):
        if under(module, ZOO_MODULES) or under(module, trusted_modules()):
            return ""    # shardverify's zoo, or a module the machine trusts: the object is checked again
        loaded = sys.modules.get(module)
        if loaded is not None:
            obj: object = loaded
            for piece in attribute.split("."):
                if piece not in vars(obj):   # vars, not getattr: a module __getattr__ would run code
                    return _refused(name, f"is not an attribute of the imported {module!r}")
                obj = vars(obj)[piece]
            return object_refusal(name, obj, project)
        path = _source_of(module)
        if path is not None:
            return "" if _in_project(path, project) else \
                _refused(name, f"lies in {module!r} ({path}), outside the project {str(project)!r}")
    return _refused(name, "names no Python module on the path")


def resolve_allowed(name: str, project: Path) -> object:
    """The object ``name`` names, imported only after :func:`name_refusal` allowed it and
    returned only when :func:`object_refusal` allows what came; InvalidArgument otherwise."""
    refusal = name_refusal(name, project)
    if refusal:
        raise InvalidArgument(refusal)
    try:
        obj = resolve_dotted(name)
    except LookupError as error:
        raise InvalidArgument(str(error)) from None
    refusal = object_refusal(name, obj, project)
    if refusal:
        raise InvalidArgument(refusal)
    return obj


def call_factory(name: str, kwargs: dict[str, object], project: Path):
    """The ``torch.nn.Module`` the factory ``name`` builds from ``kwargs`` (data only): the one
    way a spec's factory is called, by the commands and tests that verify it, never when it is
    read; allowed by :func:`resolve_allowed` first, then built by :func:`trust.build_checked`."""
    try:
        make = resolve_allowed(name, project)
    except InvalidArgument as error:
        raise InvalidArgument(f"factory {error}") from None
    return build_checked(lambda: make(**kwargs), f"factory {name}(**{kwargs!r})")  # type: ignore[operator]
