"""The decode loop. Read :func:`decode` first: everything else is plumbing for it.

One iteration = one model forward (one NFE for every live row in it): ``blocks.prepare`` says
which rows are live (finishing blocks that need no forward), ``blocks.window`` which positions'
logits are used, the model runs with the attention pattern and KV-cache boundary the schedule
declares, the policy's rules choose what to commit / edit / remask, the canvas is written, and
``blocks.finish_step`` ends converged blocks. What a rule adds to the step (a verification forward,
the shadow block, insert/delete edits, a plug-in's hook) runs at fixed stages: segments added to the
forward, after the forward, after the rules and after the write (:mod:`dlm_toolkit.hooks`); the loop
does not know which hooks it runs. Every canvas write is :mod:`dlm_toolkit.step.canvas`'s. Strategies
keep no state; the :class:`DecodeState` holds it all.

The forwards themselves (shapes, attention patterns, the KV cache, the one host read per step) are
:class:`~dlm_toolkit.decoding.engine.StepEngine`'s, in :mod:`dlm_toolkit.decoding.engine`.
"""

from __future__ import annotations

import inspect
from time import perf_counter
from typing import Any, Callable, Mapping, Sequence

import torch

from dlm_toolkit.step.canvas import write_step
from dlm_toolkit.config import ConfigError
from dlm_toolkit.strategy.policy_config import PolicyConfig
from dlm_toolkit.models.base import DiffusionLM, model_device
from dlm_toolkit.decoding.engine import CaptureMode, StepEngine, shared
from dlm_toolkit.step.facts import SavedLayout, StepFacts
from dlm_toolkit.hooks.base import HookStages, run_stage
from dlm_toolkit.decoding.policy import DecodingPolicy, StepChecks
from dlm_toolkit.decoding.rule_capture import RuleRunners
from dlm_toolkit.step.state import DecodeResult, DecodeState, row_seeds, validate_prompts
from dlm_toolkit.strategy.base import BlockSchedule, StepContext
from dlm_toolkit.step.trajectory import Trajectory


BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a captured step is built for; larger batches are split
COMPILE_BACKEND = "inductor"  # torch.compile backend of capture="compile" (tests use "aot_eager": same graph, no codegen)


def decode(
    model: DiffusionLM,
    prompts: Sequence[Sequence[int]],
    policy: DecodingPolicy | PolicyConfig | str | Mapping[str, Any] | None = None,
    gen_length: int = 128,
    *,
    kv_cache: bool = True,
    seed: int | Sequence[int] | None = 0,
    record: bool = False,
    allow_past_context: bool = False,
    cuda_graphs: bool | None = None,
    check_every: int = 1,
    capture: CaptureMode | None = None,
) -> DecodeResult:
    """Decode a batch of prompts with a policy.

    Args:
        model: any :class:`~dlm_toolkit.models.base.DiffusionLM`, on any device.
        prompts: token-id lists (lengths may differ; rows decode independently).
        policy: a :class:`DecodingPolicy`, a config, a preset name or a dict (default ``llada2.1-q``).
        gen_length: generated positions per prompt (the output is cut after the first EOS).
        kv_cache: keep an exact prefix KV cache of finished blocks (block-causal models only);
            gives the same tokens and NFE as recomputing the prefix every forward.
        seed: an int (row r draws with the key ``row_seed(seed, r)``) or one seed per prompt (used
            as is). Draws are keyed by (row seed, row step, position), so sampling and random rules
            give a row the same tokens whatever batch it is decoded in.
        record: attach a :class:`~dlm_toolkit.step.trajectory.Trajectory` of every step.
        allow_past_context: decode even where the canvas (prompt + generation, whole blocks)
            runs past the model's ``max_position_embeddings``; refused by default, since the
            model has never seen those positions.
        cuda_graphs: capture the model forward once per (batch bucket, width, canvas), and each
            rule of the policy once per layout (:mod:`dlm_toolkit.decoding.rule_capture`), in CUDA graphs
            and replay them; ``None``: on when the model is on CUDA. A rule that cannot be
            captured runs eagerly after one warning naming it (same tokens). Rows are padded to a
            bucket of :data:`BUCKETS` (a larger batch is decoded in slices of the largest bucket)
            and the canvas to a power of two, so that decodes of many prompts share captures.
        check_every: steps between host reads (see the module docstring). The default 1 keeps
            ``forward_calls`` as low as possible; larger values run up to that many forwards
            without waiting for the host (tokens and NFE stay the same: rows that finished in
            between ride along with nothing written).
        capture: engineering knob overriding ``cuda_graphs``: ``"compile"`` runs each forward
            through ``torch.compile(fullgraph=True, dynamic=False)`` (any device; the tests use
            it on the CPU), ``"eager"`` plain calls.
    """
    policy = policy if isinstance(policy, DecodingPolicy) else DecodingPolicy(policy)
    blocks = policy.blocks
    device = model_device(model)
    mode = capture_mode(cuda_graphs, capture, device)
    if isinstance(check_every, bool) or not isinstance(check_every, int) or not 1 <= check_every <= 1024:
        raise ConfigError(f"check_every: must be an integer in [1, 1024] (got {check_every!r})")
    validate_prompts(prompts, gen_length, model.mask_token_id, model.vocab_size)
    for hook in policy.hooks:
        run_stage(hook, "check_model", hook.check_model, model)
    if not allow_past_context:
        origin, _, num = blocks.layout(torch.tensor([len(p) for p in prompts], device="cpu"), gen_length)
        check_context(model, int((origin + num * blocks.block_length).max()), blocks.block_length)
    seeds = row_seeds(seed, len(prompts))
    cached = kv_cache and model.supports_kv_cache and model.attention == "block_causal"
    if mode == "eager":  # no capture to reuse: no bucket padding, no slicing
        return decode_rows(model, prompts, seeds, policy, gen_length, cached, record, mode, check_every, len(prompts))
    step = BUCKETS[-1]
    parts = [decode_rows(model, prompts[i:i + step], seeds[i:i + step], policy, gen_length, cached, record, mode,
                         check_every, bucket(len(prompts[i:i + step])))
             for i in range(0, len(prompts), step)]
    return DecodeResult.concat(parts, model.mask_token_id)


