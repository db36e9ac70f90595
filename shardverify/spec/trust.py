"""What a spec may name, decided without running it.

Reading a spec (`list`, `generate`, `generate --check`) must execute nothing the spec names: CI
runs `generate --check` on every submitted spec. So:

* an op target must be a tensor op: a function of torch's tensor namespaces (``torch.*``,
  ``torch.nn.functional.*``, ``torch.special.*``, ``torch.linalg.*``, ``torch.fft.*``), a
  ``torch.Tensor`` method, a ``torch.nn`` module class, or an overload of ``torch.ops`` that
  returns a tensor; never a serialization, file, process or network function (``torch.save``,
  ``torch.load``, ``aten.from_file``, ``torch.os.system``), never one of torch's settings
  (``torch.set_num_threads``: a builtin with no ATen op of its name), never an op on storage
  rather than values (``torch.ops.inductor.resize_storage_bytes_``, ``Tensor.set_``). A name
  under torch is reached by attribute, so no module is imported by its name (names.resolve_torch). What the user lists in
  ``SHARDVERIFY_TRUSTED_TARGETS`` (a setting of the machine, never of a spec) is allowed too,
  matched as an object (:func:`trusted_object`), never by the path a spec reached it by.
* a factory or implementation (plan, model and collective specs) is found by reading its
  module's source: :func:`find_definition` locates the module file without importing it (or
  uses the module already imported) and checks the name is a top-level ``def`` or ``class``.
  The commands and tests that verify a spec import and call it only as spec/allow.py allows.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass

from shardverify.errors import InvalidArgument
from shardverify.spec.limits import MAX_MODEL_BYTES, SettingError
from shardverify.spec.names import UnresolvedName, resolve_dotted, resolve_torch

__all__ = ["TRUSTED_ENV", "DENIED_MODULES", "trusted_modules", "trusted_object", "never_trusted", "under",
           "op_target_refusal", "check_trusted_setting",
           "Definition", "find_definition", "callable_refusal", "build_checked"]

TRUSTED_ENV = "SHARDVERIFY_TRUSTED_TARGETS"

#: Modules whose functions read or write files, run processes, reach the network or unpickle:
#: nothing a spec names may come from them (or from a module below them).
DENIED_MODULES = ("os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "pickle", "marshal", "shelve",
                  "builtins", "io", "pathlib", "tempfile", "importlib", "runpy", "code", "ctypes", "signal",
                  "multiprocessing", "urllib", "http", "ftplib", "smtplib", "webbrowser", "pty", "glob",
                  "torch.serialization", "torch.hub", "torch.utils", "torch.storage", "torch.package",
                  "torch.multiprocessing", "torch.distributed", "torch._dynamo", "torch.compiler", "numpy.lib")

#: where torch's tensor functions are defined (builtins report their C namespace)
_FUNCTION_MODULES = ("torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "torch._C._special",
                     "torch._C._linalg", "torch._C._fft", "torch.special", "torch.linalg", "torch.fft")
#: ATen arguments that name a file: an op taking one reads or writes it (aten.save, aten.from_file)
_FILE_ARGUMENTS = ("filename", "file", "path", "f")
_TARGET_KINDS = ("a tensor op: a function of torch, torch.nn.functional, torch.special, torch.linalg or torch.fft, "
                 "a torch.Tensor method, a torch.nn module class or an overload under torch.ops")


def under(name: str, modules: tuple[str, ...]) -> bool:
    """Whether the dotted ``name`` is one of ``modules`` or lies below one."""
    return any(name == m or name.startswith(f"{m}.") for m in modules)


def trusted_modules() -> tuple[str, ...]:
    """The modules the machine's ``SHARDVERIFY_TRUSTED_TARGETS`` (comma-separated) trusts."""
    text = os.environ.get(TRUSTED_ENV, "")
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        if not all(piece.isidentifier() for piece in name.split(".")):
            raise InvalidArgument(f"{TRUSTED_ENV}: {name!r} is not a dotted module name")
        if under(name, DENIED_MODULES):
            raise InvalidArgument(f"{TRUSTED_ENV}: {name!r} lies in {_denied_root(name)!r}, whose functions "
                                  "touch files, processes or the network; it cannot be trusted for targets")
    return names


