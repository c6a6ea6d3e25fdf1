"""Policy training: `Policy` (controller side, `policy.py`), `PolicyWorker` (one data-parallel
rank with FSDP2, `worker.py`; its model built and sharded in `model_loading.py`), micro-batching
and logprobs (`forward.py`), sharded checkpoints and Hugging Face export (`checkpoint.py`).

Nothing is imported here so that `import posttrain.models.policy.checkpoint` (the CLI's
`posttrain convert`) does not start Ray.
"""
