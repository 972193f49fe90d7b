"""`dlm eval`: JSON output, MLflow logging, and bad input exiting 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlm_toolkit.cli import main
from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint

import sweep_helpers as h
from sweep_helpers import restore_torch_threads  # noqa: F401

FIXTURES = Path(__file__).resolve().parent / "fixtures"

pytestmark = pytest.mark.usefixtures("restore_torch_threads")

BASE = ["eval", "--task", "add", "--n", "6", "--seed", "3", "--batch-size", "4", "--threads", "1", "--no-progress"]


def test_eval_json_matches_library_and_logs_to_mlflow(tmp_path, capsys):
    from mlflow import MlflowClient

    ckpt = h.checkpoint()
    uri = h.tracking_uri(tmp_path)
    assert main([*BASE, "--checkpoint", str(ckpt), "--preset", "llada2.1-s", "--set", "t2t.params.threshold=0.3",
                 "--json", "--tracking-uri", uri]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"accuracy", "tpf", "nfe_mean", "tokens_per_second", "n", "edits_per_token", "policy_hash",
            "mlflow_run_id"} <= set(out)
    assert out["n"] == 6 and out["task"] == "add" and out["policy"]["t2t"]["params"]["threshold"] == 0.3
    model, tok = load_checkpoint(ckpt)
    lib = evaluate(model, tok, "add", out["policy"], 6, 3, batch_size=4, progress=False).metrics
    for k in ("accuracy", "tpf", "nfe_mean", "edits_per_token"):
        assert out[k] == lib[k]

    client = MlflowClient(uri)
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["policy_hash"] == out["policy_hash"]
    assert run.data.tags["kind"] == "eval" and run.data.tags["task"] == "add" and run.data.tags["seed"] == "3"
    assert run.data.params["t2t.params.threshold"] == "0.3" and run.data.metrics["tpf"] == pytest.approx(out["tpf"])
    assert client.get_experiment(run.info.experiment_id).name == "dlm-eval"
    path = client.download_artifacts(run.info.run_id, "policy.json", str(tmp_path))
    assert json.loads(open(path).read()) == out["policy"]


def test_eval_text_output(capsys):
    assert main([*BASE, "--checkpoint", str(h.checkpoint())]) == 0
    text = capsys.readouterr().out
    assert "accuracy" in text and "up to and including the first EOS" in text


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broken")
    return {
        "no_tokenizer": h.make_checkpoint(tmp / "no_tok", tokenizer=False),
        "short_context": h.make_checkpoint(tmp / "short", max_position_embeddings=16),
        "missing": tmp / "missing",
    }


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--checkpoint", "{ckpt}", "--task", "multiply"], "unknown task 'multiply'; available tasks: add, bigcodebench, either, gsm8k, gsm_plus, humaneval, humaneval_plus, latin_square, list_copy, list_insert, list_replace, list_reverse, list_shuffle, list_sort, livecodebench, lm_eval, math500, mbpp, mbpp_plus, parallelbench, pick, sort, sudoku, tiesort"),
        (["--checkpoint", "{ckpt}", "--n", "0"], "--n: must be >= 1"),
        (["--checkpoint", "{no_tokenizer}"], "no tokenizer files"),
        (["--checkpoint", "{short_context}"], "context is 16"),
        (["--checkpoint", "{missing}"], "does not exist"),
        (["--checkpoint", "{ckpt}", "--set", "m2t.params.threshold=3"], "m2t.params.threshold"),
        (["--checkpoint", "{ckpt}", "--preset", "nope"], "unknown preset"),
        (["--checkpoint", "{ckpt}", "--tracking-uri", "sqlite:///{missing}/x/mlflow.db"], "does not exist"),
        (["--checkpoint", "{ckpt}", "--task-arg", "unsafe_exec=true"], "--task-arg: unsafe_exec has its own flag: pass --unsafe-exec"),
        (["--checkpoint", "{ckpt}", "--task-arg", "data=x"], "--task-arg: data has its own flag: pass --data"),
        (["--checkpoint", "{ckpt}", "--task-arg", "max_digits"], "--task-arg: expected KEY=VALUE"),
        (["--checkpoint", "{ckpt}", "--task-arg", "max-digits=3"], "--task-arg: expected KEY=VALUE"),
        (["--checkpoint", "{ckpt}", "--task-arg", "max_digits=3", "--task-arg", "max_digits=4"], "--task-arg: max_digits given twice"),
        (["--checkpoint", "{ckpt}", "--task-arg", "frobnicate=1"], "unexpected keyword argument 'frobnicate'"),
        (["--checkpoint", "{ckpt}", "--task", "livecodebench", "--data", "{fixtures}/livecodebench/test.jsonl",
          "--task-arg", "release_version=release_v99"], "release_version: 'release_v99' is not one of"),
    ],
)
def test_eval_bad_input_exits_2_with_one_line(broken, capsys, args, fragment):
    paths = {"ckpt": h.checkpoint(), "fixtures": FIXTURES, **broken}
    argv = [*BASE, *[a.format(**paths) for a in args]]
    # later flags win: --task/--n given again override BASE
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and len(err.splitlines()) == 1


def test_eval_subprocess_exit_code_and_no_traceback(tmp_path):
    proc = h.dlm(*BASE, "--checkpoint", str(h.checkpoint()), "--task", "multiply", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "available tasks" in proc.stderr


def test_task_args_reach_the_task_with_json_values_and_text_otherwise():
    """``--task-arg`` options arrive at the task's constructor: JSON where the value parses (numbers,
    booleans), the text itself where it does not (a date, a release name)."""
    from dlm_toolkit.cli import build_parser
    from dlm_toolkit.commands.common import task_options
    from dlm_toolkit.tasks import get_task

    def options(*extra):
        args = build_parser().parse_args(["eval", "--checkpoint", "x", "--n", "1", *extra])
        return task_options(args)

    lcb = options("--task", "livecodebench", "--task-arg", "release_version=release_v5",
                  "--task-arg", "start_date=2024-08-01", "--task-arg", "timeout_s=2.5")
    assert {k: lcb[k] for k in ("release_version", "start_date", "timeout_s")} == {
        "release_version": "release_v5", "start_date": "2024-08-01", "timeout_s": 2.5}
    bcb = options("--task", "bigcodebench", "--data", str(FIXTURES / "bigcodebench"), "--task-arg", "split=instruct",
                  "--task-arg", "subset=hard", "--task-arg", f"hard_ids={FIXTURES / 'bigcodebench' / 'hard_ids.txt'}")
    task = get_task("bigcodebench", **bcb)
    assert (task.split, task.subset) == ("instruct", "hard")
    assert options("--task", "add", "--task-arg", "max_digits=3")["max_digits"] == 3  # an int, not "3"
    assert options("--task", "add") == {"chat": "auto"}  # no --task-arg: nothing added
