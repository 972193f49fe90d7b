"""ParallelBench: metric parity with the official metrics.py, the data layout, prompts, refusals, and a
whole evaluation through the CLI on data written here (none of the repository's data ships)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.tasks import get_task
from dlm_toolkit.tasks.data import DataError
from dlm_toolkit.tasks.parallelbench import TEST_FOLDER, fill_prompt, render_turns
from dlm_toolkit.tasks.parallelbench_metrics import METRICS, parse_list

TABLE = Path(__file__).parent / "fixtures" / "parallelbench" / "metric_table.jsonl"
WAITING = ("You are managing a waiting line at a customer service desk.\nYou need to record the following "
           "people in the order they arrived:\n{context}\nPlease shuffle the list and provide only the final list.\n")


def table() -> list[dict]:
    return [json.loads(line) for line in TABLE.read_text().splitlines()]


def test_every_metric_agrees_with_the_official_metrics_py_on_the_table():
    rows = table()
    assert len(rows) >= 200 and {r["metric"] for r in rows} == set(METRICS)
    wrong = [(r["metric"], r["prediction"], s, r[key]) for r in rows
             for key, strict in (("score", False), ("score_strict", True))
             if (s := METRICS[r["metric"]](r["prediction"], r["answer"], strict)) != r[key]]
    assert not wrong, wrong[:5]


def test_the_table_has_passes_and_failures_of_each_metric_in_both_modes():
    # a table where a metric always says 0 (or 1) would let a constant implementation through
    rows = table()
    for metric in METRICS:
        scores = {(r["score"], r["score_strict"]) for r in rows if r["metric"] == metric}
        assert (0.0, 0.0) in scores and (1.0, 1.0) in scores, metric
    assert any(r["score"] == 1.0 and r["score_strict"] == 0.0 for r in rows if r["metric"] == "list_match_score")


@pytest.mark.parametrize("text, strict, want", [
    ('["a", "b"]', True, ["a", "b"]),
    ('["a","b"]', True, None),  # strict wants ", " between items
    ('["a", b]', True, None),
    ('"a", "b"', True, None),  # no brackets
    ('"a", "b"', False, ["a", "b"]),
    ('x [1] ["a", "b"', False, ["a", "b"]),  # the text after the last '[', no closing bracket needed
    ('["a, b"]', False, ["a", "b"]),
    ('[]', False, []),
])
def test_parse_list_near_misses(text, strict, want):
    assert parse_list(text, strict) == want


def test_shuffle_scores_the_original_order_as_a_failure():
    answer = {"input": ["A", "B", "C"]}
    assert METRICS["list_shuffle_score"]('["B", "A", "C"]', answer, False) == 1.0
    assert METRICS["list_shuffle_score"]('["A", "B", "C"]', answer, False) == 0.0
    assert METRICS["list_shuffle_score"]('["B", "A", "A"]', answer, False) == 0.0


def write_group(root: Path, group: str, tasks: dict[str, tuple[dict, list[dict]]]) -> Path:
    folder = root / TEST_FOLDER / group
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "task_config.yaml").write_text(yaml.safe_dump({f"{group}/{k}": v[0] for k, v in tasks.items()}))
    for name, (_, records) in tasks.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def listing(items: list[str]) -> str:
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


def shuffle_record(items: list[str], icl: list[str]) -> dict:
    return {"input": {"context": listing(items), "icl_examples": [
                {"input": {"context": listing(icl)}, "answer": {"input": icl, "example": listing(icl[::-1])}}]},
            "answer": {"input": items, "example": listing(items[::-1])}, "metadata": {"length": len(items)}}


@pytest.fixture()
def clone(tmp_path: Path) -> Path:
    shuffle = ({"prompt": WAITING, "metric": "list_shuffle_score"},
               [shuffle_record(["Ann", "Bo", "Cy"], ["Di", "Ed"]), shuffle_record(["Fay", "Gus", "Hal"], ["Ivy", "Jo"])])
    copy = ({"prompt": "Copy:\\n{context}", "metric": "list_match_score"},
            [{"input": {"context": listing(["Ann", "Bo"])}, "answer": listing(["Ann", "Bo"]), "metadata": {}}])
    write_group(tmp_path, "waiting_line", {"shuffle": shuffle, "copy": copy})
    write_group(tmp_path, "words_to_sentence", {"easy": ({"prompt": "{words}", "metric": "sentence_to_words_score"},
                                                         [{"input": {"words": "a"}, "answer": {"words": ["a"]}}])})
    return tmp_path


def test_prompt_is_the_icl_turns_then_the_instance_turn(clone):
    task = get_task("parallelbench", task="waiting_line/shuffle", data=str(clone))
    inst = task.instances(2, 0, "eval")[0]
    turns = task.chat_messages(inst)
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[0]["content"] == WAITING.format(context=listing(["Di", "Ed"]))
    assert turns[1]["content"] == listing(["Ed", "Di"])  # the example's 'example' answer
    assert turns[2]["content"] == WAITING.format(context=listing(["Ann", "Bo", "Cy"]))
    assert inst.prompt == render_turns(turns) and inst.prompt.endswith("Assistant:")
    assert task.score(inst, '["Bo", "Ann", "Cy"]') == 1.0 and task.score(inst, '["Ann", "Bo", "Cy"]') == 0.0


def test_escaped_newlines_in_a_prompt_become_line_breaks_as_in_the_official_code(clone):
    task = get_task("parallelbench", task="waiting_line/copy", data=str(clone / TEST_FOLDER))  # the test folder itself
    assert task.chat_messages(task.instances(1, 0, "eval")[0])[-1]["content"] == 'Copy:\n["Ann", "Bo"]'


def test_an_evaluation_sends_every_turn_through_the_chat_template(clone):
    from dlm_toolkit.evaluation.evaluate import task_prompt
    from dlm_toolkit.models.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(__file__).parent / "fixtures" / "llada2.1-chat-tokenizer")
    task = get_task("parallelbench", task="waiting_line/shuffle", data=str(clone))
    text = tok.decode(task_prompt(tok, task, task.instances(1, 0, "eval")[0], True))
    assert text.index('["Di", "Ed"]') < text.index('["Ed", "Di"]') < text.index('["Ann", "Bo", "Cy"]')
    assert "User:" not in text  # the template's turns, not the plain rendering


@pytest.mark.parametrize("template, values, message", [
    ("{context.__class__}", {"context": "x"}, "not a plain {name} field"),
    ("{context:>99999999}", {"context": "x"}, "not a plain {name} field"),
    ("{context!r}", {"context": "x"}, "not a plain {name} field"),
    ("{0}", {"context": "x"}, "not a plain {name} field"),
    ("{missing}", {"context": "x"}, "lacks"),
    ("{context", {"context": "x"}, "not a format string"),
    ("{context}{context}", {"context": "x" * 15_000}, "longer than"),
])
def test_hostile_prompt_fields_are_refused(template, values, message):
    with pytest.raises(DataError, match=message.replace("{", r"\{").replace("}", r"\}")):
        fill_prompt(template, values, "f.jsonl:1")
    fill_prompt("{context}", {"context": "x" * 15_000}, "f.jsonl:1")  # the near miss: one plain field


def test_text_tasks_are_refused_naming_what_they_need(clone):
    with pytest.raises(DataError, match="sentence_to_words_score.*grammar checker"):
        get_task("parallelbench", task="words_to_sentence/easy", data=str(clone))


@pytest.mark.parametrize("task", ["../etc/passwd", "waiting_line", "waiting_line/shuffle/x", "Waiting_line/shuffle"])
def test_task_names_are_group_slash_name_only(clone, task):
    with pytest.raises(ConfigError, match="task: must be 'group/name'"):
        get_task("parallelbench", task=task, data=str(clone))


def test_unknown_task_names_the_group_s_tasks(clone):
    with pytest.raises(DataError, match="no task 'waiting_line/sort'.*waiting_line/copy, waiting_line/shuffle"):
        get_task("parallelbench", task="waiting_line/sort", data=str(clone))


def test_missing_data_names_the_repository_the_folder_and_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DLM_DATA_DIR", raising=False)
    with pytest.raises(DataError) as err:
        get_task("parallelbench", task="waiting_line/shuffle")
    text = str(err.value)
    assert "furiosa-ai/ParallelBench" in text and str(TEST_FOLDER) in text and "--data" in text
    assert "\n" not in text


@pytest.mark.parametrize("answer, message", [
    ({"example": "x"}, "'input' missing"),
    ({"input": "Ann, Bo", "example": "x"}, "'input' missing or of the wrong type"),  # a string would be iterated
    ({"input": ["Ann", 3]}, "list of strings"),
    ({"input": ["Ann"], "n_words": 0}, "n_words"),
    ("[\"Ann\"]", "as an object"),
])
def test_malformed_answers_are_refused_naming_the_line(tmp_path, answer, message):
    record = {"input": {"context": "[]"}, "answer": answer}
    write_group(tmp_path, "waiting_line", {"shuffle": ({"prompt": "{context}", "metric": "list_shuffle_score"},
                                                      [record])})
    with pytest.raises(DataError, match=rf"shuffle.jsonl:1: .*{message}"):
        get_task("parallelbench", task="waiting_line/shuffle", data=str(tmp_path))


def test_dlm_eval_runs_a_task_end_to_end_and_reports_both_scores(clone, tmp_path, capsys):
    from dlm_toolkit.models.checkpoint import save_model
    from dlm_toolkit.models.tokenizer import build_char_tokenizer, save_tokenizer
    from dlm_toolkit.testing.models import tiny_llada2

    model = tiny_llada2(vocab_size=128, mask_token_id=1, eos_token_id=0, max_position_embeddings=1024)
    ckpt = tmp_path / "ckpt"
    save_model(model, ckpt)
    save_tokenizer(build_char_tokenizer(), ckpt)
    code = main(["eval", "--checkpoint", str(ckpt), "--task", "parallelbench", "--data", str(clone),
                 "--task-arg", "task=waiting_line/shuffle", "--gen-length", "24", "--n", "2",
                 "--json", "--preset", "llada2.1-s", "--set", "blocks.params.block_length=8"])
    out = capsys.readouterr().out
    assert code == 0, out
    metrics = json.loads(out)["metrics"] if "metrics" in json.loads(out) else json.loads(out)
    assert 0.0 <= metrics["accuracy"] <= 1.0 and "accuracy_strict" in metrics and metrics["tpf"] > 0
