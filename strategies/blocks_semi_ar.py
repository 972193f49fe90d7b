"""Blocks ``semi_ar``: semi-autoregressive blocks with post steps and EOS early stop.

Paper: LLaDA2.1 (arXiv 2602.08676) / LLaDA2.0 block diffusion; reference: the LLaDA2.1
Hugging Face ``generate()``. Blocks are aligned at absolute position 0 (``align: absolute``,
LLaDA2: the first decoded block may hold the prompt's tail) or start right after the prompt
(``align: prompt``, LLaDA). A block ends when a forward that began with no mask made no edit,
or, without a forward, once ``max_post_steps`` mask-free forwards were spent. After a block,
``eos_early_stop`` ends the row if its generated part has no mask and contains EOS.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dlm_toolkit import BLOCKS, BlockSchedule, DecodeState, StepContext, StrategyConfig
from dlm_toolkit.step.facts import UNKNOWN, StepFacts


@BLOCKS.register("semi_ar")
class SemiAutoregressive(BlockSchedule):
    class Config(StrategyConfig):
        block_length: int = Field(32, ge=1, le=4096)
        max_post_steps: int = Field(16, ge=0, le=1024, description="mask-free forwards allowed per block")
        eos_early_stop: bool = True
        align: Literal["absolute", "prompt"] = "absolute"

    def layout(self, prompt_len: torch.Tensor, gen_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bl = self.block_length
        if self.config.align == "prompt":
            return prompt_len.clone(), torch.zeros_like(prompt_len), torch.full_like(prompt_len, -(-gen_length // bl))
        return torch.zeros_like(prompt_len), prompt_len // bl, -(-(prompt_len + gen_length) // bl)

    def prepare(self, state: DecodeState, facts: StepFacts = UNKNOWN) -> torch.Tensor:
        live = ~state.done
        no_mask = state.block_masked < live  # block_masked == 0 on a live row (a count: never negative)
        state.post = state.post + no_mask  # a bool adds as 0/1
        # precondition of skipping advance_blocks: a prepare adds at most 1 to a row's post, so no row is
        # past post_max + since + 1 (StepFacts); within max_post_steps no row is over and it would change nothing
        if facts.post_max is not None and facts.post_max + facts.since + 1 <= self.config.max_post_steps:
            return live
        over = no_mask & (state.post > self.config.max_post_steps)  # checked before the forward
        state.advance_blocks(over, self.config.eos_early_stop)
        # One pass suffices: a block entered now holds a generated position, and generated
        # positions after the active block are all still masked, so it needs a forward.
        return ~state.done

    def window(self, state: DecodeState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return state.block_bounds(rows)

    def finish_step(self, state: DecodeState, ctx: StepContext, facts: StepFacts = UNKNOWN) -> None:
        if facts.post_any is False:  # precondition (this step's read): no live row began in a post step, so
            return  # ctx.post is all False and no block ends
        converged = ctx.post > ctx.edit.any(1)  # on bools a > b is a & ~b
        # a context of every row in order (the decode loop's) needs no scatter onto the batch
        ending = converged if ctx.rows is state.all_rows else torch.zeros_like(state.done).index_put_(
            (ctx.rows,), converged)
        state.advance_blocks(ending, self.config.eos_early_stop)
