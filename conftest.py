"""Loads the shardverify pytest plugin from a plain checkout too (when shardverify is not
installed, its `pytest11` entry point does not exist). Installed, the entry point has already
registered the plugin under this same name, so pytest does not load it twice."""

pytest_plugins = ["shardverify.pytest_plugin"]


def pytest_configure(config) -> None:
    """This session exists to check strategies: the collector thresholds of a checking
    process (see shardverify.backends.gc_policy; each pytest-xdist worker loads this file too)."""
    from shardverify.backends.gc_policy import tune_for_checking

    tune_for_checking()
