"""Router replay: the generation/training logprob mismatch of mixture-of-experts policies with and
without replaying the engine's expert choices, beside a dense model's.

    ./run.sh python benchmarks/router_replay.py      # --models tiny-qwen3_moe tiny-deepseek_v3 tiny
    ./run.sh python benchmarks/router_replay.py --engine vllm --models tiny-qwen3_moe tiny

For each model the generation engine (`--engine`: the native engine, default, or vLLM as one Ray
generation worker in its own environment) generates one GRPO-shaped rollout (`--prompts` arithmetic prompts x
`--generations` samples, temperature 1, up to `--max-new-tokens`, fixed seeds) in bfloat16 (the usual
engine precision on GPUs, and what makes engine and trainer round apart), recording each fed token's
experts (`record_routing`). The float32 trainer's logprobs of the generated tokens (what
`Policy.get_logprobs` computes, one forward per 16 rows) are then compared with the engine's, without and
with `router_replay.replaying` the recorded experts: `token_mult_prob_error` (mean exp|difference|),
mean |difference|, `gen_kl_error` (k3), and the share of (token, MoE layer) top-k sets the trainer's
routers choose differently from the engine's.
"""

from __future__ import annotations

import argparse
import copy

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from generation_135m import rollout_prompts
from generation_precision import mismatch

from posttrain.models import router_replay
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.hf import load_causal_lm, load_tokenizer


def trainer_pass(model: torch.nn.Module, out: dict, replay: bool, batch_rows: int = 16):
    """`([B, S+T] float32 logprobs, [B, S+T, layers, k] the trainer's routing or None)`."""
    ids, lengths = out["output_ids"], out["unpadded_sequence_lengths"]
    recorded = out.get(router_replay.ROUTED_EXPERTS)
    rows, routes = [], []
    with torch.inference_mode():
        for start in range(0, ids.shape[0], batch_rows):
            chunk = ids[start : start + batch_rows]
            mask = (torch.arange(ids.shape[1])[None] < lengths[start : start + batch_rows, None]).long()
            routed = recorded[start : start + batch_rows].flatten(0, 1) if replay else None
            recorder = router_replay.RoutingRecorder(model) if recorded is not None else None
            with router_replay.replaying(model, routed):
                if recorder is not None:
                    with recorder:
                        logits = model(input_ids=chunk, attention_mask=mask).logits.float()
                    routes.append(recorder.take().reshape(*chunk.shape, *recorded.shape[2:]))
                else:
                    logits = model(input_ids=chunk, attention_mask=mask).logits.float()
            chosen = torch.log_softmax(logits[:, :-1], -1).gather(2, chunk[:, 1:, None])[..., 0]
            rows.append(torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1))
    return torch.cat(rows), (torch.cat(routes) if routes else None)


def flipped_share(recorded: torch.Tensor, trainer: torch.Tensor) -> float:
    """Share of recorded (token, layer) top-k sets the trainer's routers chose differently."""
    fed = (recorded >= 0).all(-1)
    same = (recorded.long().sort(-1).values == trainer.sort(-1).values).all(-1)
    return 1.0 - same[fed].float().mean().item()


def generate(name: str, reference: torch.nn.Module, tokenizer, moe: bool, args) -> dict:
    """One bf16 rollout of `name` with `args.engine`, recording routing for a mixture of experts."""
    input_ids, input_lengths = rollout_prompts(tokenizer, args.prompts, args.generations)
    seeds = torch.arange(input_ids.shape[0], dtype=torch.long) + 1000
    if args.engine == "native":
        engine = NativeGenerationEngine(copy.deepcopy(reference).to(torch.bfloat16), tokenizer,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                        record_routing=moe)
        out = engine.generate(input_ids, input_lengths, max_new_tokens=args.max_new_tokens, temperature=1.0,
                              seeds=seeds)
        return {key: value.clone() for key, value in out.items()}  # out of inference mode
    from posttrain.distributed.batch import Batch
    from posttrain.distributed.cluster import VirtualCluster
    from posttrain.models.generation.spec import GenerationSpec
    from posttrain.models.generation.vllm_generation import VllmGeneration

    cluster = VirtualCluster([1], cpus_per_bundle=1.0, name="bench-router-replay")
    spec = GenerationSpec(name, {"backend": "vllm", "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                                 "precision": "bfloat16", "colocated": {"enabled": False}}, precision="float32",
                          max_model_len=input_ids.shape[1] + args.max_new_tokens + 1, record_routing=moe)
    generation = VllmGeneration(cluster, spec)
    try:
        return dict(generation.generate(Batch(input_ids=input_ids, input_lengths=input_lengths, seeds=seeds)))
    finally:
        generation.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-qwen3_moe", "tiny-mixtral", "tiny-deepseek_v3", "tiny"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--engine", choices=["native", "vllm"], default="native")
    args = parser.parse_args()
    if args.engine == "vllm":
        from posttrain.distributed.ray_utils import init_ray

        init_ray()
    print(f"engine: {args.engine}")
    print("| model | replay | token_mult_prob_error | mean abs | gen_kl_error (k3) | top-k sets flipped |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        tokenizer = load_tokenizer(name)
        reference = load_causal_lm(name)
        moe = bool(router_replay.moe_balance.routers(reference))
        out = generate(name, reference, tokenizer, moe, args)
        for replay in ((False, True) if moe else (False,)):
            logprobs, routes = trainer_pass(reference, out, replay)
            row = mismatch(out["logprobs"], logprobs, out)
            flipped = f"{flipped_share(out[router_replay.ROUTED_EXPERTS], routes):.4f}" if moe else "-"
            print(f"| {name} | {'on' if replay else 'off' if moe else '- (dense)'} | {row['token_mult_prob_error']:.5f} "
                  f"| {row['mean_abs']:.5f} | {row['gen_kl_error']:.6f} | {flipped} |", flush=True)


if __name__ == "__main__":
    main()
