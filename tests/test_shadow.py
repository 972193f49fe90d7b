"""Shadow blocks (WINO's verification inside the step's forward, :mod:`dlm_toolkit.hooks.shadow`) and the
``wino_shadow`` remask rule: against a plain-loop WINO whose attention matrix is written out entry by
entry, plus the engine's guarantees (the window, the cache and the NFE are those of the forward without
the shadow; cache on = off; batch = alone; captured = eager; refusals name the rule)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from dlm_toolkit import REMASK, T2T, ConfigError, DecodingPolicy, StrategyError, decode
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.testing import ScriptedLM, make_context, mixing_logits, tiny_llada2
from test_catalogue_v2 import EOS, MASK, VOCAB, random_problem
decode_module = importlib.import_module("dlm_toolkit.decoding.loop")


def reference_wino_shadow(fn, prompt: list[int], gen: int, block: int, tau1: float, tau2: float
                          ) -> tuple[list[int], int, int]:
    """WINO as the paper runs it (wide-in, then narrow-out on the shadow block's probabilities), one
    forward per step over ``[canvas up to the block's end | block_length masks]``; the attention matrix is
    built entry by entry from the paper's layout. Returns (canvas, NFE, remasks)."""
    n_blocks = -(-(len(prompt) + gen) // block)
    canvas = list(prompt) + [MASK] * (n_blocks * block - len(prompt))
    nfe = remasks = 0
    for b in range(len(prompt) // block, n_blocks):
        lo, hi = b * block, (b + 1) * block
        first = max(lo, len(prompt))
        while any(canvas[i] == MASK for i in range(first, hi)):
            t = hi + block
            ids = canvas[:hi] + [MASK] * block
            pos = list(range(hi)) + list(range(lo, hi))
            attn = torch.zeros(t, t, dtype=torch.bool)
            for q in range(t):
                for k in range(t):
                    if q < hi:  # the canvas: block-causal, never the shadow
                        attn[q, k] = k < hi and k // block <= q // block
                    else:  # shadow of position pos[q]: the block's context without pos[q], and the whole shadow
                        attn[q, k] = k >= hi or (k // block <= b and k != pos[q])
            probs = torch.softmax(fn(torch.tensor([ids]), torch.tensor([pos]), attn[None])[0].double(), -1)
            masks = [i for i in range(first, hi) if canvas[i] == MASK]
            written = [i for i in range(first, hi) if canvas[i] != MASK]
            sampled, conf = {}, {}
            for i in masks:
                row = probs[i].clone()
                row[MASK] = -1.0
                sampled[i] = int(row.argmax())
                conf[i] = float(probs[i, sampled[i]])
            chosen = [i for i in masks if conf[i] > tau1] or [max(masks, key=lambda i: (conf[i], -i))]
            shadow_p = {i: float(probs[hi + i - lo, canvas[i]]) for i in written}
            weak = sorted((shadow_p[i], i) for i in written if shadow_p[i] < tau2)
            gone = [i for _, i in weak[: max(len(chosen) - 1, 0)]]
            for i in chosen:
                canvas[i] = sampled[i]
            for i in gone:
                canvas[i] = MASK
            remasks += len(gone)
            nfe += 1
    return canvas, nfe, remasks


def wino(block: int = 8, tau1: float = 0.6, tau2: float = 0.9, remask: str = "wino_shadow", **blocks) -> dict:
    return {"m2t": {"name": "wino", "params": {"threshold": tau1}}, "t2t": {"name": "none"},
            "remask": {"name": remask, "params": {"threshold": tau2} if remask != "none" else {}},
            "blocks": {"name": "semi_ar", "params": {"block_length": block, "max_post_steps": 0, "eos_early_stop": False,
                                                     **blocks}}}


@pytest.mark.parametrize("tau1, tau2", [(0.6, 0.9), (0.3, 0.95)])
def test_decode_matches_the_plain_loop_reference(tau1, tau2):
    block = 8
    remasked = 0
    for seed in range(5):
        fn, prompt, gen = random_problem(seed)
        canvas, nfe, n_remasks = reference_wino_shadow(fn, prompt, gen, block, tau1, tau2)
        res = decode(ScriptedLM(fn, VOCAB, MASK, EOS), [prompt], wino(block, tau1, tau2), gen, seed=seed)
        assert res.canvas[0].tolist() == canvas, f"seed {seed}: tokens differ from the reference loop"
        assert (res.rows[0].nfe, res.rows[0].remasks) == (nfe, n_remasks), f"seed {seed}"
        remasked += n_remasks
    assert remasked > 0, "nothing re-masked: the shadow's probabilities decided nothing"


def test_the_shadow_changes_no_window_logit_no_cache_write_and_no_nfe():
    """A shadow rule that never re-masks decodes exactly as no remask rule, with the KV cache and
    without; only forward_tokens grows, by one block per forward."""
    model = tiny_llada2(seed=2)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    for kv in (True, False):
        shadow = decode(model, prompts, wino(4, 0.3, 1e-9), 12, kv_cache=kv, seed=1)
        plain = decode(model, prompts, wino(4, 0.3, remask="none"), 12, kv_cache=kv, seed=1)
        assert shadow.tokens == plain.tokens
        assert [r.nfe for r in shadow.rows] == [r.nfe for r in plain.rows]
        assert [s.forward_tokens - p.forward_tokens for s, p in zip(shadow.rows, plain.rows)] == [4 * r.nfe for r in plain.rows]


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def testbed():
    """The shipped testbed model and four `pick` prompts: WINO re-masks there (a random tiny model's
    near-uniform drafts come one per step, which leaves narrow-out no budget)."""
    from dlm_toolkit.evaluation.evaluate import load_checkpoint, task_prompt
    from dlm_toolkit.tasks import get_task

    model, tok = load_checkpoint(REPO / "checkpoints" / "testbed-v2-editable")
    task = get_task("pick")
    prompts = [task_prompt(tok, task, inst, False) for inst in task.instances(4, 0, "eval")]
    return model, prompts, task.answer_length + 1


def wino_on_testbed(blocks: str = "semi_ar") -> dict:
    return {"m2t": {"name": "wino"}, "remask": {"name": "wino_shadow"}, "blocks": {"name": blocks, "params": {"block_length": 32}}}


def test_cache_on_equals_off_batch_equals_alone(testbed):
    model, prompts, gen = testbed
    on = decode(model, prompts, wino_on_testbed(), gen, kv_cache=True, seed=2)
    off = decode(model, prompts, wino_on_testbed(), gen, kv_cache=False, seed=2)
    assert sum(r.remasks for r in on.rows) > 0, "nothing re-masked: the test checks nothing"
    assert on.tokens == off.tokens and [r.remasks for r in on.rows] == [r.remasks for r in off.rows]
    batched = decode(model, prompts, wino_on_testbed(), gen, kv_cache=True, seed=2, check_every=3)  # full-width forwards
    assert batched.tokens == on.tokens and [r.nfe for r in batched.rows] == [r.nfe for r in on.rows]
    for i in (0, 3):
        alone = decode(model, [prompts[i]], wino_on_testbed(), gen, kv_cache=True, seed=[row_seed(2, i)])
        assert alone.tokens[0] == on.tokens[i] and alone.rows[0].remasks == on.rows[i].remasks


@pytest.mark.parametrize("blocks", ["semi_ar", "multi_block_edit"])
def test_compiled_decode_equals_eager(monkeypatch, testbed, blocks):
    monkeypatch.setattr(decode_module, "COMPILE_BACKEND", "aot_eager")  # the same graph, no codegen
    model, prompts, gen = testbed
    eager = decode(model, prompts[:2], wino_on_testbed(blocks), gen)
    compiled = decode(model, prompts[:2], wino_on_testbed(blocks), gen, capture="compile")
    assert eager.tokens == compiled.tokens
    assert [(r.nfe, r.remasks) for r in eager.rows] == [(r.nfe, r.remasks) for r in compiled.rows]
    assert sum(r.remasks for r in eager.rows) > 0


def test_a_dynamic_block_schedule_is_refused_naming_the_rule():
    with pytest.raises(ConfigError, match=r"remask rule 'wino_shadow'.*'dsb'"):
        DecodingPolicy("llada2.1-q", **{"remask.name": "wino_shadow", "blocks.name": "dsb"})


def test_a_full_attention_model_is_refused_naming_the_rule():
    model = ScriptedLM(mixing_logits(VOCAB), VOCAB, MASK, EOS, attention="full")
    with pytest.raises(ConfigError, match=r"remask rule 'wino_shadow'.*full"):
        decode(model, [[1, 2]], wino(4), 4)


def test_a_context_without_the_shadow_is_refused_naming_the_rule():
    tokens = torch.tensor([[3, MASK, 4, MASK]])
    ctx = make_context(tokens, torch.randn(1, 4, VOCAB), mask_token_id=MASK)
    with pytest.raises(StrategyError, match="remask rule 'wino_shadow'.*shadow_confidence"):
        REMASK.get("wino_shadow")()(ctx)


def test_the_rule_reads_the_shadow_not_the_visible_token():
    tokens = torch.tensor([[3, 5, 4, MASK, MASK, MASK]])
    logits = torch.full((1, 6, VOCAB), -5.0)
    logits[0, torch.arange(6), torch.tensor([3, 5, 4, 7, 8, 9])] = 5.0  # every visible token well supported
    shadow = torch.tensor([[0.0, 0.95, 0.2, 0.0, 0.0, 0.0]])  # with itself hidden, position 2 loses its support
    ctx = make_context(tokens, logits, mask_token_id=MASK, prompt_len=1, shadow_confidence=shadow)
    ctx.commit = ctx.fillable.clone()  # three drafts now: budget two re-masks
    ctx.edit = torch.zeros_like(ctx.commit)
    assert REMASK.get("wino_shadow")()(ctx).nonzero()[:, 1].tolist() == [2]
    assert not REMASK.get("wino")()(ctx).any()  # the visible-token test keeps it


def test_one_host_read_per_step_with_the_shadow_block():
    """The shadow block and its confidences add no host read: still one per forward."""
    from dlm_toolkit.testing import HostSyncs

    policy = wino(4, 0.3, 0.95)
    policy["blocks"]["params"]["eos_early_stop"] = False
    model, counts = tiny_llada2(seed=1), []
    for gen in (8, 16):
        with HostSyncs() as syncs:
            res = decode(model, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], policy, gen)
        counts.append((syncs.count, res.forward_calls))
    (c1, f1), (c2, f2) = counts
    assert f2 > f1 and (c2 - c1) / (f2 - f1) == 1


SEEN_SHADOW: list[tuple[torch.Tensor, ...]] = []  # (is_prompt, in_block & valid, masked, shadow_confidence) per step


class _RecordsTheShadow(T2T.get("none")):
    """Edits nothing; records what the engine filled in ``ctx.shadow_confidence`` (a test probe)."""

    def __call__(self, ctx):
        SEEN_SHADOW.append((ctx.is_prompt.clone(), (ctx.in_block & ctx.valid).clone(), ctx.masked.clone(),
                            ctx.shadow_confidence.clone()))
        return super().__call__(ctx)


def test_shadow_confidence_is_zero_at_prompt_slots_of_the_active_block():
    """Prompts of 6 and 5 tokens with blocks of 4: the first active block holds the prompt's tail. The
    shadow's confidence is 0 at its prompt slots, at masks and outside the block, and positive at each
    written generated slot of the block (the near miss, same steps). Fails when ``shadow_confidence``
    drops ``~ctx.is_prompt``."""
    from dlm_toolkit.hooks.shadow import Shadow

    if "_records_shadow" not in T2T.names():
        T2T.register("_records_shadow")(type("_RecordsShadow", (_RecordsTheShadow, Shadow), {}))
    SEEN_SHADOW.clear()
    model = ScriptedLM(mixing_logits(VOCAB, seed=2, scale=2.0, mix=2.0), VOCAB, MASK, EOS)
    pol = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "t2t.name": "_records_shadow",
                                          "m2t.params.threshold": 0.3})
    decode(model, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5]], pol, 8)
    prompt_slots = written_slots = 0
    for is_prompt, in_block, masked, conf in SEEN_SHADOW:
        assert (conf[is_prompt] == 0).all() and (conf[masked] == 0).all() and (conf[~in_block] == 0).all()
        written = in_block & ~is_prompt & ~masked
        assert (conf[written] > 0).all()
        prompt_slots += int((is_prompt & in_block).sum())
        written_slots += int(written.sum())
    assert prompt_slots > 0 and written_slots > 0  # both kinds of slot were seen in the active block
