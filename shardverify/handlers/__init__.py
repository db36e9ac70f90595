"""Handler registry; importing this package registers every generated handler."""

from __future__ import annotations

import importlib
import pkgutil

from shardverify.handlers import generated as _generated
from shardverify.handlers.base import (  # noqa: F401
    HandlerDef,
    OperandDecl,
    ParamDecl,
    handler_for_node,
    register_handler,
    registered_handlers,
    resolve_operands,
    resolve_params,
)


def load_generated_handlers() -> None:
    """Import every module in handlers/generated/ so each registers its HandlerDef."""
    for info in sorted(pkgutil.iter_modules(_generated.__path__), key=lambda i: i.name):
        importlib.import_module(f"{_generated.__name__}.{info.name}")


load_generated_handlers()
