"""The package's dependency rule (docs/DESIGN.md, "Layers"): no import circle between its
modules, and every import runs from a room to a room on a lower floor or its own. Read from the
source with ``ast`` (every import statement, at any depth, ``TYPE_CHECKING`` blocks included),
so a late import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardverify"

#: floor of every room (a top-level module or package of shardverify, or a package of
#: shardverify.features), lowest first; a room may import only from rooms on its own floor or
#: below. The pipeline (spec -> capture -> strategies -> verify -> plan) is at the top level, the
#: features built on it in shardverify/features/, one floor above. Keep in step with docs/DESIGN.md.
FEATURES = ("algorithms", "audit", "coverage", "ddp", "dtensor", "explore", "opinfo", "parallelize", "report", "reshard")
FLOORS: dict[str, int] = {
    "errors": 0, "files": 0, "pysource": 0,
    "stored": 0, "stops": 0,
    "sharding": 1, "capture": 1,
    "collectives": 2, "backends": 2,
    "strategies": 3,
    "spec": 4,
    "verify": 5,
    "plan": 6, "codegen": 6,
    "features": 7, **{f"features.{name}": 7 for name in FEATURES},
    "pytest_plugin": 8, "cli": 8,
    "__init__": 9, "__main__": 9,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "generated" not in p.parts}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from a.b import c`` names ``a.b.c`` when
    that is a module, else ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imports_of(path, known) - {name} for name, path in modules.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for nxt in sorted(graph.get(name, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def room(module: str) -> str:
    """``shardverify.verify.engine`` is in room ``verify``, ``shardverify.features.audit.run`` in
    ``features.audit``."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "features":
        return f"features.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target == "shardverify":   # the package face re-exports; importing it is a user's view
                problems.append(f"{name} imports the package face `shardverify`; import the module itself")
                continue
            low, high = room(target), room(name)
            if FLOORS[low] > FLOORS[high]:
                problems.append(f"{name} (room {high!r}, floor {FLOORS[high]}) imports {target} "
                                f"(room {low!r}, floor {FLOORS[low]})")
    return problems


def test_every_room_has_a_floor():
    rooms = {room(name) for name in package_modules() if name != "shardverify"} | {"__init__"}
    assert rooms == set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))}; " \
                                 f"floors without a room: {sorted(set(FLOORS) - rooms)}"


