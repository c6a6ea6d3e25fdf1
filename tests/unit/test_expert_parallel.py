"""Expert parallelism's dispatch and combine (`models/policy/expert_parallel.py`) in two gloo
processes, without Ray: the tiny Qwen3-MoE, Mixtral and DeepSeek-V3 with their experts split over
2 ranks, each rank running its own rows, give one process's logits on the rows of both, and
(after `reduce_expert_gradients`) its gradients: the local experts' slices of the full expert
gradients, the other parameters' gradients summed over the ranks as FSDP does. Plus the config's
one-line refusals."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_collectives import free_ports

from posttrain.config.schema import PolicyConfig
from posttrain.models.parallel_sizes import expert_parallel_problem
from posttrain.models.policy import expert_parallel as ep

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")


def rows_of(rank: int) -> torch.Tensor:
    return torch.randint(7, 100, (2 + rank, 9), generator=torch.Generator().manual_seed(rank))


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from posttrain.models.tiny import make_tiny_model

    mesh = ep.build_mesh("cpu", 2, 2)
    out = {}
    for arch in ARCHS:
        reference, _ = make_tiny_model("tiny", arch)
        model = copy.deepcopy(reference)
        params = ep.shard_experts(model, mesh["ep"])
        assert len(params) == 2 * len(ep.expert_modules(model))
        weights = [torch.randn(2 + r, 9, 103, generator=torch.Generator().manual_seed(10 + r)) for r in (0, 1)]
        ref_logits = [reference(input_ids=rows_of(r)).logits for r in (0, 1)]
        sum((l * w).sum() for l, w in zip(ref_logits, weights)).backward()
        logits = model(input_ids=rows_of(rank)).logits
        (logits * weights[rank]).sum().backward()
        # One EP group (no replicas) and a loss not multiplied by the FSDP size: nothing to undo. The other
        # parameters' gradients are summed over the ranks below, as FSDP's average of a loss x 2 gives.
        ep.reduce_expert_gradients(params, mesh["edp"].get_group(), 1, fsdp_size=1)
        worst = (logits - ref_logits[rank]).abs().max().item()
        grad_worst, experts_checked = 0.0, 0
        full = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if any(p is q for q in params):
                local = p.grad.to_local()
                want = full[name].grad[rank * local.shape[0]:(rank + 1) * local.shape[0]]
                experts_checked += 1
            else:
                local = p.grad.clone()
                dist.all_reduce(local)
                want = full[name].grad
            grad_worst = max(grad_worst, (local - want).abs().max().item() / max(want.abs().max().item(), 1e-12))
        out[arch] = (worst, grad_worst, experts_checked)
    dist.destroy_process_group()
    results[rank] = out


@pytest.mark.timeout(600)
def test_ep2_dispatch_equals_one_process():
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(free_ports(1)[0], results), nprocs=2, join=True)
    for rank in (0, 1):
        for arch in ARCHS:
            logits_diff, grad_rel_diff, experts_checked = results[rank][arch]
            print(rank, arch, logits_diff, grad_rel_diff)
            assert experts_checked >= 2, arch
            assert logits_diff < 1e-5, arch
            assert grad_rel_diff < 1e-5, arch


def test_expert_parallel_problems_and_refusals():
    from transformers import LlamaConfig, Qwen3MoeConfig

    assert expert_parallel_problem(Qwen3MoeConfig(num_experts=4), 2) is None
    assert expert_parallel_problem({"n_routed_experts": 8}, 4) is None
    assert "does not divide the model's 4 routed experts" in expert_parallel_problem(Qwen3MoeConfig(num_experts=4), 3)
    assert "dense" in expert_parallel_problem(LlamaConfig(), 2)
    base = dict(model_name="tiny-qwen3_moe", num_workers=4, train_global_batch_size=4)
    assert PolicyConfig.model_validate(dict(base, expert_parallel_size=2)).expert_parallel_size == 2
    for extra, message in ((dict(expert_parallel_size=3), "must be a multiple of policy.expert_parallel_size=3"),
                           (dict(expert_parallel_size=2, tensor_parallel_size=2), "policy.tensor_parallel_size=2"),
                           (dict(expert_parallel_size=2, context_parallel_size=2), "policy.context_parallel_size=2"),
                           (dict(expert_parallel_size=2, lora=dict(enabled=True)), "lora")):
        with pytest.raises(ValueError, match=message):
            PolicyConfig.model_validate(dict(base, **extra))


def test_preflight_refuses_expert_parallelism_the_model_cannot_take():
    from posttrain.errors import UserError
    from posttrain.preflight import check_expert_parallel

    def policy(model: str, ep: int, workers: int) -> PolicyConfig:
        return PolicyConfig.model_validate(dict(model_name=model, num_workers=workers, expert_parallel_size=ep,
                                                train_global_batch_size=workers))

    check_expert_parallel(policy("tiny-deepseek_v3", 4, 4))  # 8 routed experts
    with pytest.raises(UserError, match="dense"):
        check_expert_parallel(policy("tiny", 2, 2))
    with pytest.raises(UserError, match="does not divide the model's 4 routed experts"):
        check_expert_parallel(policy("tiny-mixtral", 3, 3))


def test_vllm_generation_for_an_unverified_mixture_of_experts_is_refused_in_one_line():
    from posttrain.errors import UserError
    from posttrain.preflight import check_vllm_mixture_of_experts

    vllm = {"generation": {"backend": "vllm"}}
    with pytest.raises(UserError, match=r"backend=vllm with the mixture-of-experts model 'tiny-deepseek_v3' "
                                        r"\(model_type 'deepseek_v3'\) is not supported yet: vLLM 0.32's multi-head "
                                        r"latent attention takes a latent width .* of 320, 512 or 576 only"):
        check_vllm_mixture_of_experts(PolicyConfig(model_name="tiny-deepseek_v3", **vllm))
    for name in ("tiny-qwen3_moe", "tiny-mixtral"):  # refit verified
        check_vllm_mixture_of_experts(PolicyConfig(model_name=name, **vllm))
    check_vllm_mixture_of_experts(PolicyConfig(model_name="tiny", **vllm))  # dense: vLLM is fine
    check_vllm_mixture_of_experts(PolicyConfig(model_name="tiny-deepseek_v3"))  # the native engine
