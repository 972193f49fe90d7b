"""Third-party strategy plug-ins: the example package installed into a scratch folder (never the
shared venv) and used from subprocesses with ``PYTHONPATH`` pointing there."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugin-package"
CHECKPOINT = REPO / "conformance" / "llada2_tiny"  # tiny model, no tokenizer: mask 127, EOS 126
RULE, PLUGIN, CLASS_PATH = "confidence_ratio", "example", "dlm_example_plugin.rules:ConfidenceRatioUnmask"


NO_PLUGINS = "DLM_TOOLKIT_NO_PLUGINS"


def run(args: list[str], *paths: Path, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 240):
    """Run ``python ARGS`` with ``PYTHONPATH=paths`` and this checkout last (the toolkit under test, not
    whatever copy is installed; one intra-op thread: tiny tensors, shared CPUs)."""
    full = {k: v for k, v in os.environ.items() if k != NO_PLUGINS}
    full.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(map(str, [*paths, REPO])), **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, cwd=cwd, timeout=timeout)


def fake_distribution(root: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """A minimal installed distribution (dist-info with entry points, plus modules) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"  # the wheel spec's escaped name
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[dlm_toolkit.strategies]\n{eps}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package pip-installed (offline, no deps, no build isolation) into a scratch folder."""
    root = tmp_path_factory.mktemp("plugin")
    src = root / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    target = root / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--disable-pip-version-check", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=240, cwd=root,
    )
    assert done.returncode == 0, done.stderr
    assert (target / "dlm_example_plugin" / "rules.py").is_file()
    return target


CLI_DRIVER = """
import contextlib, io, json, sys
from dlm_toolkit.cli import main

def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}

ck = sys.argv[1]
dec = ["decode", "--checkpoint", ck, "--prompt-ids", "1,2,3", "--gen-length", "8", "--json", "--mask-id", "127",
       "--eos-id", "126", "--set", "blocks.params.block_length=8"]
print(json.dumps({
    "list": cli("strategies", "list", "--json"),
    "by_name": cli(*dec, "--set", "m2t.name=%s"),
    "by_path": cli(*dec, "--set", "m2t.name=%s", "--set", "m2t.params.ratio=4.0"),
}))
""" % (RULE, CLASS_PATH)


def test_plugin_listed_and_decodes_by_name_and_by_class_path(site, tmp_path):
    done = run(["-c", CLI_DRIVER, str(CHECKPOINT)], site, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout.strip().splitlines()[-1])
    listing = json.loads(res["list"]["out"])
    entry = next(e for e in listing["roles"]["m2t"] if e["name"] == RULE)
    assert entry["source"] == PLUGIN and entry["class"] == CLASS_PATH
    assert entry["fields"][0]["name"] == "ratio" and entry["fields"][0]["range"] == "1.0 <= x <= 1000000.0"
    assert listing["plugins"][PLUGIN] == "dlm_example_plugin.rules" and not listing["failed_plugins"]
    assert {e["source"] for e in listing["roles"]["m2t"] if e["name"] == "threshold"} == {"built-in"}
    outs = []
    for key, name in (("by_name", RULE), ("by_path", CLASS_PATH)):
        assert res[key]["rc"] == 0, res[key]["err"]
        out = json.loads(res[key]["out"])
        assert out["policy"]["m2t"] == {"name": name, "params": {"ratio": 4.0}}
        assert out["tokens"] and 127 not in out["tokens"] and out["nfe"] >= 1
        outs.append(out["tokens"])
    assert outs[0] == outs[1]  # the same class either way


def test_example_contract_suite_passes(site, tmp_path):
    tests = tmp_path / "example_tests"
    shutil.copytree(EXAMPLE / "tests", tests)
    done = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_rule.py")], site, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_no_plugins_env_hides_the_plugin(site, tmp_path):
    done = run(["-m", "dlm_toolkit.cli", "strategies", "list", "--json"], site, env={NO_PLUGINS: "1"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    assert RULE not in {e["name"] for e in listing["roles"]["m2t"]}
    assert PLUGIN not in listing["plugins"] and "threshold" in {e["name"] for e in listing["roles"]["m2t"]}


BROKEN_DRIVER = """
import contextlib, io, json
from dlm_toolkit.cli import main
from dlm_toolkit.strategy.registry import M2T

out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = main(["strategies", "list"])
try:
    M2T.get("no_such_rule")
    unknown = ""
except Exception as e:
    unknown = str(e)
print(json.dumps({"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "unknown": unknown}))
"""


def test_broken_plugin_is_reported_and_listing_still_works(site, tmp_path):
    broken = fake_distribution(tmp_path / "broken", "broken-plugin", {"broken": "broken_plugin_mod"},
                               {"broken_plugin_mod": "raise RuntimeError('boom: this plug-in is broken')\n"})
    done = run(["-c", BROKEN_DRIVER], site, broken, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0
    assert "plug-in broken FAILED to load" in res["out"] and "boom: this plug-in is broken" in res["out"]
    assert "strategy plug-in 'broken' failed to import" in res["err"]  # the logged warning
    assert RULE in res["out"] and f"[{PLUGIN}]" in res["out"]  # the healthy plug-in still loads
    assert "plug-ins that failed to load: broken" in res["unknown"]  # and unknown names point at it


def test_two_plugins_registering_one_name_fail_where_the_name_is_used(tmp_path):
    rule = """
        from dlm_toolkit import M2T, UnmaskRule
        from dlm_toolkit.strategy.selection import top1

        @M2T.register("dup_rule")
        class {cls}(UnmaskRule):
            def __call__(self, ctx):
                return top1(ctx.confidence, ctx.fillable)
    """
    a = fake_distribution(tmp_path / "a", "dup-a", {"dupa": "dup_a_mod"}, {"dup_a_mod": rule.format(cls="DupA")})
    b = fake_distribution(tmp_path / "b", "dup-b", {"dupb": "dup_b_mod"}, {"dup_b_mod": rule.format(cls="DupB")})
    probe = ("from dlm_toolkit.strategy.registry import M2T, PluginError, load_plugins\nload_plugins()\n"
             "try:\n    M2T.get('dup_rule')\nexcept PluginError as e:\n    print('PluginError:', e)")
    done = run(["-c", probe], a, b, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "PluginError: m2t rule 'dup_rule' registered twice" in done.stdout
    assert "dup_a_mod.DupA" in done.stdout and "dup_b_mod.DupB" in done.stdout
