"""A captured ATen call's arguments read by their schema names: what decides how the call behaves
(dropout's ``train``, batch norm's ``training``, embedding_bag's ``mode``) read one way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["schema_values"]


def schema_values(overload: torch._ops.OpOverload, args: Sequence, kwargs: Mapping) -> dict:
    """The call's argument values by schema name: passed by position or keyword, else the
    schema's default (an argument without one, not passed, is absent)."""
    values = {}
    for i, argument in enumerate(overload._schema.arguments):
        if i < len(args):
            values[argument.name] = args[i]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values
