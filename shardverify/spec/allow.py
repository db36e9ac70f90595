"""Which callables a spec may have called: an allow-list naming what may be built, never a deny list.

A deny list of modules cannot be complete (``timeit.timeit(stmt=...)``, ``cProfile.run``,
``pydoc.pipepager(cmd=...)`` each ran a spec's code), and "anything in the project" admitted its
test helpers (a plan spec's ``factory: tests.test_x._run`` with ``kwargs: {args: [-c, ...]}`` ran a
Python command). So a factory (plan and model specs, ``shardverify plan pkg.make``), a collective
implementation and a custom DTensor op's module are called or imported only when they are one of:

* a model class of ``torch.nn`` or of ``transformers`` (defined under either);
* one of shardverify's zoos (:data:`ZOO_MODULES`);
* defined under a module the user names: in the machine's setting ``SHARDVERIFY_TRUSTED_TARGETS``
  (matched by object: see :func:`trust.trusted_object`), or, for a name given on the command line
  (``shardverify plan pkg.make``), a Python file under the current folder;

and never, whatever admits it otherwise: a private name (a part of the dotted name, the module
or the qualified name starting with ``_``), a module of a test folder (:data:`TEST_FOLDERS`, or a
``test_*`` module), or a function of a module that runs a process or code (:func:`process_refusal`,
read statically from the module's source: its imports and the calls it spells out).

Everything else (the standard library, installed packages, shardverify's own machinery, the
modules of a spec's repository that no setting names) is refused before it is imported or
called, with this rule in the message. The check runs twice: on the name, before any import
(where the module's file lies, found without importing it), and on the object imported, before
the call (an alias such as ``from pydoc import pipepager`` in a named module is judged where it
is defined). A spec's arguments stay data only.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

from shardverify.errors import InvalidArgument, ShardVerifyError
from shardverify.files import read_regular_file
from shardverify.spec.names import UnresolvedName, resolve_dotted, resolve_torch
from shardverify.spec.trust import (TRUSTED_ENV, _source_of, _split, build_checked, own_file, trusted_modules,
                                    trusted_object, under)

__all__ = ["ZOO_MODULES", "MODEL_MODULES", "TEST_FOLDERS", "RULE", "project_of", "name_refusal", "object_refusal",
           "process_refusal", "resolve_allowed", "call_factory"]

#: shardverify's own modules of models and collectives that specs may name
ZOO_MODULES = ("shardverify.plan.zoo", "shardverify.features.ddp.zoo", "shardverify.features.algorithms.implementations",
               "shardverify.collectives.functional")
#: where the model classes a spec may name without any setting are defined
MODEL_MODULES = ("torch.nn", "transformers")
#: folders of tests: no module in them is ever called for a spec (their helpers run commands)
TEST_FOLDERS = ("tests", "test", "testing", "generated_tests")
#: modules that start processes or run code: a module importing one is never called for a spec
PROCESS_MODULES = ("subprocess", "multiprocessing", "pty", "pexpect", "asyncio.subprocess", "concurrent.futures",
                   "runpy", "code", "codeop", "ctypes", "importlib", "pydoc", "webbrowser", "timeit", "cProfile",
                   "profile", "pdb", "torch.multiprocessing", "torch.utils.cpp_extension")
#: functions of ``os`` (and of the builtins) that start a process or run code
PROCESS_CALLS = ("system", "popen", "fork", "forkpty", "kill", "killpg", "posix_spawn", "posix_spawnp",
                 "eval", "exec", "compile", "__import__", "breakpoint")
_PROCESS_PREFIXES = ("exec", "spawn")
#: the largest module source read for the check (a generated module may be large, not this large)
_MAX_SOURCE_BYTES = 4 * 1024 * 1024

RULE = ("a spec may have called only a torch.nn.Module class of torch.nn or transformers, one of shardverify's zoos "
        f"({', '.join(ZOO_MODULES)}), a function or class of a module the user names ({TRUSTED_ENV}, or for a "
        "name on the command line a Python file under the current folder); never a private name, a module of a "
        "test folder or one that runs a process")


def project_of(spec_file: str | Path | None) -> Path | None:
    """The folder whose own modules may be called: the current folder for a name the user gave on
    the command line (``spec_file`` None); None for a name a spec file holds, whose modules must be
    named in the machine's setting (:data:`TRUSTED_ENV`) or be a zoo's or a model class's."""
    return Path.cwd().resolve() if spec_file is None else None


