"""Generic strategy generators; importing this package registers them all."""

from shardverify.strategies.generators.registry import (  # noqa: F401
    GeneratorContext,
    generator_names,
    get_generator,
    register_generator,
)

from shardverify.strategies.rules import generator as _rules  # noqa: E402,F401  (the declarative `rules` family)
