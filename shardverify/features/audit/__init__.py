"""Completeness audit: every valid layout combination of an op, against the strategies its spec offers."""
