"""CPU placement (shardverify.backends.cpus): a placement that cannot be made costs speed, never a check."""

from __future__ import annotations

import os

import pytest

from shardverify.backends import cpus
from shardverify.backends.process_worker import worker_cpus


def test_without_the_platform_calls_nothing_is_kept_and_every_cpu_counts(monkeypatch):
    """Where there is no sched_setaffinity (macOS), no placement is attempted: the pool keeps
    no worker in place and a `verify --jobs` worker is left where the OS puts it."""
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert not cpus.can_keep() and not cpus.keep_to_cpu(0)
    assert cpus.usable_cpus() == list(range(os.cpu_count() or 1))
    assert worker_cpus(64) == [None] * 64


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_keeping_a_thread_on_a_cpu_and_failing_quietly():
    mine = os.sched_getaffinity(0)
    try:
        assert cpus.usable_cpus() == sorted(mine)
        assert not cpus.keep_to_cpu(None) and os.sched_getaffinity(0) == mine
        assert not cpus.keep_to_cpu(max(mine) + 4096) and os.sched_getaffinity(0) == mine   # not ours
        first = min(mine)
        assert cpus.keep_to_cpu(first) and os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, mine)
