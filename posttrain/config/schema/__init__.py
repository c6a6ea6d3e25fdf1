"""Typed configuration schemas, one module per part of the config.

Key names follow NeMo-RL where it has one, so its users feel at home. Every model forbids
unknown keys (`extra="forbid"`); the loader turns pydantic's errors into messages that name the
dotted key and suggest the closest valid one.
"""

from posttrain.config.schema.base import (  # noqa: F401
    Section,
    check_component_name,
)
from posttrain.config.schema.cluster import (  # noqa: F401
    ClusterConfig,
)
from posttrain.config.schema.policy import (  # noqa: F401
    ColocationConfig,
    DynamicBatchingConfig,
    GenerationConfig,
    LoraConfig,
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    SequencePackingConfig,
    SpeculativeConfig,
    VllmConfig,
)
from posttrain.config.schema.loss import (  # noqa: F401
    LossConfig,
    loss_option_problem,
)
from posttrain.config.schema.data import (  # noqa: F401
    BLEND_KEYS,
    VALIDATION_SEED_OFFSET,
    DataConfig,
    EnvConfig,
    ReasoningGymTask,
    blend_component,
    split_seed,
    validation_set,
)
from posttrain.config.schema.outputs import (  # noqa: F401
    CheckpointingConfig,
    LoggerConfig,
    MlflowConfig,
    WandbConfig,
)
from posttrain.config.schema.algorithms import (  # noqa: F401
    AdvantageEstimatorConfig,
    AsyncGRPOConfig,
    PartialRolloutsConfig,
    DPOConfig,
    DistillationConfig,
    DistillationLossConfig,
    EvalConfig,
    GRPOConfig,
    OfflineLoopConfig,
    RMConfig,
    RewardShapingConfig,
    SFTConfig,
)
from posttrain.config.schema.critic import (  # noqa: F401
    CriticConfig,
)
from posttrain.config.schema.jobs import (  # noqa: F401
    DPOMasterConfig,
    DistillMasterConfig,
    EvalMasterConfig,
    GRPOMasterConfig,
    MasterConfig,
    PPOMasterConfig,
    RMMasterConfig,
    SCHEMAS,
    SFTMasterConfig,
    async_grpo_problem,
    generation_precision,
    generation_precision_note,
    generation_precision_problem,
    length_penalty_note,
    partial_rollouts_problem,
    local_backend_problem,
    pair_batching_problems,
    resolve_backend,
    teacher_sections,
    training_precision,
    warm_start_problem,
)