def check_trusted_setting() -> None:
    """The machine's :data:`TRUSTED_ENV` read once, before any spec: a bad entry (not a dotted
    name, in a denied module, a name under torch that does not resolve, a module of the user's
    that cannot be found) is one SettingError naming the setting, not one error per spec. Found,
    never imported: a user's module is imported only when a target defined in it is matched."""
    place = f"environment variable {TRUSTED_ENV}"
    try:
        names = trusted_modules()
        for name in names:
            if name.split(".")[0] == "torch":
                resolve_torch(name)
            elif importlib.util.find_spec(name.split(".")[0]) is None:   # a top-level name: imports nothing
                raise InvalidArgument(f"{TRUSTED_ENV}: {name!r}: no module {name.split('.')[0]!r} can be found")
    except UnresolvedName as error:
        raise SettingError(str(error), file=place) from None
    except (InvalidArgument, ImportError, ValueError) as error:
        raise SettingError(str(error).removeprefix(f"{TRUSTED_ENV}: "), file=place) from None


def trusted_object(obj: object) -> bool:
    """Whether the machine trusts ``obj``: matched as an object, never by the path a spec reached
    it by. An entry of :data:`TRUSTED_ENV` is resolved to what it names (one under torch by
    attribute, importing nothing; one of the user's by importing it, as the machine asked) and
    trusts that object, and every function or class *defined* in it when it is a module:
    trusting ``torch.nn`` does not trust ``torch.nn.functional.torch.save`` (defined in
    torch.serialization). A user's module is imported only where ``obj`` is defined under it."""
    defined_in = getattr(obj, "__module__", None)
    defined_in = defined_in if isinstance(defined_in, str) else ""
    if never_trusted(obj):
        return False
    for name in trusted_modules():
        if name.split(".")[0] != "torch" and not under(defined_in, (name.split(".")[0],)):
            continue   # cannot be where obj is defined: left unimported
        try:
            entry = resolve_torch(name) if name.split(".")[0] == "torch" else resolve_dotted(name)
        except UnresolvedName as error:
            raise InvalidArgument(f"{TRUSTED_ENV}: {error}") from None
        if obj is entry:
            return True
        if isinstance(entry, types.ModuleType) and under(defined_in, (entry.__name__,)):
            return True
        if isinstance(entry, type) and defined_in == entry.__module__ and \
                getattr(obj, "__qualname__", "").startswith(f"{entry.__qualname__}."):
            return True
    return False


def never_trusted(obj: object) -> str:
    """Why no setting may trust ``obj``, or "": a function defined under a module that touches
    files, processes or the network (``torch.save``, ``torch.load``: torch.serialization), or a
    torch op taking a file name (``torch.from_file``, ``aten.from_file``). Trusting ``torch``
    trusts its tensor ops, never these."""
    import torch

    defined_in = getattr(obj, "__module__", None)
    if isinstance(defined_in, str) and under(defined_in, DENIED_MODULES):
        return f"defined in {defined_in}, whose functions touch files, processes or the network"
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        aten = obj
    elif isinstance(obj, types.BuiltinFunctionType) and isinstance(getattr(obj, "__name__", None), str):
        aten = getattr(torch.ops.aten, obj.__name__, None) if isinstance(defined_in, str) and \
            under(defined_in, ("torch",)) else None
    else:
        aten = None
    argument = _file_argument(aten) if isinstance(aten, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else ""
    return f"takes a file name ({argument!r}): it reads or writes files" if argument else ""


def _denied_root(name: str) -> str:
    return next(m for m in DENIED_MODULES if name == m or name.startswith(f"{m}."))


def _file_argument(op: object) -> str:
    """The name of an argument naming a file in any overload of ATen ``op``, else ""."""
    import torch

    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, o) for o in op.overloads()]
    for overload in overloads:
        for argument in overload._schema.arguments:
            if argument.name in _FILE_ARGUMENTS and str(argument.type).startswith("str"):
                return argument.name
    return ""


#: ops that resize, replace or expose a tensor's storage: they act on memory, not on values
#: (``torch.ops.inductor.resize_storage_bytes_`` frees it under every view of the tensor)
_STORAGE_OPS = ("resize_", "resize_as_", "_resize_output_", "set_", "share_memory_", "data_ptr", "record_stream")


