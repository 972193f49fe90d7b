"""Multiple choice through lm-eval: the delimiter trap is warned about once (character vocabularies)
and never for a BPE vocabulary or a format whose contexts end with the space; the loglikelihood's
last-block convention ("pad" as a decode canvas, "cut" at the answer as LLaDA's estimator) each
meets its own enumerated ELBO; README's multiple-choice YAML runs as written."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.integrations.lm_eval import delimiter_trap
from dlm_toolkit.integrations.loglik import estimate_loglikelihood
from dlm_toolkit.models.tokenizer import build_char_tokenizer
from dlm_toolkit.tasks import get_task

# the moderate-logit tiny model whose conditionals depend on the context (test_loglikelihood.py)
from test_loglikelihood import enumerated_elbo, tiny  # noqa: E402,F401  (a fixture)

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / "checkpoints" / "testbed-v2-editable"


def pairs(tok, items):
    return [(tok.encode(c, add_special_tokens=False), tok.encode(a, add_special_tokens=False)) for c, a in items]


def test_a_separate_space_token_before_the_choices_is_warned_about():
    char = build_char_tokenizer()
    message = delimiter_trap(char, pairs(char, [("12+34=", " 46"), ("12+34=", " 47")]))
    assert message is not None and "target_delimiter" in message and "' '" in message and "\n" not in message
    assert delimiter_trap(char, pairs(char, [("12+34=", "46"), ("12+34=", "47")])) is None  # target_delimiter: ""
    # near miss: the task's own contexts end with the space -- it is part of the format, not a trap
    assert delimiter_trap(char, pairs(char, [("12+34=", " 46"), ("Answer: ", " x")])) is None


def byte_level_bpe():
    """A small byte-level BPE (GPT-2 style pre-tokenizer) trained here on sums: like a real checkpoint's
    vocabulary, a space before a word is folded into the word's token ("Ġ46")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [f"Question: {a}+{b}= {a + b}" for a in range(40) for b in range(40)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_a_bpe_vocabulary_folds_the_space_into_the_choice_and_is_not_warned_about():
    bpe = byte_level_bpe()
    encoded = pairs(bpe, [("Question: 12+34=", " 46"), ("Question: 12+34=", " 47")])
    assert all(bpe.decode(cont[:1]).strip() for _, cont in encoded)  # " 46" starts with a word token
    assert delimiter_trap(bpe, encoded) is None
    # near miss: the same vocabulary with a stray double space does have a whitespace-only first token
    assert delimiter_trap(bpe, pairs(bpe, [("Question: 12+34=", "  46")])) is not None


def test_the_model_warns_once_per_run(caplog):
    from lm_eval.api.instance import Instance

    from dlm_toolkit.integrations.lm_eval import DlmLM

    lm = DlmLM(checkpoint=str(TESTBED), threads=1, mc_num=2, mc_batch_size=2)
    reqs = [Instance("loglikelihood", {}, ("3+96=", " 99"), 0), Instance("loglikelihood", {}, ("3+96=", " 98"), 0)]
    with caplog.at_level(logging.WARNING, logger="dlm_toolkit.integrations.lm_eval"):
        lm.loglikelihood(reqs, disable_tqdm=True)
        lm.loglikelihood(reqs, disable_tqdm=True)
    assert caplog.text.count("continuations start with") == 1


@pytest.mark.parametrize("last_block", ["pad", "cut"])
def test_each_convention_meets_its_own_enumerated_elbo(tiny, last_block):
    ctx, cont = [1, 2, 3], [9, 4, 7]  # the last block (positions 4..7) holds two answer tokens and one pad
    est = estimate_loglikelihood(tiny, ctx, cont, 4, mc_num=3000, mc_batch_size=1000, last_block=last_block,
                                 generator=torch.Generator().manual_seed(3))
    mine = enumerated_elbo(tiny, ctx, cont, 4, cut=last_block == "cut")
    other = enumerated_elbo(tiny, ctx, cont, 4, cut=last_block == "pad")
    assert 0 < est.stderr < 0.05 and abs(est.logprob - mine) < 4 * est.stderr
    assert abs(est.logprob - other) > 4 * est.stderr  # the conventions really differ here


def test_cut_and_pad_agree_where_the_answer_fills_its_last_block(tiny):
    a, b = (estimate_loglikelihood(tiny, [1, 2, 3, 4, 5], [6, 7, 8], 4, mc_num=64, mc_batch_size=64, last_block=lb,
                                   generator=torch.Generator().manual_seed(1)) for lb in ("pad", "cut"))
    assert a == b


@pytest.mark.parametrize("value", ["padded", "", None, 1])
def test_a_bad_convention_is_one_line_naming_the_option(tiny, value):
    with pytest.raises(ConfigError, match=r"loglik_last_block: must be one of pad, cut"):
        estimate_loglikelihood(tiny, [1], [2, 3], 4, mc_num=2, last_block=value)


def readme_yaml() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("**Multiple choice through lm-eval.**", 1)[1]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_readme_multiple_choice_yaml_runs_as_written(tmp_path, monkeypatch, caplog):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import dlm_toolkit.integrations.lm_eval  # noqa: F401  (registers "dlm")

    rng, rows = random.Random(0), []
    for inst in get_task("add").instances(6, 0, "eval"):
        wrong = sorted({str(int(inst.reference) + d) for d in (1, 10, -1)})
        label = rng.randrange(4)
        rows.append({"question": inst.prompt, "choices": wrong[:label] + [inst.reference] + wrong[label:], "label": label})
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "add_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "add_mc.yaml").write_text(readme_yaml())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with caplog.at_level(logging.WARNING, logger="dlm_toolkit.integrations.lm_eval"):
        out = lm_eval.simple_evaluate(model="dlm", model_args=f"pretrained={TESTBED},mc_num=8,mc_batch_size=8,threads=1",
                                      tasks=["add_mc"], task_manager=TaskManager(include_path=str(folder),
                                                                                 include_defaults=False))
    assert out["results"]["add_mc"]["acc,none"] >= 0.8
    assert "target_delimiter" not in caplog.text  # the README's YAML sets it
