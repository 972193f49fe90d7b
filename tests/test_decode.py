"""The decode engine against an independent transcription of the reference loop
(``conformance/reference.py``), plus invariants, batch invariance and bad input, on scripted models."""

import math
import random

import pytest
import torch

from conformance.reference import reference_decode
from dlm_toolkit import M2T, ConfigError, DecodingPolicy, StrategyError, UnmaskRule, decode
from dlm_toolkit.testing import ScriptedLM, mixing_logits

V, MASK, EOS = 40, 39, 38


def mask_never_argmax(fn, gap=0.5):
    """``fn`` with the mask token's logit ``gap`` below the best other one: never drawn greedily,
    but with real probability mass, so confidences differ from a softmax that leaves it out."""

    def wrapped(ids, pos, attn):
        logits = fn(ids, pos, attn).clone()
        logits[..., MASK] = logits[..., :MASK].max(-1).values - gap
        return logits

    return wrapped


def policy(B, tau_mask, tau_edit, max_post, eos_stop):
    return DecodingPolicy(
        {
            "m2t": {"name": "threshold", "params": {"threshold": tau_mask}},
            "t2t": {"name": "threshold", "params": {"threshold": tau_edit}} if tau_edit < 1 else {"name": "none"},
            "blocks": {"name": "semi_ar", "params": {"block_length": B, "max_post_steps": max_post, "eos_early_stop": eos_stop}},
        }
    )


@pytest.mark.parametrize("seed", range(12))
def test_engine_matches_reference_transcription(seed):
    rng = random.Random(seed)
    fn = mask_never_argmax(mixing_logits(V, seed=seed, scale=rng.choice([1.0, 2.5, 4.0]), mix=rng.choice([1.0, 3.0])),
                           gap=rng.choice([0.1, 0.5, 2.0]))
    model = ScriptedLM(fn, V, MASK, EOS)
    args = dict(
        B=rng.choice([1, 3, 4, 8]),
        tau_mask=rng.choice([0.05, 0.3, 0.5, 0.7, 0.95, 1.0]),
        tau_edit=rng.choice([0.0, 0.2, 0.5, 2.0]),
        max_post=rng.choice([0, 1, 3, 16]),
        eos_stop=rng.random() < 0.5,
    )
    prompt = [rng.randrange(0, EOS) for _ in range(rng.randint(1, 11))]
    gen_length = rng.randint(1, 30)
    want = reference_decode(fn, prompt, gen_length, block_length=args["B"], threshold=args["tau_mask"],
                            editing_threshold=args["tau_edit"], max_post_steps=args["max_post"],
                            eos_early_stop=args["eos_stop"], mask_id=MASK, eos_id=EOS)
    got = decode(model, [prompt], policy(**args), gen_length)
    assert got.tokens[0] == want["output_ids"] and got.rows[0].nfe == want["nfe"], args


def test_batch_rows_equal_single_decodes():
    model = ScriptedLM(mixing_logits(V, seed=3), V, MASK, EOS)
    prompts = [[1, 2, 3], [4] * 9, [5, 6], [7] * 17, [8]]
    pol = policy(4, 0.5, 0.3, 4, True)
    batch = decode(model, prompts, pol, 21)
    for i, p in enumerate(prompts):
        alone = decode(model, [p], pol, 21)
        assert batch.tokens[i] == alone.tokens[0]
        assert batch.rows[i].nfe == alone.rows[0].nfe
        assert batch.rows[i].edits == alone.rows[0].edits


