"""Data-parallel generation on real Ray workers with the built-in tiny model, and packed refit."""

import pytest
import torch

from posttrain.distributed.batch import Batch
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.refit import pack, refit_metadata_from_state_dict, state_dict_checksum

pytestmark = pytest.mark.functional

GEN_CONFIG = {"max_new_tokens": 8, "temperature": 1.0, "batch_size": 2, "colocated": {"enabled": False}}


@pytest.fixture(scope="module")
def generation(ray_cluster):
    from posttrain.distributed.cluster import VirtualCluster
    from posttrain.models.generation.spec import GenerationSpec
    from posttrain.models.generation.native import NativeGeneration

    cluster = VirtualCluster([2], cpus_per_bundle=1.0, name="gen-test")
    generation = NativeGeneration(cluster, GenerationSpec("tiny", GEN_CONFIG, precision="float32"))
    yield generation
    generation.shutdown()
    cluster.shutdown()


def prompt_batch(tokenizer) -> Batch:
    texts = ["1+1=", "What is 7*6?", "hi", "abc", "The quick brown fox"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    return Batch(input_ids=input_ids, input_lengths=torch.tensor([len(i) for i in ids]))


def local_engine(state_dict=None):
    tokenizer = load_tokenizer("tiny")
    model = load_causal_lm("tiny", dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    engine = NativeGenerationEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return engine, tokenizer


def assert_same_generation(out: Batch, reference: dict):
    assert out["output_ids"].tolist() == reference["output_ids"].tolist()
    assert out["generation_lengths"].tolist() == reference["generation_lengths"].tolist()
    assert out["truncated"].tolist() == reference["truncated"].tolist()
    torch.testing.assert_close(out["logprobs"], reference["logprobs"], atol=1e-5, rtol=0)


def test_data_parallel_generation_matches_single_engine(generation):
    engine, tokenizer = local_engine()
    batch = prompt_batch(tokenizer)
    assert generation.worker_group.world_size == 2

    out = generation.generate(batch, greedy=True)
    reference = engine.generate(batch["input_ids"], batch["input_lengths"], max_new_tokens=8, greedy=True)
    assert_same_generation(out, reference)
    # Rows come back in order: each output starts with its own prompt.
    for i in range(batch.size):
        n = int(batch["input_lengths"][i])
        assert out["output_ids"][i, :n].tolist() == batch["input_ids"][i, :n].tolist()

    # Seeded sampling gives the same tokens whichever worker decodes a row.
    batch["seeds"] = torch.tensor([5, 6, 7, 8, 9])
    sampled = generation.generate(batch, greedy=False, params={"temperature": 1.5})
    reference = engine.generate(
        batch["input_ids"], batch["input_lengths"], max_new_tokens=8, temperature=1.5, seeds=batch["seeds"]
    )
    assert_same_generation(sampled, reference)


def test_shards_come_back_per_worker_and_cover_the_batch(generation):
    """`generate_shards` yields each worker's rows as it finishes (2 workers: rows 0-2, 3-4), and
    the pieces equal `generate` on the whole batch."""
    tokenizer = load_tokenizer("tiny")
    batch = prompt_batch(tokenizer)
    whole = generation.generate(batch, greedy=True)
    pieces = list(generation.generate_shards(batch, greedy=True))
    assert sorted(rows for rows, _ in pieces) == [[0, 1, 2], [3, 4]]
    for rows, out in pieces:
        assert out["generation_lengths"].tolist() == whole["generation_lengths"][rows].tolist()
        for k, row in enumerate(rows):
            end = int(out["unpadded_sequence_lengths"][k])
            assert out["output_ids"][k, :end].tolist() == whole["output_ids"][row, :end].tolist()


def test_packed_refit_updates_every_worker(generation):
    tokenizer = load_tokenizer("tiny")
    torch.manual_seed(0)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in load_causal_lm("tiny").state_dict().items()}
    assert len(set(generation.get_weights_checksums()) | {state_dict_checksum(new_state)}) == 2

    metadata = refit_metadata_from_state_dict(new_state, bucket_bytes=256 * 1024)
    assert len(metadata.bucket_sizes) > 1
    generation.prepare_refit_info(metadata)
    generation.update_weights(pack(new_state, metadata), version=1)
    assert generation.weights_version == 1
    assert generation.worker_group.run_all("get_weights_version") == [1, 1]
    assert generation.get_weights_checksums() == [state_dict_checksum(new_state)] * 2

    engine, _ = local_engine(new_state)
    batch = prompt_batch(tokenizer)
    out = generation.generate(batch, greedy=True)
    reference = engine.generate(batch["input_ids"], batch["input_lengths"], max_new_tokens=8, greedy=True)
    assert_same_generation(out, reference)


def test_a_users_backend_from_a_file_is_picked_by_config_and_generates(tmp_path):
    """`policy.generation.backend: file.py:Class` builds the user's class from the run's
    `GenerationSpec` and GRPO generates with it (the local backend: one process, no Ray)."""
    from pathlib import Path

    from test_grpo import read_metrics, small_cfg

    from posttrain.algorithms import grpo
    from posttrain.errors import UserError
    from posttrain.preflight import check_components

    plugin = Path(__file__).with_name("plugin_generation.py")
    cfg = small_cfg(tmp_path, f"policy.generation.backend={plugin}:RecordingGeneration", "cluster.backend=local",
                    "grpo.max_num_steps=1")
    check_components(cfg)
    ctx = grpo.setup(cfg)
    try:
        assert type(ctx.generation).__name__ == "RecordingGeneration"
        assert ctx.generation.spec.model_name == "tiny" and ctx.generation.spec.max_model_len == 32
        grpo.grpo_train(ctx)
        requests = ctx.generation.requests
    finally:
        ctx.shutdown()
    assert requests == [(16, False)]  # one step: 4 prompts x 4 generations, sampled
    assert "train/reward" in read_metrics(tmp_path / "logs")[1]

    wrong = small_cfg(tmp_path / "wrong", f"policy.generation.backend={plugin}:NotABackend")
    with pytest.raises(UserError, match="policy.generation.backend: .*NotABackend' is not a GenerationInterface subclass"):
        check_components(wrong)
