"""`posttrain.Distill`: on-policy distillation (`posttrain distill`) as an object."""

from __future__ import annotations

from typing import Optional, Sequence

from posttrain.api.common import (
    Callback,
    Config,
    Dataset,
    RewardFuncs,
    Trainer,
    config_overrides,
    load_trainer_config,
    model_overrides,
    prompt_data_overrides,
)


class Distill(Trainer):
    """On-policy distillation (Agarwal et al. 2024), as `posttrain distill` runs it: the student
    (`model`) answers the prompts, the teacher scores each generated token, and the student learns
    the KL to the teacher's top-k distribution (`loss_fn.kl_type`).

    Args:
        model: the student's `policy.model_name` (default None: the config's); its SFT warm start
            (`sft_warmup`) is kept only when it trains this same model.
        teacher_model: `teacher.model_name`, a model with the student's vocabulary (default None:
            the config's); likewise for `teacher_warmup`.
        train_dataset, eval_dataset: prompt rows as GRPO takes them (`{"prompt", <columns>}`);
            default None keeps the config's data. Validation is the student's accuracy.
        reward_funcs, reward_weights: how the student's answers are scored (`train/reward`,
            validation accuracy), as GRPO's; default None: the config's environments.
        config: a `DistillMasterConfig`, a YAML path or a dict over the embedded default
            (`distill_tiny.yaml`).
        callbacks: `on_step_end(step, metrics) -> bool` objects or functions, after each
            distillation step (not the warm starts'); True stops the run. Default None.
    """

    command = "distill"
    section = "distillation"

    def __init__(
        self,
        model: Optional[str] = None,
        teacher_model: Optional[str] = None,
        train_dataset: Optional[Dataset] = None,
        eval_dataset: Optional[Dataset] = None,
        reward_funcs: RewardFuncs = None,
        config: Config = None,
        reward_weights: Optional[Sequence[float]] = None,
        callbacks: Optional[Sequence[Callback]] = None,
    ):
        overrides = config_overrides(config)
        base = load_trainer_config("distill", config, overrides)
        overrides += model_overrides(base, model)
        overrides += model_overrides(base, teacher_model, "teacher.model_name", "teacher_warmup")
        overrides += prompt_data_overrides(base, train_dataset, eval_dataset, reward_funcs, reward_weights)
        super().__init__(load_trainer_config("distill", config, overrides), callbacks)
