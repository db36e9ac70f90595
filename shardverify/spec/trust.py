"""What a spec may name, decided without running it: an allow list, never a deny list.

Reading a spec (`list`, `generate`, `generate --check`) must execute nothing the spec names: CI
runs `generate --check` on every submitted spec. So a name is allowed only where it is one of
these, and refused otherwise (with what is allowed in the message):

* an op target is a tensor op (:func:`op_target_refusal`): a function of torch's tensor
  namespaces (``torch.*``, ``torch.nn.functional.*``, ``torch.special.*``, ``torch.linalg.*``,
  ``torch.fft.*``) that has an ATen op of its name, a ``torch.Tensor`` method, a module class of
  ``torch.nn`` (or ``torch.ao.nn``), or an overload under ``torch.ops`` that returns a tensor; a
  tensor op acts on values, so it takes no file name (``torch.from_file``, ``aten.save``) and
  does not resize, replace or expose a tensor's storage (``Tensor.set_``,
  ``torch.ops.inductor.resize_storage_bytes_``). Anything else under torch (``torch.save``,
  ``torch.hub.load``, ``torch.os.system``, ``torch.compile``, ``torch.set_num_threads``) is none
  of these. A name under torch is reached by attribute, so no module is imported by its name
  (names.resolve_torch); the object decides, not the path it was reached by.
* or a function or class *defined* in a module of the user's own that the machine's setting
  ``SHARDVERIFY_TRUSTED_TARGETS`` names (never a spec): matched as an object
  (:func:`trusted_object`). The setting names modules of the user's own only
  (:func:`trusted_modules`): files outside Python's installation (its standard library and
  installed packages, torch among them) and outside shardverify; torch's names need no setting.
* a factory or implementation (plan, model and collective specs) is found by reading its
  module's source: :func:`find_definition` locates the module file without importing it (or
  uses the module already imported) and checks the name is a top-level ``def`` or ``class``.
  Whether it may be called is spec/allow.py's allow list, asked before it is read.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.machinery
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path

from shardverify.errors import InvalidArgument
from shardverify.spec.limits import MAX_MODEL_BYTES, SettingError
from shardverify.spec.names import UnresolvedName, resolve_dotted

__all__ = ["TRUSTED_ENV", "TENSOR_FUNCTION_MODULES", "MODULE_CLASS_MODULES", "own_file", "trusted_modules",
           "trusted_object", "under", "op_target_refusal", "check_trusted_setting",
           "Definition", "find_definition", "build_checked"]

TRUSTED_ENV = "SHARDVERIFY_TRUSTED_TARGETS"

#: where torch's tensor functions are defined (builtins report their C namespace)
TENSOR_FUNCTION_MODULES = ("torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "torch._C._special",
                           "torch._C._linalg", "torch._C._fft", "torch.special", "torch.linalg", "torch.fft")
#: where the torch.nn.Module classes an op target may name are defined: torch's layers
MODULE_CLASS_MODULES = ("torch.nn", "torch.ao.nn")
#: ATen arguments that name a file: an op taking one reads or writes it (aten.save, aten.from_file)
_FILE_ARGUMENTS = ("filename", "file", "path", "f")
_TARGET_KINDS = ("a tensor op: a function of torch, torch.nn.functional, torch.special, torch.linalg or torch.fft, "
                 "a torch.Tensor method, a torch.nn module class or an overload under torch.ops; or a function "
                 f"or class of a module of yours named in {TRUSTED_ENV}")
#: what the setting may name, said in its refusals (which name the setting themselves)
_SETTING_RULE = ("the setting names modules of your own (files outside Python's standard library, installed "
                 "packages and shardverify); torch's tensor ops, torch.nn and transformers model classes and "
                 "shardverify's zoos need no setting")


def under(name: str, modules: tuple[str, ...]) -> bool:
    """Whether the dotted ``name`` is one of ``modules`` or lies below one."""
    return any(name == m or name.startswith(f"{m}.") for m in modules)


@functools.cache
def _installed() -> tuple[Path, ...]:
    """Folders of Python itself, installed packages and shardverify: never the user's own (the
    interpreter's, so found once a process)."""
    paths = [*(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")),
             *site.getsitepackages(), site.getusersitepackages(), str(Path(__file__).resolve().parents[1])]
    return tuple(Path(p).resolve() for p in paths if p)


def own_file(file: str | None) -> bool:
    """Whether ``file`` is a module file of the user's own: it lies outside Python's installation
    (its standard library, installed packages) and outside shardverify."""
    if not file:
        return False
    path = Path(file).resolve()
    parts = set(path.parts)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not any(path.is_relative_to(p) for p in _installed())


def _module_file(module: str) -> str | None:
    """The file ``module`` is loaded from (a frozen module's source file), found without importing
    it: None for a module built into Python or not found."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        file = getattr(loaded, "__file__", None)
        return file if isinstance(file, str) else None
    spec = _spec_of(module)
    origin = getattr(spec, "origin", None)
    if origin == "frozen":
        origin = getattr(getattr(spec, "loader_state", None), "filename", None)
    return origin if isinstance(origin, str) and os.path.isabs(origin) else None


def _setting_refusal(name: str) -> str:
    """"" when the setting's entry ``name`` names a module of the user's own (or an object in
    one); otherwise why not, in words. Found, never imported."""
    top = name.split(".")[0]
    if top == "torch":
        return f"{name!r} cannot be trusted: it lies under torch; {_SETTING_RULE}"
    pieces = name.split(".")
    file = next((found for cut in range(len(pieces), 0, -1)
                 if (found := _module_file(".".join(pieces[:cut]))) is not None), None)
    if file is None:
        try:
            exists = top in sys.modules or importlib.util.find_spec(top) is not None   # top-level: imports nothing
        except (ImportError, ValueError):
            exists = False
        if not exists:
            return f"{name!r}: no module {top!r} can be found"
        return (f"{name!r} cannot be trusted: it has no module file (built into Python, or a folder without "
                f"__init__.py); {_SETTING_RULE}")
    if not own_file(file):
        return (f"{name!r} cannot be trusted: it lies in {file}, part of Python or of an installed package; "
                f"{_SETTING_RULE}")
    return ""


def trusted_modules() -> tuple[str, ...]:
    """The modules of the user's own that the machine's ``SHARDVERIFY_TRUSTED_TARGETS``
    (comma-separated) names; an entry that is not a dotted name or not of the user's own (Python's
    standard library, an installed package such as torch, shardverify) is an InvalidArgument."""
    text = os.environ.get(TRUSTED_ENV, "")
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        if not all(piece.isidentifier() for piece in name.split(".")):
            raise InvalidArgument(f"{TRUSTED_ENV}: {name!r} is not a dotted module name")
    for name in names:
        refusal = _setting_refusal(name)
        if refusal:
            raise InvalidArgument(f"{TRUSTED_ENV}: {refusal}")
    return names


def check_trusted_setting() -> None:
    """The machine's :data:`TRUSTED_ENV` read once, before any spec: a bad entry (not a dotted
    name, not a module of the user's own, a module that cannot be found) is one SettingError
    naming the setting, not one error per spec. Found, never imported: a user's module is
    imported only when a target defined in it is matched."""
    try:
        trusted_modules()
    except InvalidArgument as error:
        raise SettingError(str(error).removeprefix(f"{TRUSTED_ENV}: "),
                           file=f"environment variable {TRUSTED_ENV}") from None


def trusted_object(obj: object) -> bool:
    """Whether the machine trusts ``obj``: it is *defined* under an entry of :data:`TRUSTED_ENV`
    (a module of the user's own), matched as an object, never by the path a spec reached it by.
    An entry is resolved to what it names (by importing it, as the machine asked) and trusts that
    object, and every function or class defined in it when it is a module: trusting ``mypkg``
    does not trust ``mypkg.torch.save`` (defined in torch.serialization). A user's module is
    imported only where ``obj`` is defined under it."""
    defined_in = getattr(obj, "__module__", None)
    defined_in = defined_in if isinstance(defined_in, str) else ""
    for name in trusted_modules():
        if not under(defined_in, (name.split(".")[0],)):
            continue   # cannot be where obj is defined: left unimported
        try:
            entry = resolve_dotted(name)
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


def _values_refusal(name: str, op_name: str, aten: object, schemas=()) -> str:
    """"" when an op (named ``op_name``, ATen ``aten`` with these schemas) acts on values only:
    no storage, no file name; otherwise why not."""
    refusal = _storage_refusal(name, op_name, schemas)
    if refusal:
        return refusal
    argument = _file_argument(aten) if aten is not None else ""
    return f"{name!r} takes a file name ({argument!r}): it reads or writes files" if argument else ""


def _overload_refusal(name: str, op: object) -> str:
    """"" when an overload (or every overload of a packet) under torch.ops is a tensor op: it acts
    on values and returns a tensor; otherwise why not."""
    import torch

    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, o) for o in op.overloads()]
    schemas = [overload._schema for overload in overloads]
    op_name = schemas[0].name.split("::")[-1] if schemas else ""
    refusal = _values_refusal(name, op_name, op, schemas)
    if refusal:
        return refusal
    if not any("Tensor" in str(r.type) for schema in schemas for r in schema.returns):
        return f"{name!r} returns no tensor: not a tensor op"
    return ""


def op_target_refusal(name: str, obj: object) -> str:
    """"" when ``obj`` (what the dotted ``name`` resolved to) is what an op target may be: a
    tensor op of torch, or a function or class defined in a trusted module of the user's own;
    otherwise why not, in words. The object decides, not the path it was reached by
    (``torch.functional.torch.sum`` is ``torch.sum``)."""
    import torch

    if trusted_object(obj):
        return ""
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _overload_refusal(name, obj)
    module = getattr(obj, "__module__", None)
    module = module if isinstance(module, str) else ""
    if isinstance(obj, type):
        if not issubclass(obj, torch.nn.Module):
            return f"{name!r} is a class but not a torch.nn.Module"
        if under(module, MODULE_CLASS_MODULES):
            return ""
        return f"{name!r} is a module class defined in {module}, not one of torch.nn's layers: not {_TARGET_KINDS}"
    if name.split(".")[:-1] == ["torch", "Tensor"] or getattr(obj, "__objclass__", None) is torch._C.TensorBase:
        if not callable(obj):
            return f"{name!r} is not a torch.Tensor method"
        return _storage_refusal(name, getattr(obj, "__name__", name.rsplit(".", 1)[-1]))
    if module in TENSOR_FUNCTION_MODULES and isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        if isinstance(obj, types.FunctionType) and module == "torch":
            return f"{name!r} is one of torch's settings or tools, not a tensor op"   # torch.compile, set_default_*
        aten = getattr(torch.ops.aten, obj.__name__, None) if isinstance(obj, types.BuiltinFunctionType) else None
        if isinstance(obj, types.BuiltinFunctionType) and not isinstance(aten, torch._ops.OpOverloadPacket):
            return f"{name!r} is one of torch's settings or tools (no ATen op of that name), not a tensor op"
        return _values_refusal(name, obj.__name__, aten)
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


def _spec_of(module: str):
    """The import spec of ``module``, found without importing it or its packages (importing would
    run their code): a package already imported gives its search path, the top-level name is
    looked up by the import system's finders (which import nothing), the rest along the
    package's folders. None where there is no such module."""
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
    return spec


def _source_of(module: str) -> str | None:
    """The path of ``module``'s Python source, found without importing it (:func:`_spec_of`);
    None where there is no such file."""
    origin = getattr(_spec_of(module), "origin", None)
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
    if not isinstance(obj, (type, types.FunctionType)):
        raise InvalidArgument(f"{name!r} is a {type(obj).__name__}, not a Python function or class")
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
        if module in sys.modules:
            return _from_loaded(name, module, attribute)
        path = _source_of(module)
        if path is not None:
            return _from_source(name, module, attribute, path)
    raise InvalidArgument(f"{name!r} names no Python module on the path (looked for "
                          f"{', '.join(repr(m) for m, _ in _split(name))})")


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
