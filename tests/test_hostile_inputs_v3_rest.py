"""The rest of the earlier hostile table (issue 42 item 9): a dynamic block past its window or moving
back, lm-eval model_args with typos or wrong types, loglikelihood runs that say their cost, prompts past
any tokenizer, GSM8K answers that are not numbers, EOS tokens of the wrong type, an absurd context, an
exhausted uid pool. Every row: one line naming what was wrong, before the work; a near miss accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.strategy.registry import BLOCKS
from test_hostile_cli import TESTBED, run_cli
from test_hostile_inputs import no_hang  # noqa: F401  (autouse: a hung row fails)

BENCH = Path(__file__).resolve().parent / "fixtures" / "benchmarks"


class _TooWide(BLOCKS.get("dsb")):
    """Proposes a first block one position wider than its window (max_block_length 8)."""
    def first_bounds(self, state):
        lo, _ = super().first_bounds(state)
        return lo, lo + 9


class _JustWide(BLOCKS.get("dsb")):
    """Near miss: exactly the window."""
    def first_bounds(self, state):
        lo, _ = super().first_bounds(state)
        return lo, lo + 8


class _MovesBack(BLOCKS.get("dsb")):
    """Moves the block's start back by one after a step (positions before it are final)."""
    def next_bounds(self, state, ctx):
        lo, hi = super().next_bounds(state, ctx)
        back = (lo > state.block_lo) & (state.block_lo > state.prompt_len)  # a second move: one back instead
        return torch.where(back, state.block_lo - 1, lo), torch.where(back, state.block_lo + 1, hi)


@pytest.mark.parametrize("cls,needle", [
    ("_TooWide", r"proposed the active block \[5, 14\) for batch row 0, which is 9 wide, more than the window "
                 r"\(max_block_length 8\)"),
    ("_MovesBack", r"which moved back before the previous block's start \d+ \(the positions before that are final\)"),
])
def test_a_dynamic_block_wider_than_its_window_or_moving_back_is_refused(cls, needle):
    from dlm_toolkit import DecodingPolicy, StrategyError, decode
    from dlm_toolkit.testing import tiny_llada2

    def policy(name):
        return DecodingPolicy({"m2t": {"name": "threshold"}, "blocks": {
            "name": f"{__name__}:{name}", "params": {"block_length": 4, "max_block_length": 8}}})

    with pytest.raises(StrategyError, match=needle) as err:
        decode(tiny_llada2(seed=1), [[1, 2, 3, 4, 5]], policy(cls), 12)
    assert "\n" not in str(err.value)
    assert decode(tiny_llada2(seed=1), [[1, 2, 3, 4, 5]], policy("_JustWide"), 12).forward_calls > 0  # near miss


# lm-eval model_args: one line naming the key (the model is never loaded for a bad one)
MODEL_ARG_ROWS = {
    "presett": ("presett=llada2.1-q", "unknown key 'presett'; did you mean preset?"),
    "kv_cahce": ("kv_cahce=false", "unknown key 'kv_cahce'; did you mean kv_cache?"),
    "kv_cache no": ("kv_cache=no", "model_args kv_cache: must be true or false (got 'no')"),
    "kv_cache 1": ("kv_cache=1", "model_args kv_cache: must be true or false (got 1)"),
    "batch_size abc": ("batch_size=abc", "model_args batch_size: must be an integer in [1, 65536] (got 'abc')"),
    "batch_size 0": ("batch_size=0", "model_args batch_size: must be an integer in [1, 65536] (got 0)"),
    "seed x": ("seed=x", "model_args seed: must be an integer in [0, 9223372036854775807] (got 'x')"),
    "seed -1": ("seed=-1", "model_args seed: must be an integer in [0,"),
    "stop_every 0": ("stop_every=0", "model_args stop_every: must be an integer in [1,"),
}


