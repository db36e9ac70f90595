"""`shardverify plan SPEC`: plan a model (the solver's plan, or a user's plan file) and verify it."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from shardverify.backends import registry
from shardverify.cli import USAGE
from shardverify.cli.html_option import add_html_option, html_problem, write_html
from shardverify.cli.verify_cmd import one_rank_mesh, parse_positive_int, parse_timeout
from shardverify.cli.verify_rows import describe_error, quiet_tracing
from shardverify.errors import ShardVerifyError
from shardverify.spec.limits import mesh_problem

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    parser = sub.add_parser("plan", help="plan a model on a mesh and verify the plan end to end",
                            description="SPEC is a specs/plans/*.yaml file, a model factory's dotted path "
                                        "(then --input gives the inputs, or the model's own example_inputs "
                                        "attribute does), or zoo:NAME, a tiny HF transformers model (gpt2, llama, "
                                        "bert, vit, resnet, mixtral, mixtral-capacity, lstm, bart, convnext, swin; the models extra) "
                                        "with its own inputs. A factory's "
                                        "model is verified as the factory built it (its own weights, eval mode).")
    parser.add_argument("spec")
    parser.add_argument("--mesh", help="mesh shape, e.g. 2,2 (default: the spec's first)")
    parser.add_argument("--plan", help="YAML file: node name -> strategy name (default: the solver's plan)")
    parser.add_argument("--input", action="append", default=[], metavar="[NAME=][DTYPE][SHAPE][:LOW..HIGH]",
                        help="an input of a factory's model, once per input: 64,128 (float32, by position); "
                             "input_ids=int64[4,8]:0..128 (token ids below 128, passed as input_ids=); "
                             "mask=bool[4,8]; x=float32[2,3]:-1..1")
    parser.add_argument("--train", action="store_true",
                        help="verify the model in training mode (default: eval mode; a layer that draws random "
                             "numbers in training mode, dropout, is checked with every rank seeded alike)")
    parser.add_argument("--redraw-weights", action="store_true",
                        help="re-draw every parameter of a factory's model from randn * 0.2 (seeded) instead of "
                             "keeping the factory's own initialisation")
    parser.add_argument("--kwarg", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument of the factory, its value read as YAML (d_hidden=128, bias=false)")
    parser.add_argument("--cost-size", metavar="real|KEY=N,...",
                        help="zoo:NAME only: solve with the costs of the model at the size it trains at, map the plan "
                             "onto the tiny build node by node and verify it there: 'real' (hidden=4096,seq=4096,"
                             "batch=8), or sizes over it, e.g. hidden=8192,batch=16")
    parser.add_argument("--cost-kwarg", action="append", default=[], metavar="KEY=VALUE",
                        help="a factory's keyword argument at the size it trains at (as --kwarg, over --kwarg's); "
                             "with --cost-input, the solver's costs come from that size")
    parser.add_argument("--cost-input", action="append", default=[], metavar="[NAME=][DTYPE][SHAPE][:LOW..HIGH]",
                        help="a factory's input at the size it trains at (as --input; only its shape and dtype "
                             "are used: the model at that size is captured on fake tensors, nothing allocated)")
    names = registry.backend_names(registry.builds_any_mesh)   # refused by argparse, before any capture
    parser.add_argument("--backend", choices=names, default=registry.DEFAULT_KIND, help=registry.backend_help(names))
    parser.add_argument("--memory-limit", type=parse_positive_int,
                        help="bytes per device for the solver (default: the --device's memory; none for nominal)")
    parser.add_argument("--device", default="nominal", metavar="PROFILE",
                        help="the device the declared seconds and bytes are for: nominal (the default, not a real "
                             "device), a100-80gb, h100-80gb, h200-141gb, or calibrated (links measured by "
                             "'shardverify calibrate' for the mesh)")
    parser.add_argument("--layers", type=parse_positive_int, default=1, metavar="N",
                        help="the model runs its repeated block (layers.0, h.0...) N times: the captured copies are "
                             "costed, run and held N times over (the real size's graph with --cost-size)")
    parser.add_argument("--optimizer", choices=("adam", "sgd", "none"), default="adam",
                        help="the optimizer state each weight carries in memory: adam (two float32 moments, the "
                             "default), sgd (one momentum) or none")
    parser.add_argument("--master-weights", action="store_true",
                        help="count a float32 master copy of each weight held in a narrower dtype (mixed precision)")
    parser.add_argument("--recompute", action="store_true",
                        help="activations recomputed per repeated block: one layer's held at a time, its forward "
                             "run again in backward")
    parser.add_argument("--cost-dtype", choices=("float32", "bfloat16", "float16"),
                        help="the dtype the real size (--cost-size) trains in (default float32)")
    parser.add_argument("--min-sharded", type=int, default=0, metavar="N",
                        help="the solver's plan shards at least N nodes (on a small model the cheapest plan "
                             "is often all replicated, which checks no sharding)")
    parser.add_argument("--shard-weights", action="store_true",
                        help="the solver's plan shards every weight that a strategy can shard (tensor parallelism)")
    parser.add_argument("--data-parallel", action="store_true",
                        help="the solver's plan keeps every weight replicated and splits the batch (dim 0) of "
                             "every model input (data parallelism)")
    parser.add_argument("--capture", choices=("auto", "fx", "export"),
                        help="auto (the default for a factory): torch.fx symbolic tracing, torch.export's ATen "
                             "graph when fx cannot trace the model (said in the report); fx; export (the default "
                             "for zoo:NAME)")
    parser.add_argument("--timeout", type=parse_timeout, metavar="S",
                        help="seconds the check may take on the backend (default: the backend's; a model of "
                             "a hundred million parameters wants minutes)")
    parser.add_argument("--strict", action="store_true",
                        help="fail (exit 1) when a tensor op runs replicated for want of strategies "
                             "(refused by its spec, or covered by no spec), or when the plan shards nothing "
                             "(a plan spec's strict: true and verify_plan(strict=True) mean the same)")
    parser.add_argument("--verified-only", action="store_true",
                        help="serve only calls the op specs' grids verified (refuse the others) instead of "
                             "verifying a call outside its grid where it is met (the default; verdicts are "
                             "kept in $SHARDVERIFY_CACHE_DIR, else ~/.cache/shardverify/verdicts)")
    parser.add_argument("--export-parallelize", metavar="FILE",
                        help="also write the plan as a PyTorch parallelize plan: a Python file whose "
                             "parallelize(model, mesh) applies ColwiseParallel/RowwiseParallel/SequenceParallel "
                             "with parallelize_module; what no ParallelStyle expresses is listed there and on stderr "
                             "(check it with: shardverify parallelize MODEL --plan FILE)")
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    add_html_option(parser, "the plan over the model's graph, every node's layout and the check's findings")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="after the verdict, list every op's layout and what moves between devices, and the "
                             "coverage's detail")
    parser.add_argument("--debug", action="store_true",
                        help="on an error in the model, its capture or the plan, show the whole traceback")
    parser.set_defaults(func=run)


def _shape(text: str) -> tuple[int, ...]:
    """``"2,2"`` -> (2, 2); anything else is a usage error naming the text."""
    try:
        shape = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        shape = ()
    if not shape or any(size <= 0 for size in shape):
        raise ShardVerifyError(f"expected a shape of positive integers such as 2,2, got {text!r}")
    return shape


def run(args: argparse.Namespace) -> int:
    from shardverify.cli.progress import Progress
    from shardverify.plan.phases import PHASES, PhaseClock, cpu_seconds
    from shardverify.plan.device import device_profile
    from shardverify.plan.verify import verify_plan
    from shardverify.plan.workload import Workload

    started = cpu_seconds()   # the interpreter's start and the imports so far
    problem = html_problem(args.html)
    if args.export_parallelize and not args.export_parallelize.endswith(".py"):
        problem = f"--export-parallelize {args.export_parallelize!r}: the file is Python code; give a name ending in .py"
    if problem:
        print(f"shardverify plan: {problem}", file=sys.stderr)
        return USAGE
    status = Progress(len(PHASES))   # a status line on stderr while it is a terminal, else nothing
    clock = PhaseClock(on_start=lambda name: _phase_started(status, name))
    quiet_tracing()   # a model that fails to trace is reported in one line, not torch's printed traceback
    try:
        model = _model(args, clock)
        device = device_profile(args.device, model.mesh)
        workload = Workload(args.layers, args.optimizer, args.master_weights, args.recompute)
        result = verify_plan(model.module, model.example, model.mesh, model.plan, backend=args.backend,
                             memory_limit=args.memory_limit, capture=model.capture, min_sharded=args.min_sharded,
                             shard_weights=args.shard_weights, data_parallel=args.data_parallel,
                             timeout=args.timeout, strict=model.strict,
                             verified_only=args.verified_only, cost_size=model.cost_size, clock=clock,
                             device=device, workload=workload)
    except (ShardVerifyError, OSError, KeyError, LookupError) as error:
        status.close()
        if args.debug:
            raise
        print(f"shardverify plan: {_one_line(error)}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        status.close()
        print("shardverify plan: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the user's model or factory raised: an input error
        status.close()
        if args.debug:
            raise
        print(f"shardverify plan: {describe_error(error)} (--debug shows the traceback)", file=sys.stderr)
        return USAGE
    status.close()
    exported = None
    if args.export_parallelize:
        from shardverify.cli.plan_export import write_export

        exported = write_export(result, args.spec, args.export_parallelize)
        if exported is None:
            return USAGE
    return _report(args, result, started, exported)


@dataclass(frozen=True)
class _Model:
    """The model a plan check runs, as the command line or the spec gave it."""

    module: Any
    example: Any
    mesh: tuple[int, ...]
    plan: Any
    capture: str
    strict: bool
    cost_size: Any


def _model(args: argparse.Namespace, clock) -> _Model:
    """The model (zoo:NAME, a plan spec or a factory), its inputs, mesh and plan, and the model at its
    real size for the solver's costs where asked; raises ShardVerifyError naming the option at fault."""
    from shardverify.plan.inputs import parse_input
    from shardverify.plan.spec import build_spec_model, parse_plan_spec
    from shardverify.spec.loader import load_yaml

    zoo = args.spec.startswith("zoo:")
    capture = args.capture or ("export" if zoo else "auto")
    spec_zoo, strict, cost_size = "", args.strict, None
    if args.cost_dtype and args.cost_size is None:
        raise ShardVerifyError("--cost-dtype is the dtype of a zoo model's real size: give --cost-size too")
    if args.cost_size is not None and not zoo:
        raise ShardVerifyError("--cost-size names a zoo model's sizes (zoo:NAME); give a factory's real size "
                               "with --cost-kwarg and --cost-input")
    if (args.cost_kwarg or args.cost_input) and (zoo or args.spec.endswith((".yaml", ".yml"))):
        raise ShardVerifyError("--cost-kwarg and --cost-input give a factory's real size (a dotted path); "
                               "for zoo:NAME use --cost-size")
    if zoo:
        from shardverify.plan.hf_zoo import hf_model, real_size

        with clock.phase("build"):
            module, example = hf_model(args.spec[len("zoo:"):])
        mesh = _shape(args.mesh or "2,2")
        if args.cost_size is not None:
            with clock.phase("build"):
                cost_size = real_size(args.spec[len("zoo:"):], _sizes(args.cost_size), args.cost_dtype)
    elif args.spec.endswith((".yaml", ".yml")):
        spec = parse_plan_spec(load_yaml(args.spec))
        factory, kwargs, inputs, where = spec.factory, spec.kwargs, spec.inputs, dict(spec.where)["factory"]
        spec_zoo, capture, strict = spec.zoo, args.capture or spec.capture, args.strict or spec.strict
        mesh = _shape(args.mesh) if args.mesh else spec.meshes[0]
        if spec.cost_size is not None and not args.plan:     # the spec's solved plans cost at its real size
            from shardverify.plan.spec import spec_cost_size

            with clock.phase("build"):
                cost_size = spec_cost_size(factory, kwargs, spec.cost_size, where, spec.zoo)
    else:
        factory, kwargs = args.spec, _kwargs(args.kwarg)
        inputs = tuple(parse_input(text) for text in args.input)
        where = None
        mesh = _shape(args.mesh or "2,2")
        if args.cost_kwarg and not args.cost_input:
            raise ShardVerifyError("--cost-kwarg needs the inputs at that size too (--cost-input)")
        if args.cost_input:
            from shardverify.plan.spec import real_spec_model

            with clock.phase("build"):
                cost_size = real_spec_model(factory, kwargs, _kwargs(args.cost_kwarg),
                                            tuple(parse_input(text, "--cost-input", drawn=False)
                                                  for text in args.cost_input))
    too_many = mesh_problem(mesh)
    if too_many:
        raise ShardVerifyError(f"mesh {list(mesh)}: {too_many}")
    if args.mesh and (single := one_rank_mesh([mesh])):
        raise ShardVerifyError(single)
    plan = None
    if args.plan:
        plan = _read_plan(args.plan)
    if zoo:
        module.train(args.train)
    else:
        with clock.phase("build"):
            module, example = build_spec_model(factory, kwargs, inputs, where=where, zoo=spec_zoo,
                                               redraw=args.redraw_weights, train=args.train)
    return _Model(module, example, mesh, plan, capture, strict, cost_size)


