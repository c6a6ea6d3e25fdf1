"""Pipeline parallelism's pieces without workers: the stage split, the stage placement, the
micro-batch counts the schedules need, the config's one-line refusals, the pruned model's
parameter names and the stage chunks' maths (chained in one process they give the whole model's
logprobs and gradients). Training over real workers: tests/functional/test_pipeline_workers.py."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.config.schema import PolicyConfig
from posttrain.distributed.batch import Batch
from posttrain.errors import UserError
from posttrain.models.policy import pipeline
from posttrain.models.policy.forward import fixed_size_microbatches, next_token_logprobs
from posttrain.models.tiny import make_tiny_model
from posttrain.preflight import check_pipeline_parallel


def test_layers_split_evenly_or_as_given():
    assert pipeline.stage_layer_counts(12, 2) == [6, 6]
    assert pipeline.stage_layer_counts(7, 3) == [3, 2, 2]  # the first stages take the remainder
    assert pipeline.stage_layer_counts(12, 2, [5, 7]) == [5, 7]
    assert pipeline.stage_layers([3, 2, 2]) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match=r"pipeline_layer_split=\[5, 6\] must give 2 stages .* 12 layers in all"):
        pipeline.stage_layer_counts(12, 2, [5, 6])
    with pytest.raises(ValueError, match=r"the model's 2 layers cannot fill 4 pipeline stages"):
        pipeline.stage_layer_counts(2, 4)


def test_stage_placement_and_microbatch_counts():
    """Loop placement (stage s on rank s % pp); 1F1B needs at least one micro-batch per stage,
    interleaved a multiple of pp; GPipe takes any count."""
    assert pipeline.local_stages(0, 2, 2) == [0, 2] and pipeline.local_stages(1, 2, 2) == [1, 3]
    assert pipeline.local_stages(1, 4, 1) == [1]
    assert pipeline.microbatches_needed(1, "1f1b", 2, 2) == 2
    assert pipeline.microbatches_needed(5, "1f1b", 2, 2) == 5
    assert pipeline.microbatches_needed(3, "interleaved_1f1b", 2, 4) == 4
    assert pipeline.microbatches_needed(1, "interleaved_1f1b", 2, 4) == 2
    assert pipeline.microbatches_needed(1, "gpipe", 2, 2) == 1


def test_config_sizes_and_one_line_refusals():
    with pytest.raises(ConfigError, match=r"policy.num_workers=3 must be a multiple of policy.pipeline_parallel_size=2"):
        load_config("grpo", overrides=["policy.num_workers=3", "policy.pipeline_parallel_size=2"])
    with pytest.raises(ValueError, match=r"policy.num_workers=4 must be a multiple of policy.pipeline_parallel_size \* "
                                         r"policy.tensor_parallel_size = 2 \* 4"):
        PolicyConfig(num_workers=4, pipeline_parallel_size=2, tensor_parallel_size=4)
    cfg = PolicyConfig(num_workers=8, pipeline_parallel_size=2, tensor_parallel_size=2, train_global_batch_size=2)
    assert cfg.dp_size == 2  # the stages of a pipeline share rows, like a TP group's ranks
    with pytest.raises(ValueError, match=r"train_global_batch_size=3 must be a multiple of the 2 data-parallel ranks"):
        PolicyConfig(num_workers=4, pipeline_parallel_size=2, train_global_batch_size=3)
    refused = {
        "policy.context_parallel_size > 1": dict(num_workers=4, context_parallel_size=2),
        "policy.lora.enabled": dict(lora=dict(enabled=True)),
        "policy.sequence_packing.enabled": dict(sequence_packing=dict(enabled=True)),
        "policy.dynamic_batching.enabled": dict(dynamic_batching=dict(enabled=True)),
        "policy.batch_invariant": dict(batch_invariant=True),
        "policy.expert_parallel_size > 1": dict(num_workers=4, expert_parallel_size=2),
        "policy.moe_router_replay": dict(moe_router_replay=True),
    }
    for key, options in refused.items():
        with pytest.raises(ValueError, match=f"policy.pipeline_parallel_size > 1 with {key} is not supported"):
            PolicyConfig(**{"num_workers": 2, "pipeline_parallel_size": 2, **options})
    with pytest.raises(ValueError, match="interleaved_1f1b needs policy.pipeline_virtual_stages >= 2"):
        PolicyConfig(num_workers=2, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                     pipeline_virtual_stages=1)
    with pytest.raises(ValueError, match="pipeline_virtual_stages=2 needs policy.pipeline_schedule=interleaved_1f1b"):
        PolicyConfig(num_workers=2, pipeline_parallel_size=2, pipeline_virtual_stages=2)
    with pytest.raises(ValueError, match=r"pipeline_layer_split=\[1, 1, 1\] must list 2 stages"):
        PolicyConfig(num_workers=2, pipeline_parallel_size=2, pipeline_layer_split=[1, 1, 1])
    interleaved = PolicyConfig(num_workers=2, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    assert interleaved.pipeline_stages_per_worker == 2


def test_models_the_pipeline_cannot_split_are_named():
    """By the workers (the loaded model) and, before anything starts, by preflight (its config)."""
    tied, _ = make_tiny_model("tiny", "qwen2")
    assert "tie_word_embeddings" in pipeline.model_problem(tied)
    moe, _ = make_tiny_model("tiny", "mixtral")
    assert "model_type 'mixtral' is not one posttrain splits" in pipeline.model_problem(moe)
    dense, _ = make_tiny_model("tiny", "llama")
    assert pipeline.model_problem(dense) is None
    assert "2 layers cannot fill 4 pipeline stages" in pipeline.model_problem(dense, 4)

    def refusal(**options) -> str:
        with pytest.raises(UserError) as error:
            check_pipeline_parallel(PolicyConfig(num_workers=2, pipeline_parallel_size=2, **options))
        return str(error.value)

    assert "tie_word_embeddings" in refusal(model_name="tiny-qwen2")
    assert "cannot fill 4 pipeline stages" in refusal(pipeline_schedule="interleaved_1f1b")
    assert "pipeline_layer_split=[1, 2] sums to 3, not the model's 2 layers" in refusal(pipeline_layer_split=[1, 2])
    check_pipeline_parallel(PolicyConfig(num_workers=2, pipeline_parallel_size=2, model_name="small",
                                         pipeline_schedule="interleaved_1f1b"))


def test_pruned_stages_keep_the_full_model_names_and_chain_to_its_logprobs():
    """Stage 1 of 2 keeps layer 1, the norm and the head under their full names; the two chunks
    chained in one process give the whole model's logprobs (right-padded rows, no padding mask)
    and its gradients."""
    model, _ = make_tiny_model("tiny", "llama")
    full_names = set(model.state_dict())
    reference = copy.deepcopy(model)
    last = copy.deepcopy(model)
    pipeline.keep_stages(last, [1], first=False, last=True)
    assert set(last.state_dict()) == {n for n in full_names if not n.startswith(("model.layers.0.", "model.embed"))}

    pipeline.keep_stages(model, [0, 1], first=True, last=True)
    assert set(model.state_dict()) == full_names
    chunks = [pipeline.StageChunk(model, [0], True, False), pipeline.StageChunk(model, [1], False, True)]
    lengths = torch.tensor([9, 5, 7])
    ids = torch.randint(7, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    valid = torch.arange(9)[None] < lengths[:, None]
    chained = chunks[1](chunks[0](ids, input_ids=ids), input_ids=ids) * valid
    expected = next_token_logprobs(reference(input_ids=ids, attention_mask=valid.long()).logits, ids) * valid
    torch.testing.assert_close(chained, expected, rtol=1e-5, atol=1e-5)
    chained.sum().backward()
    expected.sum().backward()
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_microbatches_are_padded_to_one_shape():
    batch = Batch(input_ids=torch.arange(1, 16).view(3, 5), input_lengths=torch.tensor([5, 2, 3]))
    mbs = fixed_size_microbatches(batch, 2)  # widths 5 and 3, 2 rows and 1
    stacked = pipeline.padded_inputs(mbs, 2)
    assert stacked.shape == (4, 5)
    assert stacked[2].tolist() == [11, 12, 13, 0, 0] and stacked[3].tolist() == [0] * 5


def test_the_optimizer_state_format_is_read_from_the_checkpoint(tmp_path):
    """Whole param groups (saved without PP) and groups flattened per parameter name (under PP) are
    told apart by the DCP metadata, so a checkpoint of either kind loads whatever the PP size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from posttrain.models.policy.checkpoint import OPTIM_DIR, optimizer_state_is_flat

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    for flat in (False, True):
        _, state = get_state_dict(model, (optimizer,), options=StateDictOptions(flatten_optimizer_state_dict=flat))
        dcp.save(state, checkpoint_id=str(tmp_path / str(flat) / OPTIM_DIR))
        assert optimizer_state_is_flat(tmp_path / str(flat)) is flat


