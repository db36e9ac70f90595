"""Handler registry; importing this package registers every generated handler.

A generated handler module is written from a spec, so it may be stale or conflict with
another (two specs once claimed one target). Such a module must never make
``import shardverify`` fail, or no command could repair it: it is left unregistered and
its problem recorded in ``GENERATED_HANDLER_PROBLEMS``, which ``shardverify generate
--check``, ``list`` and ``verify`` report and ``shardverify generate`` repairs.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

from shardverify.strategies.handlers import generated as _generated
from shardverify.strategies.handlers.base import (  # noqa: F401
    HandlerDef,
    OperandDecl,
    ParamDecl,
    register_handler,
    registered_handlers,
)
from shardverify.strategies.handlers.call_values import resolve_operands, resolve_params  # noqa: F401
from shardverify.strategies.handlers.serving import handler_for_node  # noqa: F401

#: generated module file name ("sum.py") -> why it is not registered
GENERATED_HANDLER_PROBLEMS: dict[str, str] = {}


def load_generated_handlers() -> None:
    """Import every module in handlers/generated/ so each registers its HandlerDef; a module
    that fails to import is recorded, not raised."""
    for info in sorted(pkgutil.iter_modules(_generated.__path__), key=lambda i: i.name):
        name = f"{_generated.__name__}.{info.name}"
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any broken generated file, reported not raised
            sys.modules.pop(name, None)
            GENERATED_HANDLER_PROBLEMS[f"{info.name}.py"] = f"{type(exc).__name__}: {exc}"


def handler_problems() -> list[str]:
    """One line per generated handler module that is not registered, and why."""
    folder = "shardverify/strategies/handlers/generated"
    return [f"{folder}/{file} is not registered: {why}" for file, why in sorted(GENERATED_HANDLER_PROBLEMS.items())]


load_generated_handlers()
