"""Every store is untrusted input (shardverify/stored.py, files.write_file_atomic): DTensor results
and confirmations, the verdict cache, OpInfo entries are read as regular files of bounded size and
nesting, checked field by field, and written whole through a fresh exclusive name (as is the
calibration file)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import threading
from pathlib import Path

import pytest
import torch

from shardverify.cli.main import main
from shardverify.features.dtensor.confirm import Confirmation, load_confirmations, save_confirmation
from shardverify.features.dtensor.store import StoredRun, load_stored, save_stored, store_path
from shardverify.errors import SpecError
from shardverify.features.opinfo.sweep import CallOutcome, SweepResult

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "results" / "dtensor" / f"torch-{torch.__version__}"
#: a small shipped stored run with one finding (a missed optimisation: the store passes without it too)
MEAN_ALL = "mean_all.4.limit0.5a87f91d6b60.json"
DEEP = "[" * 100_000 + "]" * 100_000


@contextlib.contextmanager
def memory_cap(extra: int = 1 << 30):
    """At most ``extra`` more bytes of address space while inside: a reader that reads a device
    without end fails fast with MemoryError instead of taking the machine's memory."""
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def fifo_guard(path: Path, seconds: float = 10.0):
    """A FIFO at ``path``, and a writer that opens and closes it after ``seconds`` if a reader is
    still there (a reader blocked on it then reads an empty file instead of hanging the test run):
    on leaving, the FIFO must have been refused unread, no reader ever blocked on it."""
    os.mkfifo(path)
    blocked: list[bool] = []

    def unblock() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))   # succeeds only with a reader waiting
            blocked.append(True)
        except OSError:
            pass

    timer = threading.Timer(seconds, unblock)
    timer.start()
    try:
        yield path
    finally:
        timer.cancel()
    assert not blocked, f"a reader blocked on the FIFO {path}"


def _store_with(tmp_path: Path, name: str = MEAN_ALL) -> Path:
    folder = tmp_path / "results" / SHIPPED.name
    folder.mkdir(parents=True)
    shutil.copy(SHIPPED / name, folder / name)
    return folder / name


def _from_json(capsys, store: Path) -> tuple[int, str, str]:
    code = main(["dtensor", "mean_all", "--mesh", "4", "--limit", "0", "--from-json", str(store),
                 "--root", str(ROOT), "--accepted", str(ROOT / "specs/dtensor/accepted.yaml")])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def mean_all():
    from shardverify.spec.catalogue import load_op_specs

    return load_op_specs(ROOT, None, ["mean_all"])[0]


def _stored(store: Path, spec) -> tuple[list, str]:
    from shardverify.features.dtensor.stored_results import stored_results

    return stored_results(store, [spec], [(4,)], None, ROOT)


# ---------------------------------------------------------------- reading: regular files, bounded

def test_a_stored_run_linked_to_dev_zero_is_refused_unread(tmp_path, capsys):
    path = _store_with(tmp_path)
    path.unlink()
    path.symlink_to("/dev/zero")
    with memory_cap():
        code, out, err = _from_json(capsys, tmp_path / "results")
    assert code == 2 and err.count("\n") == 1 and f"{path}: is a symbolic link, not a regular file" in err


def test_a_stored_run_that_is_a_fifo_is_refused_without_blocking(tmp_path, mean_all):
    path = _store_with(tmp_path)
    path.unlink()
    with fifo_guard(path), pytest.raises(SpecError, match="is a FIFO, not a regular file") as refused:
        _stored(tmp_path / "results", mean_all)
    assert refused.value.file == str(path)


@pytest.mark.parametrize("text, reason", [(DEEP, "nests deeper than 32 levels"), ("{", "not JSON"),
                                          ("\xff", "not JSON")])
def test_a_stored_run_that_is_no_json_of_bounded_depth_is_refused(tmp_path, text, reason):
    path = _store_with(tmp_path)
    path.write_text(text, encoding="latin-1")
    with pytest.raises(SpecError, match=reason) as refused:
        load_stored(path)
    assert refused.value.file == str(path)


