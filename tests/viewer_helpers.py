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


MASK, EOS = 99, 0


def synthetic(rows: int = 2) -> Any:
    """A hand-written trajectory (no model): prompt ``[5, 6, 7, 8]``, two blocks of 4 after it.
    Forward 1 commits 11, 12 at 4, 5 (hook output ``flagged`` marks 4); forward 2 commits EOS at 6, 7
    (row 0: ``flagged`` marks 6, ``held`` marks 6 and 7; row 1: ``flagged`` marks 4); forward 3 fills
    the second block with EOS, its window reaching back to 6. Row r's first token is 11 + r."""
    from dlm_toolkit.step.trajectory import RowCanvas, StepRecord, Trajectory

    steps = []
    for r in range(rows):
        first = 11 + r
        steps += [
            StepRecord(r, 0, 0, 4, False, [4, 5], [], [], [4, 5, 6, 7], [0.9, 0.8, 0.1, 0.1], [first, 12, 3, 3],
                       [first, 12, MASK, MASK], block_lo=4, runner_up=[1, 1, 1, 1], runner_up_confidence=[0.05] * 4,
                       marks={"flagged": [4], "held": []}),
            StepRecord(r, 1, 0, 2, False, [6, 7], [], [], [4, 5, 6, 7], [0.9, 0.8, 0.7, 0.6], [first, 12, EOS, EOS],
                       [first, 12, EOS, EOS], block_lo=4, runner_up=[1, 1, 1, 1], runner_up_confidence=[0.05] * 4,
                       marks={"flagged": [6], "held": [6, 7]} if r == 0 else {"flagged": [4]}),
            StepRecord(r, 2, 1, 4, False, [8, 9, 10, 11], [], [], [6, 7, 8, 9, 10, 11], [0.5] * 6, [EOS] * 6, [EOS] * 4,
                       block_lo=8, runner_up=[1] * 6, runner_up_confidence=[0.05] * 6),
        ]
    return Trajectory(steps, canvases=[RowCanvas([5, 6, 7, 8], 12) for _ in range(rows)], mask_token_id=MASK,
                      eos_token_id=EOS, block_length=4)


class TextTokenizer:
    """Token texts from a dict (id -> text; other ids as ``t<id>``): for texts no real tokenizer has."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.texts.get(i, f"t{i}") for i in ids)
