"""README's two commands stay true."""

import re

from conftest import REPO


def commands():
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)[:2]


def test_ci_runs_readme_test_command():
    main_job, tests = commands()
    assert "pytest" in tests
    ci = (REPO / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


def test_main_job_names_existing_files_and_commands():
    main_job, _ = commands()
    experiment = re.search(r"dlm sweep (\S+)", main_job).group(1)
    assert (REPO / experiment).is_file()
    from dlm_toolkit.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    assert {"sweep", "decode", "eval", "conformance", "strategies", "pareto", "replay", "train"} <= set(sub)


def test_readme_step_context_table_matches_the_docstring():
    from dlm_toolkit.strategy import StepContext

    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| field | shape | dtype | meaning |"):]
    table = table[: table.index("\n\n")]
    in_readme = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    in_doc = re.findall(r"^    ``(\w+)``\s{2,}", StepContext.__doc__, flags=re.M)
    assert in_readme == in_doc and len(in_doc) >= 20
    fields = set(StepContext.__dataclass_fields__) | {"fillable", "probs", "token_confidence"}
    assert set(in_doc) <= fields
