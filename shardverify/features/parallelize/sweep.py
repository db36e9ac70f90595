"""Every transformers architecture whose config ships a tensor-parallel plan, each built tiny and
checked under that plan on each mesh and mode: one stored result per (architecture, mesh, mode) in
a results folder, so a stopped sweep resumes and a rerun checks only what is not stored (each
stored result is read as untrusted data: a regular file, bounded, every field checked; one that does
not check is run again), and a page (docs/parallelize.md) with one row per architecture and mesh."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardverify.backends.units import Engine, InProcess, Unit, run_units
from shardverify.errors import InvalidArgument, SpecError
from shardverify.files import read_regular_file, write_file_atomic
from shardverify.features.parallelize.check import VERDICTS, check_parallelize
from shardverify.features.parallelize.names import resolve_model
from shardverify.features.parallelize.plans import transformers_unmatched
from shardverify.features.parallelize.report import as_json
from shardverify.features.parallelize.tiny import CannotBuild

__all__ = ["SweepRow", "PlanRules", "sweep", "plan_rules", "render_page", "OUTCOMES"]

#: what a row can say: the check's verdicts, and the architectures the sweep cannot get to a verdict
OUTCOMES = (*VERDICTS, "cannot build", "error")
MAX_RESULT_BYTES = 1 << 20
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,80}$")


@dataclass(frozen=True)
class SweepRow:
    architecture: str
    mesh: tuple[int, ...]
    mode: str
    outcome: str                 # one of OUTCOMES
    phase: str = ""
    culprit: str = ""            # the first culprit's line, or why the row has no verdict
    compared: int = 0
    outside: int = 0
    cpu_seconds: float = 0.0

    def record(self) -> dict:
        return {"architecture": self.architecture, "mesh": list(self.mesh), "mode": self.mode,
                "outcome": self.outcome, "phase": self.phase, "culprit": self.culprit, "compared": self.compared,
                "outside": self.outside, "cpu_seconds": round(self.cpu_seconds, 3)}


def _file(folder: Path, architecture: str, mesh: tuple[int, ...], mode: str) -> Path:
    if not _NAME.match(architecture):
        raise InvalidArgument(f"architecture {architecture!r}: not a transformers model type name")
    return folder / (f"{architecture}--{mode}.json" if not mesh else f"{architecture}--{'x'.join(map(str, mesh))}--{mode}.json")


def _read_json(path: Path) -> object:
    """A stored file's JSON: a regular file, bounded; None when there is none or it does not parse."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return json.loads(read_regular_file(path, MAX_RESULT_BYTES))
    except (SpecError, ValueError, RecursionError):
        return None


def _stored(path: Path, architecture: str, mesh: tuple[int, ...], mode: str) -> SweepRow | None:
    """The stored row, or None when there is none or it does not check (it is then run again)."""
    data = _read_json(path)
    fields = {"architecture": str, "mesh": list, "mode": str, "outcome": str, "phase": str, "culprit": str,
              "compared": int, "outside": int, "cpu_seconds": (int, float)}
    if not isinstance(data, dict) or set(data) != set(fields) or \
            any(not isinstance(data[k], t) or isinstance(data[k], bool) for k, t in fields.items()):
        return None
    if (data["architecture"], tuple(data["mesh"]), data["mode"]) != (architecture, tuple(mesh), mode) \
            or data["outcome"] not in OUTCOMES or data["compared"] < 0 or data["outside"] < 0 \
            or (data["outcome"] == "right" and (data["outside"] or not data["compared"])) \
            or (data["outcome"] == "silently wrong" and not data["outside"]):
        return None
    return SweepRow(architecture, tuple(mesh), mode, data["outcome"], data["phase"], data["culprit"][:2000],
                    data["compared"], data["outside"], float(data["cpu_seconds"]))