def _in_project(file: str | None, project: Path | None) -> bool:
    """Whether ``file`` is a module of the user's own (trust.own_file) under ``project``."""
    if project is None or not own_file(file):
        return False
    return Path(file).resolve().is_relative_to(project)   # type: ignore[arg-type]


def _refused(name: str, why: str) -> str:
    return f"{name!r} {why}: {RULE}"


def _pieces(dotted: str) -> list[str]:
    return [piece for piece in dotted.replace(":", ".").split(".") if piece]


def _shape_refusal(name: str, dotted: str, file: str | None = None) -> str:
    """Why a name, module or qualified name ``dotted`` (defined in ``file``) is never called: a
    private part, or a test folder's module; "" otherwise."""
    pieces = _pieces(dotted)
    private = next((piece for piece in pieces if piece.startswith("_")), None)
    if private is not None:
        return _refused(name, f"is a private name ({private!r} starts with '_')")
    folders = [*pieces[:-1], *(_import_folders(file) if file else ())]
    test = next((piece for piece in folders if piece in TEST_FOLDERS), None) or next(
        (piece for piece in pieces if piece.startswith("test_") or piece == "conftest"), None)
    if test is not None:
        return _refused(name, f"lies in a test folder or module ({test!r})")
    return ""


def _import_folders(file: str) -> tuple[str, ...]:
    """The folders ``file`` is imported through: the entry of ``sys.path`` it lies under (its
    name: ``tests/`` itself on the path, as pytest puts it there) and the folders below it; the
    folders above the entry are not the module's (a project may lie under a folder named test)."""
    path = Path(file).resolve()
    entries = sorted({Path(entry).resolve() for entry in sys.path if isinstance(entry, str)},
                     key=lambda entry: len(entry.parts), reverse=True)
    for entry in entries:
        if path.is_relative_to(entry):
            return (entry.name, *path.relative_to(entry).parts[:-1])
    return path.parts[:-1]


def _process_name(node: ast.AST) -> str:
    """The process-starting or code-running function a call or import of ``node`` names, or ""."""
    if isinstance(node, ast.Import):
        return next((a.name for a in node.names if under(a.name, PROCESS_MODULES)), "")
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if under(module, PROCESS_MODULES):
            return module
        if module in ("os", "posix", "nt", "builtins"):
            return next((f"{module}.{a.name}" for a in node.names if _process_call(a.name)), "")
        return ""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
            node.value.id in ("os", "posix", "nt", "builtins") and _process_call(node.attr):
        return f"{node.value.id}.{node.attr}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and _process_call(node.func.id):
        return node.func.id
    return ""


def _process_call(name: str) -> bool:
    return name in PROCESS_CALLS or name.startswith(_PROCESS_PREFIXES)


def process_refusal(name: str, file: str | None) -> str:
    """Why the module in ``file`` may not be called for a spec: it imports a module that starts
    processes or runs code (:data:`PROCESS_MODULES`), or spells out a call of ``os.system``,
    ``os.exec*``, ``os.spawn*``, ``eval``, ``exec``, ... (:data:`PROCESS_CALLS`). Read from its
    source, never run: the whole module is judged, as a function may reach any of its helpers.
    "" when none; a module without readable source is refused (it cannot be judged)."""
    if not file or not file.endswith(".py"):
        return _refused(name, "has no Python source to judge whether it runs a process")
    try:
        tree = ast.parse(read_regular_file(Path(file), _MAX_SOURCE_BYTES).decode("utf-8"), filename=file)
    except (ShardVerifyError, OSError, SyntaxError, ValueError) as error:
        return _refused(name, f"has a module whose source cannot be read ({file}: {str(error).splitlines()[0]})")
    for node in ast.walk(tree):
        found = _process_name(node)
        if found:
            return _refused(name, f"lies in a module that runs a process or code ({file} uses {found})")
    return ""


def _named_module_refusal(name: str, module: str, file: str | None) -> str:
    """The checks a module the user named (trusted, or on the command line) passes before its
    functions are called: no private name, no test folder, no process started."""
    return _shape_refusal(name, module, file) or process_refusal(name, file)


