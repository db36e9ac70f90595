"""The one dotted-name resolver behind spec targets, harness cases, collective
implementations and model factories."""

import pytest
import torch

from shardverify.errors import InvalidArgument
from shardverify.spec.names import UnresolvedName, resolve_dotted


@pytest.mark.parametrize("name, expected", [
    ("torch.sum", torch.sum),
    ("torch.Tensor.sum", torch.Tensor.sum),                       # attribute of a class
    ("torch.nn.Linear", torch.nn.Linear),
    ("torch.nn.functional.linear", torch.nn.functional.linear),  # submodule imported on the way
    ("torch.nn:Linear", torch.nn.Linear),                         # explicit module part
])
def test_resolves_functions_methods_classes_and_module_colon_forms(name, expected):
    assert resolve_dotted(name) is expected


@pytest.mark.parametrize("name, message", [
    ("torch.nope", "'torch' has no attribute 'nope'"),
    ("torch.nn:Nope", "'torch.nn' has no attribute 'Nope'"),
    ("no_such_package_xyz.f", "does not name an importable object"),
    ("no_such_package_xyz:f", "cannot import 'no_such_package_xyz'"),
    ("torch..sum", "expected a dotted name"),
    ("", "expected a dotted name"),
    (3, "expected a dotted name"),
])
def test_unresolvable_names_say_why(name, message):
    with pytest.raises(UnresolvedName, match=message) as info:
        resolve_dotted(name)
    # callers catch it as a usage error or as a failed lookup
    assert isinstance(info.value, InvalidArgument) and isinstance(info.value, LookupError)


def test_overlong_names_are_refused_before_any_import():
    from shardverify.spec.names import MAX_NAME_CHARS, UnresolvedName, resolve_dotted

    with pytest.raises(UnresolvedName, match=f"longer than {MAX_NAME_CHARS}"):
        resolve_dotted("torch." + "a" * 300)


def test_a_module_that_fails_while_importing_is_an_unresolved_name(tmp_path, monkeypatch):
    from shardverify.spec.names import UnresolvedName, resolve_dotted

    (tmp_path / "sv_broken_mod.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnresolvedName, match="failed: RuntimeError: broken at import"):
        resolve_dotted("sv_broken_mod.factory")