def test_no_import_circle():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import."""
    rooms: dict[str, set[str]] = {}
    for name, targets in graph.items():
        rooms.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    return rooms


def test_no_circle_between_rooms():
    """Rooms on one floor may import each other one way only, so the floors stay a drawing."""
    circle = find_circle(room_graph(import_graph()))
    assert circle is None, "rooms importing each other: " + " -> ".join(circle)


def test_imports_run_downward():
    problems = upward_imports(import_graph())
    assert not problems, "imports that run up a floor:\n  " + "\n  ".join(problems)


#: the only modules outside ``codegen`` that may import it: the ``generate`` command. Every other
#: feature reads specs through the catalogue (``shardverify.spec.catalogue``), below the features.
CODEGEN_IMPORTERS = {"shardverify.cli.generate_cmd"}


def codegen_importers(graph: dict[str, set[str]]) -> set[str]:
    return {name for name, targets in graph.items()
            if room(name) != "codegen" and any(room(target) == "codegen" for target in targets)}


def test_codegen_is_imported_only_by_the_generate_command():
    found = codegen_importers(import_graph())
    assert found == CODEGEN_IMPORTERS, (f"modules importing codegen (it only renders; read specs through "
                                        f"shardverify.spec.catalogue): {sorted(found - CODEGEN_IMPORTERS)}")


def test_a_codegen_importer_is_named():
    graph = {"shardverify.verify.engine": {"shardverify.codegen.render"}, "shardverify.codegen.render": set()}
    assert codegen_importers(graph) == {"shardverify.verify.engine"}


@pytest.mark.parametrize("graph, circle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, None),
    ({"a": {"a2"}, "a2": {"b"}, "b": {"a2"}}, ["a2", "b", "a2"]),
])
def test_find_circle_finds_what_is_there(graph, circle):
    assert find_circle(graph) == circle


def test_an_upward_import_is_named(tmp_path):
    graph = {"shardverify.sharding.mesh": {"shardverify.verify.engine"}, "shardverify.verify.engine": set()}
    (problem,) = upward_imports(graph)
    assert "shardverify.sharding.mesh" in problem and "shardverify.verify.engine" in problem


def module_map() -> str:
    """The module map block of docs/DESIGN.md."""
    text = (PACKAGE.parent / "docs" / "DESIGN.md").read_text()
    section = text.split("## Module map", 1)[1]
    return section.split("```", 2)[1]


def test_the_module_map_matches_the_tree():
    import re

    block = module_map()
    words = set(re.findall(r"[A-Za-z_][\w]*", block))
    files = [p for p in PACKAGE.rglob("*.py") if "generated" not in p.parts and p.name != "__init__.py"]
    unnamed = sorted(str(p.relative_to(PACKAGE)) for p in files if p.stem not in words)
    rooms = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}
    unlisted = sorted(r for r in rooms if not re.search(rf"^  {re.escape(r)}(/|\s)", block, re.M))
    named = set(re.findall(r"([A-Za-z_]\w*)\.py\b", block))
    stale = sorted(n for n in named if not any(p.stem == n for p in PACKAGE.rglob(f"{n}.py")))
    assert not (unnamed or unlisted or stale), (
        f"docs/DESIGN.md's module map is out of date: modules it does not name {unnamed}, top-level rooms "
        f"not listed at the top level {unlisted}, files it names that do not exist {stale}")


def _private(word: str) -> bool:
    """A name its module keeps to itself: a leading underscore, dunders (``__version__``) aside."""
    return word.startswith("_") and not (word.startswith("__") and word.endswith("__"))


def private_imports(path: Path, source: str | None = None) -> list[str]:
    """Each import in ``path`` (at any depth) of a private name, or through a private module, of
    another room: ``file:line: name``. A room's private names are its own to change; another room
    that needs one needs it public (renamed at its home) or moved to a module both can use."""
    own = module_name(path)
    own_room = room(own)
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:      # relative: resolved against the importing module's package
                package = own.split(".") if path.name == "__init__.py" else own.split(".")[:-1]
                up = package[:len(package) - node.level + 1] if node.level > 1 else package
                base = ".".join(up + ([node.module] if node.module else []))
            found = [(base, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found = [(alias.name, "") for alias in node.names]
        else:
            continue
        for module, name in found:
            if not (module == "shardverify" or module.startswith("shardverify.")):
                continue
            target_room = room(f"{module}.{name}" if module == "shardverify" and name else module)
            if target_room == own_room:
                continue
            private = [part for part in module.split(".") if _private(part)] + ([name] if _private(name) else [])
            if private:
                problems.append(f"{where}:{node.lineno}: `{private[-1]}` ({module}"
                                f"{'.' + name if name else ''}, room {target_room!r}) imported into room "
                                f"{own_room!r}; give it a public name at its home")
    return problems


def test_no_private_name_is_imported_from_another_room():
    problems = [line for path in sorted(package_modules().values()) for line in private_imports(path)]
    assert not problems, "private names imported across rooms:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("source, line, named", [
    ("from shardverify.features.audit.report import _by_op, markdown_report\n", 1, "_by_op"),
    ("def f():\n    from shardverify.verify.engine import _backend_name\n", 2, "_backend_name"),
    ("from shardverify.verify._hidden import thing\n", 1, "_hidden"),
    ("import os\nimport shardverify.verify._hidden\n", 2, "_hidden"),
    ("from shardverify import _private_helper\n", 1, "_private_helper"),
])
def test_a_private_import_from_another_room_is_named(source, line, named):
    (problem,) = private_imports(PACKAGE / "features" / "dtensor" / "example.py", source)
    assert problem.startswith(f"shardverify/features/dtensor/example.py:{line}: `{named}`")


@pytest.mark.parametrize("source", [
    "from shardverify.features.dtensor.run import _sample\n",          # its own room
    "from shardverify.features.audit.report import markdown_report\n",  # public
    "from shardverify import __version__\n",                   # a dunder
    "from collections import _chain\n",                        # not the package's
])
def test_what_is_not_a_private_import_across_rooms(source):
    assert private_imports(PACKAGE / "features" / "dtensor" / "example.py", source) == []