def check_row(architecture: str, mesh: tuple[int, ...], mode: str, steps: int = 2,
              dtype: torch.dtype = torch.float32) -> SweepRow:
    """One architecture's shipped plan on one mesh and mode, as a row (never an exception)."""
    began = time.process_time()
    try:
        result = check_parallelize(f"hf:{architecture}", "hf", mesh, mode=mode, steps=steps, dtype=dtype)
    except CannotBuild as exc:
        return SweepRow(architecture, mesh, mode, "cannot build", culprit=exc.reason,
                        cpu_seconds=time.process_time() - began)
    except Exception as exc:  # noqa: BLE001 - one architecture's surprise is its row, said, not the sweep's end
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return SweepRow(architecture, mesh, mode, "error", culprit=f"{type(exc).__name__}: {first}"[:500],
                        cpu_seconds=time.process_time() - began)
    data = as_json(result)
    why = result.culprit.line() if result.culprit else (result.failure.error if result.failure else "")
    return SweepRow(architecture, mesh, mode, result.verdict, result.phase, why[:2000], result.compared,
                    len(result.findings), result.cpu_seconds)


def sweep(architectures: Iterable[str], meshes: Sequence[tuple[int, ...]], modes: Sequence[str], folder: Path,
          steps: int = 2, say: Callable[[str], None] = lambda line: None, run: bool = True,
          engine: Engine | None = None) -> list[SweepRow]:
    """Every (architecture, mesh, mode) row: read from ``folder`` where stored and valid, else checked
    and stored there (``run=False``: only what is stored; the page says the rest was not run).
    ``engine`` runs the checks (default: one after another here; a Ray cluster's workers with
    ``RayEngine``): this process alone stores each row as it comes back."""
    folder.mkdir(parents=True, exist_ok=True)
    rows: list[SweepRow | None] = []
    todo: list[tuple[int, Path, Unit]] = []
    for architecture in architectures:
        for mesh in meshes:
            for mode in modes:
                path = _file(folder, architecture, tuple(mesh), mode)
                row = _stored(path, architecture, tuple(mesh), mode)
                if row is None and not run:
                    continue
                if row is None:
                    todo.append((len(rows), path, Unit(check_row, (architecture, tuple(mesh), mode, steps),
                                                       f"{architecture} {'x'.join(map(str, mesh))} {mode}")))
                rows.append(row)

    def done(index: int, value: object) -> None:
        at, path, unit = todo[index]
        row = value if isinstance(value, SweepRow) else SweepRow(
            *unit.args[:3], "error", culprit=f"{getattr(value, 'error', value)}"[:500])   # its worker died twice
        write_file_atomic(path, json.dumps(row.record(), indent=1) + "\n")
        say(f"{unit.label}: {row.outcome}" + (f" ({row.culprit[:160]})" if row.outcome != "right" else "")
            + f" [{row.cpu_seconds:.1f} CPU-s]")
        rows[at] = row

    run_units([unit for _, _, unit in todo], engine or InProcess(), done)
    return rows  # type: ignore[return-value]


@dataclass(frozen=True)
class PlanRules:
    """An architecture's shipped tensor-parallel plan against its tiny build: how many rules it has
    and which name no module or parameter there (transformers applies them to nothing)."""

    architecture: str
    rules: int
    unmatched: tuple[str, ...]

    def record(self) -> dict:
        return {"architecture": self.architecture, "rules": self.rules, "unmatched": list(self.unmatched)}


def _stored_rules(path: Path, architecture: str) -> PlanRules | None:
    data = _read_json(path)
    if not isinstance(data, dict) or set(data) != {"architecture", "rules", "unmatched"} \
            or data["architecture"] != architecture or not isinstance(data["rules"], int) \
            or isinstance(data["rules"], bool) or not isinstance(data["unmatched"], list) \
            or not all(isinstance(k, str) and len(k) <= 300 for k in data["unmatched"]) \
            or not 0 <= len(data["unmatched"]) <= data["rules"] <= 10_000:
        return None
    return PlanRules(architecture, data["rules"], tuple(data["unmatched"]))


def plan_rules(architectures: Iterable[str], folder: Path, run: bool = True) -> list[PlanRules]:
    """Each architecture's :class:`PlanRules`, read from ``folder`` where stored and valid, else
    found by building the tiny model (no run) and stored; an architecture that cannot be built
    has none (its rows say why)."""
    folder.mkdir(parents=True, exist_ok=True)
    found = []
    for architecture in architectures:
        path = _file(folder, architecture, (), "plan")
        rules = _stored_rules(path, architecture)
        if rules is None and run:
            try:
                model = resolve_model(f"hf:{architecture}", (), 0).build()
            except Exception:  # noqa: BLE001 - a model that cannot be built has no rules to read; its rows say why
                continue
            rules = PlanRules(architecture, len(getattr(model, "tp_plan", None) or {}), transformers_unmatched(model))
            write_file_atomic(path, json.dumps(rules.record(), indent=1) + "\n")
        if rules is not None:
            found.append(rules)
    return found


