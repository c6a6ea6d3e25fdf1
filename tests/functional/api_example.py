"""The README's Python API example: GRPO on a reward function, through `posttrain.GRPO` (run by test_api.py)."""
import json
import random

from posttrain import GRPO


def first_digit(prompts, completions, answer, **columns):  # TRL's signature; `answer` is a column of the rows
    return [float(c.strip()[:1] == a[0]) for c, a in zip(completions, answer)]


rng = random.Random(0)
rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((rng.randrange(10, 100), rng.randrange(10, 100)) for _ in range(300))]
trainer = GRPO(model="tiny", reward_funcs=first_digit, train_dataset=rows[:268], eval_dataset=rows[268:], config={
    "sft_warmup": None,  # train the tiny model from scratch, not after the default's arithmetic warm start
    "grpo": {"max_num_steps": 20, "val_period": 5, "num_prompts_per_step": 8, "num_generations_per_prompt": 8},
    "policy": {"train_global_batch_size": 64, "train_micro_batch_size": 64, "optimizer": {"lr": 1e-3}, "scheduler": {"name": "constant"},
               "generation": {"max_new_tokens": 4}},
    "logger": {"log_dir": "logs/api_example"}, "checkpointing": {"checkpoint_dir": "checkpoints/api_example"},
})
result = trainer.train()
print(json.dumps({step: {k: v for k, v in m.items() if k.startswith("validation/")} for step, m in result.history.items()}))
