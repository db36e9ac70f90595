"""Which transformers architectures ship a tensor-parallel plan (``base_model_tp_plan``), read
from their config classes' attributes without instantiating any, and transformers itself imported
with an error saying how to install it where the `models` extra is missing."""

from __future__ import annotations

import functools
import os

from shardverify.errors import InvalidArgument

__all__ = ["import_transformers", "plan_config", "tp_architectures", "read_source"]


def import_transformers():
    """transformers, or an error saying how to install it (the `models` extra)."""
    try:
        import transformers
    except ImportError as exc:   # the extra is not installed
        raise InvalidArgument("tiny transformers models need transformers: pip install -e '.[models]'") from exc
    return transformers


def plan_config(cls: type) -> type | None:
    """The config class whose ``base_model_tp_plan`` the architecture's model applies: the class
    itself, else the first sub-config class that has one (a composite model's language model)."""
    if getattr(cls, "base_model_tp_plan", None):
        return cls
    for sub in (getattr(cls, "sub_configs", None) or {}).values():
        if isinstance(sub, type) and getattr(sub, "base_model_tp_plan", None):
            return sub
    return None


def tp_architectures() -> list[str]:
    """Every model type transformers knows whose config (or one of its sub-configs: a composite
    model's language model or encoder) ships a non-empty ``base_model_tp_plan``, sorted. Reads the
    config classes' class attributes, instantiating none; only the model packages whose
    configuration source names a plan are imported (the other ~400 cost seconds and declare none)."""
    return list(_tp_architectures())


@functools.cache
def _tp_architectures() -> tuple[str, ...]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    mapping = import_transformers().CONFIG_MAPPING
    root = os.path.join(os.path.dirname(import_transformers().__file__), "models")
    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        if not _declares_plan(os.path.join(root, model_type_to_module_name(model_type))):
            continue
        try:
            cls = mapping[model_type]
        except Exception:   # an optional dependency of that config missing: it ships no usable plan here
            continue
        if plan_config(cls) is not None:
            found.append(model_type)
    return tuple(sorted(found))


@functools.cache
def _declares_plan(package: str) -> bool:
    """Whether a model package's configuration source mentions ``base_model_tp_plan``."""
    try:
        names = [n for n in os.listdir(package) if n.startswith("configuration_") and n.endswith(".py")]
        return any("base_model_tp_plan" in read_source(os.path.join(package, n)) for n in names)
    except OSError:
        return False


def read_source(path: str) -> str:
    """The text of one of transformers' own source files."""
    with open(path, encoding="utf-8") as source:
        return source.read()