def _cell(row: SweepRow | None) -> str:
    if row is None:
        return "not run"
    text = row.outcome + (f" ({row.phase})" if row.phase and row.outcome == "silently wrong" else "")
    return text


def render_page(rows: Sequence[SweepRow], architectures: Sequence[str], meshes: Sequence[tuple[int, ...]],
                modes: Sequence[str], rules: Sequence[PlanRules] = ()) -> str:
    """docs/parallelize.md: the counts, then one row per architecture and mesh (a cell per mode),
    then every row without a plain verdict with its culprit or reason, then the plans' rules that
    name no module of their tiny build."""
    by_key = {(r.architecture, r.mesh, r.mode): r for r in rows}
    counts = Counter(r.outcome for r in rows)
    missing = len(architectures) * len(meshes) * len(modes) - len(rows)
    verdicts = {r.architecture for r in rows if r.outcome in VERDICTS}
    total = sum(r.cpu_seconds for r in rows)
    import transformers

    lines = [
        "# The tensor-parallel plans transformers ships, checked against the single device",
        "",
        "<!-- written by `shardverify parallelize --sweep-hf --write docs/transformers_tp_plans.md`; do not edit by hand -->",
        "",
        f"Every architecture of transformers {transformers.__version__} whose config declares a `base_model_tp_plan` "
        f"({len(architectures)}), built tiny from its config (hidden 64, 4 attention and 4 key/value heads, 2 layers "
        "or one of each kind, vocabulary 256; nothing downloaded), parallelized exactly as "
        "`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` parallelizes it (`maybe_distribute_model`), "
        f"on torch {torch.__version__}, and run against the single device from the same weights and inputs: training "
        "(forward, loss, backward, 2 AdamW steps) and inference (a `torch.no_grad` forward, transformers' local fast "
        "path). Every module's input and output, the loss, every gradient and the weights after each step are "
        "compared with the single device in float64, each allowed 8x what the single device itself errs by in "
        "float32 (`shardverify/features/parallelize/compare.py`). A run that raises in process is run again on gloo processes, "
        "which give its verdict.",
        "",
        f"- rows: {len(rows)} of {len(rows) + missing} ({len(verdicts)} architectures run to a verdict on at least one "
        f"mesh; {missing} rows not run yet, each marked `not run`)",
        "- " + ", ".join(f"{counts.get(o, 0)} {o}" for o in OUTCOMES),
        f"- CPU time of the rows: {total:.0f} s ({total / 3600:.2f} h), the sum of each row's CPU time as stored "
        "(a row run on gloo counts its rank processes' too)",
        f"- plan rules: {sum(r.rules for r in rules)} in {len(rules)} architectures' plans; "
        f"{sum(len(r.unmatched) for r in rules)} of them, in {sum(1 for r in rules if r.unmatched)} architectures, "
        "name no module of the tiny build (transformers logs them on rank 0 and applies them to nothing; listed at the end)",
        "",
        "| architecture | mesh | " + " | ".join(modes) + " |",
        "| --- | --- | " + " | ".join("---" for _ in modes) + " |",
    ]
    for architecture in architectures:
        for mesh in meshes:
            cells = [_cell(by_key.get((architecture, tuple(mesh), mode))) for mode in modes]
            lines.append(f"| {architecture} | {','.join(map(str, mesh))} | " + " | ".join(cells) + " |")
    lines += ["", "## Rows without a right verdict", ""]
    for row in rows:
        if row.outcome != "right":
            lines.append(f"- {row.architecture} on {','.join(map(str, row.mesh))}, {row.mode}: {_cell(row)}: "
                         + row.culprit.replace("\n", " ").replace("|", "/")[:600])
    lines += ["", "## Plan rules that name no module of the tiny build", "",
              "A tiny build has two layers or one of each kind, so a rule for a kind of layer it lacks is listed too.", ""]
    for found in rules:
        if found.unmatched:
            lines.append(f"- {found.architecture} ({len(found.unmatched)} of {found.rules}): "
                         + ", ".join(f"`{key}`" for key in found.unmatched))
    return "\n".join(lines) + "\n"
