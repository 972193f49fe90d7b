"""Contract suite of block schedules: layout, end-to-end decodes under both attention kinds, and
the KV cache against recomputing on a real LLaDA2 model."""

from __future__ import annotations

import random

import torch

from dlm_toolkit.config import RoleSpec
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.strategy.base import BlockSchedule, Strategy
from dlm_toolkit.testing.contracts_base import _policy, _StrategyContract


class BlockScheduleContract(_StrategyContract):
    """Contract suite for block schedules (:class:`~dlm_toolkit.strategy.base.BlockSchedule`).

    Checks, besides the config ones: ``layout`` covers the generated span (the first block holds
    the first generated position, the last one reaches ``prompt + gen_length``); end-to-end
    decodes (block-causal and full attention, with T2T edits and low-confidence remasking in the
    policy) finish with no mask, keep the prompt, stay within ``max_forwards_per_block`` (the
    engine raises otherwise) and give each batch row what decoding it alone gives; on a real
    LLaDA2 model the KV-cache path gives what recomputing the prefix gives.
    The subclass's configs should use small blocks (the default block length is a good start).
    """

    role = "blocks"

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=RoleSpec(name="threshold", params={"threshold": 0.5}),
                       t2t=RoleSpec(name="threshold", params={"threshold": 0.6}),
                       remask=RoleSpec(name="low_confidence", params={"threshold": 0.3}), blocks=rule.spec())

    def test_layout_covers_generation(self):
        for rule in self.rules():
            assert isinstance(rule, BlockSchedule)
            bl = rule.block_length
            for seed in range(10):
                g = random.Random(seed)
                prompt_len = torch.tensor([g.randint(1, 3 * bl) for _ in range(g.randint(1, 4))])
                gen = g.randint(1, 3 * bl)
                origin, first, num = rule.layout(prompt_len, gen)
                assert origin.shape == first.shape == num.shape == prompt_len.shape
                start = origin + first * bl
                assert (start <= prompt_len).all() and (start + bl > prompt_len).all(), (
                    f"{rule!r}: the first decoded block must hold the first generated position"
                )
                assert (origin + num * bl >= prompt_len + gen).all(), f"{rule!r}: blocks end before prompt + gen_length"
                assert (first < num).all()

    def test_max_forwards_per_block_is_positive(self):
        for rule in self.rules():
            assert int(rule.max_forwards_per_block()) >= 1

    def test_kv_cache_matches_recompute(self):
        """On a real LLaDA2 model (block-causal, with a KV cache) the decode with the cache equals
        the decode that recomputes the prefix every forward: a cache boundary that lets a position
        enter the cache before it is final, or attention groups that let a cached position see
        a later one, change tokens or forward counts here."""
        from dlm_toolkit.testing.models import tiny_llada2

        model = tiny_llada2(5)
        for n, rule in enumerate(self.rules()):
            rng = random.Random(n)
            prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 9))] for _ in range(2)]
            policy, gen = self.policy_for(rule), 3 * rule.block_length  # several blocks: the cache fills
            on = decode(model, prompts, policy, gen, kv_cache=True, seed=n)
            off = decode(model, prompts, policy, gen, kv_cache=False, seed=n)
            assert on.tokens == off.tokens, f"{rule!r}: tokens with the KV cache differ from recomputing"
            assert [r.nfe for r in on.rows] == [r.nfe for r in off.rows], f"{rule!r}: NFE with the KV cache differs"

    def test_decode_full_attention(self):
        for n, rule in enumerate(self.rules()):
            prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
            res = self._decode(rule, n, prompts, 9, attention="full")
            for i, p in enumerate(prompts):
                assert 23 not in res.tokens[i] and res.canvas[i, : len(p)].tolist() == p
                alone = self._decode(rule, n, [p], 9, attention="full", streams=[row_seed(n, i)])
                assert alone.tokens[0] == res.tokens[i], f"{rule!r}: batch row {i} differs from decoding it alone"
