"""Partial rollouts for GRPO (`grpo.partial_rollouts`; slime's partial rollout, Kimi k1.5's
"partial rollouts"): a step's generation does not wait for its longest sequences.

Generation proceeds in chunks of `chunk_tokens` new tokens. After each chunk the step counts its
prompt groups whose every sequence has finished; once at least `min_complete_fraction` of them
have, generation stops. The complete groups are scored by their environments and trained on; the
unfinished sequences stop (`SampleStatus.PAUSED`) and, with the rest of their groups, carry over:
the next step continues them under its new weights, before its own new prompts' groups.

Exactness. Each generated token keeps the generation logprob and the weight version that produced
it (`SequenceProgress`; the trained message gets `generation_logprobs` and a per-token
`weight_versions`), so the loss's importance weights pi / pi_gen and `token_mult_prob_error` use
each token's own generating distribution. A continued sequence draws what one uninterrupted
generation would under the same weights and seed: the native engine's sampling is counter-based
and the continuation passes `start_steps` (`NativeGenerationEngine.generate`), so a chunk boundary
changes neither the random stream nor stop-string detection. A group whose oldest token is more
than `max_age_steps` weight versions behind the current weights is dropped and counted.

The carry-over is checkpointed beside the policy (`partial_rollouts.pt` in the step directory),
so a resumed run continues exactly where it stopped. The config refuses what cannot be exact
(`posttrain.config.schema.jobs.partial_rollouts_problem`): async GRPO, dynamic sampling, a loss
without importance-sampling correction, multi-turn rollouts and backends other than `native`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from posttrain.algorithms.experience import PromptGroup, score_groups
from posttrain.data.sample import Sample, SampleStatus
from posttrain.distributed.batch import Batch
from posttrain.models.generation.engine import assemble_outputs
from posttrain.rollouts import run_multi_turn_rollout, sample_seeds
from posttrain.utils.timer import Timer

STATE_FILE = "partial_rollouts.pt"


@dataclass
class SequenceProgress:
    """One sequence's generation so far: its sample (the prompt as `message_log`), its sampling
    seed, and per generated token the id, the generation logprob and the weight version."""

    sample: Sample
    seed: int
    token_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    weight_versions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    done: bool = False  # the turn's generation ended (a stop) or used its whole budget
    stopped: bool = False  # ended on eos / a stop token / a stop string (not the budget)

    @property
    def oldest_version(self) -> Optional[int]:
        return int(self.weight_versions.min()) if self.weight_versions.numel() else None

    def prompt_ids(self) -> torch.Tensor:
        return torch.cat([m["token_ids"] for m in self.sample.message_log])


Group = list[SequenceProgress]


def _chunk_batch(active: list[SequenceProgress], pad_token_id: int) -> Batch:
    """The active sequences as prompts (prompt + tokens generated so far, right-padded), with
    their seeds, stop strings and `start_steps` (tokens already generated)."""
    rows = [torch.cat([p.prompt_ids(), p.token_ids]) for p in active]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    input_ids = torch.full((len(rows), int(lengths.max())), pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = r
    batch = Batch(input_ids=input_ids, input_lengths=lengths)
    batch["seeds"] = torch.tensor([p.seed for p in active], dtype=torch.long)
    batch["start_steps"] = torch.tensor([len(p.token_ids) for p in active], dtype=torch.long)
    batch["stop_strings"] = [p.sample.stop_strings for p in active]
    return batch


def _extend(p: SequenceProgress, out: Batch, k: int, start: int, remaining: int, version: int,
            max_new_tokens: int) -> None:
    """Append row `k` of a chunk's output (its new tokens from column `start`), cut at the
    sequence's remaining budget (`remaining`), to `p`, and mark it done when its turn ended."""
    length = int(out["generation_lengths"][k])
    take = min(length, remaining)
    p.token_ids = torch.cat([p.token_ids, out["output_ids"][k, start : start + take].long().cpu()])
    p.logprobs = torch.cat([p.logprobs, out["logprobs"][k, start : start + take].float().cpu()])
    p.weight_versions = torch.cat([p.weight_versions, torch.full((take,), version, dtype=torch.long)])
    if not bool(out["truncated"][k]) and length <= remaining:
        p.done, p.stopped = True, True
    elif len(p.token_ids) >= max_new_tokens:
        p.done = True


