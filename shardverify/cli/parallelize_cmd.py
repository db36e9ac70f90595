"""`shardverify parallelize MODEL --plan PLAN`: a model under the parallel plan people ship (a
PyTorch parallelize plan or function, or a transformers config's own tp_plan), against the single
device: forward, loss, gradients and AdamW steps, every value at its rounding budget, the first
culprit named. Exit status 0 when every run is right, 1 when one is silently wrong, fails loudly or
cannot be applied, 2 on a usage or input error."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from shardverify.cli.cluster_option import add_cluster_options, jobs_problem
from shardverify.cli.html_option import add_html_option, html_problem, write_html
from shardverify.cli.verify_cmd import parse_mesh
from shardverify.errors import InvalidArgument, ShardVerifyError, SpecError

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "parallelize", help="check a model's parallel plan (PyTorch ParallelStyles, a transformers tp_plan) "
                            "against the single device",
        description="Run MODEL on one device and parallelized by PLAN on every rank of an in-process mesh "
                    "(DTensor's LocalTensorMode), from the same weights and inputs: forward, loss, backward and "
                    "AdamW steps (training) or a no_grad forward (inference). Every module's output, the loss, "
                    "every gradient and the weights after each step are compared with the single device in "
                    "float64, each allowed 8x what the single device itself errs by in the same dtype, and the "
                    "first value that leaves its budget is blamed down to the module and the aten op.")
    parser.add_argument("model", nargs="?", default=None, help="hf:MODEL_TYPE (a transformers architecture built tiny from its config), "
                                      "zoo:NAME (mlp, titan_llama), or a factory's dotted name (with --input)")
    parser.add_argument("--plan", default=None,
                        help="hf (the config's own base_model_tp_plan, applied as from_pretrained applies it; "
                             "the default for hf: models), zoo:NAME (mlp, titan, titan-norm-left-out, ...), or the "
                             "dotted name of a dict of ParallelStyles or of a parallelize(model, mesh) function, or "
                             "a file of it under the current folder (PATH.py, PATH.py:NAME)")
    parser.add_argument("--tp-override", action="append", default=[], metavar="PATTERN=STYLE",
                        help="with a transformers plan: a rule merged into the config's plan as DistributedConfig(tp_plan=...) "
                             "merges it, e.g. model.layers.*.self_attn.q_norm=replicated_with_grad_allreduce (repeatable)")
    parser.add_argument("--mesh", action="append", type=parse_mesh, default=None, metavar="SHAPE",
                        help="tp (e.g. 2) or dp,tp (e.g. 2,2); repeatable (default: 2)")
    parser.add_argument("--mode", choices=("train", "inference", "both"), default=None,
                        help="train: AdamW steps; inference: a torch.no_grad forward (transformers' local fast path)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps in training (default: 3)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype the model runs in")
    parser.add_argument("--input", action="append", default=[], metavar="SPEC",
                        help="a factory model's input, e.g. x=8,16 or ids=int64[2,16]:0..128 (repeatable)")
    parser.add_argument("--loss-parallel", action="store_true",
                        help="take the loss and its backward under torch.distributed.tensor.parallel.loss_parallel()")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    add_html_option(parser, "each run's verdict and evidence")
    parser.add_argument("--sweep-hf", action="store_true",
                        help="instead of MODEL: every transformers architecture whose config ships a tp_plan, "
                             "built tiny, under its own plan (on each --mesh, default 2 and 4; each --mode, default both)")
    parser.add_argument("--only", default=None, metavar="TYPES", help="--sweep-hf: these model types (comma-separated)")
    parser.add_argument("--results", type=Path, default=Path("results/parallelize"), metavar="DIR",
                        help="--sweep-hf: one stored result per architecture, mesh and mode; a rerun checks only what "
                             "is not stored (default: results/parallelize)")
    parser.add_argument("--stored", action="store_true",
                        help="--sweep-hf: report what --results holds without running anything (rows not stored: not run)")
    parser.add_argument("--write", type=Path, default=None, metavar="FILE",
                        help="--sweep-hf: write the Markdown page (docs/parallelize.md) to FILE")
    add_cluster_options(parser, "--sweep-hf rows (this process storing each in --results)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every value outside its budget")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from shardverify.features.parallelize import check_parallelize
    from shardverify.features.parallelize.names import CONFIG_PLAN, overrides_text, resolve_plan
    from shardverify.cli.progress import Progress
    from shardverify.features.parallelize.report import as_json, render_runs, summary_line
    from shardverify.plan.inputs import parse_input

    if problem := jobs_problem(args) or (args.cluster is not None and not args.sweep_hf and
                                         "--cluster runs the rows of --sweep-hf; one check runs here"):
        print(f"shardverify parallelize: error: {problem}", file=sys.stderr)
        return 2
    if args.sweep_hf:
        if args.html is not None:
            print("shardverify parallelize: error: --html pages one check; the sweep writes its own page (--write)",
                  file=sys.stderr)
            return 2
        return _sweep(args)
    problem = html_problem(args.html)
    if problem:
        print(f"shardverify parallelize: error: {problem}", file=sys.stderr)
        return 2
    if args.model is None:
        print("shardverify parallelize: error: give a MODEL (or --sweep-hf)", file=sys.stderr)
        return 2
    plan_text = args.plan or ("hf" if args.model.startswith("hf:") else None)
    if plan_text is None:
        print("shardverify parallelize: error: --plan is needed for a model that is not hf:TYPE", file=sys.stderr)
        return 2
    if args.tp_override:
        if plan_text not in CONFIG_PLAN:
            print("shardverify parallelize: error: --tp-override changes a transformers plan: give an hf: model "
                  "and --plan hf (or none)", file=sys.stderr)
            return 2
        rules = [rule.partition("=") for rule in args.tp_override]
        bad = [rule for rule, (key, sep, style) in zip(args.tp_override, rules) if not (key and sep and style)]
        if bad:
            print(f"shardverify parallelize: error: --tp-override {bad[0]!r}: expected PATTERN=STYLE", file=sys.stderr)
            return 2
        plan_text = overrides_text({key: style for key, _, style in rules})
    modes = ("train", "inference") if args.mode == "both" else (args.mode or "train",)
    meshes = args.mesh or [(2,)]
    results = []
    runs = [(tuple(mesh), mode) for mesh in meshes for mode in modes]
    # runs done of several on stderr while it is a terminal, nothing otherwise
    with Progress(len(runs)) as status:
        try:
            inputs = [parse_input(text) for text in args.input]
            resolve_plan(plan_text, loss_parallel=args.loss_parallel)    # a bad plan name is a usage error up front
            for mesh, mode in runs:
                status.show(f"checking {args.model} on mesh {','.join(map(str, mesh))}, {mode}")
                results.append(check_parallelize(args.model, plan_text, mesh, mode=mode, steps=args.steps,
                                                 dtype=getattr(torch, args.dtype), inputs=inputs,
                                                 loss_parallel=args.loss_parallel))
                status.step()
        except (InvalidArgument, SpecError) as exc:
            status.close()
            print(f"shardverify parallelize: error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps([as_json(r) for r in results], indent=1))
    else:
        print(render_runs(results, args.verbose))
    passed = all(r.passed for r in results)

    def page():
        from shardverify.features.parallelize.report import render
        from shardverify.features.report.text_pages import parallelize_page

        return parallelize_page([as_json(r) for r in results], passed, render_runs(results).splitlines()[:2],
                                [(summary_line(r), render(r, verbose=True)) for r in results])

    if not write_html(page, args.html):
        return 2
    return 0 if passed else 1


def _sweep(args: argparse.Namespace) -> int:
    from shardverify.files import write_file_atomic
    from shardverify.features.parallelize.sweep import plan_rules, render_page, sweep
    from shardverify.features.parallelize.tiny import tp_architectures

    shipped = tp_architectures()
    chosen = shipped if args.only is None else [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(shipped))
    if unknown:
        print(f"shardverify parallelize: error: --only {', '.join(unknown)}: no config of that model type ships a "
              "tp_plan", file=sys.stderr)
        return 2
    meshes = [tuple(m) for m in args.mesh] if args.mesh else [(2,), (4,)]
    modes = ("train", "inference") if args.mode in (None, "both") else (args.mode,)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.cluster is not None and not args.stored:
        from functools import partial

        from shardverify.cli.cluster_option import cluster_engine, preload

        try:
            with cluster_engine(args, partial(preload, "shardverify.features.parallelize.check")) as engine:
                rows = sweep(chosen, meshes, modes, args.results, steps=args.steps, say=say, engine=engine)
        except ShardVerifyError as exc:
            print(f"shardverify parallelize: error: {exc}", file=sys.stderr)
            return 2
    else:
        rows = sweep(chosen, meshes, modes, args.results, steps=args.steps, say=say, run=not args.stored)
    rules = plan_rules(chosen, args.results, run=not args.stored)
    page = render_page(rows, chosen, meshes, modes, rules)
    if args.write is not None:
        write_file_atomic(args.write, page)
    wrong = [r for r in rows if r.outcome != "right"]
    expected = len(chosen) * len(meshes) * len(modes)
    if len(rows) < expected:
        print(f"not run: {expected - len(rows)} of {expected} rows (run without --stored to check them)")
    print(f"{'PASS' if not wrong and len(rows) == expected else 'FAIL'}: {len(rows) - len(wrong)} of {expected} rows right "
          f"({', '.join(f'{n} {o}' for o, n in sorted(Counter(r.outcome for r in rows).items()))})")
    return 0 if not wrong and len(rows) == expected else 1