@pytest.mark.parametrize("row", sorted(MODEL_ARG_ROWS))
def test_lm_eval_model_args_are_checked(row):
    from dlm_toolkit.integrations.lm_eval import DlmLM

    arg, needle = MODEL_ARG_ROWS[row]
    with pytest.raises(ConfigError) as err:
        DlmLM.create_from_arg_string(f"checkpoint={TESTBED},{arg}")
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("path", ["/dev/zero", "{tmp}/nowhere", "{tmp}/file"])
def test_lm_eval_checkpoint_that_is_not_a_folder(path, tmp_path):
    from dlm_toolkit.integrations.lm_eval import DlmLM

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="model_args checkpoint: .* is not a checkpoint folder"):
        DlmLM.create_from_arg_string(f"pretrained={path.format(tmp=tmp_path)}")


@pytest.fixture(scope="module")
def lm():
    """Near miss of every row above: the right keys and types load the model (lm-eval's own
    ``--batch_size`` arrives as text)."""
    from dlm_toolkit.integrations.lm_eval import DlmLM

    model = DlmLM.create_from_arg_string(f"pretrained={TESTBED},preset=llada2.1-q,kv_cache=false,seed=3,"
                                         "stop_every=2,mc_num=8,mc_batch_size=3", {"batch_size": "4", "device": None})
    assert (model.kv_cache, model.seed, model.stop_every, model.batch_size) == (False, 3, 2, 4)
    return model


def _requests(pairs):
    from lm_eval.api.instance import Instance as Request

    return [Request("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def test_loglikelihood_states_its_cost_and_shows_progress(lm, capsys):
    """mc_num 8 in batches of 3: three forwards per estimate, said before the first one; the bar
    counts samples (16 for two requests, the exact one-token case included)."""
    out = lm.loglikelihood(_requests([("12+3=", "15\n"), ("1+2=", "3")]))
    assert len(out) == 2
    err = capsys.readouterr().err
    assert "dlm loglikelihood: 2 request(s), 2 estimate(s) of mc_num 8 samples: up to 6 forwards of up to 3 rows" in err
    assert "16/16" in err


def test_rolling_loglikelihood_states_its_cost(lm, capsys):
    from lm_eval.api.instance import Instance as Request

    text = "1+2=3\n" * 40  # 240 characters: two windows of half the 256-position context
    out = lm.loglikelihood_rolling([Request("loglikelihood_rolling", {}, (text,), 0)])
    assert len(out) == 1
    err = capsys.readouterr().err
    assert "dlm loglikelihood_rolling: 1 request(s), 2 estimate(s) of mc_num 8 samples" in err and "16/16" in err


def test_a_huge_lm_eval_request_is_refused_before_tokenizing():
    from dlm_toolkit.integrations.lm_eval import encode_text
    from dlm_toolkit.tasks.base import MAX_PROMPT_CHARS

    with pytest.raises(ConfigError, match=f"an lm-eval request: a prompt of {MAX_PROMPT_CHARS + 1} characters"):
        encode_text(None, "x" * (MAX_PROMPT_CHARS + 1))  # the tokenizer is never reached


def test_a_huge_question_is_refused_before_tokenizing(tmp_path, capsys):
    """A question past the bound: one line naming the task and the record, not a Rust abort. Near
    miss: a prompt of exactly the bound passes the check."""
    from dlm_toolkit.tasks.base import MAX_PROMPT_CHARS, check_prompt_length

    frame = len("Question: \nAnswer:")
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "1" * (MAX_PROMPT_CHARS + 1 - frame), "answer": "so #### 3"}) + "\n")
    line = run_cli(["eval", "--checkpoint", str(TESTBED), "--task", "gsm8k", "--data", str(data), "--n", "1",
                    "--chat", "false", "--no-progress"], capsys, tmp_path)
    assert f"task 'gsm8k', instance 0: a prompt of {MAX_PROMPT_CHARS + 1} characters, more than" in line, line
    check_prompt_length("1" * MAX_PROMPT_CHARS, "near miss")


@pytest.mark.parametrize("final,refused", [("NaN", True), ("nan", True), ("inf", True), ("3 apples", True),
                                           ("", True), ("1,234", False), ("-7", False), ("2.5", False)])
