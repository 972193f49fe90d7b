"""The lm-evaluation-harness model ``dlm``, offline: lm-eval's own ``simple_evaluate`` and its CLI on
custom task YAMLs over local JSONL files give what ``dlm eval`` gives on the same instances and policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
from dlm_toolkit.integrations.lm_eval import write_gsm8k_task
from dlm_toolkit.tasks import get_task
from dlm_toolkit.tasks.gsm8k import extract_answer
from test_loglikelihood import MC_YAML

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / "checkpoints" / "testbed-editable"
GSM8K = REPO / "tests" / "fixtures" / "benchmarks" / "gsm8k" / "test.jsonl"
N_ADD = 16
N_GSM = 8
GSM_GEN = 24  # tokens; dlm eval --gen-length 24 decodes 25 positions (room for EOS)
POLICY = "llada2.1-q"

ADD_YAML = """task: dlm_add
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{reference}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    add = folder / "add.jsonl"
    add.write_text("".join(json.dumps({"prompt": i.prompt, "reference": i.reference}) + "\n"
                           for i in get_task("add").instances(N_ADD, 0, "eval")))
    (folder / "dlm_add.yaml").write_text(ADD_YAML.format(data=add, until='["\\n"]', max_gen=get_task("add").answer_length + 1))
    gsm = folder / "gsm8k" / "test.jsonl"  # the first N_GSM problems of the GSM8K-format fixture
    gsm.parent.mkdir()
    gsm.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:N_GSM]))
    write_gsm8k_task(folder, gsm, max_gen_toks=GSM_GEN + 1, name="dlm_gsm8k_local")
    bad = folder / "bad"
    bad.mkdir()
    mc = bad / "mc.jsonl"
    mc.write_text(json.dumps({"prompt": "1+2=", "choices": ["3", "4"], "label": 0}) + "\n")
    (bad / "dlm_mc.yaml").write_text(MC_YAML.format(name="dlm_mc", data=mc))
    (bad / "dlm_long.yaml").write_text(ADD_YAML.format(data=add, until='["\\n"]', max_gen=1000).replace("dlm_add", "dlm_long"))
    (bad / "dlm_empty_stop.yaml").write_text(ADD_YAML.format(data=add, until='[""]', max_gen=7).replace("dlm_add", "dlm_empty_stop"))
    return folder


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