def _report(args: argparse.Namespace, result, started: float, exported=None) -> int:
    """The verdict (text or --json, and --html); the exit status."""
    from shardverify.plan.phases import cpu_seconds
    from shardverify.plan.report import plan_text, verdict_lines
    from shardverify.features.report.plan_page import plan_page

    strict_failure = result.strict and bool(result.strict_failures)
    # no pass without a check: a model without one tensor op ran no plan node
    no_node = result.coverage is not None and result.coverage.tensor_ops == 0
    phases = {"start": started, **dict(result.cpu_seconds), "total": cpu_seconds()}
    if args.json:
        headline = verdict_lines(result, args.spec)
        print(json.dumps({**result.to_json(), "cpu_seconds": phases, "strict_failure": strict_failure,
                          "no_node": no_node, "model": args.spec,
                          "verdict": "PASS" if result.passed and not no_node else "FAIL", "headline": headline,
                          **({"parallelize_export": exported.to_json()} if exported is not None else {})},
                         indent=2))
    else:
        print(plan_text(result, args.spec, args.verbose, phases))
    if no_node:
        print("FAILED: the model has no tensor op: no plan node was run, nothing was checked", file=sys.stderr)
    if not write_html(lambda: plan_page(result, args.spec, verdict_lines(result, args.spec)), args.html):
        return USAGE
    return 0 if result.passed and not no_node else 1