def _storage_refusal(name: str, op_name: str, schemas=()) -> str:
    """Why an op named ``op_name`` (with these ATen schemas) acts on storage rather than values, else ""."""
    storage_typed = any(str(a.type) == "Storage" for schema in schemas for a in (*schema.arguments, *schema.returns))
    if "storage" in op_name.lower() or op_name in _STORAGE_OPS or storage_typed:
        return f"{name!r} resizes, replaces or exposes a tensor's storage: not a tensor op"
    return ""


def _overload_refusal(name: str, op: object) -> str:
    """Why an overload (or every overload of a packet) under torch.ops is no tensor op, else ""."""
    import torch

    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, o) for o in op.overloads()]
    schemas = [overload._schema for overload in overloads]
    op_name = schemas[0].name.split("::")[-1] if schemas else ""
    refusal = _storage_refusal(name, op_name, schemas)
    if refusal:
        return refusal
    argument = _file_argument(op)
    if argument:
        return f"{name!r} takes a file name ({argument!r}): it reads or writes files"
    if not any("Tensor" in str(r.type) for schema in schemas for r in schema.returns):
        return f"{name!r} returns no tensor: not a tensor op"
    return ""


def op_target_refusal(name: str, obj: object) -> str:
    """"" when ``obj`` (what the dotted ``name`` resolved to) is a tensor op a spec may target;
    otherwise why not, in words. The object decides, not the path it was reached by
    (``torch.functional.torch.sum`` is ``torch.sum``)."""
    import torch

    never = never_trusted(obj)
    if never:
        return f"{name!r} ({never})"
    if trusted_object(obj):
        return ""
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _overload_refusal(name, obj)
    if isinstance(obj, type):
        return "" if issubclass(obj, torch.nn.Module) else f"{name!r} is a class but not a torch.nn.Module"
    module = getattr(obj, "__module__", None) or ""
    if name.split(".")[:-1] == ["torch", "Tensor"] or getattr(obj, "__objclass__", None) is torch._C.TensorBase:
        if not callable(obj):
            return f"{name!r} is not a torch.Tensor method"
        return _storage_refusal(name, getattr(obj, "__name__", name.rsplit(".", 1)[-1]))
    if module in _FUNCTION_MODULES and isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        if isinstance(obj, types.FunctionType) and module == "torch":
            return f"{name!r} is one of torch's settings or tools, not a tensor op"   # torch.compile, set_default_*
        aten = getattr(torch.ops.aten, obj.__name__, None) if isinstance(obj, types.BuiltinFunctionType) else None
        if isinstance(obj, types.BuiltinFunctionType) and not isinstance(aten, torch._ops.OpOverloadPacket):
            return f"{name!r} is one of torch's settings or tools (no ATen op of that name), not a tensor op"
        refusal = _storage_refusal(name, obj.__name__)
        if refusal:
            return refusal
        argument = _file_argument(aten) if aten is not None else ""
        return f"{name!r} takes a file name ({argument!r}): it reads or writes files" if argument else ""
    where = f" (defined in {module})" if module else ""
    return f"{name!r}{where} is not {_TARGET_KINDS}"


# --------------------------------------------------------------- factories, read not run


@dataclass(frozen=True)
class Definition:
    """A top-level ``def`` or ``class`` found for a dotted name; ``signature`` of a function
    (None for a class, or a function the source does not spell out)."""

    name: str
    module: str
    attribute: str
    kind: str                               # "function" | "class"
    signature: inspect.Signature | None


def _split(name: str) -> list[tuple[str, str]]:
    """The (module, attribute) readings of ``name``: ``pkg.mod:attr`` has one, ``pkg.mod.attr``
    one per cut, the longest module first."""
    if ":" in name:
        module, _, attribute = name.partition(":")
        return [(module, attribute)]
    parts = name.split(".")
    return [(".".join(parts[:cut]), ".".join(parts[cut:])) for cut in range(len(parts) - 1, 0, -1)]


def _source_of(module: str) -> str | None:
    """The path of ``module``'s Python source, found without importing it or its packages
    (importing would run their code): a package already imported gives its search path, the
    top-level name is looked up by the import system's finders (which import nothing), the rest
    along the package's folders. None where there is no such file."""
    pieces = module.split(".")
    spec = None
    for depth in range(1, len(pieces) + 1):
        name = ".".join(pieces[:depth])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None)
        elif depth == 1:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
        else:
            locations = list(getattr(spec, "submodule_search_locations", None) or [])
            spec = importlib.machinery.PathFinder.find_spec(name, locations) if locations else None
        if spec is None:
            return None
    origin = getattr(spec, "origin", None)
    return origin if isinstance(origin, str) and origin.endswith(".py") else None


