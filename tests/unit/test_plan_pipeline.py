"""`posttrain plan` under pipeline parallelism: every pipeline rank is planned (`formulas.pipeline_rank`),
the first and last stages (and the largest rank between them) are devices of their own, and the
largest decides fit. Exact bytes by hand for the made-up `SHAPE` of test_plan.py (4 layers, hidden 64,
987 200 decoder-layer elements; float32: 7168 activation bytes per token and layer) with one
2048-token row per micro-batch."""

from __future__ import annotations

from test_plan import SHAPE

from posttrain import plan as mp
from posttrain.config import load_config
from posttrain.plan.formulas import FUSED_LOGPROB_TILE_BYTES, pipeline_rank

GiB = mp.GiB
PER_LAYER = 7168  # activation_bytes_per_token_layer(SHAPE, 4): 4 x (640 attention + 1152 MLP)
TOKENS = 2048
LAYER_PARAMS = 987_200  # SHAPE's elements outside the embeddings and head
COMMON = ["policy.precision=float32", "policy.train_micro_batch_size=1", "policy.max_total_sequence_length=2048",
          "policy.train_global_batch_size=8", "policy.logprob_batch_size=1"]


def sft(*overrides):
    """An SFT job (no generation engine on the policy's devices: its training phase is the peak)."""
    return load_config("sft", None, list(overrides))


def shape_with_vocab(vocab: int) -> mp.ModelShape:
    """SHAPE with an untied vocabulary of `vocab` (embeddings and head vocab x 64 each)."""
    return mp.ModelShape(**{**SHAPE.__dict__, "vocab_size": vocab, "embedding_params": 2 * vocab * 64,
                            "num_params": LAYER_PARAMS + 2 * vocab * 64})


def head_bytes_by_hand(vocab: int, waiting: int = 1) -> int:
    """The last stage's head: the fused kernel's tile, the saved final hidden states of `waiting`
    micro-batches (2048 x 64 fp32 each) and the fp32 [vocab, 64] weight-gradient accumulator."""
    return FUSED_LOGPROB_TILE_BYTES + waiting * TOKENS * 4 * 64 + 4 * vocab * 64


def test_even_split_the_first_stage_holds_the_most():
    """PP=2 x DP=2 on 4 GPUs, 8 rows per step (4 micro-batches per pipeline), vocabulary 100. Each
    rank holds 2 layers and half of the 12 800 embedding elements (embeddings on the first, head on
    the last), over its 2 FSDP ranks, and keeps them gathered through the step. 1F1B: the first rank
    holds 2 stage forwards in flight (pp - rank), the last 1 plus its head; GPipe all 4 on both
    (and the head saves every micro-batch's hidden states); interleaved 1F1B (2 virtual stages of
    one layer each) torch's warm-up (2 - 1) x 2 + 2 x (1 - rank) plus one: 5 and 3."""
    shape = shape_with_vocab(100)
    common = ["cluster.gpus_per_node=4", "policy.num_workers=4", "policy.pipeline_parallel_size=2", *COMMON]
    for schedule, flights, chunk_layers, waiting in (("1f1b", (2, 1), 2, 1), ("gpipe", (4, 4), 2, 4),
                                                    ("interleaved_1f1b", (5, 3), 1, 1)):
        plan = mp.memory_plan(sft(*common, f"policy.pipeline_schedule={schedule}"), shape, device_bytes=80 * GiB)
        first, last = plan.devices[:2]
        assert first.name.startswith("policy worker (first pipeline stage)")
        assert last.name.startswith("policy worker (last pipeline stage)")
        assert plan.process_counts[:2] == [2, 2]
        for device, flight in zip((first, last), flights):
            rows = device.rows
            assert rows["policy parameters (fp32)"]["training"] == 4 * (LAYER_PARAMS * 2 / 4 + 6_400) / 2
            assert rows["activations (%d stage forwards in flight)" % flight]["training"] == \
                TOKENS * PER_LAYER * (flight * chunk_layers + 1), schedule
        assert first.rows["FSDP gathered stage (layers, embeddings)"]["training"] == 4 * (LAYER_PARAMS * 2 / 4 + 6_400)
        assert last.rows["FSDP gathered stage (layers, head)"]["training"] == 4 * (LAYER_PARAMS * 2 / 4 + 6_400)
        assert "LM head: fused logprobs + fp32 weight gradient" not in first.rows
        assert last.rows["LM head: fused logprobs + fp32 weight gradient"]["training"] == \
            head_bytes_by_hand(100, waiting), schedule
    # 1F1B: 2048 x 7168 x (5 - 3) = 29.4 MB more activations on the first than the last's 17.3 MB head.
    plan = mp.memory_plan(sft(*common), shape, device_bytes=80 * GiB)
    first, last = plan.devices[:2]
    assert first.phase_total("training") - last.phase_total("training") == \
        TOKENS * PER_LAYER * 2 - head_bytes_by_hand(100) == 12_033_024
    assert plan.node_peak() == first.peak()[1]