def test_gsm8k_final_answers_are_numbers(final, refused, tmp_path):
    from dlm_toolkit.tasks import DataError, get_task

    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" +
                    json.dumps({"question": "q", "answer": f"steps\n#### {final}"}) + "\n")
    if refused:
        with pytest.raises(DataError, match=r"record 1: 'answer' ends in '#### .*', not a number"):
            get_task("gsm8k", data=str(data))
    else:
        assert get_task("gsm8k", data=str(data)).eval_size == 2


@pytest.mark.parametrize("value", ["NaN", "-inf", "Infinity"])
def test_gsm_plus_answers_are_finite(value, tmp_path):
    from dlm_toolkit.tasks import DataError, get_task

    data = tmp_path / "gsmplus_testmini.jsonl"
    rows = [{"question": "q", "answer": "3", "perturbation_type": "x"},
            {"question": "q", "answer": value, "perturbation_type": "x"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="record 1: 'answer' .* is not a finite number"):
        get_task("gsm_plus", data=str(data))
    data.write_text(json.dumps(rows[0]) + "\n")
    assert get_task("gsm_plus", data=str(data)).eval_size == 1  # near miss


@pytest.mark.parametrize("eos,refused", [(12, True), ({"x": 1}, True), ({"content": 5}, True), (None, False),
                                         ({"content": "<|endoftext|>"}, False)])
def test_an_official_style_eos_token_of_the_wrong_type(eos, refused, tmp_path, capsys):
    """A checkpoint whose config.json names no special ids (as the released ones): the EOS token is
    read from tokenizer_config.json, which must name it as text (or the added-token form)."""
    from test_hostile_cli import make

    d = make(tmp_path, "ckpt", src=TESTBED,
             config=lambda c: {k: v for k, v in c.items() if k not in ("eos_token_id", "mask_token_id")})
    tc = json.loads((d / "tokenizer_config.json").read_text())
    if eos is not None:
        tc["eos_token"] = eos
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    args = ["decode", "--checkpoint", str(d), "--prompt", "1+2=", "--gen-length", "4"]
    if refused:
        line = run_cli(args, capsys, tmp_path)
        assert "tokenizer_config.json: eos_token must be a token's text or {\"content\": text}" in line, line
    else:
        assert main(args) == 0


@pytest.mark.parametrize("value,refused", [(10**18, True), ((1 << 20) + 1, True), (1 << 20, False)])
def test_max_position_embeddings_is_bounded(value, refused, tmp_path, capsys):
    from test_hostile_cli import IDS, make

    d = make(tmp_path, "ckpt", config=lambda c: {**c, "max_position_embeddings": value})
    args = ["decode", "--checkpoint", str(d), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS]
    if refused:
        line = run_cli(args, capsys, tmp_path)
        assert "max_position_embeddings" in line and "1048576" in line, line
    else:
        assert main(args) == 0


def test_an_exhausted_uid_pool_is_one_line(tmp_path, monkeypatch):
    """Every sandbox uid leased (by this test, in a lock folder of its own so that nothing else on the
    machine is starved): the code task's run ends in a ConfigError -- one line from ``dlm`` --, and
    with two uids freed the same run goes through."""
    import fcntl
    import os

    from dlm_toolkit.tasks import get_task
    from dlm_toolkit.tasks.sandbox import limits

    if os.geteuid() != 0:
        pytest.skip("uids are leased only by a root evaluator")  # the CI machine runs as root
    task = get_task("mbpp", data=str(BENCH / "mbpp"), timeout_s=20.0)  # probes the sandbox: before the pool is full
    inst = task.instances(1, 0, "eval")[0]
    assert task.run(inst, inst.reference).passed  # near miss first (and the runner's own probe, cached)
    folder = tmp_path / "uids"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(limits, "lock_dir", lambda: folder)
    held = {}
    for uid in range(limits.POOL_FIRST, limits.POOL_FIRST + limits.POOL_SIZE):
        held[uid] = os.open(folder / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(held[uid], fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(ConfigError, match=r"all 1000 sandbox uids .* are in use by other sandboxed runs"):
            task.run(inst, inst.reference)
        for uid in sorted(set(held) - limits._reserved())[:2]:  # a run takes two: the candidate's and the tests'
            os.close(held.pop(uid))
        assert task.run(inst, inst.reference).passed
    finally:
        for fd in held.values():
            os.close(fd)