def generate_in_chunks(
    generation: Any, groups: list[Group], *, version: int, max_new_tokens: int, chunk_tokens: int,
    min_complete_fraction: float, pad_token_id: int,
) -> tuple[float, int]:
    """Generate the groups' unfinished sequences chunk by chunk (`generation.generate` with
    `max_new_tokens` of at most `chunk_tokens`) under weight version `version` until every
    sequence is done or at least `min_complete_fraction` of the groups are complete; sequences
    still unfinished then are PAUSED. Returns (fraction of groups complete, chunks generated)."""
    chunks = 0
    while True:
        active = [p for group in groups for p in group if not p.done]
        if not active:
            break
        remaining = [max_new_tokens - len(p.token_ids) for p in active]
        batch = _chunk_batch(active, pad_token_id)
        # Rows with less budget left generate a little more and are cut: counter-based sampling
        # draws a row's tokens independently of the others and of the call's budget.
        out = generation.generate(batch, greedy=False, params={"max_new_tokens": min(chunk_tokens, max(remaining))})
        for k, (p, left) in enumerate(zip(active, remaining)):
            _extend(p, out, k, int(batch["input_lengths"][k]), left, version, max_new_tokens)
        chunks += 1
        if complete_fraction(groups) >= min_complete_fraction:
            break
    for group in groups:
        for p in group:
            p.sample.status = SampleStatus.RUNNING if p.done else SampleStatus.PAUSED
    return complete_fraction(groups), chunks


def complete_fraction(groups: list[Group]) -> float:
    return sum(all(p.done for p in group) for group in groups) / max(len(groups), 1)


class _Replay:
    """A generation backend that answers a rollout's one turn with the tokens the chunks already
    generated (one `SequenceProgress` per row, in order), so the rollout loop scores them as usual."""

    def __init__(self, progress: list[SequenceProgress], pad_token_id: int):
        self.progress, self.pad_token_id = progress, pad_token_id

    def prepare_for_generation(self) -> bool:
        return True

    def finish_generation(self) -> bool:
        return True

    def generate_shards(self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None):
        longest = max(len(p.token_ids) for p in self.progress)
        tokens = torch.full((len(self.progress), longest), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(self.progress), longest), dtype=torch.float32)
        for i, p in enumerate(self.progress):
            tokens[i, : len(p.token_ids)], logprobs[i, : len(p.logprobs)] = p.token_ids, p.logprobs
        lengths = torch.tensor([len(p.token_ids) for p in self.progress], dtype=torch.long)
        stopped = torch.tensor([p.stopped for p in self.progress], dtype=torch.bool)
        out = assemble_outputs(batch["input_ids"], batch["input_lengths"], tokens, logprobs, lengths, stopped,
                               self.pad_token_id)
        yield list(range(batch.size)), Batch(out)


