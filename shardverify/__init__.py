"""shardverify: declarative, numerically verified tensor-sharding strategies."""


def _quiet_start() -> None:
    """Started as the command (``python -m shardverify``, the ``shardverify`` script), a Ctrl-C
    or SIGTERM while torch is imported (seconds) ends the process with 130 or 143 and one line,
    not a traceback of torch's import; ``cli.main`` puts Python's own handler back before any work starts. A
    program that imports the library keeps its KeyboardInterrupt."""
    import os
    import signal
    import sys
    import threading

    command = sys.argv[0] == "-m" or os.path.basename(sys.argv[0] or "") == "shardverify"
    if (not command or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return

    from shardverify import stops

    def starting(signum, frame):  # noqa: ANN001
        stops.record(lambda: SystemExit(128 + signum))   # raised again where the run's loops ask (stops.py)
        print(f"shardverify: interrupted while starting; exit {128 + signum}", file=sys.stderr)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, starting)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:   # cli.main sets its own before any work
        signal.signal(signal.SIGTERM, starting)


_quiet_start()

from shardverify.errors import *  # noqa: F401,F403
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.sharding_spec import DimSpec, ShardingSequence, ShardingSpec
from shardverify.sharding.strategy import (
    CommAction,
    CommPattern,
    CommWhere,
    MemoryCost,
    MemoryCycle,
    OperandLocator,
    OperationData,
    OperationDataType,
    ShardingStrategy,
    StrategiesVector,
    TrainCycleItem,
)
#: the public names that pull in the pipeline (torch.fx capture, the strategy registry, the plan
#: and its solver), imported at first use: a command imports only what it runs
_LAZY = {"trace": "shardverify.capture.fx", "strategies_for_node": "shardverify.strategies.for_node",
         "verify_plan": "shardverify.plan", "OnDemandVerifier": "shardverify.verify.on_demand",
         "verify_node": "shardverify.verify.on_demand"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardverify' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
