"""Rule sources: where a rule's factors come from, one module each (a frozen dataclass that
declares its YAML keys, which of them name call parameters and which operands, parses itself,
builds the equation for a call and tells explore how to draw the parameters it reads), and the
registry that picks one by the key a spec writes (:mod:`.registry`). Importing the package
registers the built-in sources, in the order their keys are listed in messages."""

from shardverify.strategies.rules.sources import einsum as _einsum  # noqa: F401
from shardverify.strategies.rules.sources import pointwise as _pointwise  # noqa: F401
from shardverify.strategies.rules.sources import reduction as _reduction  # noqa: F401
from shardverify.strategies.rules.sources import view as _view  # noqa: F401
from shardverify.strategies.rules.sources import advanced_index as _advanced_index  # noqa: F401
from shardverify.strategies.rules.sources import whole_tensors as _whole_tensors  # noqa: F401
from shardverify.strategies.rules.sources.base import Derived, RuleCall, Source, opt  # noqa: F401
from shardverify.strategies.rules.sources.registry import (  # noqa: F401
    RuleSpec, parse_rule, register_source, source_keys, unregister_source)
