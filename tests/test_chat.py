"""Chat templates: the same ids as transformers' own ``apply_chat_template``, read from a checkpoint
folder, and nothing changed where a checkpoint has no template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dlm_toolkit.models.chat import chat_ids, chat_text, encode_prompt, messages_for, use_chat
from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.tasks import get_task
from dlm_toolkit.models.tokenizer import find_tokenizer, special_ids

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llada2.1-chat-tokenizer"
TESTBED = Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-editable"

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17+25?"}],
    [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "Add 3 and 4."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Sort 3,1,2\nplease."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "system", "content": "Now be verbose."}, {"role": "user", "content": "c"}],
]


def reference_ids(folder: Path, messages: list[dict]) -> list[int]:
    """transformers' own loader and apply_chat_template(..., add_generation_prompt=True)."""
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def test_fixture_renders_the_llada2_format():
    tok = find_tokenizer(FIXTURE)
    assert chat_text(tok, messages_for("Q")) == \
        "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>Q<|role_end|><role>ASSISTANT</role>"
    mask, eos = special_ids(tok)
    ids = chat_ids(tok, messages_for("Q"))
    assert tok.convert_tokens_to_ids("<role>") == ids[0] and mask not in ids and eos not in ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_ids_identical_to_transformers(messages):
    tok = find_tokenizer(FIXTURE)
    assert chat_ids(tok, messages) == reference_ids(FIXTURE, messages)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(FIXTURE, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = find_tokenizer(folder)
    assert chat_text(tok, CONVERSATIONS[1]) == "[system]You are a careful math tutor.[user]Add 3 and 4.[assistant]"
    assert chat_ids(tok, CONVERSATIONS[1]) == reference_ids(folder, CONVERSATIONS[1])


def test_template_writes_its_own_bos_once(tmp_path):
    """A tokenizer that adds a BOS on encode: the template writes it, the encode must not add a second."""
    from tokenizers import processors

    tok = find_tokenizer(FIXTURE)
    tok.add_special_tokens({"bos_token": "<|startoftext|>"})
    bos = tok.convert_tokens_to_ids("<|startoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", special_tokens=[("<|startoftext|>", bos)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    folder = tmp_path / "bos"
    tok.save_pretrained(str(folder))
    mine = chat_ids(find_tokenizer(folder), CONVERSATIONS[0])
    assert mine == reference_ids(folder, CONVERSATIONS[0]) and mine.count(bos) == 1


def test_chat_modes():
    with_template, without = find_tokenizer(FIXTURE), find_tokenizer(TESTBED)
    assert use_chat(with_template, "auto") and not use_chat(without, "auto")
    assert not use_chat(with_template, "false") and not use_chat(with_template, False)
    assert use_chat(with_template, True)
    with pytest.raises(ConfigError, match="no chat template"):
        use_chat(without, "true")
    with pytest.raises(ConfigError, match="auto, true, false"):
        use_chat(without, "sometimes")
    assert encode_prompt(without, "12+3=", False) == without.encode("12+3=", add_special_tokens=False)


def test_testbed_prompts_and_numbers_unchanged_without_template():
    """chat: auto on a checkpoint without a template decodes the raw prompts: the records equal a
    plain decode of the raw-encoded prompts (the path before chat templates existed)."""
    model, tok = load_checkpoint(TESTBED)
    task = get_task("add")
    res = evaluate(model, tok, task, "llada2.1-q", 12, 5, batch_size=5, progress=False)
    assert not res.chat
    insts = task.instances(12, 5, "eval")
    raw = [tok.encode(i.prompt, add_special_tokens=False) for i in insts]
    out = decode(model, raw, "llada2.1-q", task.answer_length + 1, seed=[row_seed(5, i) for i in range(12)])
    eos = model.eos_token_id
    for rec, row in zip(res.records, out.rows):
        text = tok.decode(row.tokens[: row.tokens.index(eos)] if eos in row.tokens else row.tokens)
        assert (rec["completion"], rec["nfe"], rec["tokens"]) == (text, row.nfe, len(row.tokens))
    off = evaluate(model, tok, get_task("add", chat="false"), "llada2.1-q", 12, 5, batch_size=5, progress=False)
    assert res.records == off.records


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """The testbed with a chat template in its tokenizer_config.json (plain characters, as the
    char tokenizer has no control tokens)."""
    folder = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(TESTBED, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m.role == 'system' %}({{ m.content }}){% else %}"
                            "{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_decode_chat_uses_the_template(chat_checkpoint, capsys):
    base = ["decode", "--checkpoint", str(chat_checkpoint), "--prompt", "12+34=", "--gen-length", "8", "--json",
            "--threads", "1"]
    assert main([*base, "--chat", "--system", "x"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = load_checkpoint(chat_checkpoint)
    ids = chat_ids(tok, messages_for("12+34=", "x"))
    assert ids == tok.encode("(x)12+34=", add_special_tokens=False)
    assert out["tokens"] == decode(model, [ids], "llada2.1-q", 8).rows[0].tokens
    assert main(base) == 0  # without --chat: the raw prompt
    raw = json.loads(capsys.readouterr().out)
    assert raw["tokens"] == decode(model, [tok.encode("12+34=", add_special_tokens=False)], "llada2.1-q", 8).rows[0].tokens


def test_eval_chat_true_on_a_checkpoint_with_template(chat_checkpoint, capsys):
    args = ["eval", "--task", "add", "--n", "4", "--json", "--no-progress", "--threads", "1"]
    assert main([*args, "--checkpoint", str(chat_checkpoint), "--chat", "true", "--system", "s"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chat"] is True
    model, tok = load_checkpoint(chat_checkpoint)
    lib = evaluate(model, tok, get_task("add", chat="true", system="s"), "llada2.1-q", 4, 0, progress=False)
    assert [r["nfe"] for r in lib.records] == [i["nfe"] for i in out["instances"]]
    inst = get_task("add").instances(4, 0, "eval")[0]
    assert lib.records[0]["prompt"] == inst.prompt
    ids = tok.encode(f"(s){inst.prompt}", add_special_tokens=False)  # what the template renders
    row = decode(model, [ids], "llada2.1-q", get_task("add").answer_length + 1, seed=[row_seed(0, 0)]).rows[0]
    assert (lib.records[0]["nfe"], lib.records[0]["tokens"]) == (row.nfe, len(row.tokens))


def test_template_files_must_lie_inside_the_checkpoint(tmp_path):
    from dlm_toolkit.models.validate import CheckpointError

    folder = tmp_path / "tok"
    shutil.copytree(FIXTURE, folder)
    (tmp_path / "outside.jinja").write_text("{{ messages[0].content }}")
    (folder / "chat_template.jinja").symlink_to(tmp_path / "outside.jinja")
    with pytest.raises(CheckpointError, match="chat_template.jinja.*outside the checkpoint folder"):
        find_tokenizer(folder)


@pytest.mark.parametrize("args, needle", [
    (["eval", "--task", "add", "--n", "2", "--chat", "true"], "no chat template"),
    (["decode", "--prompt", "1+1=", "--gen-length", "4", "--chat"], "no chat template"),
    (["decode", "--prompt-ids", "5,6", "--gen-length", "4", "--chat"], "--prompt-ids"),
    (["decode", "--prompt", "1+1=", "--gen-length", "4", "--system", "s"], "needs --chat"),
])
def test_chat_bad_input_exits_2(args, needle, capsys):
    assert main([*args, "--checkpoint", str(TESTBED)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