@pytest.mark.parametrize("max_shard_size", [None, "200KB"], ids=["one file", "indexed shards"])
def test_each_stage_reads_only_its_tensors_from_safetensors(tmp_path, max_shard_size):
    """A meta-built model pruned to stage 1 of 2 gets exactly the saved tensors of layer 1, the norm
    and the head, in float32 (the checkpoint saved in bfloat16), and reads nothing else."""
    from posttrain.models.policy import sharded_load

    model, _ = make_tiny_model("tiny", "llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    files = sharded_load.safetensors_files(str(tmp_path))
    assert set(files) == set(model.state_dict())
    assert (len(set(files.values())) > 1) == bool(max_shard_size)
    stage = sharded_load.empty_causal_lm(str(tmp_path))
    pipeline.keep_stages(stage, [1], first=False, last=True)
    sharded_load.fill_from_safetensors(stage, files)
    saved = model.state_dict()
    for name, tensor in stage.state_dict().items():
        assert tensor.dtype == torch.float32 and not tensor.is_meta
        assert torch.equal(tensor, saved[name].float()), name
    assert not any(n.startswith(("model.layers.0.", "model.embed")) for n in stage.state_dict())
    assert sharded_load.safetensors_files(str(tmp_path / "nowhere")) is None  # not local safetensors: read whole
    broken = {n: f for n, f in files.items() if n != "lm_head.weight"}
    fresh = sharded_load.empty_causal_lm(str(tmp_path))
    pipeline.keep_stages(fresh, [1], first=False, last=True)
    with pytest.raises(RuntimeError, match=r"no tensor for \['lm_head.weight'\]"):
        sharded_load.fill_from_safetensors(fresh, broken)
