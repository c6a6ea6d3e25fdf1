"""Evaluation: accuracy, pass@k and mean response length of a model on a prompt set.

`evaluate` is shared by GRPO's periodic validation and `posttrain eval` (a checkpoint or any HF
model), so both report the same numbers the same way.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from posttrain.data.sample import Sample
from posttrain.rollouts import run_multi_turn_rollout, sample_seeds
from posttrain.utils.metric_names import accuracy_name, in_validation_set
from posttrain.utils.metrics import per_task_means, response_lengths


def pass_at_k(n: int, c: Union[int, torch.Tensor], k: int) -> torch.Tensor:
    """Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
    ``1 - C(n - c, k) / C(n, k)`` for ``n`` samples of which ``c`` are correct, computed in
    log space. ``c`` may be a tensor of counts; returns a float tensor of the same shape."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = torch.as_tensor(c)
    if c.numel() and (c.min() < 0 or c.max() > n):
        raise ValueError(f"pass@k: correct counts must lie in [0, n={n}], got {c.tolist()}")
    wrong = (n - c).double()
    log_ratio = (
        torch.lgamma(wrong + 1) - torch.lgamma((wrong - k).clamp(min=0) + 1)
        - torch.lgamma(torch.tensor(n + 1.0, dtype=torch.double))
        + torch.lgamma(torch.tensor(n - k + 1.0, dtype=torch.double))
    )
    return torch.where(wrong < k, torch.ones_like(wrong), 1 - log_ratio.exp()).float()


def validation_sampling(generation_cfg, k: int) -> tuple[bool, Optional[float]]:
    """`(greedy, temperature)` for validation with `k` samples per prompt: greedy when k == 1 and
    `val_temperature` is unset; otherwise sampled at `val_temperature`, or at the training
    `temperature` when it is unset (temperature None: the engine's configured one)."""
    greedy = k == 1 and generation_cfg.val_temperature is None
    return greedy, None if greedy else generation_cfg.val_temperature


def evaluate(
    generation,
    samples: list[Sample],
    tokenizer,
    envs: dict[str, Any],
    *,
    k: int = 1,
    greedy: bool = True,
    temperature: Optional[float] = None,
    batch_size: int = 256,
    max_seq_len: int = 256,
    max_rollout_turns: int = 1,
    seed: int = 0,
    weight_version: int = 0,
    num_samples_to_print: int = 0,
    log_samples: Optional[Callable[[list[dict]], None]] = None,
) -> dict[str, float]:
    """Roll out every prompt `k` times and score the answers.

    Sampling (not `greedy`) uses `temperature` when given, else the engine's configured one.
    The first sample of the first `num_samples_to_print` prompts goes to `log_samples` as
    `{"prompt", "response", "reward"}` dicts (`completion_rows`; default None: printed, short).

    Returns the accuracy under a name that says how it was decoded
    (`posttrain.utils.metric_names`): `validation/accuracy_greedy` (greedy: the mean reward of the
    one sample per prompt) or `validation/accuracy_sampled` (the mean reward of all `k` samples,
    i.e. pass@1), per task too with several environments; `validation/avg_length`; and for k > 1
    `validation/pass@k` (the unbiased estimator of Chen et al. 2021), `validation/cons@k` (majority
    vote) and `validation/mean_reward`; and `validation/reward_components/<name>`, the mean of each
    reward component the environments reported (`EnvironmentReturn.reward_components`) where it applied.
    """
    rewards, lengths, answers = [], [], []
    components: dict[str, list[float]] = {}  # each reward component's values where it applied
    for start in range(0, len(samples), batch_size):
        chunk = [s.fresh_copy() for s in samples[start : start + batch_size] for _ in range(k)]
        result = run_multi_turn_rollout(
            generation, chunk, tokenizer, envs, max_seq_len=max_seq_len,
            max_rollout_turns=max_rollout_turns, greedy=greedy,
            seeds=sample_seeds(seed, start, len(chunk)), weight_version=weight_version,
            params={"temperature": temperature} if temperature is not None and not greedy else None, group_size=k,
        )
        rewards.append(result.rewards)
        answers.extend(result.answers)
        lengths.append(response_lengths(chunk))
        for sample in chunk:
            for name, value in sample.reward_components.items():
                components.setdefault(name, []).append(value)
        if start == 0 and num_samples_to_print > 0:
            rows = completion_rows(chunk[::k][:num_samples_to_print], tokenizer)
            if log_samples is not None:
                log_samples(rows)
            else:
                from posttrain.utils.logger import format_samples, write_line

                write_line(format_samples(rows, "validation samples"))
    r = torch.cat(rewards).view(-1, k)
    accuracy = accuracy_name(greedy)
    per_prompt = r.mean(dim=1)  # greedy: k == 1 (the config check), so this is the one sample
    metrics = {
        accuracy: per_prompt.mean().item(),
        "validation/avg_length": torch.cat(lengths).mean().item(),
    }
    metrics.update(per_task_means(per_prompt, [s.task_name for s in samples], accuracy, list(envs)))
    metrics.update({f"validation/reward_components/{name}": sum(values) / len(values)
                    for name, values in sorted(components.items())})
    if k > 1:
        correct = (r > 0.5).sum(dim=1)
        metrics[f"validation/pass@{k}"] = pass_at_k(k, correct, k).float().mean().item()
        metrics[f"validation/cons@{k}"] = consensus_accuracy(answers, r.flatten(), k)
        metrics["validation/mean_reward"] = r.mean().item()
    return metrics