def test_a_big_vocabulary_makes_the_last_stage_the_largest():
    """Qwen's 152 064-token vocabulary on the same layers (PP=2, one data-parallel rank): both ends
    hold a 152 064 x 64 table, but only the last stage's fused head backward accumulates its
    gradient in fp32 (38.9 MB), more than the first stage's extra in-flight forward (2048 x 2 x 7168)."""
    shape = shape_with_vocab(152_064)
    plan = mp.memory_plan(sft("cluster.gpus_per_node=2", "policy.num_workers=2", "policy.pipeline_parallel_size=2",
                               *COMMON), shape, device_bytes=80 * GiB)
    first, last = plan.devices[:2]
    table = 152_064 * 64
    for device in (first, last):  # fp32 weights, gradients and AdamW's two moments: 16 bytes each
        assert device.rows["policy parameters (fp32)"]["training"] == 4 * (LAYER_PARAMS / 2 + table)
    assert first.rows["activations (2 stage forwards in flight)"]["training"] == TOKENS * PER_LAYER * 5
    assert last.rows["activations (1 stage forwards in flight)"]["training"] == TOKENS * PER_LAYER * 3
    assert last.rows["LM head: fused logprobs + fp32 weight gradient"]["training"] == head_bytes_by_hand(152_064)
    assert last.phase_total("training") - first.phase_total("training") == \
        head_bytes_by_hand(152_064) - TOKENS * PER_LAYER * 2 == 26_869_760
    assert plan.node_peak() == last.peak()[1] > first.peak()[1]  # training is each one's peak
    # Below float32 the accumulator's cast to the compute dtype is alive with it: 4 + 2 bytes per element.
    bf16 = pipeline_rank(sft("policy.num_workers=2", "policy.pipeline_parallel_size=2", "policy.precision=bfloat16",
                              *COMMON[1:]).policy, shape, 1, 1, 2, TOKENS, 1)
    assert bf16["head"] == FUSED_LOGPROB_TILE_BYTES + TOKENS * 2 * 64 + 6 * table
    assert pipeline_rank(sft("policy.num_workers=2", "policy.pipeline_parallel_size=2", *COMMON).policy,
                         shape, 1, 1, 4, TOKENS, 0)["head"] == 0


def test_an_uneven_split_makes_a_middle_rank_the_largest_and_it_decides_fit():
    """PP=3 on 3 GPUs with `pipeline_layer_split=[1, 2, 1]`, 8 micro-batches under 1F1B (3, 2 and 1
    in flight): the middle rank's 2 layers (493 600 elements, 16 bytes each with AdamW) and 2 x 2
    layers of activations in flight outweigh the first rank's 1 layer + embeddings with 3 x 1, and
    the last's 1 layer + head with 1 x 1 and the head. The plan shows all three; the peak, and
    whether it fits, is the middle rank's."""
    shape = shape_with_vocab(100)
    cfg = sft("cluster.gpus_per_node=3", "policy.num_workers=3", "policy.pipeline_parallel_size=3",
               "policy.pipeline_layer_split=[1,2,1]", *COMMON)
    plan = mp.memory_plan(cfg, shape, device_bytes=80 * GiB)
    first, middle, last = plan.devices[:3]
    assert middle.name.startswith("policy worker (pipeline rank 1, the largest of ranks 1-1)")
    assert plan.process_counts[:3] == [1, 1, 1]
    layer = LAYER_PARAMS / 4
    expected = [(layer + 6_400, 3, 1, 0), (2 * layer, 2, 2, 0), (layer + 6_400, 1, 1, head_bytes_by_hand(100))]
    for device, (params, flight, layers, head) in zip((first, middle, last), expected):
        rows = device.rows
        assert rows["policy parameters (fp32)"]["training"] == 4 * params
        assert rows["gradients (fp32)"]["training"] == 4 * params
        assert rows["optimizer state (adamw)"]["training"] == 8 * params
        assert rows[f"activations ({flight} stage forwards in flight)"]["training"] == \
            TOKENS * PER_LAYER * (flight * layers + 1)
        assert rows.get("LM head: fused logprobs + fp32 weight gradient", {}).get("training", 0) == head
    assert [d.phase_total("training") for d in (first, middle, last)] == [62_771_456, 81_297_920, 50_738_432]
    assert plan.node_peak() == middle.peak()[1]
    between = (middle.peak()[1] + max(first.peak()[1], last.peak()[1])) / 2 / (1 - mp.HEADROOM)
    assert not mp.fits(mp.memory_plan(cfg, shape, device_bytes=int(between)))


def test_more_ranks_show_the_largest_middle_one_for_all_of_them():
    """PP=4 (4 layers, one each), 4 micro-batches: ranks 1 and 2 hold 3 and 2 forwards in flight;
    the plan shows rank 1 for both (x2 processes), between the first and the last."""
    plan = mp.memory_plan(sft("policy.num_workers=4", "policy.pipeline_parallel_size=4", *COMMON[:-1],
                              "policy.train_global_batch_size=4"),
                          shape_with_vocab(100))
    assert [d.name.split(" (")[1] for d in plan.devices[:3]] == [
        "first pipeline stage)", "pipeline rank 1, the largest of ranks 1-2)", "last pipeline stage)"]
    assert plan.process_counts[:3] == [1, 2, 1]
    assert "activations (3 stage forwards in flight)" in plan.devices[1].rows


def test_fixes_name_pipeline_sizes_only_for_models_that_split_into_stages():
    """The tiny llama preset (untied, 2 layers) is told `pipeline_parallel_size=2`; a mixture of
    experts, the tiny qwen2 preset (tied embeddings, `pipeline_problem`) and LoRA never are."""
    from test_plan_expert_parallel import MOE

    def pipeline_fixes(*overrides, shape=shape_with_vocab(100)):
        cfg = sft("cluster.gpus_per_node=8", "policy.num_workers=8", *COMMON, *overrides)
        return [key for key, _ in mp.candidate_fixes(cfg, shape) if "pipeline" in key]

    assert pipeline_fixes() == ["policy.pipeline_parallel_size=2"]  # 4 and 8: more stages than layers
    assert pipeline_fixes(shape=MOE) == []
    assert pipeline_fixes("policy.tiny_arch=qwen2") == []
    assert pipeline_fixes("policy.lora.enabled=true") == []  # refused together (the config)