def decode_rows(model: DiffusionLM, prompts: Sequence[Sequence[int]], seeds: list[int], policy: DecodingPolicy,
                gen_length: int, cached: bool, record: bool, mode: CaptureMode, check_every: int,
                rows: int) -> DecodeResult:
    """Decode ``prompts`` as a batch of ``rows`` rows (rows past the prompts pad a bucket and are
    done from the start)."""
    blocks = policy.blocks
    n = len(prompts)
    padded = list(prompts) + [prompts[0]] * (rows - n)
    state = DecodeState.start(padded, gen_length, blocks, model.mask_token_id, model.eos_token_id, model.vocab_size,
                              list(seeds) + [0] * (rows - n), model_device(model), round_width=mode != "eager")
    state.done[n:] = True
    hooks = HookStages(policy.hooks)  # what the rules add to the step (dlm_toolkit.hooks)
    engine = StepEngine(model, blocks, state, cached, mode, COMPILE_BACKEND, trim=mode == "eager" and check_every == 1,
                        segment_hooks=hooks.step_segments)
    rules_step = policy.step if mode == "eager" else RuleRunners(policy, mode, COMPILE_BACKEND, shared(model)).step
    trajectory = Trajectory(n_rows=n) if record else None
    checks = StepChecks(policy, policy.forward_limit())
    prepare, finish_step = with_facts(blocks.prepare, 1), with_facts(blocks.finish_step, 2)
    start = perf_counter()
    facts = StepFacts()  # what the host knows: the last read's facts, passed to every stage that uses them
    context_layout = SavedLayout()  # the step context's positions and masks, kept under facts.context_key
    with torch.inference_mode():
        since_read = check_every
        while True:
            live = prepare(state, facts)
            lo, hi = blocks.window(state, state.all_rows)
            if since_read >= check_every:  # the one host read (module docstring)
                read = engine.read(live, lo, hi, checks)
                if read is None:
                    break
                facts, since_read = read, 0
            else:
                facts = facts.later()
            since_read += 1
            logits = engine.forward(live, lo, hi, facts)  # (N, W, V)
            ctx = step_context(policy, state, live, lo, hi, logits, facts, context_layout)
            for after_forward in hooks.after_forward:
                after_forward(ctx, engine, state)
            rules_step(ctx, state.memory)
            for after_rules in hooks.after_rules:
                after_rules(ctx, engine, state)
            write_step(state, ctx, facts, checks.no_remask)
            for after_write in hooks.after_write:
                after_write(ctx, state)
            finish_step(state, ctx, facts)
            checks.add(ctx, state)
            if trajectory is not None:
                trajectory.add(ctx, state)
    result = state.result(perf_counter() - start, n)
    result.trajectory = trajectory
    return result