#: what each phase of a plan check is doing, said on the status line (short: it shares an 80-column
#: line with the progress bar)
PHASE_WORDS = {"build": "building the model", "capture": "capturing its graph",
               "strategies": "finding sharding strategies", "solve": "choosing the plan",
               "check": "checking it against one device"}


def _phase_started(status, name: str) -> None:
    """The status line names the phase now running; a phase that ran before counts as done."""
    status.done = min(list(PHASE_WORDS).index(name), status.total)
    status.show(PHASE_WORDS[name])


def _sizes(text: str) -> dict[str, int]:
    """``--cost-size``: ``real`` -> {} (the zoo's realistic size), ``hidden=8192,batch=16`` -> sizes."""
    if text.strip() == "real":
        return {}
    found = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip().isdigit():
            raise ShardVerifyError(f"--cost-size expects 'real' or KEY=N,... such as hidden=4096,seq=4096,batch=8, "
                                   f"got {text!r}")
        found[key.strip()] = int(value)
    return found


def _read_plan(path: str) -> dict[str, str]:
    """A --plan file (node name -> strategy name) read as strictly as a spec: the one spec reader
    (regular files only, size-limited, errors at file:line)."""
    from shardverify.spec.fields import check_type
    from shardverify.spec.loader import load_yaml

    root = load_yaml(path)
    check_type(root, dict)
    plan = {}
    for name, node in root.value.items():  # type: ignore[union-attr]
        check_type(node, str)
        plan[name] = node.value
    return plan  # type: ignore[return-value]


