"""Command-line interface: one module per subcommand, wired together in main.py.

Every command exits 0 when what it checked passed, 1 when a verification failed (a strategy, a
plan, an audit gap, stale generated files) and :data:`USAGE` on a usage or input error (a
malformed or unknown spec, an impossible mesh, a model that cannot be built), with one line
saying which.
"""

USAGE = 2
