"""Partial rollouts for GRPO (`grpo.partial_rollouts`; slime's partial rollout, Kimi k1.5's
"partial rollouts"): a step's generation does not wait for its longest episodes.

Generation proceeds in chunks of `chunk_tokens` new tokens. After each chunk, the groups whose
samples have all generated their current turn take their environment step together (as in
`posttrain.rollouts`: a group's samples active in a turn are stepped at once); a sample the
environment lets go on starts its next turn (multi-turn: tool results, game moves) in the next
chunk, one that ends is done (and an episode the rollout stops, by the token limit or
`max_rollout_turns`, is scored by its environment's `finish` once its whole group has ended). The
step counts its prompt groups whose every sample has ended; once at least `min_complete_fraction`
of them have, generation stops. The complete groups are trained on; the others carry over, with
each sample's state: its conversation so far (earlier turns and observations), the current turn's
tokens (`SampleStatus.PAUSED` mid-turn), its turn count, counters, reward so far and environment
metadata. The next step continues them under its new weights, before its own new prompts' groups.

Exactness. Each generated token keeps the generation logprob and the weight version that produced
it (`SequenceProgress`; each trained assistant message gets `generation_logprobs` and a per-token
`weight_versions`), so the loss's importance weights pi / pi_gen and `token_mult_prob_error` use
each token's own generating distribution. A continued turn draws what one uninterrupted generation
would under the same weights and seed: the native engine's sampling is counter-based and the
continuation passes `start_steps` (`NativeGenerationEngine.generate`), so a chunk boundary changes
neither the random stream nor stop-string detection; turn t samples with the seed the ordinary
rollout gives it (`seed + t * TURN_SEED_STRIDE`). A group whose oldest token (over all turns) is
more than `max_age_steps` weight versions behind the current weights is dropped and counted.

The carry-over is checkpointed beside the policy (`partial_rollouts.pt` in the step directory),
so a resumed run continues exactly where it stopped; a step replayed after a recovered failure
(`cluster.max_restarts`) starts from the carry-over it began with. An environment that keeps an
episode's state in its own memory (`Environment.live_episode_state`: a textarena game, an HTTP
session) cannot be carried through a checkpoint: multi-turn runs refuse it (`environment_problem`). The config refuses
what cannot be exact (`posttrain.config.schema.jobs.partial_rollouts_problem`): async GRPO, dynamic
sampling, a loss without importance-sampling correction and backends other than `native`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from posttrain.algorithms.experience import PromptGroup, score_groups
from posttrain.data.message_log import message_log_images, message_log_source_images
from posttrain.data.sample import Sample, SampleStatus
from posttrain.distributed.batch import Batch
from posttrain.rollouts import (TURN_SEED_STRIDE, RolloutTotals, add_counts, add_speculative_counts, append_turn,
                                collect_env, finish_episodes, launch_env, rollout_result, sample_seeds, take_env_step)
from posttrain.utils.timer import Timer

STATE_FILE = "partial_rollouts.pt"
_LIVE = (SampleStatus.PENDING, SampleStatus.RUNNING, SampleStatus.PAUSED)  # the episode has not ended


@dataclass
class SequenceProgress:
    """One episode's progress: its sample (the conversation so far as `message_log`: the prompt,
    finished turns and observations; its turn count, counters, reward and environment metadata),
    its sampling seed, and per token of the current turn generated so far the id, the generation
    logprob and the weight version."""

    sample: Sample
    seed: int
    token_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    weight_versions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    done: bool = False  # the current turn's generation ended (a stop) or used its whole budget
    stopped: bool = False  # ended on eos / a stop token / a stop string (not the budget)
    # Counts of the group's environment calls so far (`EnvironmentReturn.metrics`), kept on the
    # group's first sequence and logged in the step that trains the group.
    env_counts: dict = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.sample.status not in _LIVE

    @property
    def oldest_version(self) -> Optional[int]:
        """The oldest weight version of the episode's tokens, over all its turns."""
        versions = [int(m["weight_versions"].min()) for m in self.sample.message_log
                    if "weight_versions" in m and len(m["weight_versions"])]
        if self.weight_versions.numel():
            versions.append(int(self.weight_versions.min()))
        return min(versions) if versions else None

    def all_versions(self) -> torch.Tensor:
        """The weight version of every generated token of the episode, turn by turn."""
        return torch.cat([m["weight_versions"] for m in self.sample.message_log if "weight_versions" in m]
                         + [self.weight_versions])

    def prompt_ids(self) -> torch.Tensor:
        return torch.cat([m["token_ids"] for m in self.sample.message_log])

    def turn_seed(self) -> int:
        """The seed of the current turn: the ordinary rollout's (`_turn_batch`)."""
        return self.seed + int(getattr(self.sample, "turns", 0) or 0) * TURN_SEED_STRIDE

    def start_turn(self) -> None:
        self.token_ids, self.logprobs = self.token_ids[:0], self.logprobs[:0]
        self.weight_versions, self.done, self.stopped = self.weight_versions[:0], False, False


