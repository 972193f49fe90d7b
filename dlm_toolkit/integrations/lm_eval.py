"""lm-evaluation-harness model ``dlm``: lm-eval ``generate_until`` tasks decoded with a policy of ours,
``loglikelihood`` (multiple-choice) tasks scored by a Monte-Carlo estimate of the diffusion ELBO.

Install the extra (``pip install -e ".[eval]"``, lm-eval pinned), then either the CLI::

    dlm-lm-eval --model dlm --model_args checkpoint=DIR,preset=llada2.1-q,set=m2t.params.threshold=0.8,\\
        device=cuda,dtype=bfloat16 --batch_size 8 --tasks gsm8k [--apply_chat_template]

(``dlm-lm-eval`` is lm-eval's own command line, ``lm_eval ...``, with this model registered first:
lm-eval 0.4.13 discovers models only among its own modules, so ``lm_eval --model dlm`` itself
cannot find it), or Python::

    import dlm_toolkit.integrations.lm_eval  # registers "dlm"
    lm_eval.simple_evaluate(model="dlm", model_args="checkpoint=DIR,preset=llada2.1-q", tasks=[...])

Model arguments: ``checkpoint`` (required; ``pretrained`` is accepted as its alias, the key lm-eval
users type first), ``preset`` or ``policy`` (a policy file), ``set`` (``KEY=VALUE``, several joined
by ``;``), ``device``, ``dtype``, ``threads``, ``seed`` (each request draws from its own stream,
seeded from ``seed`` and the request itself -- task, document, arguments and, for lm-eval's
repeats, its occurrence -- so a request decodes and scores the same whatever batch, group or
other requests it comes with), ``stop_every`` (blocks between stop-string checks), ``kv_cache``,
``mc_num`` and ``mc_batch_size`` (loglikelihood: Monte-Carlo samples per request, and per forward),
``loglik_last_block`` (``pad``, the default: the answer's last block padded with masks as a decode
canvas; ``cut``: the sequence ends at the answer, LLaDA's estimator; :mod:`~dlm_toolkit.integrations.loglik`),
``tracking_uri`` (MLflow; default ``$MLFLOW_TRACKING_URI`` when set) and ``experiment_name``;
lm-eval's ``--batch_size`` is the decode batch. A key not in this list (``presett=``) is refused
naming the nearest one, and each value is checked for its type (``kv_cache=no`` is not a boolean).

``generate_until`` decodes batches of requests with the policy, stops each row at the request's
``until`` strings or EOS (its further blocks are not decoded: :mod:`dlm_toolkit.evaluation.generate`) and at
``max_gen_toks`` tokens. Per request NFE, tokens, TPF and how it stopped, and the totals (TPF,
tokens/s), go into the results under ``config.dlm`` (and into MLflow when a tracking URI is set).
``loglikelihood`` (multiple-choice tasks) is a Monte-Carlo estimate of the masked-diffusion ELBO
(:mod:`dlm_toolkit.integrations.loglik`: exact for a one-token continuation); each request's
estimate, standard error and sample count go into ``config.dlm.loglikelihood`` (lm-eval itself
takes only ``(logprob, is_greedy)``). ``loglikelihood_rolling`` (perplexity) sums the estimates
of disjoint windows, each conditioned on up to the window before it. Under ``torchrun`` every
rank decodes every request on its shard of the model; only rank 0 prints and writes.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Sequence

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from dlm_toolkit.models.chat import chat_text, has_chat_template
from dlm_toolkit.config import ConfigError, parse_value
from dlm_toolkit.evaluation.generate import generate, validate_stops
from dlm_toolkit.integrations.lm_eval_tasks import GSM8K_TASK, delimiter_trap, write_gsm8k_task  # noqa: F401  (public here)

__all__ = ["DlmLM", "delimiter_trap", "main", "write_gsm8k_task"]

DEFAULT_MAX_GEN_TOKS = 256
LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # lm-eval's CLI passes this unless --device says otherwise


def _sets(text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (text or "").split(";"):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"model_args set: expected KEY=VALUE[;KEY=VALUE...], got {item!r}")
        out[key.strip()] = parse_value(value.strip())
    return out


MAX_BATCH = 1 << 16


def _integer(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"model_args {name}: must be an integer in [{lo}, {hi}] (got {value!r})")
    return value


def _batch_size(value: Any) -> int:
    """lm-eval's ``--batch_size`` (text from its command line, an integer from Python) as rows per
    decode: ``auto``/``auto:N`` (lm-eval's automatic sizing, which we do not do) decodes 8 at a time."""
    if isinstance(value, str) and (value == "auto" or value.startswith("auto:")):
        return 8
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return _integer(value, "batch_size", 1, MAX_BATCH)


def model_arg_names() -> list[str]:
    import inspect

    return [p for p in inspect.signature(DlmLM.__init__).parameters if p != "self"]


def check_model_args(args: dict[str, Any]) -> None:
    """Refuse a ``model_args`` key the model does not take, naming the nearest one (``presett`` ->
    ``preset``): a typo would otherwise be ignored and the run go on with the default."""
    import difflib

    known = model_arg_names()
    for key in args:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(f"model_args: unknown key {key!r}{hint} (known: {', '.join(known)})")


@register_model("dlm")
class DlmLM(LM):
    """lm-eval model over a dlm-toolkit checkpoint and decoding policy (see the module docstring)."""

    def __init__(self, checkpoint: str | None = None, preset: str | None = None, policy: str | None = None,
                 set: str | None = None, device: str | None = None, dtype: str | None = None, batch_size: int | str = 8,
                 max_batch_size: int | None = None, seed: int = 0, threads: int | None = None, stop_every: int = 1,
                 kv_cache: bool = True, tracking_uri: str | None = None, experiment_name: str = "dlm-lm-eval",
                 mc_num: int = 128, mc_batch_size: int = 32, loglik_last_block: str = "pad",
                 pretrained: str | None = None) -> None:
        super().__init__()
        from dlm_toolkit.models.distributed import init_from_env
        from dlm_toolkit.evaluation.evaluate import load_checkpoint
        from dlm_toolkit.integrations.loglik import check_last_block, check_mc_args
        from dlm_toolkit.decoding.policy import DecodingPolicy
        from dlm_toolkit.strategy.policy_config import load_policy
        from dlm_toolkit.util.runtime import apply_threads, is_small, resolve_dtype, resolve_threads

        if preset and policy:
            raise ConfigError("model_args: give preset or policy, not both")
        if checkpoint and pretrained and str(checkpoint) != str(pretrained):
            raise ConfigError("model_args: give checkpoint or pretrained (its alias), not both")
        checkpoint = checkpoint or pretrained
        if not checkpoint:
            raise ConfigError("model_args: checkpoint=DIR (or pretrained=DIR) is required")
        for name, value in (("checkpoint", checkpoint), ("preset", preset), ("policy", policy), ("set", set),
                            ("device", device), ("dtype", dtype), ("tracking_uri", tracking_uri),
                            ("experiment_name", experiment_name)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"model_args {name}: must be text (got {value!r})")
        if not os.path.isdir(checkpoint):
            raise ConfigError(f"model_args checkpoint: {checkpoint} is not a checkpoint folder")
        self.mc_num, self.mc_batch_size = check_mc_args(mc_num, mc_batch_size)
        self.loglik_last_block = check_last_block(loglik_last_block)
        self._warned_delimiter = False
        self.batch_size = _batch_size(batch_size)
        if max_batch_size is not None:
            _integer(max_batch_size, "max_batch_size", 1, MAX_BATCH)
        self.seed = _integer(seed, "seed", 0, 2**63 - 1)
        self.stop_every = _integer(stop_every, "stop_every", 1, 1 << 20)
        if not isinstance(kv_cache, bool):  # lm-eval turns true/false into booleans; "no" is not False
            raise ConfigError(f"model_args kv_cache: must be true or false (got {kv_cache!r})")
        self.kv_cache = kv_cache
        self.config = load_policy(policy or preset, _sets(set))
        self.policy = DecodingPolicy(self.config)
        resolve_threads(threads, small_model=True)
        tp, dev = init_from_env(device)
        self.model, self.tokenizer = load_checkpoint(checkpoint, device=dev, dtype=resolve_dtype(dtype, dev), tp=tp)
        apply_threads(resolve_threads(threads, small_model=is_small(self.model)))
        self.checkpoint = str(checkpoint)
        self._device = dev
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.experiment_name = experiment_name
        self.requests_log: list[dict[str, Any]] = []
        self.loglik_log: list[dict[str, Any]] = []
        self.wall = 0.0

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "DlmLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> "DlmLM":
        """``model_args`` win over lm-eval's ``--batch_size``/``--device``; lm-eval's own default
        device (``cuda:0``, passed even when nobody asked for it) means the CPU where there is no GPU."""
        import torch

        check_model_args(arg_dict)
        known = model_arg_names()  # lm-eval's own additions (batch_size, device, ...) that we take
        extra = {k: v for k, v in (additional_config or {}).items()
                 if v is not None and k not in arg_dict and k in known}
        if extra.get("device") == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
            extra.pop("device")
        return cls(**arg_dict, **extra)

    # -- what lm-eval asks ------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return f"dlm:{self.checkpoint}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if has_chat_template(self.tokenizer) else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not has_chat_template(self.tokenizer):
            raise ConfigError(f"--apply_chat_template: the checkpoint {self.checkpoint} has no chat template")
        if add_generation_prompt:
            return chat_text(self.tokenizer, chat_history)
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, continue_final_message=True)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p, is_greedy)`` per ``(context, continuation)`` request: the Monte-Carlo ELBO of
        :mod:`dlm_toolkit.integrations.loglik` (``mc_num`` samples, exact for one token); each
        estimate's standard error goes into :attr:`loglik_log` and the results' ``config.dlm``."""
        import torch

        from dlm_toolkit.evaluation.evaluate import check_task_context
        from dlm_toolkit.integrations.loglik import estimate_loglikelihood

        pairs = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            ctx_ids, cont_ids = self._encode_pair(context, continuation)
            check_task_context(self.model, len(ctx_ids) + len(cont_ids), self.policy,
                               "lm-eval loglikelihood request (context + continuation)")
            pairs.append((ctx_ids, cont_ids))
        self._check_memory([(len(c), len(x)) for c, x in pairs])
        if not self._warned_delimiter and _is_main():
            trap = delimiter_trap(self.tokenizer, pairs)
            if trap is not None:
                self._warned_delimiter = True
                logging.getLogger(__name__).warning(trap)
        out = []
        seeds = request_seeds(self.seed, requests)
        bar = self._sample_bar("dlm loglikelihood", len(pairs), len(pairs), disable_tqdm)
        for i, ((ctx_ids, cont_ids), seed) in enumerate(zip(pairs, seeds)):
            est = estimate_loglikelihood(self.model, ctx_ids, cont_ids, self.policy.blocks.block_length,
                                         mc_num=self.mc_num, mc_batch_size=self.mc_batch_size,
                                         generator=torch.Generator().manual_seed(seed), progress=bar.update,
                                         last_block=self.loglik_last_block)
            self.loglik_log.append({"request": len(self.loglik_log), "logprob": est.logprob, "stderr": est.stderr,
                                    "samples": est.samples, "exact": est.exact, "greedy": est.greedy,
                                    "continuation_tokens": len(cont_ids)})
            out.append((est.logprob, est.greedy))
            self.cache_hook.add_partial("loglikelihood", requests[i].args, out[-1])
        bar.close()
        if out and _is_main():
            errors = [r["stderr"] for r in self.loglik_log[-len(out):]]
            logging.getLogger(__name__).info(
                "dlm loglikelihood: %d requests, mc_num %d, standard error mean %.4g, max %.4g (per request: "
                "config.dlm.loglikelihood)", len(out), self.mc_num, sum(errors) / len(errors), max(errors))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks: a document's log-likelihood as the sum of the estimates of disjoint
        windows of half the context, each conditioned on (up to) the window before it."""
        import torch

        from dlm_toolkit.integrations.loglik import estimate_loglikelihood

        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None) or 4096
        block = self.policy.blocks.block_length
        width = max(1, (limit // 2) // block * block)
        out = []
        docs = [encode_text(self.tokenizer, req.args[0]) for req in requests]
        self._check_memory([(min(lo, width), min(width, len(ids) - lo)) for ids in docs
                            for lo in range(0, len(ids), width)])
        windows = sum(-(-len(ids) // width) for ids in docs)
        bar = self._sample_bar("dlm loglikelihood_rolling", len(docs), windows, disable_tqdm)
        for req, ids, seed in zip(requests, docs, request_seeds(self.seed, requests)):
            gen = torch.Generator().manual_seed(seed)
            total, var = 0.0, 0.0
            for lo in range(0, len(ids), width):
                est = estimate_loglikelihood(self.model, ids[max(0, lo - width):lo], ids[lo:lo + width], block,
                                             mc_num=self.mc_num, mc_batch_size=self.mc_batch_size, generator=gen,
                                             progress=bar.update, last_block=self.loglik_last_block)
                total, var = total + est.logprob, var + est.stderr ** 2
            self.loglik_log.append({"request": len(self.loglik_log), "logprob": total, "stderr": var ** 0.5,
                                    "rolling": True, "tokens": len(ids)})
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        bar.close()
        return out

    def _check_memory(self, sizes: list[tuple[int, int]]) -> None:
        """Refuse, before the first forward, requests (``(context, continuation)`` token counts)
        whose largest scoring forward would not fit in memory (:func:`~dlm_toolkit.integrations.loglik.check_forward_memory`)."""
        from dlm_toolkit.integrations.loglik import check_forward_memory, forward_bytes, forward_shape

        shapes = [forward_shape(self.model, P, l, self.policy.blocks.block_length, self.mc_num, self.mc_batch_size,
                                self.loglik_last_block) for P, l in sizes]
        if shapes:
            check_forward_memory(self.model, *max(shapes, key=lambda s: forward_bytes(self.model, *s)))

    def _sample_bar(self, what: str, requests: int, estimates: int, disable: bool) -> Any:
        """A progress bar over Monte-Carlo samples, after one line stating the cost up front: each
        estimate takes ``mc_num`` samples in ``ceil(mc_num / mc_batch_size)`` forwards (one where
        the estimate is exact)."""
        forwards = -(-self.mc_num // self.mc_batch_size)
        quiet = disable or not _is_main()
        if not quiet:
            print(f"{what}: {requests} request(s), {estimates} estimate(s) of mc_num {self.mc_num} samples: up to "
                  f"{estimates * forwards} forwards of up to {self.mc_batch_size} rows (lower mc_num or raise "
                  "mc_batch_size for fewer)", file=sys.stderr)
        return tqdm(total=estimates * self.mc_num, desc=what, unit="sample", disable=quiet)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of a request's context and continuation, split as lm-eval's own models split
        them: trailing spaces of the context move to the continuation, the pair is encoded whole
        and the continuation is what follows the context's own encoding."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = encode_text(self.tokenizer, context + continuation)
        ctx = encode_text(self.tokenizer, context)
        return whole[:len(ctx)], whole[len(ctx):]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from dlm_toolkit.evaluation.evaluate import check_task_context

        seeds = request_seeds(self.seed, requests)
        jobs = []
        for i, req in enumerate(requests):
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            stops = validate_stops(until, "until")
            max_gen = kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", DEFAULT_MAX_GEN_TOKS))
            if isinstance(max_gen, bool) or not isinstance(max_gen, int) or max_gen < 1:
                raise ConfigError(f"max_gen_toks: must be an integer >= 1 (got {max_gen!r})")
            ids = encode_text(self.tokenizer, context)
            check_task_context(self.model, len(ids) + max_gen, self.policy, "lm-eval request (prompt + max_gen_toks)")
            jobs.append((i, ids, stops, max_gen))
        out: list[str] = [""] * len(requests)
        # requests that share stop strings and budget decode together, in request order
        groups: dict[tuple[tuple[str, ...], int], list[tuple[int, list[int]]]] = {}
        for i, ids, stops, max_gen in jobs:
            groups.setdefault((stops, max_gen), []).append((i, ids))
        bar = tqdm(total=len(jobs), desc="dlm generate_until", disable=disable_tqdm or not _is_main())
        for (stops, max_gen), members in groups.items():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                rows, wall = generate(self.model, self.tokenizer, [ids for _, ids in chunk], self.policy, max_gen,
                                      stop=stops, seeds=[seeds[i] for i, _ in chunk],
                                      kv_cache=self.kv_cache, stop_every=self.stop_every)
                self.wall += wall
                for (i, _), row in zip(chunk, rows):
                    out[i] = row.text
                    self.requests_log.append({"request": i, "nfe": row.nfe, "tokens": len(row.tokens),
                                              "tpf": len(row.tokens) / max(row.nfe, 1), "edits": row.edits,
                                              "stopped": row.stopped, "blocks_skipped": row.blocks_skipped})
                    self.cache_hook.add_partial("generate_until", requests[i].args, row.text)
                bar.update(len(chunk))
        bar.close()
        return out

    # -- what goes into the results -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Totals over the requests decoded so far (TPF: tokens up to and including EOS per forward)."""
        log = sorted(self.requests_log, key=lambda r: r["request"])
        tokens, nfe = sum(r["tokens"] for r in log), sum(r["nfe"] for r in log)
        return {"requests": len(log), "nfe_total": nfe, "nfe_mean": nfe / max(len(log), 1),
                "tpf": tokens / max(nfe, 1), "tokens_per_second": tokens / self.wall if self.wall > 0 else 0.0,
                "stopped_at_stop_string": sum(r["stopped"] == "stop" for r in log),
                "stopped_at_eos": sum(r["stopped"] == "eos" for r in log),
                "blocks_skipped": sum(r["blocks_skipped"] for r in log), "wall_time_s": self.wall}

    def get_model_info(self) -> dict[str, Any]:
        totals = self.stats()
        info = {"dlm": {"checkpoint": self.checkpoint, "policy": self.config.model_dump(mode="json"),
                        "policy_hash": self.config.config_hash(), **totals,
                        "per_request": sorted(self.requests_log, key=lambda r: r["request"])}}
        if self.loglik_log:
            errors = [r["stderr"] for r in self.loglik_log]
            info["dlm"]["loglikelihood"] = {"mc_num": self.mc_num, "mc_batch_size": self.mc_batch_size,
                                            "last_block": self.loglik_last_block,
                                            "requests": len(self.loglik_log), "stderr_max": max(errors),
                                            "stderr_mean": sum(errors) / len(errors), "per_request": self.loglik_log}
        if self.tracking_uri and _is_main() and self.requests_log:
            info["dlm"]["mlflow_run_id"] = self._log_mlflow(totals)
        return info

    def _log_mlflow(self, totals: dict[str, Any]) -> str:
        from mlflow import MlflowClient

        client = MlflowClient(self.tracking_uri)
        exp = client.get_experiment_by_name(self.experiment_name)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment_name)
        run = client.create_run(exp_id, tags={"kind": "lm-eval", "policy_hash": self.config.config_hash(),
                                              "checkpoint": self.checkpoint})
        for key, value in self.config.flat().items():
            client.log_param(run.info.run_id, key, value)
        for key in ("nfe_mean", "tpf", "tokens_per_second", "wall_time_s", "blocks_skipped"):
            client.log_metric(run.info.run_id, key, float(totals[key]))
        client.set_terminated(run.info.run_id)
        return run.info.run_id


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Raw ids of ``text`` (no special tokens; a chat template, if asked, is already applied), its
    length checked first (:func:`~dlm_toolkit.tasks.base.check_prompt_length`)."""
    from dlm_toolkit.models.chat import encode_prompt
    from dlm_toolkit.tasks.base import check_prompt_length

    check_prompt_length(text, "an lm-eval request")
    return encode_prompt(tokenizer, text, False)


def request_seeds(seed: int, requests: Sequence[Any]) -> list[int]:
    """One stream seed per request, from ``seed`` and the request itself (task, document, index,
    arguments) plus its occurrence among identical requests (lm-eval's ``repeats`` send one request
    several times; each copy samples anew). Never from its position in the list, a batch or a group:
    the same request gives the same text and the same estimate whatever it is sent with."""
    import hashlib
    import json

    from dlm_toolkit.step.state import row_seed

    seen: dict[str, int] = {}
    out = []
    for req in requests:
        key = json.dumps([getattr(req, "task_name", None), getattr(req, "doc_id", None), getattr(req, "idx", None),
                          list(req.args)], sort_keys=True, default=str)
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        digest = hashlib.sha256(f"{key}|{occurrence}".encode()).digest()
        out.append(row_seed(seed, int.from_bytes(digest[:8], "big")))
    return out


def _is_main() -> bool:
    from dlm_toolkit.models.distributed import is_main_process

    return is_main_process()


def main(argv: Sequence[str] | None = None) -> int:
    """``dlm-lm-eval``: lm-eval's command line with the ``dlm`` model registered.

    Bad input (our checks: a policy, a checkpoint, stop strings, ``max_gen_toks`` past the context,
    ``mc_num``, a loglikelihood request past the context) exits 2 with one line. Under ``torchrun`` the model
    joins the process group as it loads (:func:`dlm_toolkit.models.distributed.init_from_env`), which
    silences ``stdout`` on ranks other than 0, and lm-eval then saves results on rank 0 only.
    """
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm_eval", *args]
    try:
        cli_evaluate()
    except (ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