def test_a_stored_run_with_a_finding_deleted_is_refused_not_passed(tmp_path, capsys):
    path = _store_with(tmp_path)
    document = json.loads(path.read_text())
    document["results"]["torch.ops.aten.mean.default"]["findings"] = []
    path.write_text(json.dumps(document))
    code, out, err = _from_json(capsys, tmp_path / "results")
    assert code == 2 and "passed" not in out and err.count("\n") == 1 and "Traceback" not in err
    assert (f"{path}: field 'results.torch.ops.aten.mean.default.findings': the counts do not add up: "
            "1 missed-optimisation counted, 0 stored as findings") in err


CASE = "results.torch.ops.aten.mean.default"


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["results"]["torch.ops.aten.mean.default"]["counts"].update(agrees=3), f"{CASE}.counts"),
    (lambda d: d["results"]["torch.ops.aten.mean.default"].update(executed="5"), f"{CASE}.executed"),
    (lambda d: d["results"]["torch.ops.aten.mean.default"]["findings"][0].update({"class": "fine"}),
     f"{CASE}.findings[0].class"),
    (lambda d: d["results"]["torch.ops.aten.mean.default"]["findings"][0].update(layouts=[1]),
     f"{CASE}.findings[0].layouts"),
    (lambda d: d.update(mesh=[2, 2]), f"{CASE}.mesh"),
    (lambda d: d.update(died={"x": {"0": 1}}), "died.x.0"),
    (lambda d: d.update(done=["another case"]), "done"),
    (lambda d: d.update(spec="neg"), None),          # another spec's run under this one's name
])
def test_a_stored_run_that_does_not_check_is_refused_naming_the_field(tmp_path, mean_all, edit, field):
    path = _store_with(tmp_path)
    assert len(_stored(tmp_path / "results", mean_all)[0]) == 1
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    with pytest.raises(SpecError) as refused:
        _stored(tmp_path / "results", mean_all)
    assert (refused.value.file, refused.value.field) == (str(path), field)


def test_a_stored_run_says_it_was_made_by_this_version(tmp_path, mean_all):
    _store_with(tmp_path)
    results, note = _stored(tmp_path / "results", mean_all)
    assert len(results) == 1 and (f"Each of the 1 stored file(s) read was made by this version (torch "
                                  f"{torch.__version__}, DTensor harness 1)") in note


def test_a_saved_json_run_is_checked_and_says_which_version_made_it(tmp_path):
    from shardverify.features.dtensor.store import made_by, read_saved_run

    stored = json.loads((SHIPPED / MEAN_ALL).read_text())
    result = stored["results"]["torch.ops.aten.mean.default"]
    whole = {**result, "findings": [{"op": "mean_all", "case": result["case"], "mesh": [4], **f}
                                    for f in result["findings"]]}
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"torch": "2.0.0", "results": [whole]}))
    document = read_saved_run(saved)
    assert made_by(document.get("torch"), document.get("harness")).startswith(
        "NOT made by this version: made by torch 2.0.0, DTensor harness unknown")
    assert made_by(torch.__version__, 1) == f"made by this version (torch {torch.__version__}, DTensor harness 1)"
    saved.write_text(json.dumps({"torch": torch.__version__, "results": [{**whole, "findings": []}]}))
    with pytest.raises(SpecError, match="the counts do not add up") as refused:
        read_saved_run(saved)
    assert refused.value.field == "results[0].findings"
    saved.write_text(json.dumps({"results": [{**whole, "findings": [{**whole["findings"][0], "op": "other"}]}]}))
    with pytest.raises(SpecError, match="a finding of op 'other' in a result of 'mean_all'"):
        read_saved_run(saved)


def test_a_running_marker_that_is_a_fifo_is_refused_and_one_cut_short_skips_nothing(tmp_path):
    from shardverify.features.dtensor.store import read_running
    from shardverify.stored import StoreError

    marker = tmp_path / "x.json.running"
    with fifo_guard(marker):
        with pytest.raises(StoreError, match="is a FIFO"):
            read_running(marker, ["case"])
    marker.unlink()
    for text in ("", "case\n", "other\n2\nstage\n", "case\nx\n"):
        marker.write_text(text)
        assert read_running(marker, ["case"]) is None
    marker.write_text("case\n2\nDTensor's execution\n")
    assert read_running(marker, ["case"]) == ("case", "2", "DTensor's execution")


