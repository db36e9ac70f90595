"""Strategy production: where a spec's rule is expanded into sharding strategies.

``rules/`` (the declarative rule notation and its one generator family), ``generators/`` (the
other families and their registry), ``handlers/`` (the generated handler per op spec, keyed by
target) and ``for_node`` (:func:`strategies_for_node`, the entry point for a captured node)."""