Group = list[SequenceProgress]


def _chunk_batch(active: list[SequenceProgress], pad_token_id: int) -> Batch:
    """The active sequences as prompts (conversation + tokens of the turn so far, right-padded),
    with their turn's seeds, stop strings and `start_steps` (tokens of the turn already generated)."""
    rows = [torch.cat([p.prompt_ids(), p.token_ids]) for p in active]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    input_ids = torch.full((len(rows), int(lengths.max())), pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = r
    batch = Batch(input_ids=input_ids, input_lengths=lengths)
    batch["seeds"] = torch.tensor([p.turn_seed() for p in active], dtype=torch.long)
    batch["start_steps"] = torch.tensor([len(p.token_ids) for p in active], dtype=torch.long)
    batch["stop_strings"] = [p.sample.stop_strings for p in active]
    images = message_log_images([p.sample.message_log for p in active])  # a vision-language model's prompts
    if images is not None:
        batch["pixel_values"] = images
        batch["images"] = message_log_source_images([p.sample.message_log for p in active])  # for vLLM
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
    min_complete_fraction: float, pad_token_id: int, advance: Optional[Callable[[list[Group]], None]] = None,
    totals: Optional[RolloutTotals] = None,
) -> tuple[float, int]:
    """Generate the groups' unfinished turns chunk by chunk (`generation.generate` with
    `max_new_tokens` of at most `chunk_tokens`) under weight version `version`, calling
    `advance(groups)` after each chunk (`EpisodeStepper`: environment steps, next turns; None:
    single turns without environments), until every sequence is done or at least
    `min_complete_fraction` of the groups are complete; sequences still mid-turn then are PAUSED.
    The engine's speculative counts are added to `totals` (default None: not kept).
    Returns (fraction of groups complete, chunks generated)."""
    chunks = 0
    if advance is not None:  # groups carried over with their turn generated (none, unless stopped in between)
        advance(groups)
    while True:
        active = [p for group in groups for p in group if not p.done]
        if not active:
            break
        remaining = [max_new_tokens - len(p.token_ids) for p in active]
        batch = _chunk_batch(active, pad_token_id)
        # Rows with less budget left generate a little more and are cut: counter-based sampling
        # draws a row's tokens independently of the others and of the call's budget.
        out = generation.generate(batch, greedy=False, params={"max_new_tokens": min(chunk_tokens, max(remaining))})
        if totals is not None:
            add_speculative_counts(totals.speculative, out)
        for k, (p, left) in enumerate(zip(active, remaining)):
            _extend(p, out, k, int(batch["input_lengths"][k]), left, version, max_new_tokens)
        chunks += 1
        if advance is not None:
            advance(groups)
        if complete_fraction(groups) >= min_complete_fraction:
            break
    for group in groups:
        for p in group:
            if not p.ended:
                p.sample.status = SampleStatus.RUNNING if p.done else SampleStatus.PAUSED
    return complete_fraction(groups), chunks


def complete_fraction(groups: list[Group]) -> float:
    """Groups whose every sequence is done: with environment steps (`EpisodeStepper`), whose every
    episode has ended (a done turn of a live episode is stepped at once)."""
    return sum(all(p.done for p in group) for group in groups) / max(len(groups), 1)


