"""`logger` and `checkpointing`: what a run writes (metrics, trackers, checkpoints)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from posttrain.config.schema.base import Section


def _require_package(enabled: bool, key: str, package: str) -> None:
    """An enabled tracker whose package is missing fails at config load, not after start-up."""
    import importlib.util
    import sys

    if not enabled:
        return
    loaded = sys.modules.get(package, False)  # None: import blocked; a module: already imported
    if loaded is None or (loaded is False and importlib.util.find_spec(package) is None):
        raise ValueError(f"{key}=true needs the '{package}' package: pip install 'posttrain[tracking]'")


class WandbConfig(Section):
    """Weights & Biases logging."""

    enabled: bool = Field(False, description="Log metrics and the config to Weights & Biases (the 'tracking' extra).")
    project: str = Field("posttrain", description="W&B project name.")
    name: Optional[str] = Field(None, description="W&B run name; None lets W&B choose.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline",
        description="'offline' (default: files under log_dir, sync later), 'online' or 'disabled'.",
    )

    @model_validator(mode="after")
    def _check(self):
        _require_package(self.enabled, "logger.wandb.enabled", "wandb")
        return self


class MlflowConfig(Section):
    """MLflow logging."""

    enabled: bool = Field(False, description="Log metrics and the config to MLflow (the 'tracking' extra).")
    experiment_name: str = Field("posttrain", description="MLflow experiment name.")
    run_name: Optional[str] = Field(None, description="MLflow run name; None lets MLflow choose.")
    tracking_uri: Optional[str] = Field(
        None,
        description="MLflow tracking URI; None uses MLflow's default ($MLFLOW_TRACKING_URI, else ./mlruns).",
    )

    @model_validator(mode="after")
    def _check(self):
        _require_package(self.enabled, "logger.mlflow.enabled", "mlflow")
        return self


class LoggerConfig(Section):
    """Where metrics go: metrics.jsonl, TensorBoard, W&B, MLflow, the console and report.png."""

    log_dir: str = Field(
        "logs/run",
        description=(
            "Directory of metrics.jsonl, TensorBoard events, config.yaml and report.png (relative to the working "
            "directory)."
        ),
    )
    tensorboard_enabled: bool = Field(True, description="Write TensorBoard event files under log_dir.")
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    progress_bar: bool = Field(True, description="Show a progress bar with the latest reward / loss and step time.")
    report: bool = Field(True, description="Write report.png (curves, step-time breakdown) at the end.")
    num_val_samples_to_print: int = Field(
        3, ge=0,
        description=(
            "At each validation, show this many prompts with their responses and rewards: short lines on the "
            "console and a table in TensorBoard's TEXT tab (validation/samples); 0 shows none."
        ),
    )


class CheckpointingConfig(Section):
    """Checkpoints (atomic step_N directories) and resume."""

    enabled: bool = Field(
        True,
        description="Save checkpoints and resume from the latest one when the run starts again.",
    )
    checkpoint_dir: str = Field(
        "checkpoints/run",
        description="Directory of the step_N checkpoints (relative to the working directory).",
    )
    save_period: int = Field(50, ge=1, description="Save every this many steps, and at the last step.")
    keep_top_k: Optional[int] = Field(
        3, ge=1,
        description="Keep the best k checkpoints by metric_name (the latest is always kept); None keeps all.",
    )
    metric_name: Optional[str] = Field(
        "validation/accuracy",
        description="Metric that ranks checkpoints (the most recent validation's); None keeps the newest. "
        "'validation/accuracy' stands for the run's accuracy, validation/accuracy_greedy or _sampled, when it "
        "logs no validation/accuracy of its own (DPO's and RM's preference accuracy).",
    )
    higher_is_better: bool = Field(True, description="Whether a larger metric_name is better.")
    save_optimizer: bool = Field(
        True,
        description=(
            "Save the optimizer state (Adam's moments: twice the weights' size) with each checkpoint, for an "
            "exact resume; false saves the space, and a resumed run starts its optimizer afresh (the "
            "learning-rate schedule goes on)."
        ),
    )
    allow_resume_config_changes: bool = Field(
        False,
        description=(
            "Resume even when the model, data or batch-shape keys differ from the checkpoints' saved config "
            "(<checkpoint_dir>/config.yaml); the differences are then printed as warnings."
        ),
    )