class PartialRollouts:
    """GRPO's partial rollouts: the carried-over groups and the step's rollout (module doc)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.carried: list[Group] = []

    # ----------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"groups": [[vars(p).copy() for p in group] for group in self.carried]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.carried = [[SequenceProgress(**p) for p in group] for group in state["groups"]]

    @classmethod
    def attach(cls, ctx: Any) -> "PartialRollouts":
        """The run's partial rollouts: restored from the latest checkpoint when `ctx` resumed, and
        saved with every checkpoint from now on (`TrainingLoop.checkpoint_extras`)."""
        partial = cls(ctx.cfg)
        latest = ctx.loop.checkpointer.latest() if ctx.step and ctx.cfg.checkpointing.enabled else None
        if latest is not None and (latest / STATE_FILE).exists():
            partial.load_state_dict(torch.load(latest / STATE_FILE, weights_only=False))
        loader = ctx.train_loader
        ctx.loop.checkpoint_extras = lambda: (loader.state_dict(), {STATE_FILE: partial.state_dict()})
        return partial

    # -------------------------------------------------------------------------- rollout
    def roll_out(self, ctx: Any, prompts: list[Sample], seed_key: int, timer: Timer) -> tuple[list[PromptGroup], dict[str, float]]:
        """One step's rollout: the carried-over groups (too old ones dropped) and a group for each
        of `prompts` generated in chunks until enough groups are complete; the complete ones
        scored (`PromptGroup`s, tagged with their oldest weight version) and the step's metrics
        (`partial_rollouts/*` beside the rollout's own). The rest carry over."""
        cfg, g = ctx.cfg, ctx.cfg.grpo
        p_cfg, n_gen, version = g.partial_rollouts, g.num_generations_per_prompt, ctx.step
        kept = [group for group in self.carried if not self._too_old(group, version)]
        dropped = [group for group in self.carried if self._too_old(group, version)]
        resumed = sum(len(p.token_ids) > 0 and not p.done for group in kept for p in group)
        seeds = sample_seeds(g.seed, seed_key, len(prompts) * n_gen).tolist()
        new = [[SequenceProgress(prompt.fresh_copy(), seeds[i * n_gen + j]) for j in range(n_gen)]
               for i, prompt in enumerate(prompts)]
        groups = kept + new

        t0 = time.perf_counter()
        ctx.generation.prepare_for_generation()
        try:
            fraction, chunks = generate_in_chunks(
                ctx.generation, groups, version=version, max_new_tokens=cfg.policy.generation.max_new_tokens,
                chunk_tokens=p_cfg.chunk_tokens, min_complete_fraction=p_cfg.min_complete_fraction,
                pad_token_id=ctx.tokenizer.pad_token_id,
            )
        finally:
            ctx.generation.finish_generation()
        complete = [group for group in groups if all(p.done for p in group)]
        self.carried = [group for group in groups if not all(p.done for p in group)]

        progress = [p for group in complete for p in group]
        result = run_multi_turn_rollout(
            _Replay(progress, ctx.tokenizer.pad_token_id), [p.sample for p in progress], ctx.tokenizer, ctx.envs,
            max_seq_len=cfg.policy.max_total_sequence_length, max_rollout_turns=1, weight_version=version,
            group_size=n_gen,
        )
        for p in progress:
            message = next(m for m in p.sample.message_log if "generation_logprobs" in m)
            message["weight_versions"] = p.weight_versions.clone()
            message["weight_version"] = p.oldest_version
        result.add_timings(timer, time.perf_counter() - t0)
        scored = score_groups(ctx, result, len(complete), version)
        for prompt_group, group in zip(scored, complete):
            prompt_group.weight_version = min(p.oldest_version for p in group)

        metrics = dict(result.metrics)
        metrics.update({
            "partial_rollouts/trained_groups": float(len(complete)),
            "partial_rollouts/carried_over_groups": float(len(self.carried)),
            "partial_rollouts/carried_over_sequences": float(sum(not p.done for grp in self.carried for p in grp)),
            "partial_rollouts/resumed_sequences": float(resumed),
            "partial_rollouts/dropped_too_old_groups": float(len(dropped)),
            "partial_rollouts/dropped_too_old_sequences": float(sum(len(group) for group in dropped)),
            "partial_rollouts/complete_fraction_at_stop": fraction,
            "partial_rollouts/num_chunks": float(chunks),
            "partial_rollouts/mixed_version_sequences": float(
                sum(bool((p.weight_versions != p.weight_versions[0]).any()) for p in progress if len(p.weight_versions))
            ),
        })
        return scored, metrics

    def _too_old(self, group: Group, version: int) -> bool:
        """The group's oldest token is more than `max_age_steps` versions behind `version`."""
        oldest = [p.oldest_version for p in group if p.oldest_version is not None]
        return bool(oldest) and version - min(oldest) > self.cfg.grpo.partial_rollouts.max_age_steps
