"""Command-line interface: one module per subcommand, wired together in main.py.

Every command exits 0 when what it checked passed, 1 when a verification failed (a strategy, a
plan, an audit gap, stale generated files) and :data:`USAGE` on a usage or input error (a
malformed or unknown spec, an impossible mesh, a model that cannot be built), with one line
saying which.
"""

USAGE = 2


def parse_int(text: str, least: int, problem: str, most: int | None = None) -> int:
    """An integer option's value ``text``, from ``least`` (to ``most``); otherwise an
    argparse.ArgumentTypeError saying ``problem``, a format string that names the bad value as
    ``{text!r}`` (argparse names the option before it), and the command exits with :data:`USAGE`."""
    import argparse

    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or value < least or (most is not None and value > most):
        raise argparse.ArgumentTypeError(problem.format(text=text))
    return value


def parse_seconds(text: str, problem: str, *, zero: bool) -> float:
    """A number of seconds ``text``: finite and positive (or 0 where ``zero`` allows it, which the
    option reads as "no limit"); otherwise an argparse.ArgumentTypeError saying ``problem``, a
    format string that names the bad value as ``{text!r}``."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(problem.format(text=text))
    return value