def _signature_of(node: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The parameters a ``def`` declares (defaults stand in as None: only their presence counts)."""
    args = node.args
    P = inspect.Parameter
    positional = [*((a, P.POSITIONAL_ONLY) for a in args.posonlyargs), *((a, P.POSITIONAL_OR_KEYWORD) for a in args.args)]
    first_default = len(positional) - len(args.defaults)
    params = [P(a.arg, kind, default=None if i >= first_default else P.empty) for i, (a, kind) in enumerate(positional)]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None)
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _from_source(name: str, module: str, attribute: str, path: str) -> Definition:
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as error:
        raise InvalidArgument(f"{name!r}: cannot read {module!r} ({path}): {error}") from None
    if "." in attribute:
        raise InvalidArgument(f"{name!r}: {attribute!r} is not a top-level function or class of {module!r}")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attribute:
            return Definition(name, module, attribute, "function", _signature_of(node))
        if isinstance(node, ast.ClassDef) and node.name == attribute:
            return Definition(name, module, attribute, "class", None)
    raise InvalidArgument(f"{name!r}: {module!r} has no attribute {attribute!r} (no top-level def or class of that "
                          f"name in {path})")


def _from_loaded(name: str, module: str, attribute: str) -> Definition:
    obj: object = sys.modules[module]
    for piece in attribute.split("."):
        if piece not in vars(obj):  # vars, not getattr: a module __getattr__ would run code
            raise InvalidArgument(f"{name!r}: {module!r} has no attribute {attribute!r}")
        obj = vars(obj)[piece]
    refusal = callable_refusal(name, obj)
    if refusal:
        raise InvalidArgument(refusal)
    if isinstance(obj, type):
        return Definition(name, module, attribute, "class", None)
    try:
        signature: inspect.Signature | None = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        signature = None
    return Definition(name, module, attribute, "function", signature)


def find_definition(name: str) -> Definition:
    """The function or class ``name`` (``pkg.mod.attr`` or ``pkg.mod:attr``) names, found by
    reading its module's source, or from the module when it is imported already; nothing is
    imported or called. Raises InvalidArgument naming what is wrong."""
    for module, attribute in _split(name):
        if under(module, DENIED_MODULES):
            raise InvalidArgument(f"{name!r} lies in {_denied_root(module)!r}, whose functions touch files, "
                                  "processes or the network; a spec may not name it")
        if module in sys.modules:
            return _from_loaded(name, module, attribute)
        path = _source_of(module)
        if path is not None:
            return _from_source(name, module, attribute, path)
    raise InvalidArgument(f"{name!r} names no Python module on the path (looked for "
                          f"{', '.join(repr(m) for m, _ in _split(name))})")


def callable_refusal(name: str, obj: object) -> str:
    """"" when ``obj`` is a Python function or class outside :data:`DENIED_MODULES`; otherwise
    why a spec may not have it called."""
    module = getattr(obj, "__module__", None) or ""
    if under(module, DENIED_MODULES):
        return f"{name!r} is defined in {module!r}, whose functions touch files, processes or the network"
    if not isinstance(obj, (type, types.FunctionType)):
        return f"{name!r} is a {type(obj).__name__}, not a Python function or class"
    return ""


def build_checked(build, what: str):
    """The ``torch.nn.Module`` ``build()`` returns, built on the meta device first so that a
    model over MAX_MODEL_BYTES is refused before anything is allocated. Any failure is an
    InvalidArgument in one line naming ``what``."""
    import torch

    for device in ("meta", None):
        try:
            with torch.device(device) if device else contextlib.nullcontext():
                module = build()
        except Exception as error:  # noqa: BLE001 - the user's factory raised: said in one line
            text = str(error).strip().splitlines()
            raise InvalidArgument(f"{what} raised {type(error).__name__}{': ' + text[0] if text else ''}") from error
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgument(f"{what} returned a {type(module).__name__}, not a torch.nn.Module")
        if device == "meta":
            tensors = [*module.parameters(), *module.buffers()]
            too_big = MAX_MODEL_BYTES.exceeded(sum(t.numel() * t.element_size() for t in tensors))
            if too_big:
                raise InvalidArgument(f"{what}: the model's {too_big}")
    return module
