"""Loads the shardverify pytest plugin from a plain checkout too (when shardverify is not
installed, its `pytest11` entry point does not exist). Installed, the entry point has already
registered the plugin under this same name, so pytest does not load it twice."""

pytest_plugins = ["shardverify.pytest_plugin"]
