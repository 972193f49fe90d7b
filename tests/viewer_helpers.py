"""Shared by the viewer tests: a testbed decode with MBE edits and WINO remasks, and a replay of
trajectory records written here from the records' own definitions (the independent reference)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / "checkpoints" / "testbed-v2-editable"
# WINO drafts and re-masks, the threshold T2T edits (sampling at temperature 1 makes the model change
# its mind), and the edit window of multi_block_edit reaches the previous block.
EDITING = {"m2t": {"name": "wino"}, "remask": {"name": "wino_shadow"},
           "t2t": {"name": "threshold", "params": {"threshold": 0.0}},
           "blocks": {"name": "multi_block_edit", "params": {"block_length": 16, "edit_blocks": 1}},
           "sampling": {"temperature": 1.0}}


@functools.lru_cache(maxsize=1)
def load_testbed() -> tuple[Any, Any, list[list[int]], int]:
    from dlm_toolkit.evaluation.evaluate import load_checkpoint, task_prompt
    from dlm_toolkit.tasks import get_task

    model, tok = load_checkpoint(TESTBED)
    task = get_task("pick")
    prompts = [task_prompt(tok, task, inst, False) for inst in task.instances(2, 0, "eval")]
    return model, tok, prompts, task.answer_length + 1


@functools.lru_cache(maxsize=4)
def recorded(policy: str = "editing") -> Any:
    from dlm_toolkit import decode

    model, _, prompts, gen = load_testbed()
    return decode(model, prompts, EDITING if policy == "editing" else policy, gen, record=True, seed=2)


def replay(traj: Any, row: int) -> list[list[int]]:
    """The row's canvas before any forward and after each one: the drawn token at commits and
    edits, the mask at remasks, then the active block as the record says the step left it."""
    c = traj.canvases[row]
    mask = traj.mask_token_id
    canvas = list(c.prompt) + [mask] * (c.length - len(c.prompt))
    out = [list(canvas)]
    for s in traj.for_row(row):
        drawn = dict(zip(s.positions, s.sampled))
        for p in s.commit + s.edit:
            canvas[p] = drawn[p]
        for p in s.remask:
            canvas[p] = mask
        canvas[s.block_lo:s.block_lo + len(s.block_after)] = s.block_after
        out.append(list(canvas))
    return out