def test_names_in_a_store_never_climb_a_folder(tmp_path):
    from shardverify.features.opinfo.store import _file

    path = store_path(tmp_path, "../../escape", "0" * 12, (4,), "../t", 3)
    assert path.parent.parent == tmp_path and ".." not in path.name and "/" not in path.parent.name[6:]
    assert _file(tmp_path, "../../escape").parent == tmp_path
    assert _file(tmp_path, "nn.functional.conv2d").name == "nn.functional.conv2d.json"   # plain: kept


# ---------------------------------------------------------------- OpInfo entries and confirmations

def _entry(tmp_path: Path):
    from shardverify.features.opinfo.store import save_entry, settings_key

    settings = settings_key(3, ((4,),), ("fx",), 0)
    outcome = CallOutcome("neg", "neg#0((4,))", "fx", (4,), "grid", served_by=("neg",), strategies=2)
    save_entry(tmp_path, "neg", settings, SweepResult([outcome], [], 1.0))
    return settings, tmp_path / "neg.json"


@contextlib.contextmanager
def planted(path, plant: str, document: dict):
    """``path`` replaced by a /dev/zero link (memory capped), a FIFO (a guard unblocks a reader), JSON
    nested past any limit, or ``document`` (an edited copy) for the rest of the block."""
    path.unlink()
    with contextlib.ExitStack() as stack:
        if plant == "dev-zero":
            path.symlink_to("/dev/zero")
            stack.enter_context(memory_cap())
        elif plant == "fifo":
            stack.enter_context(fifo_guard(path))
        elif plant == "deep":
            path.write_text(DEEP)
        else:
            path.write_text(json.dumps(document))
        yield


@pytest.mark.parametrize("plant", ["dev-zero", "fifo", "deep", "wrong-field", "bad-outcome"])
def test_an_opinfo_entry_that_does_not_check_is_swept_again(tmp_path, plant):
    from shardverify.features.opinfo.store import load_entry

    settings, path = _entry(tmp_path)
    assert load_entry(tmp_path, "neg", settings) is not None
    document = json.loads(path.read_text())
    if plant == "wrong-field":
        document["outcomes"][0]["mesh"] = "4"
    elif plant == "bad-outcome":
        document["outcomes"][0]["outcome"] = "fine"
    with planted(path, plant, document):
        assert load_entry(tmp_path, "neg", settings) is None


def test_an_opinfo_lock_that_is_a_fifo_is_not_blocked_on(tmp_path):
    from shardverify.features.opinfo.store import held, lock_owner

    with fifo_guard(tmp_path / "neg.lock"):
        assert held(tmp_path, "neg") is None            # names no live process: stale, the next claim takes it over
        assert "unreadable" in lock_owner(tmp_path, "neg").invalid


def _confirmation() -> Confirmation:
    example = {"op": "neg", "case": "c", "mesh": [4], "layouts": {"x": "S0"}, "spec_hash": "h", "format": 1}
    return Confirmation("neg forward x=S(0)", "silent-wrong", "t", example, "confirmed", "wrong on rank 1", 4, 1.0,
                        "abc")


@pytest.mark.parametrize("plant", ["dev-zero", "fifo", "deep", "status", "world"])
def test_a_confirmation_that_does_not_check_is_left_out(tmp_path, plant):
    found = _confirmation()
    save_confirmation(tmp_path, found)
    examples = {found.key: found.example}
    assert load_confirmations(tmp_path, "t", examples) == {found.key: found}
    (path,) = tmp_path.rglob("*.json")
    document = json.loads(path.read_text())
    with planted(path, plant, {**document, plant: "fine" if plant == "status" else "4"}):
        assert load_confirmations(tmp_path, "t", examples) == {}


# ---------------------------------------------------------------- writing: whole, through no planted link

