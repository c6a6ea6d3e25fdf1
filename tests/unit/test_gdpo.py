"""GDPO (`grpo.adv_estimator.name=gdpo`): advantages against the paper's formula by hand, reward
components from reward functions to the estimator's options, and the config's checks."""

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.advantages import compute_advantages, grpo_advantages
from posttrain.algorithms.experience import advantage_options
from posttrain.config.schema.algorithms import AdvantageEstimatorConfig
from posttrain.data.sample import Sample
from posttrain.environments.registry import resolve_env
from posttrain.environments.reward_fn_env import PROMPT_KEY, reward_fn_section

# Two groups of three; component "correct" and component "format" (NaN: does not apply).
GROUP_IDS = torch.tensor([0, 0, 0, 1, 1, 1])
CORRECT = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
FORMAT = [1.0, 1.0, 0.0, 0.5, math.nan, 0.25]
WEIGHTS = {"correct": 1.0, "format": 0.5}


def by_hand(weights=WEIGHTS, batch_normalize=True):
    """The formula written out: per component and group, (r - mean) / (sample std + 1e-6) where the
    std > 0 (NaN samples left out, adding 0); weighted sum; batch z-score with the sample std."""
    total = [0.0] * 6
    for name, values in (("correct", CORRECT), ("format", FORMAT)):
        for group in (range(0, 3), range(3, 6)):
            members = [values[i] for i in group if not math.isnan(values[i])]
            mean, std = statistics.mean(members), statistics.stdev(members) if len(members) > 1 else 0.0
            for i in group:
                if not math.isnan(values[i]):
                    total[i] += weights[name] * ((values[i] - mean) / (std + 1e-6) if std > 0 else values[i] - mean)
    if not batch_normalize:
        return total
    mean, std = statistics.mean(total), statistics.stdev(total)
    return [(a - mean) / std for a in total]


def gdpo(**options):
    components = torch.tensor([CORRECT, FORMAT]).T
    rewards = components.nan_to_num(0.0) @ torch.tensor([1.0, 0.5])
    return compute_advantages("gdpo", rewards, GROUP_IDS, torch.ones(6), reward_components=components,
                              component_weights=[1.0, 0.5], **options)


def test_gdpo_matches_the_formula_by_hand():
    expected = by_hand()
    assert gdpo().tolist() == pytest.approx(expected, rel=1e-5)
    # group 1's "format" is [0.5, NaN, 0.25]: the NaN sample stays out of its mean (0.375)
    assert gdpo(batch_normalize=False).tolist() == pytest.approx(by_hand(batch_normalize=False), rel=1e-5)
    assert expected[4] != pytest.approx(expected[3])


def test_gdpo_differs_from_grpo_on_the_weighted_sum():
    """Summing first, the spread of 'correct' in group 0 swamps 'format'; GDPO gives each its own scale."""
    rewards = torch.tensor([c + 0.5 * (0.0 if math.isnan(f) else f) for c, f in zip(CORRECT, FORMAT)])
    summed = grpo_advantages(rewards, GROUP_IDS)
    assert gdpo().tolist() != pytest.approx(summed.tolist(), abs=1e-2)
    # With one component and no batch normalisation, GDPO is GRPO.
    one = compute_advantages("gdpo", rewards, GROUP_IDS, batch_normalize=False)
    assert one.tolist() == pytest.approx(summed.tolist())


def test_masked_samples_get_zero_and_stay_out_of_the_statistics():
    mask = torch.tensor([1.0, 1, 1, 1, 1, 0])
    components = torch.tensor([CORRECT, FORMAT]).T
    out = compute_advantages("gdpo", torch.zeros(6), GROUP_IDS, mask, reward_components=components,
                             component_weights=[1.0, 0.5])
    assert out[5].item() == 0.0
    assert out[:5].mean().item() == pytest.approx(0.0, abs=1e-6) and out[:5].std().item() == pytest.approx(1.0)


def test_reward_functions_report_raw_components_and_their_weights():
    def accuracy(completions, **_):
        return [1.0, 0.0]

    def brevity(completions, **_):
        return [None, 0.25]

    cls, cfg = resolve_env("rewards", reward_fn_section([accuracy, brevity], [1.0, 0.1]))
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": a}] for a in ("4", "5")]
    out = cls(cfg).step(logs, [{PROMPT_KEY: "q"}, {PROMPT_KEY: "q"}])
    assert out.rewards.tolist() == pytest.approx([1.0, 0.025])
    assert out.reward_components[0]["accuracy"] == 1.0 and math.isnan(out.reward_components[0]["brevity"])
    assert out.reward_components[1] == {"accuracy": 0.0, "brevity": 0.25}
    assert out.reward_component_weights == {"accuracy": 1.0, "brevity": 0.1}


def test_options_carry_the_components_and_the_weights_config_or_environment_give():
    samples = [Sample([{"role": "user", "content": "q"}], 1) for _ in range(3)]
    for sample, (c, f) in zip(samples, [(1.0, 0.5), (0.0, None), (1.0, 0.0)]):
        sample.reward_components = {"correct": c, **({} if f is None else {"format": f})}
        sample.reward_component_weights = {"correct": 2.0, "format": 0.1}
    g = SimpleNamespace(normalize_rewards=True, use_leave_one_out_baseline=False, group_std="sample",
                        adv_estimator=AdvantageEstimatorConfig(name="gdpo", reward_component_weights={"format": 0.3}))
    options = advantage_options(g, samples)
    assert options["component_weights"] == [2.0, 0.3]  # 'correct' from the environment, 'format' configured
    assert options["reward_components"][:, 0].tolist() == [1.0, 0.0, 1.0]
    assert math.isnan(options["reward_components"][1, 1].item()) and options["batch_normalize"] is True


def test_gdpo_keys_need_the_gdpo_estimator():
    with pytest.raises(ValueError, match="grpo.adv_estimator.reward_component_weights is a GDPO option"):
        AdvantageEstimatorConfig(reward_component_weights={"a": 1.0})
    with pytest.raises(ValueError, match="5 component weights for 2 reward components"):
        compute_advantages("gdpo", torch.zeros(6), GROUP_IDS, reward_components=torch.zeros(6, 2),
                           component_weights=[1.0] * 5)


def test_reward_shaping_is_one_more_component():
    samples = [Sample([{"role": "user", "content": "q"}], 1) for _ in range(2)]
    for sample, c in zip(samples, (1.0, 0.0)):
        sample.reward_components = {"correct": c}
    g = SimpleNamespace(normalize_rewards=True, use_leave_one_out_baseline=False, group_std="sample",
                        adv_estimator=AdvantageEstimatorConfig(name="gdpo", reward_component_weights={"shaping": 0.5}))
    options = advantage_options(g, samples, shaping=torch.tensor([0.0, -0.3]))
    assert options["reward_components"].flatten().tolist() == pytest.approx([1.0, 0.0, 0.0, -0.3])
    assert options["component_weights"] == [1.0, 0.5]
    assert advantage_options(g, samples, shaping=torch.zeros(2))["component_weights"] == [1.0]
