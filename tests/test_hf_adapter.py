"""A Hugging Face masked LM (randomly initialised BERT, saved locally) decodes through the adapter."""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from dlm_toolkit import decode
from dlm_toolkit.models.hf import HFMaskedLM


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("bert")
    BertForMaskedLM(cfg).save_pretrained(path)
    return path


def test_lowconf_decode_with_full_attention(bert_dir):
    model = HFMaskedLM.from_pretrained(bert_dir, mask_token_id=49, eos_token_id=48)
    assert model.attention == "full" and not model.supports_kv_cache
    res = decode(model, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], "llada-lowconf", 32)
    assert [r.nfe for r in res.rows] == [32, 32]  # one token per step, 32 steps per 32-block
    for r in res.rows:
        assert 49 not in r.tokens


def test_batch_padding_does_not_change_rows(bert_dir):
    model = HFMaskedLM.from_pretrained(bert_dir, mask_token_id=49, eos_token_id=48)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]]
    pol = {"m2t": {"name": "topk", "params": {"steps_per_block": 4}},
           "blocks": {"name": "semi_ar", "params": {"block_length": 8, "align": "prompt", "max_post_steps": 0}}}
    batch = decode(model, prompts, pol, 16)
    for i, p in enumerate(prompts):
        assert decode(model, [p], pol, 16).tokens[0] == batch.tokens[i]


def test_no_remote_code_by_default(bert_dir, monkeypatch):
    import transformers

    seen = {}
    real = transformers.AutoModelForMaskedLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForMaskedLM, "from_pretrained", spy)
    HFMaskedLM.from_pretrained(bert_dir, mask_token_id=49, eos_token_id=48)
    assert seen["trust_remote_code"] is False and seen["local_files_only"] is True
