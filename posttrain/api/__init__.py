"""The Python API: every `posttrain` command as an object (docs/python-api.md).

    from posttrain import GRPO, PPO, SFT, DPO, RewardModel, Distill, evaluate

    trainer = SFT(model="tiny", train_dataset=rows, eval_dataset=held_out, config={"sft": {"max_num_steps": 50}})
    result = trainer.train()        # the same job as `posttrain sft`; metrics, history, paths
    model, tokenizer = result.load_model()   # the trained model, as transformers loads it
    evaluate(result.model_dir(), dataset=held_out)   # `posttrain eval`

Every trainer takes the same arguments where they mean the same thing: `model` (a name or path),
`train_dataset` / `eval_dataset` (a list of dicts, a `datasets.Dataset` or a JSONL path, with TRL's
column names), `config` (a config object, a YAML path or a dict of keys over the command's
embedded default) and `callbacks` (`on_step_end(step, metrics) -> bool`; True stops the run);
`train()` returns a `TrainResult`, and `trainer.model` / `trainer.tokenizer` are the trained model.
A trainer only writes a config and runs `posttrain.cli.run_job`, the CLI's job (`common.py`).
"""

from posttrain.api.common import TrainResult, Trainer, dataset_jsonl
from posttrain.api.distill import Distill
from posttrain.api.evaluate import evaluate
from posttrain.api.grpo import GRPO
from posttrain.api.offline import DPO, SFT, RewardModel
from posttrain.api.ppo import PPO

__all__ = ["GRPO", "PPO", "SFT", "DPO", "RewardModel", "Distill", "evaluate", "TrainResult", "Trainer", "dataset_jsonl"]