def test_simple_evaluate_equals_dlm_eval(tasks_dir, monkeypatch):
    """lm-eval's simple_evaluate with the dlm model (registered by importing the integration): accuracy and per-request forwards equal
    dlm eval on the same add instances; on the GSM8K-format file, lm-eval's own strict and flexible
    filters read exactly what our verifier extracts from our completions."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    for key, value in env().items():
        monkeypatch.setenv(key, value)
    out = lm_eval.simple_evaluate(
        model="dlm", model_args=f"checkpoint={TESTBED},preset={POLICY},threads=1", tasks=["dlm_add", "dlm_gsm8k_local"],
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False), batch_size=8, log_samples=True)
    model, tok = load_checkpoint(TESTBED)
    ours = evaluate(model, tok, "add", POLICY, N_ADD, 0, batch_size=8, progress=False)
    assert out["results"]["dlm_add"]["exact_match,none"] == ours.metrics["accuracy"] > 0.5
    stats = out["config"]["dlm"]
    assert stats["requests"] == N_ADD + N_GSM and stats["policy"]["m2t"]["params"]["threshold"] == 0.7
    add_nfe = [r["nfe"] for r in stats["per_request"]][:N_ADD]  # lm-eval sends the add requests first
    assert sorted(add_nfe) == sorted(r["nfe"] for r in ours.records)

    data = str(tasks_dir / "gsm8k")
    gsm = evaluate(model, tok, get_task("gsm8k", data=data, answer_length=GSM_GEN), POLICY, N_GSM, 0, progress=False)
    assert any(r["stopped"] == "eos" for r in gsm.records)
    for match, key in (("strict", "strict-match"), ("flexible", "flexible-extract")):
        samples = sorted((s for s in out["samples"]["dlm_gsm8k_local"] if s["filter"] == key), key=lambda s: s["doc_id"])
        assert len(samples) == N_GSM
        for sample, record in zip(samples, gsm.records):
            assert sample["resps"][0][0] == record["completion"]
            assert sample["filtered_resps"][0] == extract_answer(record["completion"], match)
        rescored = evaluate(model, tok, get_task("gsm8k", data=data, answer_length=GSM_GEN, match=match),
                            POLICY, N_GSM, 0, progress=False)
        assert out["results"]["dlm_gsm8k_local"][f"exact_match,{key}"] == rescored.metrics["accuracy"]


# dlm-lm-eval (lm-eval's own command line) with one change: lm-eval's index of its ~10k built-in task
# files is skipped (15 s per rank here); only the custom tasks of --include_path are looked up
CLI = """import functools, sys
import lm_eval.tasks
lm_eval.tasks.TaskManager = functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
from dlm_toolkit.integrations.lm_eval import main
sys.exit(main())
"""


def test_cli_under_torchrun_prints_once_and_equals_dlm_eval(tasks_dir, tmp_path):
    """lm-eval's CLI (dlm-lm-eval) on 2 gloo ranks: one results table, one results file, the same
    accuracy as dlm eval."""
    script = tmp_path / "dlm_lm_eval.py"
    script.write_text(CLI)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--model", "dlm", "--model_args", f"checkpoint={TESTBED},preset={POLICY},threads=1", "--tasks", "dlm_add",
           "--include_path", str(tasks_dir), "--batch_size", "8", "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("|dlm_add|") == 1
    files = list((tmp_path / "out").rglob("results_*.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    model, tok = load_checkpoint(TESTBED)
    ours = evaluate(model, tok, "add", POLICY, N_ADD, 0, progress=False)
    assert result["results"]["dlm_add"]["exact_match,none"] == ours.metrics["accuracy"]
    assert result["config"]["dlm"]["tpf"] == pytest.approx(ours.metrics["tpf"])


def test_bad_request_exits_2_with_one_message_and_writes_nothing(tasks_dir, tmp_path, monkeypatch, capsys):
    """Through lm-eval's CLI: a multiple-choice task with ``mc_num=0`` (no Monte-Carlo sample to
    estimate its loglikelihood from). (lm-eval's index of its ~10k built-in task files is skipped
    here to save 15 s: only the custom task is looked up.)"""
    import functools

    import lm_eval.tasks

    from dlm_toolkit.integrations.lm_eval import main

    for key, value in env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    out = tmp_path / "out"
    code = main(["--model", "dlm", "--model_args", f"checkpoint={TESTBED},threads=1,mc_num=0", "--tasks", "dlm_mc",
                 "--include_path", str(tasks_dir / "bad"), "--output_path", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: mc_num: must be an integer in [2, ")
    assert not out.exists()


def test_sampled_request_decodes_the_same_in_any_batch_or_group():
    """At temperature 1 a request's text depends on its own stream only: the same request alone,
    or second in a batch after requests of another group, gives the same text; other requests
    (same prompt, other documents) and a second copy of one (lm-eval's repeats) draw other streams."""
    from lm_eval.api.instance import Instance

    from dlm_toolkit.integrations.lm_eval import DlmLM

    lm = DlmLM(checkpoint=str(REPO / "checkpoints" / "testbed-v2-editable"), preset="llada2.1-q",
               set="sampling.temperature=1.0", threads=1, batch_size=4)
    prompt = get_task("pick").instances(1, 0, "eval")[0].prompt  # many correct answers: sampling shows

    def req(doc: int, until: str = "@@") -> Instance:
        return Instance("generate_until", {}, (prompt, {"until": [until], "max_gen_toks": 40}), 0, ("pick", doc, 1))

    alone = lm.generate_until([req(0)], disable_tqdm=True)[0]
    other_group = [req(d, "##") for d in (7, 8, 9)]
    mixed = lm.generate_until([*other_group, req(5), req(0), req(6)], disable_tqdm=True)
    assert mixed[4] == alone
    others = lm.generate_until([req(d) for d in range(1, 7)], disable_tqdm=True)
    assert len({alone, *others}) >= 3  # the near-miss: other requests, other streams
    assert mixed[3] == others[4] and mixed[5] == others[5]
    twice = req(0)
    copies = lm.generate_until([twice] * 6, disable_tqdm=True)
    assert copies[0] == alone and len(set(copies)) >= 2


@pytest.mark.parametrize("task, needle", [
    ("dlm_long", "max_position_embeddings"),
    ("dlm_empty_stop", "empty stop string"),
])
def test_bad_generation_requests_are_refused_before_decoding(tasks_dir, monkeypatch, task, needle):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from dlm_toolkit.config import ConfigError
    from dlm_toolkit.integrations.lm_eval import DlmLM

    for key, value in env().items():
        monkeypatch.setenv(key, value)
    lm = DlmLM(checkpoint=str(TESTBED), threads=1)
    with pytest.raises(ConfigError, match=needle):
        lm_eval.simple_evaluate(model=lm, tasks=[task],
                                task_manager=TaskManager(include_path=str(tasks_dir / "bad"), include_defaults=False))
    assert lm.requests_log == []  # nothing was decoded


def test_generate_until_honours_until_and_max_gen_toks():
    """Requests straight to the model: each row is cut before its earliest stop string and decoded
    no further than the block it appeared in; max_gen_toks bounds the tokens."""
    from lm_eval.api.instance import Instance

    from dlm_toolkit.decoding.loop import decode
    from dlm_toolkit.integrations.lm_eval import DlmLM
    from dlm_toolkit.step.state import row_seed

    lm = DlmLM(checkpoint=str(REPO / "checkpoints" / "testbed-v2-editable"), preset="llada2.1-q",
               set="blocks.params.block_length=4", threads=1)
    prompt = get_task("sort").instances(1, 3, "eval")[0].prompt
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
    whole = decode(lm.model, [ids], lm.policy, 50, seed=[row_seed(0, 0)]).rows[0]
    text = lm.tokenizer.decode(whole.tokens)
    stop = text[12:15]
    requests = [Instance("generate_until", {}, (prompt, {"until": [stop, "@@"], "max_gen_toks": 50}), 0),
                Instance("generate_until", {}, (prompt, {"until": ["@@"], "max_gen_toks": 6}), 1)]
    cut, short = lm.generate_until(requests, disable_tqdm=True)
    assert cut == text[: text.find(stop)] and short == text[:6]
    log = sorted(lm.requests_log, key=lambda r: r["request"])
    assert log[0]["stopped"] == "stop" and log[0]["nfe"] < whole.nfe and log[0]["blocks_skipped"] > 0
    assert log[1]["tokens"] == 6
