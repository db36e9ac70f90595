"""Loads the shardverify pytest plugin from a plain checkout too (when shardverify is not
installed, its `pytest11` entry point does not exist). Installed, the entry point has already
registered the plugin under this same name, so pytest does not load it twice."""

pytest_plugins = ["shardverify.pytest_plugin"]


def pytest_configure(config) -> None:
    """This session exists to check strategies: the collector thresholds of a checking
    process (see shardverify.backends.gc_policy; each pytest-xdist worker loads this file too)."""
    from shardverify.backends.gc_policy import tune_for_checking

    tune_for_checking()


def pytest_collection_finish(session) -> None:
    """Every test module is imported now: what they and the libraries they import hold lives to
    the session's end, and full collections need not walk it again (see gc_policy)."""
    from shardverify.backends.gc_policy import freeze_what_is_loaded

    freeze_what_is_loaded()