def _writers(tmp_path: Path):
    """(what writes a store's file, the file, every name a writer has used for its partial file)."""
    from shardverify.features.dtensor.confirm import _path
    from shardverify.features.opinfo.store import save_entry, settings_key
    from shardverify.sharding.calibration_file import AxisFit, save_calibration
    from shardverify.verify.on_demand import OnDemandVerifier

    run = StoredRun("neg", "0" * 12, (4,), "t", None, 20.0)
    stored = store_path(tmp_path / "results", "neg", "0" * 12, (4,), "t", None)
    confirmation = _confirmation()
    confirmed = _path(tmp_path / "c", "t", confirmation.key, [4])
    pid = os.getpid()
    verdicts = OnDemandVerifier(cache_dir=tmp_path / "v")
    key = "ab" * 32
    return [
        (lambda: save_stored(stored, run), stored, [stored.name + ".tmp"]),
        (lambda: save_confirmation(tmp_path / "c", confirmation), confirmed, [confirmed.name + ".tmp"]),
        (lambda: save_entry(tmp_path / "o", "neg", settings_key(3, ((4,),), ("fx",), 0), SweepResult()),
         tmp_path / "o" / "neg.json", [f"neg.{pid}.part"]),
        (lambda: verdicts._store(key, {"failed": []}), tmp_path / "v" / "ab" / f"{key}.json", [f"{key}.{pid}.tmp"]),
        (lambda: save_calibration((4,), [AxisFit(0, 1e-5, 1e-9, 0.01, 8)], backend="gloo", device="cpu",
                                  path=tmp_path / "cal" / "calibration.json"),
         tmp_path / "cal" / "calibration.json", ["calibration.json.tmp"]),
    ]


def test_no_store_is_written_through_a_link_planted_at_its_partial_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for write, target, partials in _writers(tmp_path):
        target.parent.mkdir(parents=True, exist_ok=True)
        for name in partials:
            (target.parent / name).symlink_to(victim)
        write()
        assert victim.read_text() == "precious", target
        assert target.is_file() and not target.is_symlink()


def test_a_link_planted_at_the_store_itself_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for write, target, _ in _writers(tmp_path)[:4]:     # the stores (the calibration file is read first)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(victim)
        write()
        assert victim.read_text() == "precious" and not target.is_symlink()


@contextlib.contextmanager
def file_size_limit(size: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_write_cut_short_by_a_file_size_limit_leaves_the_old_file_and_nothing_else(tmp_path):
    from shardverify.files import write_file_atomic

    run = StoredRun("neg", "0" * 12, (4,), "t", None, 20.0, cases=["c" * 5000])
    path = store_path(tmp_path, "neg", "0" * 12, (4,), "t", None)
    save_stored(path, StoredRun("neg", "0" * 12, (4,), "t", None, 20.0))
    before = path.read_bytes()
    with pytest.raises(OSError), file_size_limit(4096):
        save_stored(path, run)
    assert path.read_bytes() == before and os.listdir(path.parent) == [path.name]
    with pytest.raises(OSError), file_size_limit(10):
        write_file_atomic(tmp_path / "new.txt", "x" * 100)
    assert not (tmp_path / "new.txt").exists() and sorted(os.listdir(tmp_path)) == [path.parent.name]


def test_the_reader_says_absent_refused_or_parsed(tmp_path):
    from shardverify.stored import StoreError, read_json

    assert read_json(tmp_path / "none.json", 100) is None
    (tmp_path / "big.json").write_text("[" + "1," * 100 + "1]")
    with pytest.raises(StoreError, match="larger than 100 bytes"):
        read_json(tmp_path / "big.json", 100)
    (tmp_path / "ok.json").write_text('{"a": [1, {"b": 2}]}')
    assert read_json(tmp_path / "ok.json", 100) == {"a": [1, {"b": 2}]}
    (tmp_path / "deep.json").write_text("[" * 40 + "]" * 40)
    with pytest.raises(StoreError, match="nests deeper than 32 levels") as refused:
        read_json(tmp_path / "deep.json", 100)
    assert isinstance(refused.value, SpecError) and refused.value.file == str(tmp_path / "deep.json")


@pytest.mark.parametrize("plant", ["dev-zero", "fifo"])
def test_a_cached_verdict_that_is_no_regular_file_is_discarded_unread(tmp_path, plant):
    from shardverify.verify.on_demand import OnDemandVerifier

    verifier = OnDemandVerifier(cache_dir=tmp_path)
    key = "cd" * 32
    path = tmp_path / "cd" / f"{key}.json"
    path.parent.mkdir()
    with contextlib.ExitStack() as stack:
        if plant == "dev-zero":
            path.symlink_to("/dev/zero")
            stack.enter_context(memory_cap())
        else:
            stack.enter_context(fifo_guard(path))
        assert verifier._load(key, ["RR -> RR"]) is None
    assert len(verifier.discarded) == 1 and str(path) in verifier.discarded[0]
