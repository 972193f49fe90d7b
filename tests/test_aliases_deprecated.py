"""The old flat module paths warn: each names its new path and the release that removes it.

regroup: skip -- this file names the old flat module paths on purpose.

pyproject's pytest config ignores DeprecationWarning, so every check here records warnings
explicitly (``simplefilter("always")``). Imports run in a fresh interpreter: an old path warns on
its first import in a process, and this one has imported most of the toolkit already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_layout import OLD_TO_NEW  # the old -> new table, written there independently of _aliases.py

import dlm_toolkit
from dlm_toolkit import _aliases

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = '''
import importlib, json, sys, warnings
old_to_new = json.loads(sys.argv[1])
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dlm_toolkit
    decode_fn = dlm_toolkit.decode
    for new in old_to_new.values():
        importlib.import_module("dlm_toolkit." + new)
    out["package and new paths"] = [str(w.message) for w in caught]
    for old, new in old_to_new.items():
        del caught[:]
        if old == "files":
            module = dlm_toolkit.files  # the attribute form warns too
        else:
            module = importlib.import_module("dlm_toolkit." + old)
        line = sys._getframe().f_lineno
        out[old] = [[str(w.message), w.category.__name__, w.filename] for w in caught]
        out[old + " same module"] = module is importlib.import_module("dlm_toolkit." + new)
    del caught[:]
    import dlm_toolkit.verify
    out["second import"] = len(caught)
    out["decode still the function"] = dlm_toolkit.decode is decode_fn
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    script = tmp_path_factory.mktemp("aliases") / "user_code.py"
    script.write_text(_SCRIPT)
    run = subprocess.run([sys.executable, str(script), json.dumps(OLD_TO_NEW)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    out["script"] = str(script)
    return out


def test_each_old_path_warns_naming_its_new_path_and_the_removal(imported: dict) -> None:
    assert len(OLD_TO_NEW) == 39
    for old, new in OLD_TO_NEW.items():
        assert imported[old] == [[
            f"dlm_toolkit.{old} is deprecated and will be removed in dlm-toolkit {_aliases.REMOVAL_VERSION}; "
            f"import dlm_toolkit.{new} instead", "DeprecationWarning", imported["script"]]], old
        assert imported[old + " same module"] is True, old  # still the very module object


def test_new_paths_and_the_package_do_not_warn(imported: dict) -> None:
    assert imported["package and new paths"] == []
    assert imported["second import"] == 0  # once per process, like any module import
    assert imported["decode still the function"] is True


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_the_aliases_cannot_outlive_their_removal_version(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _version(dlm_toolkit.__version__) < _version(_aliases.REMOVAL_VERSION)
    major, minor, patch = _version(_aliases.REMOVAL_VERSION)
    just_before = f"{major}.{minor - 1}.99" if minor else f"{major - 1}.99.99"
    monkeypatch.setattr(dlm_toolkit, "__version__", just_before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _aliases.deprecate("verify")
    assert [w.category for w in caught] == [DeprecationWarning]
    monkeypatch.setattr(dlm_toolkit, "__version__", _aliases.REMOVAL_VERSION)
    with pytest.raises(RuntimeError, match=r"delete dlm_toolkit/_aliases\.py"):
        _aliases.deprecate("verify")


def test_readme_says_when_the_old_paths_go() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"removed in dlm-toolkit {_aliases.REMOVAL_VERSION}" in readme