@pytest.mark.parametrize("preset", ["llada2.1-q", "llada2.1-s", "llada2.0", "llada-lowconf"])
@pytest.mark.parametrize("seed", [0, 1])
def test_invariants_over_random_canvases(preset, seed):
    rng = random.Random(seed)
    model = ScriptedLM(mixing_logits(V, seed=seed + 10), V, MASK, EOS)
    B = rng.choice([4, 8])
    pol = DecodingPolicy(preset, **{"blocks.params.block_length": B, "m2t.params.steps_per_block": B} if preset == "llada-lowconf" else {"blocks.params.block_length": B})
    prompts = [[rng.randrange(0, EOS) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    gen = rng.randint(5, 25)
    res = decode(model, prompts, pol, gen, record=True)
    max_post = pol.blocks.config.max_post_steps
    for i, p in enumerate(prompts):
        canvas = res.canvas[i]
        assert canvas[: len(p)].tolist() == p  # the prompt never changes
        assert MASK not in res.tokens[i]
        n_blocks = math.ceil((len(p) + gen) / B) if preset != "llada-lowconf" else math.ceil(gen / B)
        assert res.rows[i].nfe <= n_blocks * (B + max_post)
        assert res.rows[i].commits >= len(res.tokens[i])
    for s in res.trajectory.steps:
        assert s.masks_before == 0 or len(s.commit) >= 1  # progress
        assert not set(s.commit) & set(s.edit)
        assert all(q >= len(prompts[s.row]) for q in s.commit + s.edit)


def test_lowconf_preset_one_token_per_step_with_full_attention():
    model = ScriptedLM(mixing_logits(V, seed=5), V, MASK, EOS, attention="full")
    res = decode(model, [[1, 2, 3, 4, 5]], "llada-lowconf", 64)
    assert res.rows[0].nfe == 64 and res.rows[0].commits == 64


def test_post_steps_semantics_on_a_fixed_table():
    # logits that never change: every mask commits in one forward, then the block verifies once
    table = torch.full((64, V), -5.0)
    table[:, 7] = 5.0
    model = ScriptedLM(lambda ids, pos, attn: table[pos], V, MASK, EOS)
    for max_post, per_block in [(0, 1), (1, 2), (16, 2)]:
        res = decode(model, [[1] * 8], policy(8, 0.5, 0.0, max_post, False), 32)
        assert res.rows[0].nfe == 4 * per_block and res.rows[0].post_forwards == 4 * (per_block - 1)


def test_sampling_is_seeded():
    model = ScriptedLM(mixing_logits(V, seed=1, scale=1.0), V, MASK, EOS)
    pol = DecodingPolicy("llada2.1-q", **{"sampling.temperature": 1.0, "blocks.params.block_length": 4})
    a = decode(model, [[1, 2]], pol, 24, seed=5).tokens
    assert a == decode(model, [[1, 2]], pol, 24, seed=5).tokens
    assert any(decode(model, [[1, 2]], pol, 24, seed=s).tokens != a for s in range(6, 10))


@pytest.mark.parametrize(
    "prompts, gen, fragment",
    [
        ([[1, 2]], 0, "gen_length"),
        ([[1, 2]], -3, "gen_length"),
        ([[]], 8, "empty prompt"),
        ([], 8, "at least one prompt"),
        ([[1, V]], 8, "outside the vocabulary"),
        ([[1, -1]], 8, "outside the vocabulary"),
        ([[1, MASK]], 8, "mask token"),
    ],
)
def test_bad_input(prompts, gen, fragment):
    model = ScriptedLM(mixing_logits(V), V, MASK, EOS)
    with pytest.raises(ConfigError, match=fragment):
        decode(model, prompts, "llada2.1-q", gen)


class _Bad(UnmaskRule):
    def __call__(self, ctx):
        return self.out(ctx)


def _policy_with(fn):
    cls = type("Rule", (_Bad,), {"out": staticmethod(fn)})
    M2T.register(f"_test_{fn.__name__}")(cls)
    return DecodingPolicy("llada2.1-q", **{"m2t.name": f"_test_{fn.__name__}", "blocks.params.block_length": 4})


def wrong_shape(ctx):
    return torch.zeros(ctx.batch_size, ctx.width + 1, dtype=torch.bool)


def wrong_dtype(ctx):
    return ctx.fillable.float()


def commits_prompt(ctx):
    return ctx.fillable | ctx.is_prompt


def no_progress(ctx):
    return torch.zeros_like(ctx.fillable)


@pytest.mark.parametrize(
    "fn, fragment",
    [(wrong_shape, "shape"), (wrong_dtype, "bool tensor"), (commits_prompt, "not fillable"), (no_progress, "committed nothing")],
)
def test_rule_contract_violations_name_the_rule(fn, fragment):
    model = ScriptedLM(mixing_logits(V), V, MASK, EOS)
    with pytest.raises(StrategyError, match=fragment) as err:
        decode(model, [[1, 2, 3, 4, 5]], _policy_with(fn), 8)
    assert f"_test_{fn.__name__}" in str(err.value)