def with_facts(method: Callable[..., Any], before: int) -> Callable[..., Any]:
    """``method`` (a block schedule's ``prepare`` or ``finish_step``) as a callable taking the step's
    facts after its ``before`` arguments; a plug-in schedule written before the facts existed (no
    parameter for them) is called without them."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):  # no signature to read: trust it takes them
        return method
    takes = any(p.kind == p.VAR_POSITIONAL for p in params) or len(params) > before
    return method if takes else lambda *args: method(*args[:before])


def bucket(n: int) -> int:
    """The smallest batch bucket holding ``n`` rows (``n`` at most the largest bucket)."""
    return next(b for b in BUCKETS if b >= n)


def capture_mode(cuda_graphs: bool | None, capture: CaptureMode | None, device: torch.device) -> CaptureMode:
    """How forwards run: ``capture`` if given, else CUDA graphs when asked for (or, by default,
    when the model is on CUDA), else eagerly."""
    if capture is not None:
        if capture not in ("eager", "compile", "cuda_graphs"):
            raise ConfigError(f"capture: must be 'eager', 'compile' or 'cuda_graphs' (got {capture!r})")
        cuda_graphs = capture == "cuda_graphs"
        if not cuda_graphs:
            return capture
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ConfigError(f"cuda_graphs: must be true, false or null (got {cuda_graphs!r})")
    if cuda_graphs and device.type != "cuda":
        raise ConfigError(f"cuda_graphs needs a CUDA device; the model is on {device.type}")
    return "cuda_graphs" if (device.type == "cuda" if cuda_graphs is None else cuda_graphs) else "eager"


def check_context(model: DiffusionLM, canvas: int, block_length: int, what: str = "the decode") -> None:
    """Refuse a canvas of ``canvas`` positions past the model's ``max_position_embeddings`` (models
    without one have no limit)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and canvas > limit:
        raise ConfigError(
            f"{what} needs a canvas of {canvas} positions (prompt + gen_length, whole blocks of {block_length}) but "
            f"the model's context is {limit} (max_position_embeddings); pass allow_past_context=True "
            "(--allow-past-context) to decode on positions the model never saw"
        )


def step_context(policy: DecodingPolicy, state: DecodeState, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 logits: torch.Tensor, facts: StepFacts | None = None, saved: SavedLayout | None = None) -> StepContext:
    """The :class:`StepContext` of every row for the window ``hi - W + [0, W)`` (real from ``lo``, in
    live rows). ``saved``: the decode's one saved context layout (positions, canvas index, masks), taken
    when ``facts.context_key`` is its key and kept under that key when it is not."""
    rows = state.all_rows
    width = logits.shape[1]
    key = facts.context_key if facts is not None and saved is not None else None
    # the default edit region is the active block: folded into the saved layout's writable slots
    default_edit = type(policy.blocks).edit_region is BlockSchedule.edit_region
    if key is not None and key == saved.key:  # precondition: positions, valid, is_prompt, in_block depend only
        positions, idx, valid, is_prompt, in_block, writable = saved.window  # on the key (context_key) and W
    else:
        positions = (hi[:, None] - width) + state.offsets(width)  # (N, W)
        idx = positions.clamp(0, state.canvas.shape[1] - 1)
        valid = (positions >= lo[:, None]) & live[:, None]
        is_prompt, in_block, writable = StepContext.window_masks(positions, valid, state.prompt_len,
                                                                 *state.block_bounds(rows))
        if default_edit:  # editable & edit_region(ctx) for the default region, ctx.in_block
            writable = writable & in_block
        if key is not None:
            saved.key, saved.window = key, (positions, idx, valid, is_prompt, in_block, writable)
    # copies, since the engine updates these in place after the rules ran: one stack, not four clones
    step, block, block_step, block_masked_start = torch.stack(
        [state.nfe, state.block, state.block_step, state.block_masked_start]).unbind(0)
    ctx = StepContext.build(
        rows=rows,
        positions=positions,
        valid=valid,
        tokens=state.canvas.gather(1, idx),
        prompt_len=state.prompt_len,
        block_lo=None,
        block_hi=None,
        logits=logits,
        sampling=policy.sampling,
        written_step=state.written_step.gather(1, idx),
        written_conf=state.written_conf.gather(1, idx),
        step=step,
        block=block,
        block_step=block_step,
        block_masked_start=block_masked_start,
        seeds=state.seeds,
        memory=state.memory,
        mask_token_id=state.mask_token_id,
        eos_token_id=state.eos_token_id,
        batch_rows=state.batch_size,
        live=live,
        outputs=policy.hook_outputs,
        layout=(is_prompt, in_block, writable),
    )
    if not default_edit:
        ctx.editable = ctx.editable & policy.blocks.edit_region(state, ctx)
    return ctx
