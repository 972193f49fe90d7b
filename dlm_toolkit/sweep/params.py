"""From an experiment to Optuna and back: samplers, pruners, enqueued presets, sampled params
and the policy a trial evaluates."""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from dlm_toolkit.config import ROLES
from dlm_toolkit.strategy.policy_config import PolicyConfig, load_policy
from dlm_toolkit.sweep.experiment import DEFAULT_NSGA2_POPULATION, Experiment
from dlm_toolkit.sweep.pareto import preset_label

def sampler_seed(seed: int | None, worker: int, started: int) -> int | None:
    """The seed of one sampler: mixed from the experiment's seed, the worker id and the number of
    trials the study had when the sampler started, so a restarted (or resumed) process continues
    the search instead of replaying the proposals its predecessor already made."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}|{worker}|{started}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def make_sampler(exp: Experiment, worker: int = 0, started: int = 0) -> Any:
    """The experiment's sampler for ``worker``; ``started``: trials in the study when it starts."""
    import optuna

    spec = exp.sampler
    seed = sampler_seed(spec.seed, worker, started)
    opts = dict(spec.options)
    if spec.name == "nsga2":
        opts.setdefault("population_size", DEFAULT_NSGA2_POPULATION)
        return optuna.samplers.NSGAIISampler(seed=seed, **opts)
    if spec.name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, **opts)
    if spec.name == "random":
        return optuna.samplers.RandomSampler(seed=seed, **opts)
    grid = {k: s.grid_values() for k, s in exp.search_space.items()}
    return optuna.samplers.GridSampler(grid, seed=seed, **opts)


def make_pruner(exp: Experiment) -> Any:
    import optuna

    if exp.pruning.rule == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=exp.pruning.n_startup_trials,
                                           n_warmup_steps=exp.pruning.after)
    return optuna.pruners.NopPruner()


def enqueue_presets(study: Any, exp: Experiment) -> list[str]:
    """Enqueue each preset once per study; returns the names enqueued now."""
    done = list(study.user_attrs.get("presets_enqueued") or [])
    existing = {t.user_attrs.get("preset") for t in study.get_trials(deepcopy=False)}
    added = []
    for preset in exp.presets_to_enqueue:
        label = preset_label(preset)
        if label in done or label in existing:
            continue
        policy = load_policy(preset)
        params = preset_params(exp, policy)
        study.enqueue_trial(params, user_attrs={"preset": label, "preset_policy": policy.canonical_json()},
                            skip_if_exists=False)
        done.append(label)
        added.append(label)
        study.set_user_attr("presets_enqueued", done)
    return added


def preset_params(exp: Experiment, policy: PolicyConfig) -> dict[str, Any]:
    """The preset's values of the search-space keys that are points of the space."""
    flat = policy.flat()
    values = {f"{r}.name": getattr(policy, r).name for r in ROLES}
    values.update(flat)
    out: dict[str, Any] = {}
    for key in exp.key_order():
        spec = exp.search_space[key]
        if key not in values or not spec.active(values):
            continue
        if spec.contains(values[key]):
            out[key] = values[key]
    return out


def trial_policy(exp: Experiment, params: Mapping[str, Any]) -> PolicyConfig:
    """Base policy + sampled flat params. Picking the base's own rule keeps the base's params."""
    base = exp.base()
    overrides = dict(params)
    for role in ROLES:
        key = f"{role}.name"
        if key in overrides and overrides[key] == getattr(base, role).name:
            del overrides[key]
    return load_policy(base, overrides)


def sample_params(trial: Any, exp: Experiment) -> dict[str, Any]:
    """Suggest every active key, in dependency order (``when`` conditions)."""
    values: dict[str, Any] = {}
    for key in exp.key_order():
        spec = exp.search_space[key]
        if spec.active(values):
            values[key] = spec.suggest(trial, key)
    return values
