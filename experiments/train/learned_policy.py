"""Fit the ``learned`` commit rule's scoring network on decode trajectories of a testbed checkpoint.

    python experiments/train/learned_policy.py checkpoints/testbed-v2-editable --task pick --n 300 \
        --out strategies/learned_pick.safetensors

Recipe (well under a minute on one CPU thread for the shipped testbed): decode ``n`` train-split
instances with a careful teacher policy (Q, ``llada2.1-q``) while recording, at every forward, the
features (:func:`strategies.m2t_learned.features`) and the sampled token of every mask of the active
block. A recorded position is a positive example iff the token sampled then is the token the
teacher's decode ends with there (committing it at that moment would have been kept). A
one-hidden-layer MLP is fitted to these labels with a logistic loss (Adam, full batch, seeded), and
written as safetensors plus its JSON config, the format the rule reads (never a pickle).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from dlm_toolkit import StepContext, UnmaskRule
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.evaluation.evaluate import load_checkpoint, task_prompt
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.tasks import get_task
from dlm_toolkit.models.chat import use_chat
from strategies.m2t_learned import FEATURES, FORMAT, VERSION, features, score


class Recorder(UnmaskRule):
    """Wraps the teacher's commit rule and keeps what each forward showed it (training only: a
    strategy must not keep state, this helper exists to collect data)."""

    def __init__(self, teacher: UnmaskRule) -> None:
        super().__init__()
        self.teacher, self.seen = teacher, []

    def __call__(self, ctx: StepContext):
        where = ctx.fillable.nonzero()
        b, w = where[:, 0], where[:, 1]
        self.seen.append((features(ctx)[b, w], ctx.rows[b], ctx.positions[b, w], ctx.sampled[b, w]))
        return self.teacher(ctx)


def collect(model, tokenizer, task_name: str, n: int, seed: int, teacher: str, batch_size: int = 50):
    """(features (N, F), labels (N,)) from teacher decodes of ``n`` train instances."""
    task = get_task(task_name)
    chat = use_chat(tokenizer, task.chat, f"task '{task.name}': chat")
    prompts = [task_prompt(tokenizer, task, inst, chat) for inst in task.instances(n, seed, "train")]
    xs, ys = [], []
    for start in range(0, n, batch_size):
        policy = DecodingPolicy(teacher)
        recorder = Recorder(policy.m2t)
        policy.m2t = recorder
        res = decode(model, prompts[start : start + batch_size], policy, task.answer_length + 1, seed=seed + start)
        for feats, rows, positions, sampled in recorder.seen:
            xs.append(feats)
            ys.append((res.canvas[rows, positions] == sampled).float())
    return torch.cat(xs), torch.cat(ys)


def fit(x: torch.Tensor, y: torch.Tensor, hidden: int, steps: int, seed: int, lr: float = 0.02) -> dict[str, torch.Tensor]:
    """A one-hidden-layer MLP fitted with a logistic loss (full batch Adam, positives reweighted to balance)."""
    gen = torch.Generator().manual_seed(seed)
    net = {"w1": torch.randn(hidden, x.shape[1], generator=gen) * 0.5, "b1": torch.zeros(hidden),
           "w2": torch.randn(1, hidden, generator=gen) * 0.5, "b2": torch.zeros(1)}
    for t in net.values():
        t.requires_grad_(True)
    opt = torch.optim.Adam(list(net.values()), lr=lr)
    pos_weight = ((1 - y).sum() / y.sum().clamp(min=1)).clamp(max=20)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(score(net, x), y, pos_weight=pos_weight)
        loss.backward()
        opt.step()
    return {k: v.detach().contiguous() for k, v in net.items()}


def save(net: dict[str, torch.Tensor], out: Path, meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(net, str(out))
    config = {"format": FORMAT, "version": VERSION, "features": list(FEATURES), "hidden": int(net["w1"].shape[0]), **meta}
    out.with_suffix(".json").write_text(json.dumps(config, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--task", default="pick")
    ap.add_argument("--n", type=int, default=300, help="train-split instances decoded by the teacher")
    ap.add_argument("--teacher", default="llada2.1-q")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="the .safetensors file (its .json is written next to it)")
    args = ap.parse_args(argv)
    if args.n < 1 or args.hidden < 1 or args.steps < 1:
        ap.error("--n, --hidden and --steps must be >= 1")
    if args.out.suffix != ".safetensors":
        ap.error(f"--out {args.out}: must end in .safetensors")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny model and network: one thread is fastest, and stated
    t0 = time.perf_counter()
    model, tokenizer = load_checkpoint(args.checkpoint)
    x, y = collect(model, tokenizer, args.task, args.n, args.seed, args.teacher)
    net = fit(x, y, args.hidden, args.steps, args.seed)
    with torch.no_grad():
        accuracy = float(((score(net, x) > 0).float() == y).float().mean())
    seconds = time.perf_counter() - t0
    save(net, args.out, {"task": args.task, "teacher": args.teacher, "examples": len(y), "positives": int(y.sum()),
                         "train_accuracy": round(accuracy, 4), "checkpoint": Path(args.checkpoint).name})
    print(f"{len(y)} positions ({int(y.sum())} positive), train accuracy {accuracy:.3f}, {seconds:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
