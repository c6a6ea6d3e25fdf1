"""The `reward_model` environment (RLHF): a trained reward model scores each response.

`model_path` is a Hugging Face sequence-classification model with one output: what `posttrain rm`
writes to `rm.export_dir`, or any such model on disk. The model is loaded once in the
environment's own Ray actor process (on its GPU when the actor has one, else CPU) and scores a
batch at a time; the policy never shares memory with it.

What the reward model sees is exactly the layout `posttrain rm` trained it on
(`build_preference_example`): the prompt as the chat template rendered it, the response, and the
template's end of the assistant turn (e.g. `<|end|>`); then the score at the last token. So a
response is scored as the same response would be in a preference pair. Reward =
`scale * (score - shift)` (defaults 1 and 0), single turn (the episode ends).

Multi-turn conversations are scored on the text of all their messages in order (the prompt text
already holds the template's tokens; later environment messages are added as they are).
"""

from __future__ import annotations

from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog
from posttrain.environments.registry import register_env


class RewardModelEnvConfig(BaseModel):
    """`env.reward_model.*`."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(..., description="HF sequence-classification model dir (e.g. posttrain rm's rm.export_dir).")
    batch_size: int = Field(16, ge=1, description="Conversations per forward pass. Default 16.")
    scale: float = Field(1.0, description="Reward = scale * (score - shift). Default 1.")
    shift: float = Field(0.0, description="Subtracted from the score before scaling. Default 0.")
    max_length: Optional[int] = Field(None, ge=8, description="Tokens kept (the end); default: no limit.")
    device: str = Field("auto", description="auto (cuda when the actor has a GPU, else cpu), cpu or cuda.")

    @field_validator("model_path")
    @classmethod
    def _exists(cls, path: str) -> str:
        from pathlib import Path

        resolved = Path(path).expanduser().resolve()  # in the driver: the actor may run elsewhere
        if not (resolved / "config.json").is_file():
            raise ValueError(f"{path!r} is not a Hugging Face model directory (no config.json); "
                             "train one with `posttrain rm` and rm.export_dir")
        return str(resolved)


def end_of_assistant_turn(tokenizer) -> str:
    """What the chat template writes after an assistant message's content (e.g. `<|end|>`), or
    the eos token without a template."""
    if getattr(tokenizer, "chat_template", None):
        from posttrain.data.chat import after_assistant_closing

        return after_assistant_closing(tokenizer)
    return tokenizer.eos_token or ""


@register_env("reward_model")
class RewardModelEnvironment(Environment):
    """Scores responses with a sequence-classification reward model. Config: `RewardModelEnvConfig`."""

    config_class = RewardModelEnvConfig

    def __init__(self, cfg: RewardModelEnvConfig | dict):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg if isinstance(cfg, RewardModelEnvConfig) else RewardModelEnvConfig.model_validate(cfg)
        device = self.cfg.device
        if device == "auto":
            # cuda: a GPU-only path (docs/scaling.md, "GPU-only paths")
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        from posttrain.utils.model_build import MODEL_BUILD_LOCK

        with MODEL_BUILD_LOCK:  # another thread of this process (the local backend) may be building one
            self.model = AutoModelForSequenceClassification.from_pretrained(self.cfg.model_path, num_labels=1)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()
        self.closing = end_of_assistant_turn(self.tokenizer)

    def conversation_ids(self, message_log: MessageLog) -> list[int]:
        """Token ids the reward model scores for one conversation (module docstring)."""
        text = "".join(str(m.get("content", "")) for m in message_log)
        if message_log and message_log[-1].get("role") == "assistant":
            text += self.closing
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.cfg.max_length:] if self.cfg.max_length else ids

    @torch.no_grad()
    def score(self, message_logs: list[MessageLog]) -> torch.Tensor:
        """Raw reward-model scores `[B]`, scored at each conversation's last token."""
        scores = []
        for start in range(0, len(message_logs), self.cfg.batch_size):
            rows = [self.conversation_ids(log_) for log_ in message_logs[start: start + self.cfg.batch_size]]
            width = max(len(r) for r in rows)
            input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
            attention = torch.zeros(len(rows), width, dtype=torch.long)
            for b, row in enumerate(rows):
                input_ids[b, : len(row)] = torch.tensor(row)
                attention[b, : len(row)] = 1
            # Our own last-token gather (right padding), so a pad id inside the text cannot move it.
            out = self.model.base_model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device))
            last = attention.sum(dim=1) - 1
            hidden = out.last_hidden_state[torch.arange(len(rows)), last.to(self.device)]
            head = getattr(self.model, "score", None) or getattr(self.model, "classifier")
            scores.append(head(hidden).float().reshape(-1).cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        n = len(message_logs)
        scores = self.score(message_logs)
        rewards = self.cfg.scale * (scores - self.cfg.shift)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Reward model score: {s:.4f}"} for s in scores.tolist()],
            metadata=list(metadata), next_stop_strings=[None] * n, rewards=rewards.to(torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n,
            metrics={"score_sum": float(scores.sum()), "scored": float(n)},
        )