@dataclass
class EpisodeStepper:
    """What follows a chunk (`generate_in_chunks`'s `advance`): each group whose live samples have
    all generated their turn has it appended (with per-token versions) and takes its environment
    step; its samples that go on start their next turn, or reach `max_rollout_turns`; a group
    whose episodes have all ended has the unfinished ones scored by `finish`. Environment calls
    are one per group (as the ordinary rollout's), launched together, then waited for."""

    envs: dict[str, Any]
    tokenizer: Any
    max_seq_len: int
    max_rollout_turns: int
    totals: RolloutTotals = field(default_factory=RolloutTotals)

    def __call__(self, groups: list[Group]) -> None:
        ready = [group for group in groups if all(p.done or p.ended for p in group) and not all(p.ended for p in group)]
        if not ready:
            return
        t0 = time.perf_counter()
        launched = []
        for group in ready:
            members = [p for p in group if not p.ended]
            for p in members:
                p.sample.status = SampleStatus.RUNNING
                message = append_turn(p.sample, p.token_ids, p.logprobs, self.tokenizer,
                                      int(p.weight_versions.min()) if len(p.weight_versions) else None,
                                      hit_max_new_tokens=not p.stopped)
                message["weight_versions"] = p.weight_versions.clone()
                p.start_turn()
            samples = [p.sample for p in members]
            launched.append((group, members, launch_env(self.envs, samples, list(range(len(samples))))))
        for group, members, pending in launched:
            samples, counts = [p.sample for p in members], RolloutTotals()
            env_out = collect_env(pending, None, samples, list(range(len(samples))), counts)
            for row, p in enumerate(members):
                take_env_step(p.sample, env_out, row, self.tokenizer, self.max_seq_len)
                if p.sample.status is SampleStatus.RUNNING and p.sample.turns >= self.max_rollout_turns:
                    p.sample.status = SampleStatus.TURN_LIMIT
                p.done = p.ended  # a live episode generates its next turn
            if all(p.ended for p in group):
                finish_episodes(self.envs, [p.sample for p in group], None, counts)
            add_counts(group[0].env_counts, counts.env_counts)
        self.totals.env_seconds += time.perf_counter() - t0


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

    def restore(self, checkpoint: Optional[Path]) -> None:
        """The carry-over saved in `checkpoint` (None, or a checkpoint without one: none)."""
        self.carried = []
        if checkpoint is not None and (checkpoint / STATE_FILE).exists():
            self.load_state_dict(torch.load(checkpoint / STATE_FILE, weights_only=False))

    def _put_back(self, carried: list[Group]) -> None:
        self.carried = carried

    @classmethod
    def attach(cls, ctx: Any) -> "PartialRollouts":
        """The run's partial rollouts: restored from the latest checkpoint when `ctx` resumed, and
        saved with every checkpoint from now on (`TrainingLoop.checkpoint_extras`). A recovered
        failure replays a step from the carry-over it began with (a rollout advances it in
        place, so it is copied before each step), or goes back to the one of the checkpoint the
        run goes back to."""
        partial = cls(ctx.cfg)
        partial.restore(ctx.loop.checkpointer.latest() if ctx.step and ctx.cfg.checkpointing.enabled else None)
        loader = ctx.train_loader
        ctx.loop.checkpoint_extras = lambda: (loader.state_dict(), {STATE_FILE: partial.state_dict()})
        ctx.loop.replay_extras = (lambda: copy.deepcopy(partial.carried), partial._put_back)
        ctx.loop.on_rewind = partial.restore
        return partial

    # -------------------------------------------------------------------------- rollout
    def roll_out(self, ctx: Any, prompts: list[Sample], seed_key: int, timer: Timer) -> tuple[list[PromptGroup], dict[str, float]]:
        """One step's rollout: the carried-over groups (too old ones dropped) and a group for each
        of `prompts`, generated in chunks and stepped by their environments turn by turn until
        enough groups are complete; the complete ones scored (`PromptGroup`s, tagged with their
        oldest weight version) and the step's metrics (`partial_rollouts/*` beside the rollout's
        own). The rest carry over."""
        cfg, g = ctx.cfg, ctx.cfg.grpo
        p_cfg, n_gen, version = g.partial_rollouts, g.num_generations_per_prompt, ctx.step
        kept = [group for group in self.carried if not self._too_old(group, version)]
        dropped = [group for group in self.carried if self._too_old(group, version)]
        resumed = sum(not p.done for group in kept for p in group)
        seeds = sample_seeds(g.seed, seed_key, len(prompts) * n_gen).tolist()
        new = [[SequenceProgress(prompt.fresh_copy(), seeds[i * n_gen + j]) for j in range(n_gen)]
               for i, prompt in enumerate(prompts)]
        for group in new:
            for p in group:
                p.sample.start_rollout()
        groups = kept + new
        stepper = EpisodeStepper(ctx.envs, ctx.tokenizer, cfg.policy.max_total_sequence_length, g.max_rollout_turns)

        t0 = time.perf_counter()
        ctx.generation.prepare_for_generation()
        try:
            fraction, chunks = generate_in_chunks(
                ctx.generation, groups, version=version, max_new_tokens=cfg.policy.generation.max_new_tokens,
                chunk_tokens=p_cfg.chunk_tokens, min_complete_fraction=p_cfg.min_complete_fraction,
                pad_token_id=ctx.tokenizer.pad_token_id, advance=stepper, totals=stepper.totals,
            )
        finally:
            ctx.generation.finish_generation()
        complete = [group for group in groups if all(p.done for p in group)]
        self.carried = [group for group in groups if not all(p.done for p in group)]

        progress = [p for group in complete for p in group]
        for group in complete:
            add_counts(stepper.totals.env_counts, group[0].env_counts)
        result = rollout_result([p.sample for p in progress], stepper.totals)
        result.add_timings(timer, time.perf_counter() - t0)
        scored = score_groups(ctx, result, len(complete), version)
        for prompt_group, group in zip(scored, complete):
            prompt_group.weight_version = min(p.oldest_version for p in group)

        carried = [p for group in self.carried for p in group if not p.done]
        metrics = dict(result.metrics)
        metrics.update({
            "partial_rollouts/trained_groups": float(len(complete)),
            "partial_rollouts/carried_over_groups": float(len(self.carried)),
            "partial_rollouts/carried_over_sequences": float(len(carried)),
            "partial_rollouts/carried_over_later_turn_sequences": float(sum(p.sample.turns > 0 for p in carried)),
            "partial_rollouts/resumed_sequences": float(resumed),
            "partial_rollouts/dropped_too_old_groups": float(len(dropped)),
            "partial_rollouts/dropped_too_old_sequences": float(sum(len(group) for group in dropped)),
            "partial_rollouts/complete_fraction_at_stop": fraction,
            "partial_rollouts/num_chunks": float(chunks),
            "partial_rollouts/mixed_version_sequences": float(
                sum(bool((v != v[0]).any()) for v in (p.all_versions() for p in progress) if len(v))
            ),
        })
        return scored, metrics

    def _too_old(self, group: Group, version: int) -> bool:
        """The group's oldest token is more than `max_age_steps` versions behind `version`."""
        oldest = [p.oldest_version for p in group if p.oldest_version is not None]
        return bool(oldest) and version - min(oldest) > self.cfg.grpo.partial_rollouts.max_age_steps


def environment_problem(cfg: Any, env_names: list[str]) -> Optional[str]:
    """Why the environments `env_names` (`env.<name>` sections) cannot run with this config's
    partial rollouts, or None: a multi-turn episode carried over keeps only what its sample holds
    (conversation, metadata), so an environment that keeps episode state in its own memory
    (`Environment.live_episode_state`) would lose it in a checkpoint."""
    if not cfg.grpo.partial_rollouts.enabled or cfg.grpo.max_rollout_turns <= 1:
        return None
    from posttrain.environments.registry import resolve_env

    for name in sorted(set(env_names)):
        cls, _ = resolve_env(name, cfg.env.section(name))
        if getattr(cls, "live_episode_state", False):
            return (f"grpo.partial_rollouts.enabled with grpo.max_rollout_turns={cfg.grpo.max_rollout_turns}: env.{name} "
                    f"({cls.__name__}) keeps each episode's state in its own memory, which a carried-over episode "
                    "cannot take through a checkpoint; set grpo.partial_rollouts.enabled=false or grpo.max_rollout_turns=1")
    return None
