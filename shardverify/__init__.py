"""shardverify: declarative, numerically verified tensor-sharding strategies."""

from shardverify.errors import *  # noqa: F401,F403