def completion_rows(samples: Sequence[Sample], tokenizer) -> list[dict]:
    """`{"prompt", "response", "reward"}` of rolled-out samples, for people to read: the prompt's
    text without the chat template's special tokens, everything after it (the generated turns and
    any environment observations), and the reward."""
    rows = []
    for sample in samples:
        prompt = sample.message_log[0]
        ids = prompt.get("token_ids")
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True) if ids is not None else prompt["content"]
        rows.append({"prompt": text.strip(), "response": "".join(m["content"] for m in sample.message_log[1:]),
                     "reward": float(sample.reward)})
    return rows


def consensus_accuracy(answers: list[Optional[str]], rewards: torch.Tensor, k: int) -> float:
    """cons@k (majority voting, Wang et al. 2023 "self-consistency"): per prompt, the most common
    extracted answer among its k samples (ties: the first seen); correct when a sample giving
    that answer was rewarded. Prompts with no extracted answer count as wrong."""
    correct = 0
    num_prompts = len(answers) // k
    for p in range(num_prompts):
        group = answers[p * k : (p + 1) * k]
        votes = Counter(a for a in group if a is not None)
        if not votes:
            continue
        majority = max(votes, key=lambda a: (votes[a], -group.index(a)))
        correct += any(a == majority and float(rewards[p * k + j]) > 0.5 for j, a in enumerate(group))
    return correct / max(num_prompts, 1)


def run(cfg) -> dict[str, float]:
    """`posttrain eval`: evaluate `policy.model_name` (hub id, HF dir or checkpoint step dir).

    Prints what was scored (model, split, prompts, samples per prompt) and the metrics, and
    appends one record per evaluation to `<logger.log_dir>/eval_results.jsonl` (never to a
    training run's metrics.jsonl). With `eval.split=validation`, each of `data.validation_sets`
    is scored too, as `validation_<name>/...` (a column of the per-task table).
    """
    import time

    from posttrain.data.processors import build_prompt_message_log
    from posttrain.environments.registry import EnvRouter
    from posttrain.job import (
        build_datums,
        build_validation_sets,
        make_cluster,
        make_envs,
        make_generation,
        start_run,
        workers_description,
    )
    from posttrain.utils import startup

    e = cfg.eval
    model_name = cfg.policy.model_name
    cfg, tokenizer = start_run(cfg, seed=e.seed)
    samples = build_datums(cfg, build_prompt_message_log, tokenizer, e.split, e.max_samples)
    if not samples:
        from posttrain.errors import UserError

        raise UserError(f"eval.split={e.split!r} of the configured data has no records (is data.validation_path set?)")
    # The named validation sets (data.validation_sets) are scored with the validation split.
    sets = build_validation_sets(cfg, build_prompt_message_log, tokenizer, e.max_samples) if e.split == "validation" else {}
    k = e.num_generations_per_prompt
    greedy, temperature = validation_sampling(cfg.policy.generation, k)
    sampling = "greedy" if greedy else f"sampled at temperature {temperature or cfg.policy.generation.temperature}"
    also = "".join(f" + {len(rows)} of validation set {name}" for name, rows in sets.items())
    print(f"[posttrain] eval: {model_name}, {e.split} split, {len(samples)} prompts{also} x {k} samples ({sampling})",
          flush=True)
    envs = make_envs(cfg, samples + [s for rows in sets.values() for s in rows])
    with startup.phase("workers", workers_description(cfg, policy=False, generation=True)):
        cluster = make_cluster(cfg, 1, name="eval")
        generation = make_generation(cfg, cluster, seed=e.seed)
    try:
        def score(rows: list, show: int) -> dict[str, float]:
            return evaluate(
                generation, rows, tokenizer, envs, k=k, greedy=greedy, temperature=temperature,
                batch_size=e.batch_size, max_seq_len=cfg.policy.max_total_sequence_length,
                max_rollout_turns=e.max_rollout_turns, seed=e.seed, num_samples_to_print=show,
            )

        metrics = score(samples, cfg.logger.num_val_samples_to_print)
        for name, rows in sets.items():
            metrics.update(in_validation_set(score(rows, 0), name))
    finally:
        EnvRouter(envs).shutdown()
        generation.shutdown()
        cluster.shutdown()
    results = Path(cfg.logger.log_dir) / "eval_results.jsonl"
    print_metrics(metrics, previous_result(results, e.split))
    record = {"model": model_name, "split": e.split, "num_prompts": len(samples), "samples_per_prompt": k,
              "greedy": greedy, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "metrics": metrics}
    with results.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"[posttrain] results appended to {results}", flush=True)
    return metrics


def previous_result(results: Path, split: str) -> Optional[dict]:
    """The last record of `eval_results.jsonl` for `split` (None if none, or the file is unreadable)."""
    try:
        records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    records = [r for r in records if isinstance(r, dict) and r.get("split") == split and "metrics" in r]
    return records[-1] if records else None


def print_metrics(metrics: dict[str, float], previous: Optional[dict] = None) -> None:
    """The overall metrics, one per line; with several tasks, then the per-task table
    (`posttrain.evals.task_table`), compared with the `previous` evaluation's record."""
    from posttrain.evals.task_table import format_task_table, task_columns

    names, tasks = task_columns(metrics)
    per_task = {f"{name}/{task}" for name in names for task in tasks} | {f"{name}_count/{task}" for name in names
                                                                        for task in tasks}
    for name, value in metrics.items():
        if name not in per_task:
            print(f"{name}: {value:.4f}")
    table = format_task_table(metrics, previous and previous["metrics"], previous and previous.get("model"))
    if table:
        print(table, flush=True)
