"""Each algorithm's own section: `grpo`, `sft`, `dpo`, `rm`, `eval`, `distillation`."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from posttrain.config.schema.base import Section, check_component_name


class ValidatedLoopConfig(Section):
    """What every loop that validates shares: stopping once its validation reaches a target."""

    stop_at_validation: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Stop after the first validation at which every named metric is at or above its value, e.g. "
            "{validation/accuracy_greedy: 0.5}: the run is then complete (checkpointed when checkpointing is on; a "
            "rerun trains no further). Checked at each validation (val_period); max_num_steps stays the limit. "
            "Default {}: run to max_num_steps. Early stopping on a target rather than a fixed length gives a warm "
            "start of the same skill whatever the seed or CPU kind: at a fixed length a constant-lr run ends "
            "wherever its last steps happened to swing."
        ),
    )

    @model_validator(mode="after")
    def _check_stop_at_validation(self):
        for name in self.stop_at_validation:
            if not name.startswith("validation/"):
                raise ValueError(f"stop_at_validation names {name!r}, not a validation metric: the names are those "
                                 f"of metrics.jsonl, e.g. validation/accuracy_greedy")
        if self.stop_at_validation and self.val_period == 0:
            raise ValueError("stop_at_validation is checked at each validation, and val_period=0 validates only at "
                             "the start and the end: set val_period")
        return self


class AdvantageEstimatorConfig(Section):
    """Which advantage estimator GRPO uses (NeMo-RL's `adv_estimator` section)."""

    name: str = Field(
        "grpo",
        description=(
            "'grpo' (default: group baseline, optional std normalisation, from grpo.normalize_rewards, "
            "grpo.group_std, grpo.use_leave_one_out_baseline), 'gdpo' (several reward components, each normalised "
            "within its group, then weighted and summed, then normalised over the batch: 'GDPO: Group reward-"
            "Decoupled Normalization Policy Optimization for Multi-reward RL Optimization', NVIDIA 2026, "
            "arXiv:2601.05242; the components are the environments' reward_components, e.g. one per reward "
            "function), 'reinforce_pp' (Hu et al. 2025), or a user's "
            "function as an import path 'module:function' / 'file.py:function' with the signature "
            "fn(rewards [B], group_ids [B], sample_mask [B], **kwargs) -> advantages [B]."
        ),
    )
    kwargs: dict[str, Any] = Field({}, description="Extra keyword options passed to the estimator.")
    reward_component_weights: dict[str, float] = Field(
        {},
        description=(
            "GDPO only: the weight w_k of each reward component by name in A = sum_k w_k A_k (default {}: the "
            "weight the environment gives the component, e.g. env.<name>.weights of reward functions or the "
            "Python API's reward_weights, else 1.0)."
        ),
    )
    batch_normalize: bool = Field(
        True,
        description="GDPO only: normalise the weighted sum of the components over the batch (default true, the paper's).",
    )

    @model_validator(mode="after")
    def _check(self):
        check_component_name(self.name, "grpo.adv_estimator.name")
        if self.name != "gdpo":
            for key in ("reward_component_weights", "batch_normalize"):
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise ValueError(f"grpo.adv_estimator.{key} is a GDPO option; set grpo.adv_estimator.name=gdpo")
        return self


class AsyncGRPOConfig(Section):
    """Asynchronous GRPO: a trajectory collector keeps generating on its own workers while the
    policy trains, through a replay buffer of per-prompt groups with bounded staleness (NeMo-RL's
    async GRPO; `posttrain/algorithms/async_grpo.py`). Under `posttrain ppo` the same section
    makes it async PPO: the critic and the policy train while the next batches generate."""

    enabled: bool = Field(
        False,
        description=(
            "Overlap generation and training (async GRPO; async PPO under posttrain ppo): needs "
            "policy.generation.colocated.enabled=false and loss_fn.use_importance_sampling_correction=true."
        ),
    )
    max_trajectory_age_steps: int = Field(
        1, ge=1,
        description=(
            "Oldest weights a trained group may come from, in steps behind the policy; older groups are evicted "
            "and counted (async/evicted_groups). The collector runs at most this many steps ahead."
        ),
    )
    buffer_timeout_s: float = Field(
        600.0, gt=0,
        description=(
            "Longest the trainer waits for a step's groups before the run stops with the collector's state; "
            "a dead collector stops it at once."
        ),
    )
    rollout_timeout_s: float = Field(
        300.0, gt=0,
        description=(
            "Longest one rollout batch may wait for its environments: groups whose environment calls are still "
            "running then are dropped and counted (async/dropped_groups) instead of holding the buffer."
        ),
    )
    max_consecutive_failed_rollouts: int = Field(
        3, ge=1,
        description=(
            "Rollout batches in a row that may yield no group (all dropped) before the collector gives up and "
            "the run stops with the reason."
        ),
    )


class PartialRolloutsConfig(Section):
    """Partial rollouts (slime, Kimi k1.5): a step's generation ends once most of its prompt groups
    are complete; unfinished sequences keep their tokens and continue in the next step under the
    new weights, each token carrying the weight version and logprob that produced it
    (`posttrain/algorithms/partial_rollouts.py`)."""

    enabled: bool = Field(
        False,
        description=(
            "Stop a step's generation early and carry unfinished episodes over, multi-turn ones too (default "
            "false); needs loss_fn.use_importance_sampling_correction=true, policy.generation.backend=native, "
            "and neither grpo.async_grpo nor grpo.use_dynamic_sampling."
        ),
    )
    min_complete_fraction: float = Field(
        0.75, gt=0, le=1,
        description="A step's generation ends when this fraction of its prompt groups are complete (default 0.75).",
    )
    chunk_tokens: int = Field(
        256, ge=1,
        description="Generation proceeds in chunks of this many new tokens, so it can stop between chunks (default 256).",
    )
    max_age_steps: int = Field(
        1, ge=0,
        description=(
            "A carried-over group whose oldest token is more than this many weight versions behind the current "
            "weights is dropped and counted (train/partial_rollouts/dropped_too_old_sequences) (default 1)."
        ),
    )


class GRPOConfig(ValidatedLoopConfig):
    """The GRPO loop: group sizes, run length, validation schedule, advantage estimation, DAPO filters."""

    num_prompts_per_step: int = Field(
        16, ge=1,
        description="Prompts per GRPO step; each is answered num_generations_per_prompt times.",
    )
    num_generations_per_prompt: int = Field(
        8, ge=1,
        description="Samples per prompt: the group whose rewards form the baseline.",
    )
    max_rollout_turns: int = Field(
        1, ge=1,
        description="Turns per episode at most (1: single-turn; multi-turn environments need more).",
    )
    max_num_steps: int = Field(
        100, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    max_num_epochs: int = Field(1000, ge=1, description="Passes over the training prompts at most.")
    normalize_rewards: bool = Field(
        True,
        description="Divide advantages by the group's reward std (GRPO); false keeps mean-centred rewards (Dr.GRPO).",
    )
    group_std: Literal["sample", "population"] = Field(
        "sample",
        description=(
            "Std that normalises group advantages: 'sample' divides by n - 1 (NeMo-RL, TRL; default), "
            "'population' by n (posttrain before 0.2: advantages sqrt(n/(n-1)) larger)."
        ),
    )
    use_leave_one_out_baseline: bool = Field(
        False,
        description="Baseline each sample by the mean of the other samples of its group (RLOO).",
    )
    adv_estimator: AdvantageEstimatorConfig = AdvantageEstimatorConfig()
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()
    partial_rollouts: PartialRolloutsConfig = PartialRolloutsConfig()
    val_period: int = Field(10, ge=0, description="0 disables periodic validation.")
    val_at_start: bool = Field(True, description="Validate before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    max_val_samples: int = Field(500, ge=1, description="Validation prompts at most (per blend component).")
    val_batch_size: int = Field(256, ge=1, description="Validation prompts generated per batch.")
    val_num_generations_per_prompt: int = Field(1, ge=1, description=">1 also reports pass@k.")
    overlong_filtering: bool = Field(
        False,
        description="Mask out of the loss samples cut by max_new_tokens or the sequence limit (DAPO).",
    )
    use_dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards all agree and generate more prompts to fill the step (DAPO).",
    )
    dynamic_sampling_max_gen_batches: int = Field(
        10, ge=1,
        description="Generation batches per step at most under dynamic sampling (then trains on what it has).",
    )
    seed: int = Field(
        42,
        description="Seed of prompt order and sampling (generation seeds are a function of seed, step and sample).",
    )


class LengthPenaltyConfig(Section):
    """Kimi k1.5's length reward (Kimi Team 2025, arXiv:2501.12599, section 2.3.3), per prompt group:
    with lambda = 0.5 - (len - min_len) / (max_len - min_len) over the group's responses, a correct
    sample's reward gets + weight * lambda, an incorrect one's + weight * min(0, lambda)
    (`advantages.length_reward`)."""

    enabled: bool = Field(False, description="Add the per-group length reward to the environment's rewards.")
    weight: float = Field(
        1.0, gt=0,
        description=(
            "Multiplier of the length reward (in [-0.5, 0.5]) before it is added to the reward; the paper uses a "
            "weight without publishing it. Default 1.0. Under grpo.normalize_rewards=true the group std division "
            "undoes it in groups whose answers are all wrong or all right (the start-up line warns): use "
            "grpo.normalize_rewards=false with it."
        ),
    )
    correct_reward: float = Field(
        1.0,
        description="A sample counts as correct when its environment reward is at least this (default 1.0, the paper's r = 1).",
    )
    warmup_steps: int = Field(
        0, ge=0,
        description=(
            "Steps trained without the penalty before it applies (the paper's warm-up: the penalty slowed early "
            "training). Default 0."
        ),
    )


class FormatRewardConfig(Section):
    """A small reward for a completion in the task's answer format, beside the environment's own
    reward, as in DeepSeek-R1-Zero's rule-based format reward (DeepSeek-AI 2025, arXiv:2501.12948,
    section 2.2.2): a base model that does not yet answer in the format a verifier reads gets a
    signal from its groups even while every answer is wrong. A shaping term of training only:
    validation accuracy stays the environment's reward (`algorithms.format_reward`)."""

    weight: float = Field(
        0.0, ge=0,
        description=(
            "Reward added to each completion in format (0 or this much per completion). Default 0.0: off, since a "
            "model that already answers in format gains nothing from it; R1-Zero-style runs from a base model use a "
            "fraction of the correctness reward (e.g. 0.1-0.2 beside a reward of 1), so that a correct answer stays "
            "worth far more than a well-formed wrong one."
        ),
    )
    pattern: Optional[str] = Field(
        None,
        description=(
            "Regular expression (Python `re`, searched in the last assistant message; anchor it with ^ and $ to ask "
            "for the whole answer) a completion in format matches. Default None: in format when the task's "
            "environment extracted an answer from it (`EnvironmentReturn.answers`: a number for math, a letter for "
            "mcqa, a program for code); environments that extract none (structured, instructions) need a pattern."
        ),
    )
    task_patterns: dict[str, str] = Field(
        {},
        description=(
            "Patterns of single tasks (a blend component's name, or data.env_name), in place of `pattern` for their "
            "rows; default {}: every task uses `pattern`."
        ),
    )

    @model_validator(mode="after")
    def _compiles(self):
        import re

        for key, pattern in [("pattern", self.pattern), *((f"task_patterns.{t}", p) for t, p in self.task_patterns.items())]:
            if pattern is None:
                continue
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"reward_shaping.format_reward.{key}={pattern!r} is not a regular expression: {e}") from None
        return self


class RewardShapingConfig(Section):
    """Reward shaping before the advantages: DAPO's overlong penalty (Yu et al. 2025), Kimi k1.5's
    per-group length reward (`length_penalty`) and R1-Zero's format reward (`format_reward`)."""

    enabled: bool = Field(False, description="Apply DAPO's soft overlong penalty to rewards.")
    overlong_buffer_length: int = Field(
        16, ge=1,
        description="Tokens before max_response_length where the penalty ramps up linearly.",
    )
    overlong_buffer_penalty: float = Field(1.0, ge=0, description="Penalty at max_response_length (the ramp's end).")
    max_response_length: Optional[int] = Field(None, ge=1, description="Defaults to policy.generation.max_new_tokens.")
    length_penalty: LengthPenaltyConfig = LengthPenaltyConfig()
    format_reward: FormatRewardConfig = FormatRewardConfig()


class OfflineLoopConfig(ValidatedLoopConfig):
    """What `algorithms.loop.train_offline` reads: run length, validation schedule, seed."""

    max_num_steps: int = Field(
        1000, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    max_num_epochs: int = Field(1000, ge=1, description="Passes over the training data at most.")
    val_period: int = Field(100, ge=0, description="Validate every this many steps; 0 only at the start / end.")
    val_at_start: bool = Field(False, description="Validate before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    max_val_samples: int = Field(500, ge=1, description="Validation examples at most.")
    val_batch_size: int = Field(256, ge=1, description="Validation examples per forward batch.")
    seed: int = Field(42, description="Seed of data order and initialisation.")


class SFTConfig(OfflineLoopConfig):
    """The SFT loop: run length, validation schedule, export."""

    export_dir: Optional[str] = Field(None, description="Write the trained model here in HF format at the end.")


class _PairLoopConfig(OfflineLoopConfig):
    """Preference-pair training (DPO, RM): shorter runs; validation counts pairs."""

    max_num_steps: int = Field(
        200, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    val_period: int = Field(50, ge=0, description="Validate every this many steps; 0 only at the start / end.")
    max_val_samples: int = Field(500, ge=1, description="Validation preference pairs.")
    val_batch_size: int = Field(256, ge=1, description="Pairs per validation forward batch.")


class DPOConfig(_PairLoopConfig):
    """The DPO loop and loss (Rafailov et al. 2023)."""

    reference_policy_kl_penalty: float = Field(0.1, gt=0, description="beta in the DPO loss (Rafailov et al. 2023).")
    preference_average_log_probs: bool = Field(
        False,
        description=(
            "Use per-token mean instead of summed response logprobs in the preference term (length-normalised, as in "
            "SimPO / IPO variants)."
        ),
    )
    sft_loss_weight: float = Field(
        0.0, ge=0,
        description="Weight of an NLL term on the chosen response (RPO-style regularisation); 0 disables.",
    )
    preference_loss_weight: float = Field(1.0, ge=0, description="Weight of the DPO preference term.")


class RMConfig(_PairLoopConfig):
    """The reward-model loop: run length, validation schedule, export."""

    export_dir: Optional[str] = Field(None, description="Write the trained reward model here in HF format at the end.")


class EvalConfig(Section):
    """What `posttrain eval` scores and how."""

    num_generations_per_prompt: int = Field(1, ge=1, description="k of pass@k; k>1 samples at policy.generation.temperature.")
    max_samples: int = Field(500, ge=1, description="Prompts evaluated at most.")
    batch_size: int = Field(256, ge=1, description="Prompts generated per batch.")
    max_rollout_turns: int = Field(1, ge=1, description="Turns per episode at most.")
    split: Literal["train", "validation"] = Field(
        "validation",
        description="Which split of data to evaluate: 'validation' (default) or 'train'.",
    )
    seed: int = Field(42, description="Seed of sampling (with num_generations_per_prompt > 1).")


class DistillationConfig(ValidatedLoopConfig):
    """The on-policy distillation loop (`posttrain distill`; NeMo-RL's `distillation` section)."""

    num_prompts_per_step: int = Field(16, ge=1, description="Prompts the student answers per step.")
    num_generations_per_prompt: int = Field(4, ge=1, description="Student samples per prompt.")
    max_rollout_turns: int = Field(1, ge=1, description="Turns per student episode at most.")
    max_num_steps: int = Field(
        100, ge=1,
        description="Training steps (the run stops at this or max_num_epochs, whichever comes first).",
    )
    max_num_epochs: int = Field(1000, ge=1, description="Passes over the training prompts at most.")
    topk_logits_k: int = Field(
        64, ge=1, description="Teacher logits kept per position (NeMo-RL's default 64; at most the vocabulary size)."
    )
    val_period: int = Field(10, ge=0, description="0 disables periodic validation.")
    val_at_start: bool = Field(True, description="Validate the student (and once the teacher) before the first step.")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    max_val_samples: int = Field(500, ge=1, description="Validation prompts at most.")
    val_batch_size: int = Field(256, ge=1, description="Validation prompts generated per batch.")
    seed: int = Field(42, description="Seed of prompt order and sampling.")
    tokenizer_alignment: Literal["auto", "always", "never"] = Field(
        "auto",
        description="How a teacher reads the student's answers. 'auto' (default): as token ids when its vocabulary "
        "is the student's, else re-tokenised from their text and aligned by character offsets (cross-tokenizer "
        "distillation; the idea of TRL's GOLD and NeMo-RL's x-token distillation): the teacher's next-token "
        "distribution read through the text, and span log-ratios where it does not reach (loss_fn.xtok_match_weight, "
        "loss_fn.xtok_span_weight). Default auto: on the tiny example (examples/configs/distill_xtok_tiny.yaml) it "
        "moved every seed's student toward its teacher (docs/algorithms.md). 'always': align every teacher by "
        "text. 'never': as token ids, refusing a teacher of another vocabulary in one line.",
    )


class DistillationLossConfig(Section):
    """KL between the student and the teacher's top-k distribution (`algorithms/distill_loss.py`)."""

    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        "forward",
        description="'forward' KL(teacher||student) (default, mass-covering), 'reverse' KL(student||teacher) "
        "(mode-seeking) or 'mixed' (mixed_kl_weight x forward + (1 - mixed_kl_weight) x reverse).",
    )
    mixed_kl_weight: float = Field(0.5, ge=0, le=1, description="Weight of the forward KL when kl_type='mixed'.")
    zero_outside_topk: bool = Field(
        False,
        description="Treat the teacher's probability outside its top-k as ~0 and compare with the student's "
        "full-vocabulary probabilities (default False: both renormalised over the top-k).",
    )
    xtok_span_weight: float = Field(
        1.0, ge=0,
        description="Cross-tokenizer teachers: weight of the span term, on the aligned spans the teacher's next-token "
        "distribution does not cover: the sampled reverse KL of the span (student minus teacher log-probability of "
        "the same text) as a policy-gradient signal on its tokens (Agarwal et al. 2024, arXiv:2306.13649; Thinking "
        "Machines' on-policy distillation, 2025). Default 1.0: the one signal such spans get.",
    )
    xtok_match_weight: float = Field(
        1.0, ge=0,
        description="Cross-tokenizer teachers: weight of the distribution term, kl_type's KL between the student's "
        "next-token distribution and the teacher's read through the text (where an aligned span is one teacher "
        "token: each teacher token's probability goes to the student token its text starts with; on tokens of "
        "one string, TRL's GOLD / ULD KL over the shared vocabulary). Default 1.0: the same-tokenizer KL's weight.",
    )
    xtok_span_baseline: bool = Field(
        True,
        description="Cross-tokenizer teachers: subtract from each span's log-ratio, in the span term's gradient, the "
        "step's mean log-ratio of the spans at the same place in their rows (a REINFORCE baseline, Williams 1992). "
        "Default true: without it the mean reverse KL pushes every sampled answer down.",
    )
    xtok_match_min_mass: float = Field(
        0.5, ge=0, le=1,
        description="Cross-tokenizer teachers: the distribution term applies at a student token where the student "
        "tokens the teacher's top-k reaches hold at least this share of the teacher's probability (after a span's "
        "first token, of its tokens that start with the span's text so far). Default 0.5: below it the teacher "
        "means a continuation the student cannot spell in one token, and the rest, renormalised, would pull the "
        "student toward what the teacher itself finds unlikely (measured: without it the example's student, then "
        "taught through exact matches only, collapsed to empty answers).",
    )