def object_refusal(name: str, obj: object, project: Path | None) -> str:
    """"" when ``obj`` (what ``name`` resolved to) may be called; otherwise why not, with the
    rule. Judged where ``obj`` is defined, not how it was reached. ``project``: the folder whose
    modules a name on the command line may come from (None for a spec's name)."""
    import torch

    module = getattr(obj, "__module__", None)
    module = module if isinstance(module, str) else ""
    qualified = getattr(obj, "__qualname__", "")
    shape = _shape_refusal(name, name) or _shape_refusal(
        name, f"{module}.{qualified if isinstance(qualified, str) else ''}")
    if shape:
        return shape
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and under(module, MODEL_MODULES):
        return ""
    zoo = under(module, ZOO_MODULES)
    file = getattr(sys.modules.get(module), "__file__", None)
    named = not zoo and (trusted_object(obj) or _in_project(file, project))
    if not (zoo or named):
        where = "outside the project" if project is not None else "in no module the user named"
        return _refused(name, f"is defined in {module or 'no module'!r}, {where}")
    if not isinstance(obj, (type, types.FunctionType)):
        return _refused(name, f"is a {type(obj).__name__}, not a Python function or class")
    return _named_module_refusal(name, module, file) if named else ""


def name_refusal(name: str, project: Path | None) -> str:
    """The check before any import: "" when ``name`` may be imported and called; otherwise why
    not, with the rule. Torch's objects are reached by attribute and a module already imported
    is judged by object; any other module by where its file lies and what its source holds."""
    if not isinstance(name, str) or not all(p.isidentifier() for p in name.replace(":", ".").split(".")):
        return _refused(str(name), "is not a dotted name such as 'package.module:function'")
    if "__main__" in name.replace(":", ".").split("."):
        return _refused(name, "names a module's __main__ (a command line)")
    shape = _shape_refusal(name, name)
    if shape:
        return shape
    if project is not None:
        _project_on_path(name, project)
    if name.split(".")[0].split(":")[0] == "torch":
        try:
            obj = resolve_torch(name.replace(":", "."))
        except UnresolvedName as error:
            return f"{error}; {RULE}"
        return object_refusal(name, obj, project)
    for module, attribute in _split(name):
        if under(module, ZOO_MODULES):
            return ""    # shardverify's zoo: the object is checked again
        loaded = sys.modules.get(module)
        if loaded is not None:
            obj: object = loaded
            for piece in attribute.split("."):
                if piece not in vars(obj):   # vars, not getattr: a module __getattr__ would run code
                    return _refused(name, f"is not an attribute of the imported {module!r}")
                obj = vars(obj)[piece]
            return object_refusal(name, obj, project)
        path = _source_of(module)
        if under(module, trusted_modules()):
            return _named_module_refusal(name, module, path)   # the object is checked again
        if path is not None:
            if _in_project(path, project):
                return _named_module_refusal(name, module, path)
            where = f"outside the project {str(project)!r}" if project is not None else "in no module the user named"
            return _refused(name, f"lies in {module!r} ({path}), {where}")
    return _refused(name, "names no Python module on the path")


def _project_on_path(name: str, project: Path) -> None:
    """A name given on the command line may be a module of the current folder (``shardverify plan
    mymodel.make`` beside ``mymodel.py``): that folder goes on Python's path, as ``python -m`` puts
    it, where the module is found there and nowhere else (a console script's path lacks it)."""
    for module, _ in _split(name):
        top = module.split(".")[0]
        if top in sys.modules or _source_of(top) is not None:
            return
        if (project / f"{top}.py").is_file() or (project / top / "__init__.py").is_file():
            if str(project) not in sys.path:
                sys.path.insert(0, str(project))
            importlib.invalidate_caches()
            return


def resolve_allowed(name: str, project: Path | None) -> object:
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


def call_factory(name: str, kwargs: dict[str, object], project: Path | None):
    """The ``torch.nn.Module`` the factory ``name`` builds from ``kwargs`` (data only): the one
    way a spec's factory is called, by the commands and tests that verify it, never when it is
    read; allowed by :func:`resolve_allowed` first, then built by :func:`trust.build_checked`
    (on the meta device first: a model over the size limit is refused before it is allocated)."""
    try:
        make = resolve_allowed(name, project)
    except InvalidArgument as error:
        raise InvalidArgument(f"factory {error}") from None
    return build_checked(lambda: make(**kwargs), f"factory {name}(**{kwargs!r})")  # type: ignore[operator]