#: the most characters one --kwarg value may hold (a model's keyword arguments are a few numbers)
MAX_KWARG_CHARS = 4096


def _kwargs(items: list[str]) -> tuple[tuple[str, object], ...]:
    """``["d_hidden=128", "bias=false"]`` -> (("d_hidden", 128), ("bias", False)). A value is read
    as a spec's YAML is (spec/loader.py): no aliases or anchors (a six-level alias bomb built
    531,441 values from one line), no tags, bounded depth, strings and integers, and at most
    :data:`MAX_KWARG_CHARS` characters."""
    from shardverify.errors import SpecError, shorten
    from shardverify.spec.loader import load_yaml_text

    found = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ShardVerifyError(f"--kwarg expects KEY=VALUE with KEY an identifier, got {shorten(item)}")
        if len(value) > MAX_KWARG_CHARS:
            raise ShardVerifyError(f"--kwarg {key.strip()}: a value of {len(value)} characters is longer than the "
                                   f"limit of {MAX_KWARG_CHARS}")
        try:
            parsed = load_yaml_text(value, f"--kwarg {key.strip()}").plain() if value.strip() else None
        except SpecError as exc:
            raise ShardVerifyError(f"--kwarg {key.strip()}={shorten(value, 40)}: {exc.reason}") from None
        found.append((key.strip(), parsed))
    return tuple(found)


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
