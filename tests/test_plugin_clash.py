"""A plug-in rule named like a built-in (issue 45 item 2): only the name's use fails, and says how out.

A real plug-in (a dist-info with an entry point on ``sys.path``, imported by the entry-point
machinery) registers an M2T rule ``margin`` -- a built-in's name -- and a rule of its own. Every
command that does not use ``margin`` runs as before (the built-in keeps the name; the load logs one
warning); a policy that names ``margin`` fails in one line that names both classes, how to rename
the plug-in's rule, its class path, and ``DLM_TOOLKIT_NO_PLUGINS=1``; with that set, ``margin`` is the
built-in again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_plugins import CHECKPOINT, NO_PLUGINS, fake_distribution, run

CLASH = """
    from dlm_toolkit import M2T, UnmaskRule
    from dlm_toolkit.strategy.selection import top1

    @M2T.register("margin")
    class MarginUnmask(UnmaskRule):
        def __call__(self, ctx):
            return top1(ctx.confidence, ctx.fillable)

    @M2T.register("own_rule")
    class OwnRule(UnmaskRule):
        def __call__(self, ctx):
            return top1(ctx.confidence, ctx.fillable)
"""

DRIVER = """
import contextlib, io, json, sys
from dlm_toolkit.cli import main

def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}

dec = ["decode", "--checkpoint", sys.argv[1], "--prompt-ids", "1,2,3", "--gen-length", "8", "--json",
       "--mask-id", "127", "--eos-id", "126", "--set", "blocks.params.block_length=8"]
results = {
    "default": cli(*dec),
    "own": cli(*dec, "--set", "m2t.name=own_rule"),
    "clash": cli(*dec, "--set", "m2t.name=margin"),
    "by_path": cli(*dec, "--set", "m2t.name=clash_plugin_mod:MarginUnmask"),
}
if len(sys.argv) < 3:
    results["list"] = cli("strategies", "list")
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def clash(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clash")
    return fake_distribution(root / "site", "clash-plugin", {"clashy": "clash_plugin_mod"},
                             {"clash_plugin_mod": CLASH})


def _result(done) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_clash_fails_only_where_the_name_is_used(clash: Path, tmp_path: Path) -> None:
    res = _result(run(["-c", DRIVER, str(CHECKPOINT)], clash, cwd=tmp_path))
    assert res["default"]["rc"] == 0, res["default"]["err"]  # the default policy does not use `margin`
    assert res["own"]["rc"] == 0, res["own"]["err"]  # the plug-in's other rule loaded
    assert res["by_path"]["rc"] == 0, res["by_path"]["err"]  # the hint of the message: the class path works
    err = res["clash"]["err"]
    assert res["clash"]["rc"] == 2 and err.count("\n") == 1, err
    assert err.startswith("error: m2t rule 'margin' registered twice: by strategies.m2t_margin.MarginUnmask "
                          "(built-in) and by clash_plugin_mod.MarginUnmask (plug-in 'clashy')")
    assert '@M2T.register("margin") in clash_plugin_mod' in err  # how to rename
    assert "clash_plugin_mod:MarginUnmask" in err  # how to use the plug-in's class anyway
    assert f"{NO_PLUGINS}=1" in err  # how to run without plug-ins
    listing = res["list"]
    assert listing["rc"] == 0 and "own_rule" in listing["out"]
    assert "m2t rule 'margin' registered twice" in listing["out"]  # the listing shows the clash
    # the load warned once (logging's last-resort handler writes to stderr, captured per command)
    assert "registered twice" in res["default"]["err"] + res["own"]["err"] + res["clash"]["err"]


def test_without_plugins_the_name_is_the_builtin_again(clash: Path, tmp_path: Path) -> None:
    res = _result(run(["-c", DRIVER, str(CHECKPOINT), "no-list"], clash, cwd=tmp_path, env={NO_PLUGINS: "1"}))
    assert res["clash"]["rc"] == 0, res["clash"]["err"]
    assert res["own"]["rc"] == 2 and "unknown m2t rule 'own_rule'" in res["own"]["err"]  # near miss: really off
