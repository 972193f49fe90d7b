"""A digest of many decodes (tokens, NFE, every counter, the canvas) to prove a refactor of the decode
step changes no output (issue 36 Part 2: the step hooks).

    python benchmarks/hook_digest.py --write benchmarks/hook_digest.json   # on the code before the change
    python benchmarks/hook_digest.py --check benchmarks/hook_digest.json   # after it: exit 1 on a difference

The decodes: every conformance case (``conformance/llada2_tiny``, KV cache on and off), the shipped
testbed ``checkpoints/testbed-v2-editable`` on a few prompts of each catalogue task under every
catalogue policy, and a random tiny model at batch 1, 3 and 8 with the KV cache on and off under
every catalogue policy, plus multi-block editing, temperature 1, ``check_every`` > 1 and compiled
decodes of the policies with a hook (verification, shadow block, insert/delete, dynamic blocks).
``tests/test_hook_digest.py`` runs the ``quick`` subset against the same file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from catalogue import POLICIES, TASKS  # noqa: E402

from dlm_toolkit.decoding.loop import decode  # noqa: E402
from dlm_toolkit.decoding.policy import DecodingPolicy  # noqa: E402
from dlm_toolkit.strategy.policy_config import load_policy  # noqa: E402
from dlm_toolkit.step.state import DecodeResult  # noqa: E402

# the catalogue policies that run a hook (the quick subset decodes these)
HOOKED = ("S2D2", "WINO, shadow block", "Indel, eager", "DSB")
MBE = {"blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 1}


def result_digest(result: DecodeResult) -> dict[str, Any]:
    """Tokens, every per-row counter, ``forward_calls`` and a hash of the canvas (no times)."""
    rows = []
    for i in range(len(result.rows)):
        d = result.row_dict(i)
        d.pop("tpf"), d.pop("edits_per_token")  # derived from the kept fields
        rows.append(d)
    canvas = hashlib.sha256(result.canvas.cpu().numpy().tobytes()).hexdigest()[:16]
    return {"rows": rows, "forward_calls": result.forward_calls, "canvas": canvas}


def catalogue_policy(label: str, extra: dict[str, Any] | None = None) -> DecodingPolicy:
    preset, sets = POLICIES[label]
    return DecodingPolicy(load_policy(preset, {**sets, **(extra or {})}))


Case = tuple[str, Callable[[], dict[str, Any]]]


def _guard(run: Callable[[], DecodeResult]) -> dict[str, Any]:
    try:
        return result_digest(run())
    except Exception as err:  # an error is part of the behaviour: the same message before and after
        return {"error": f"{type(err).__name__}: {err}"}


def conformance_cases() -> Iterator[Case]:
    from dlm_toolkit.evaluation.conformance import case_policy
    from dlm_toolkit.models import load_model

    folder = ROOT / "conformance" / "llada2_tiny"
    spec = json.loads((folder / "cases.json").read_text())
    model = load_model(folder, device=torch.device("cpu"), mask_token_id=spec["mask_id"], eos_token_id=spec["eos_id"])
    for case in spec["cases"]:
        for kv in (True, False):
            yield (f"conformance/{case['name']}/kv={kv}",
                   lambda case=case, kv=kv: _guard(lambda: decode(model, [case["prompt_ids"]], case_policy(case),
                                                                  case["gen_length"], kv_cache=kv)))


def testbed_cases(labels: tuple[str, ...], per_task: int = 3) -> Iterator[Case]:
    from dlm_toolkit.evaluation.evaluate import load_checkpoint, task_prompt
    from dlm_toolkit.tasks import get_task

    model, tokenizer = load_checkpoint(ROOT / "checkpoints" / "testbed-v2-editable")
    for name in TASKS:
        task = get_task(name)
        prompts = [task_prompt(tokenizer, task, inst, False) for inst in task.instances(per_task, 0, "eval")]
        for label in labels:
            yield (f"testbed/{name}/{label}",
                   lambda label=label, prompts=prompts, task=task: _guard(
                       lambda: decode(model, prompts, catalogue_policy(label), task.answer_length + 1)))


def random_cases(labels: tuple[str, ...], batches: tuple[int, ...], extras: bool) -> Iterator[Case]:
    from dlm_toolkit.testing.models import tiny_llada2

    model = tiny_llada2(seed=3)
    gen = torch.Generator().manual_seed(11)
    lengths = [3, 17, 9, 30, 1, 12, 25, 6]
    prompts = [torch.randint(0, 60, (n,), generator=gen).tolist() for n in lengths]

    def run(label: str, batch: int, kv: bool, extra: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return _guard(lambda: decode(model, prompts[:batch], catalogue_policy(label, extra), 40, kv_cache=kv, **kw))

    for label in labels:
        for batch in batches:
            for kv in (True, False):
                yield f"random/{label}/b{batch}/kv={kv}", lambda a=(label, batch, kv): run(*a)
    if not extras:
        return
    for label in ("Q", "S", "S2D2", "WINO, shadow block", "Indel, eager"):  # multi-block editing
        for kv in (True, False):
            yield f"random-mbe/{label}/kv={kv}", lambda a=(label, 3, kv, MBE): run(*a)
    for label in HOOKED:
        yield f"random-t1/{label}", lambda a=(label, 3, True, {"sampling.temperature": 1.0}): run(*a)
        yield f"random-check3/{label}", lambda label=label: run(label, 3, True, check_every=3)
        yield f"random-compile/{label}", lambda label=label: run(label, 3, True, capture="compile")


def cases(quick: bool) -> Iterator[Case]:
    """Every decode of the digest (``quick``: the random-model decodes of the hooked policies only)."""
    if quick:
        yield from random_cases(("Q",) + HOOKED, (3,), False)
        return
    yield from conformance_cases()
    yield from testbed_cases(tuple(POLICIES))
    yield from random_cases(tuple(POLICIES), (1, 3, 8), True)


def digest(quick: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: run() for name, run in cases(quick)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--write", type=Path)
    how.add_argument("--check", type=Path)
    args = parser.parse_args(argv)
    got = digest()
    if args.write:
        from dlm_toolkit.util.files import atomic_write

        text = json.dumps(got, indent=1, sort_keys=True) + "\n"
        atomic_write(args.write, lambda tmp: tmp.write_text(text))
        print(f"{len(got)} decodes -> {args.write}")
        return 0
    want = json.loads(args.check.read_text())
    bad = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    for k in bad[:20]:
        print(f"DIFFERS {k}:\n  before {want.get(k)}\n  now    {got.get(k)}")
    print(f"{len(got)} decodes, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
