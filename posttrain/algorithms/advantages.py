"""Advantage estimators and reward shaping for policy-gradient training (pure functions).

Samples of one prompt form a *group*, identified by a non-negative integer group id per sample
(after ``repeat_interleave`` the samples of a prompt are contiguous, but nothing here relies on
it). Per-group outputs have length ``num_groups`` (default ``max(group_ids) + 1``) and are indexed
by group id. Samples with ``sample_mask == 0`` are left out of every group statistic.

Estimators are registered by name (``@register_advantage_estimator("grpo")``) and return one
advantage per sample ``[B]``; `broadcast_to_tokens` spreads them over a token mask ``[B, S]``.
An estimator that takes ``values`` (GAE, PPO's) is a critic's: it runs once the critic has
valued the batch's tokens and returns one advantage per token ``[B, S]`` (`takes_values`).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from posttrain.utils.registry import registrar, resolve

AdvantageEstimator = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


# @register_advantage_estimator("name") on ``fn(rewards, group_ids, sample_mask, **options) -> advantages [B]``.
register_advantage_estimator = registrar(ADVANTAGE_ESTIMATORS, "advantage estimator")


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    **options: object,
) -> torch.Tensor:
    """Run the estimator registered under ``name`` (or, with a colon, the function at that import
    path, e.g. ``"my_estimators:centred"``); ``options`` are its keyword options."""
    try:
        estimator = resolve(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    try:
        inspect.signature(estimator).bind(rewards, group_ids, sample_mask, **options)
    except TypeError as e:
        raise TypeError(f"advantage estimator {name!r}: {e}; signature {inspect.signature(estimator)}") from None
    return estimator(rewards, group_ids, sample_mask, **options)


def takes_values(name: str) -> bool:
    """Whether the estimator `name` takes a critic's per-token ``values`` (and so returns ``[B, S]``
    advantages, computed after the critic's forward rather than when the rollout is scored)."""
    try:
        estimator = resolve(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    return "values" in inspect.signature(estimator).parameters


def broadcast_to_tokens(advantages: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` per-sequence advantages -> ``[B, S]``, zero where ``token_mask`` is 0."""
    return advantages[:, None].to(token_mask.dtype) * token_mask


# ------------------------------------------------------------------------------- group statistics
def _check_inputs(
    rewards: torch.Tensor, group_ids: torch.Tensor, sample_mask: Optional[torch.Tensor], num_groups: Optional[int]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate shapes; return rewards and mask as float64 (exact enough that a constant group
    has a variance of exactly ~0) and the number of groups."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, rewards {tuple(rewards.shape)}")
    if group_ids.dtype.is_floating_point or (group_ids.numel() and group_ids.min() < 0):
        raise ValueError("group_ids must be non-negative integers (one id per prompt group)")
    if sample_mask is None:
        sample_mask = torch.ones_like(rewards)
    elif sample_mask.shape != rewards.shape:
        raise ValueError(f"sample_mask has shape {tuple(sample_mask.shape)}, rewards {tuple(rewards.shape)}")
    needed = int(group_ids.max()) + 1 if group_ids.numel() else 0
    if num_groups is None:
        num_groups = needed
    elif num_groups < needed:
        raise ValueError(f"num_groups={num_groups} but group_ids go up to {needed - 1}")
    return rewards.double(), sample_mask.double(), num_groups


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, group_ids, values)


def group_mean(
    values: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    num_groups: Optional[int] = None,
) -> torch.Tensor:
    """Mean of ``values`` per group over valid samples, ``[num_groups]`` (0 for an empty group)."""
    v, m, n = _check_inputs(values, group_ids, sample_mask, num_groups)
    count = _group_sums(m, group_ids, n)
    return (_group_sums(v * m, group_ids, n) / count.clamp(min=1)).to(values.dtype)


def group_std(
    values: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    num_groups: Optional[int] = None,
    unbiased: bool = True,
) -> torch.Tensor:
    """Standard deviation per group over valid samples, ``[num_groups]``: the sample std (divide by
    n - 1; default, as the advantage's ``group_std="sample"``, NeMo-RL and TRL), or the population
    std (divide by n) with ``unbiased=False``. 0 for groups with too few samples."""
    v, m, n = _check_inputs(values, group_ids, sample_mask, num_groups)
    count = _group_sums(m, group_ids, n)
    mean = _group_sums(v * m, group_ids, n) / count.clamp(min=1)
    squared_deviation = _group_sums((v - mean[group_ids]).square() * m, group_ids, n)
    dof = count - 1 if unbiased else count
    std = torch.where(dof > 0, squared_deviation / dof.clamp(min=1), torch.zeros_like(dof)).sqrt()
    return std.to(values.dtype)


def group_baseline_and_std(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    leave_one_out: bool = False,
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std ``[B]`` of the rewards of the sample's group (as NeMo-RL's
    ``calculate_baseline_and_std_per_prompt``).

    Without ``leave_one_out`` both are the mean / std over the group's valid samples. With it
    (RLOO, Ahmadian et al. 2024) they are computed over the *other* valid samples of the group, so
    the baseline does not depend on the sample's own reward. ``unbiased`` (default True, as NeMo-RL
    and TRL) divides the squared deviations by n - 1 (the sample std), False by n (population
    std); a set of values too small for the chosen std has std 0. A group with at most one valid
    sample gets baseline = reward (advantage 0) and std 0.
    """
    r, m, n = _check_inputs(rewards, group_ids, sample_mask, None)
    count = _group_sums(m, group_ids, n)[group_ids]
    total = _group_sums(r * m, group_ids, n)[group_ids]
    total_sq = _group_sums(r.square() * m, group_ids, n)[group_ids]
    if leave_one_out:
        count, total, total_sq = count - m, total - r * m, total_sq - r.square() * m
    baseline = total / count.clamp(min=1)
    squared_deviation = (total_sq - count * baseline.square()).clamp(min=0)
    dof = count - 1 if unbiased else count
    variance = torch.where(dof > 0, squared_deviation / dof.clamp(min=1), torch.zeros_like(dof))
    lonely = _group_sums(m, group_ids, n)[group_ids] <= 1
    baseline = torch.where(lonely, r, baseline)
    std = torch.where(lonely, torch.zeros_like(variance), variance.sqrt())
    return baseline.to(rewards.dtype), std.to(rewards.dtype)


# ------------------------------------------------------------------------------------ estimators
@register_advantage_estimator("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    *,
    normalize_rewards: bool = True,
    leave_one_out: bool = False,
    group_std: str = "sample",
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024): ``A = r - baseline(group)``, divided by
    ``std(group) + epsilon`` where the std is > 0.

    Args:
        normalize_rewards: divide by the group std (default True; Dr.GRPO, Liu et al. 2025, sets
            False because it biases towards easy/hard prompts). Config ``grpo.normalize_rewards``.
        group_std: "sample" (default; divide by n - 1 as NeMo-RL and TRL: rewards [1, 3] give
            advantages -+0.707) or "population" (divide by n: -+1). Config ``grpo.group_std``.
        leave_one_out: RLOO baseline, the mean of the *other* samples of the group (default False;
            Ahmadian et al. 2024). Config ``grpo.use_leave_one_out_baseline``.
        epsilon: added to the std before dividing (default 1e-6).

    Samples with ``sample_mask == 0`` get advantage 0 and do not enter any group statistic.
    """
    if group_std not in ("sample", "population"):
        raise ValueError(f"group_std must be 'sample' or 'population', got {group_std!r}")
    baseline, std = group_baseline_and_std(rewards, group_ids, sample_mask, leave_one_out, group_std == "sample")
    advantages = rewards - baseline
    if normalize_rewards:
        advantages = torch.where(std > 0, advantages / (std + epsilon), advantages)
    if sample_mask is not None:
        advantages = advantages * (sample_mask > 0)
    return advantages


@register_advantage_estimator("gdpo")
def gdpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    *,
    reward_components: Optional[torch.Tensor] = None,
    component_weights: Optional[Sequence[float]] = None,
    batch_normalize: bool = True,
    normalize_rewards: bool = True,
    leave_one_out: bool = False,
    group_std: str = "sample",
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GDPO (NVIDIA 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization", arXiv:2601.05242; NeMo-RL's ``gdpo`` estimator): each reward
    component is normalised within its group on its own, then the components are weighted and
    summed, and the sum is normalised over the batch:

        A_k = grpo_advantages(r_k)            (group baseline, / (group std + epsilon) where std > 0)
        A   = sum_k w_k A_k
        A^  = (A - mean(A)) / std(A)          (over the batch's valid samples, sample std; centred
                                               only when std is 0; skipped if not batch_normalize)

    Summing first (GRPO on sum_k w_k r_k) lets a component with a large spread drown the others
    and maps different reward combinations to the same advantage; GDPO keeps each component's
    resolution.

    Args:
        reward_components: ``[B, K]`` raw component rewards; NaN where a component does not apply
            to a sample (it then stays out of that component's group statistics and adds 0, as TRL's
            ``normalize_then_sum``). Default None: ``rewards`` is the one component.
        component_weights: K weights w_k (default 1.0 each). Config
            ``grpo.adv_estimator.reward_component_weights``.
        batch_normalize: the final batch normalisation (default True, the paper's).
        normalize_rewards, leave_one_out, group_std, epsilon: as `grpo_advantages`, per component.

    Samples with ``sample_mask == 0`` get advantage 0 and enter no statistic.
    """
    components = rewards[:, None] if reward_components is None else reward_components
    if components.ndim != 2 or components.shape[0] != rewards.shape[0]:
        raise ValueError(f"reward_components must be [B, K] with B = {rewards.shape[0]}, got {tuple(components.shape)}")
    weights = [1.0] * components.shape[1] if component_weights is None else list(component_weights)
    if len(weights) != components.shape[1]:
        raise ValueError(f"{len(weights)} component weights for {components.shape[1]} reward components")
    mask = torch.ones_like(rewards) if sample_mask is None else sample_mask
    valid = mask > 0
    total = torch.zeros(rewards.shape, dtype=torch.float64, device=rewards.device)
    for k, weight in enumerate(weights):
        values = components[:, k].double()
        applies = ~torch.isnan(values)
        per_component = grpo_advantages(
            torch.where(applies, values, 0.0), group_ids, (valid & applies).double(),
            normalize_rewards=normalize_rewards, leave_one_out=leave_one_out, group_std=group_std, epsilon=epsilon,
        )
        total = total + weight * per_component
    if batch_normalize and valid.sum() > 0:
        selected = total[valid]
        total = total - selected.mean()
        if selected.numel() > 1 and selected.std() > 0:
            total = total / selected.std()
    return (total * valid).to(rewards.dtype)


@register_advantage_estimator("reinforce_pp")
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    *,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu et al. 2025): subtract the group mean, then whiten
    over all valid samples of the batch (global mean 0, std 1) instead of per group.

    Sequence-level: the token-level KL-in-reward term of the paper is not applied here.
    ``epsilon`` (default 1e-6) is added to the global std. Masked samples get advantage 0.
    """
    _, m, _ = _check_inputs(rewards, group_ids, sample_mask, None)
    centred = rewards - group_mean(rewards, group_ids, sample_mask)[group_ids]
    valid = m > 0
    if valid.sum() > 1:
        values = centred[valid].double()
        centred = (centred - values.mean()) / (values.std(unbiased=False) + epsilon)
    return (centred * valid).to(rewards.dtype)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> torch.Tensor:
    """Generalised advantage estimation (Schulman et al. 2016) over the tokens where ``mask`` is
    set, ``[B, S]`` each: ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next``,
    where "next" is the row's next token *in the mask*: a masked-out span (an environment's
    observation between two turns, padding) is not a time step, so the recursion carries the next
    valid token's value and advantage across it (NeMo-RL's carry-forward). After the row's last
    valid token the episode has ended: ``V_next = A_next = 0``. Positions off the mask get 0.

    ``lam = 1`` gives the Monte-Carlo return minus the value, ``lam = 0`` the one-step TD error.
    Computed in float64; returns the dtype of ``values``.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or values.ndim != 2:
        raise ValueError(f"gae: token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must be the same [B, S]")
    r, v, valid = token_rewards.double(), values.double(), mask > 0
    advantages = torch.zeros_like(v)
    next_value = torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
    next_advantage = torch.zeros_like(next_value)
    for t in range(v.shape[1] - 1, -1, -1):
        advantage = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_advantage
        here = valid[:, t]
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, v[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    return advantages.to(values.dtype)


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` sequence rewards placed on each row's last token in ``mask`` ``[B, S]`` (the last
    generated token: where the episode's reward arrives); 0 elsewhere and for a row without one."""
    valid = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, -1).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    out[rows, last[rows]] = rewards[rows]
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """``values`` shifted and scaled to mean 0 and std 1 over the positions in ``mask`` (population
    std); 0 off the mask. Fewer than two positions: centred only. PPO whitens its advantages
    this way (``critic.whiten_advantages``), as verl and OpenRLHF do."""
    valid = mask > 0
    selected = values[valid].double()
    whitened = values.double() - (selected.mean() if selected.numel() else 0.0)
    if selected.numel() > 1:
        whitened = whitened / (selected.std(unbiased=False) + epsilon)
    return torch.where(valid, whitened, 0.0).to(values.dtype)


@register_advantage_estimator("gae")
def gae_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    *,
    values: torch.Tensor,
    token_mask: torch.Tensor,
    token_rewards: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> torch.Tensor:
    """PPO's advantages from a critic (`posttrain ppo`): GAE (`gae`) per token ``[B, S]``.

    The sequence reward ``rewards [B]`` arrives at each row's last token in ``token_mask`` (the
    generated tokens; environment observations and the prompt are not in it), on top of
    ``token_rewards [B, S]`` when given (PPO's ``-beta KL`` per token, `critic.kl_in_reward`).
    ``values [B, S]`` are the critic's, aligned like logprobs: position i holds V of the prefix
    before token i. The group does not enter: the critic is the baseline (``group_ids`` is
    accepted for the registry's signature).

    Args:
        gamma: discount per token (default 1.0; config ``critic.gamma``).
        lam: GAE's lambda (default 0.95). PPO calls this twice (VAPO, Yuan et al. 2025): with
            ``critic.lambda_actor`` for the policy's advantages, with ``critic.lambda_critic``
            for the critic's targets (returns = advantages + values).

    Samples with ``sample_mask == 0`` get advantage 0.
    """
    if values.shape != token_mask.shape or values.shape[0] != rewards.shape[0]:
        raise ValueError(f"gae: values {tuple(values.shape)} and token_mask {tuple(token_mask.shape)} must be "
                         f"[B, S] with B = {rewards.shape[0]} rewards")
    mask = token_mask * (sample_mask[:, None] > 0) if sample_mask is not None else token_mask
    per_token = last_token_rewards(rewards.to(values.dtype), mask)
    if token_rewards is not None:
        per_token = per_token + token_rewards * (mask > 0)
    return gae(per_token, values, mask, gamma, lam)


# --------------------------------------------------------------------------------- reward shaping
def apply_overlong_penalty(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025):
    ``r += min(-(L - (max_response_length - buffer_length)) / buffer_length * penalty, 0)``,
    i.e. no penalty up to ``max - buffer`` tokens, then linear down to ``-penalty`` at ``max``.
    Config: ``reward_shaping.overlong_buffer_length`` / ``overlong_buffer_penalty`` /
    ``max_response_length``."""
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong buffer_length={buffer_length} must be in (0, max_response_length={max_response_length}]"
        )
    if response_lengths.shape != rewards.shape:
        raise ValueError(f"response_lengths {tuple(response_lengths.shape)} and rewards {tuple(rewards.shape)} differ")
    expected = max_response_length - buffer_length
    excess = response_lengths.to(rewards.dtype) - expected
    return rewards + (-excess / buffer_length * penalty).clamp(max=0)


def length_reward(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    group_ids: torch.Tensor,
    sample_mask: Optional[torch.Tensor] = None,
    correct_reward: float = 1.0,
) -> torch.Tensor:
    """Kimi k1.5's per-group length reward (Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement
    Learning with LLMs", arXiv:2501.12599, section 2.3.3), ``[B]``, to be added to the rewards with
    a weight.

    Within each group, with ``min_len`` / ``max_len`` the shortest and longest valid response,
    ``lambda = 0.5 - (len - min_len) / (max_len - min_len)``; a correct sample (reward >=
    ``correct_reward``, default 1.0, the paper's r = 1) gets ``lambda`` (+0.5 for the shortest down to
    -0.5 for the longest), an incorrect one ``min(0, lambda)`` (only the penalty for being long).
    A group whose valid responses all have the same length gets 0, as do samples with
    ``sample_mask == 0`` (they also stay out of min / max).
    Config: ``reward_shaping.length_penalty``.
    """
    r, m, n = _check_inputs(rewards, group_ids, sample_mask, None)
    if response_lengths.shape != rewards.shape:
        raise ValueError(f"response_lengths {tuple(response_lengths.shape)} and rewards {tuple(rewards.shape)} differ")
    lengths = response_lengths.double()
    valid = m > 0
    ids, values = group_ids[valid], lengths[valid]
    shortest = torch.full((n,), float("inf"), dtype=lengths.dtype).scatter_reduce(0, ids, values, "amin")[group_ids]
    longest = torch.full((n,), float("-inf"), dtype=lengths.dtype).scatter_reduce(0, ids, values, "amax")[group_ids]
    spread = longest - shortest
    varied = valid & (spread > 0)
    lam = torch.where(varied, 0.5 - (lengths - shortest) / torch.where(varied, spread, 1.0), 0.0)
    reward = torch.where(r >= correct_reward, lam, lam.clamp(max=0))
    return reward.to(rewards.dtype)


def filter_zero_variance_groups(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: Optional[int] = None,
    sample_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): ``[num_groups]`` bool, True for groups whose valid
    rewards are not all equal (they carry a learning signal). Groups without valid samples: False."""
    r, m, n = _check_inputs(rewards, group_ids, sample_mask, num_groups)
    valid = m > 0
    ids, values = group_ids[valid], r[valid]
    high = torch.full((n,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, ids, values, "amax")
    low = torch.full((n,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, ids, values, "amin")
    return high > low
