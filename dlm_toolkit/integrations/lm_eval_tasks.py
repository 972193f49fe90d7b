"""lm-eval task-side helpers of the ``dlm`` model: a local copy of lm-eval's ``gsm8k`` task
(:func:`write_gsm8k_task`, for machines that cannot reach the hub) and the multiple-choice delimiter
check (:func:`delimiter_trap`). Kept apart from :mod:`dlm_toolkit.integrations.lm_eval` (the model
itself), which re-exports both."""

from __future__ import annotations

import os
from typing import Any, Sequence

from dlm_toolkit.config import ConfigError

__all__ = ["GSM8K_TASK", "delimiter_trap", "write_gsm8k_task"]

GSM8K_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
num_fewshot: 0
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: "take_first"
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: "take_first"
"""


def delimiter_trap(tokenizer: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """A warning when the continuations start with a whitespace-only token that no context ends
    with, else None.

    lm-eval puts ``target_delimiter`` (default ``" "``) between context and choice. A BPE vocabulary
    folds that space into the choice's first token (``"Ġ5"``), which is what the model saw in
    training; a character- or byte-level one encodes it as a token of its own, which a model trained on
    ``question answer`` text without it rarely predicts there, so every choice is scored on an unlikely
    first token and the ranking is mostly noise (the testbed: 0.35 accuracy on a 4-option task where
    ``target_delimiter: ""`` gives 1.00). Where some context itself ends with that token the space is
    part of the task's format, and nothing is said."""
    firsts = {cont[0] for _, cont in pairs if cont}
    ends = {ctx[-1] for ctx, _ in pairs if ctx}
    for token in sorted(firsts - ends):
        text = tokenizer.decode([token])
        if text and not text.strip():
            return (f"lm-eval loglikelihood: continuations start with {text!r} encoded as a token of its own, which no "
                    "context ends with: with this tokenizer the model is asked to predict the delimiter before each "
                    "choice, which it rarely saw there. If the task's target_delimiter is lm-eval's default ' ', set "
                    "target_delimiter: \"\" in its YAML (README: 'Multiple choice through lm-eval')")
    return None


def write_gsm8k_task(folder: str | os.PathLike, data: str | os.PathLike, max_gen_toks: int = 256,
                     name: str = "gsm8k_local") -> str:
    """Write ``folder/<name>.yaml``: lm-eval's ``gsm8k`` task (v3: zero-shot prompt, stop strings,
    strict/flexible filters, exact match) over a local GSM8K ``test.jsonl``, for ``--include_path
    folder --tasks <name>`` where the hub is out of reach. Returns the task name."""
    from pathlib import Path

    path = Path(data).resolve()
    if not path.is_file():
        raise ConfigError(f"data: no GSM8K test.jsonl at {path}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.yaml").write_text(GSM8K_TASK.format(name=name, data=path, max_gen=int(max_gen_toks)))
    return name
