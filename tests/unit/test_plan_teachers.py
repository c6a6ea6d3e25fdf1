"""The memory plan of a distillation's teachers (`posttrain/plan/teachers.py`): their rows where
they run (in the policy's process with the local backend, processes of their own on CPU with Ray,
GPUs of their own shared by every teacher), by hand for small made-up shapes (no model loaded),
the fit check naming a teacher, and `posttrain plan` printing them."""

from __future__ import annotations

import pytest

from posttrain import cli
from posttrain import plan as mp
from posttrain.config import load_config

GiB = mp.GiB

# Made-up llama-like shapes. Elements per token and layer (`activation_bytes_per_token_layer`):
# STUDENT 2*64 + 7*64 + 2*32 + 2*64 + 4*256 = 1792; BIG 2*128 + 7*128 + 2*32 + 2*128 + 4*512 = 3520;
# SMALL (no grouping) 2*64 + 7*64 + 2*64 + 2*64 + 4*128 = 1344.
STUDENT = mp.ModelShape(num_params=1_000_000, hidden_size=64, num_layers=4, vocab_size=100, num_heads=4,
                        num_kv_heads=2, head_dim=16, intermediate_size=256, largest_tensor=100_000)
BIG = mp.ModelShape(num_params=3_000_000, hidden_size=128, num_layers=4, vocab_size=100, num_heads=8, num_kv_heads=2,
                    head_dim=16, intermediate_size=512, largest_tensor=100_000, embedding_params=2 * 100 * 128)
SMALL = mp.ModelShape(num_params=2_000_000, hidden_size=64, num_layers=2, vocab_size=100, num_heads=4, num_kv_heads=4,
                      head_dim=16, intermediate_size=128, largest_tensor=100_000, embedding_params=100 * 64)

# 4 prompts x 2 answers = 8 rows of 64 tokens a step, top-16, validation calls of 4 prompts.
COMMON = ["sft_warmup=null", "teacher_warmup=null", "distillation.num_prompts_per_step=4",
          "distillation.num_generations_per_prompt=2", "distillation.topk_logits_k=16", "distillation.val_batch_size=4",
          "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4", "policy.max_total_sequence_length=64"]
TWO = ["teacher=null", "teachers={a: {model_name: tiny, logprob_batch_size: 8, num_workers: 2, precision: float32}, "
       "b: {model_name: tiny-qwen2, logprob_batch_size: 4, num_workers: 2, precision: bfloat16}}"]


def distill(*overrides):
    return load_config("distill", None, [*COMMON, *overrides])


def big_engine(rows: int) -> int:
    """BIG's accuracy engine in float32: weights, KV cache and prefill cache of `rows` rows of 64
    tokens (2 x 4 layers x 2 KV heads x 16 x 4 bytes = 1024 per token), the prefill's one layer."""
    return 4 * 3_000_000 + 2 * 1024 * rows * 64 + rows * 64 * 4 * 3520


def test_topk_head_by_hand():
    # 512 tokens x 100 logits: float32 logits and their shifted copy (8 bytes each); below float32
    # the compute-dtype logits, the float32 upcast and the shifted copy (2 + 8 bytes).
    assert mp.topk_logits_bytes(BIG, 512, 4, 16) == 8 * 512 * 100
    assert mp.topk_logits_bytes(BIG, 256, 2, 16) == 10 * 256 * 100
    # A large k: one float32 copy and the top-k values and indices (4 + 8 bytes each).
    assert mp.topk_logits_bytes(BIG, 10, 4, 50) == 4 * 10 * 100 + 12 * 10 * 50


def test_one_teacher_in_the_policy_process_with_the_local_backend():
    cfg = distill("teacher.logprob_batch_size=8")
    plan = mp.run_plan(cfg, STUDENT, device_bytes=16 * GiB, teacher_shapes={"teacher": BIG})
    assert plan.phases == ("generation", "refit", "logprobs", "training", "validation", "teacher eval")
    assert plan.teacher_shapes == {"teacher": BIG}
    (device,) = plan.devices  # one process: the student, its engine and the teacher
    rows = device.rows
    assert rows["teacher parameters (fp32)"] == {p: 4 * 3_000_000 for p in plan.phases}  # no gradients, no optimizer
    # 8 rows x 64 tokens of one micro-batch: one float32 layer (4 x 3520 bytes a token) and the head.
    assert rows["teacher top-k forward"] == {"logprobs": 512 * 4 * 3520 + 8 * 512 * 100}
    assert rows["teacher top-k output"] == {"logprobs": 12 * 16 * 8 * 64}  # values float32, indices int64
    assert rows["top-k from the teachers (received)"] == {"training": 12 * 16 * 8 * 64}
    # One float32 worker: no FSDP, no autocast copies.
    assert not any(item.startswith("teacher FSDP") or "autocast" in item for item in rows)
    # Before the first step an engine on the teachers' bundles (here this process) decodes validation's 4 prompts.
    engine = {item: r["teacher eval"] for item, r in rows.items() if item.startswith("teacher engine: ")}
    assert sum(engine.values()) == big_engine(4)
    assert device.turns["teacher top-k forward"] == ("teacher forward", "teacher") and not device.taking_turns()
    # The student computes no logprobs in distillation, and trains on full logits (no fused head).
    assert "logprob forward" not in rows
    assert rows["activations"]["training"] == int(mp.training_activation_bytes(STUDENT, 4 * 64, 4, False, False))
    without = sum(r.get("logprobs", 0) for item, r in rows.items() if not item.startswith("teacher "))
    assert device.phase_total("logprobs") - without == 4 * 3_000_000 + 512 * 4 * 3520 + 8 * 512 * 100 + 12 * 16 * 8 * 64
    # Without validation at the start the teacher's accuracy is not measured: no such phase.
    assert "teacher eval" not in mp.memory_plan(distill("distillation.val_at_start=false"), STUDENT,
                                                teacher_shapes={"teacher": BIG}).phases


def test_two_teachers_share_their_gpus_and_take_turns():
    cfg = distill(*TWO, "cluster.gpus_per_node=8", "cluster.backend=ray")
    plan = mp.memory_plan(cfg, STUDENT, device_bytes=80 * GiB, teacher_shapes={"teachers.a": BIG, "teachers.b": SMALL})
    trainer, teachers = plan.devices
    assert teachers.name == "teacher worker (teachers.a, teachers.b)" and plan.process_counts == [1, 2]
    rows = teachers.rows
    # float32 weights over the 2 workers whatever the precision; FSDP2 gathers in the compute dtype:
    # the root (embeddings and LM head) kept after the first forward, two layers in a forward.
    assert rows["teachers.a parameters (fp32)"]["training"] == 4 * 3_000_000 // 2
    assert rows["teachers.b parameters (fp32)"]["training"] == 4 * 2_000_000 // 2
    assert rows["teachers.a FSDP root (gathered)"]["logprobs"] == 4 * 25_600
    assert rows["teachers.b FSDP root (gathered)"]["logprobs"] == 2 * 6_400
    assert "teacher eval" not in rows["teachers.a FSDP root (gathered)"]
    assert rows["teachers.a FSDP gathered layers"] == {"logprobs": 2 * 4 * (3_000_000 - 25_600) // 4}
    assert rows["teachers.b FSDP gathered layers"] == {"logprobs": 2 * 2 * (2_000_000 - 6_400) // 2}
    # a: 8 rows x 64 tokens in float32; b: 4 x 64 in bf16 (2 x 1344 + the norms' fp32 upcast 8 x 64 a
    # token and layer; logits 2 + 8 bytes each).
    assert rows["teachers.a top-k forward"] == {"logprobs": 512 * 4 * 3520 + 8 * 512 * 100}
    assert rows["teachers.b top-k forward"] == {"logprobs": 256 * (2 * 1344 + 8 * 64) + 10 * 256 * 100}
    assert not any(item.endswith("top-k output") for item in rows)  # host memory on GPUs
    resident = 4 * 3_000_000 // 2 + 4 * 25_600 + 4 * 2_000_000 // 2 + 2 * 6_400
    a_turn = 2 * 4 * (3_000_000 - 25_600) // 4 + 512 * 4 * 3520 + 8 * 512 * 100
    assert teachers.phase_total("logprobs") == resident + a_turn  # a's forward is the larger: b's comes after
    # Each accuracy engine on 2 GPUs decodes 2 of the 4 prompts, one teacher after the other.
    small_engine = 2 * 2_000_000 + 2 * (2 * 2 * 4 * 16 * 2) * 2 * 64 + 2 * 64 * (2 * 1344 + 8 * 64)
    engines = {key: sum(r["teacher eval"] for item, r in rows.items() if item.startswith(f"teachers.{key} engine: "))
               for key in "ab"}
    assert engines == {"a": big_engine(2), "b": small_engine}
    assert teachers.phase_total("teacher eval") == resident - 4 * 25_600 - 2 * 6_400 + big_engine(2)
    assert teachers.taking_turns() == set(teachers.turns)
    # The student's GPU: a micro-batch's top-k, nothing of the teachers.
    assert trainer.rows["top-k from the teachers (received)"] == {"training": 12 * 16 * 4 * 64}
    assert not any(item.startswith("teachers.") for item in trainer.rows)
    text = mp.format_plan(plan)
    assert "teacher worker (teachers.a, teachers.b) (x2), GiB per GPU:" in text
    assert "  teachers.b top-k forward *" in text and "a total counts the largest one's" in text


def test_two_teachers_on_cpu_are_processes_of_their_own():
    cfg = distill(*TWO, "cluster.backend=ray")
    plan = mp.memory_plan(cfg, STUDENT, device_bytes=16 * GiB, teacher_shapes={"teachers.a": BIG, "teachers.b": SMALL})
    names = [d.name for d in plan.devices]
    assert names == ["policy worker (+ generation)", "teacher worker (teachers.a)", "teacher worker (teachers.b)",
                     "teacher generation worker"]
    assert plan.process_counts == [1, 2, 2, 2]
    a, b, engine = plan.devices[1:]
    assert a.rows["runtime (python, torch)"]["training"] == mp.CPU_RUNTIME_BYTES
    assert a.phase_total("logprobs") == (mp.CPU_RUNTIME_BYTES + 4 * 3_000_000 // 2 + 4 * 25_600
                                         + 2 * 4 * (3_000_000 - 25_600) // 4 + 512 * 4 * 3520 + 8 * 512 * 100
                                         + 12 * 16 * 4 * 64)  # its answer for its 4 of the 8 rows
    assert b.rows["teachers.b top-k forward"]["logprobs"] == 256 * (2 * 1344 + 8 * 64) + 10 * 256 * 100  # bf16 asked
    # The accuracy engines run one at a time, each in a process that lives only while it measures.
    assert engine.rows["runtime (python, torch)"] == {"teacher eval": mp.CPU_RUNTIME_BYTES}
    assert engine.phase_total("teacher eval") == mp.CPU_RUNTIME_BYTES + big_engine(2)
    assert engine.phase_total("training") == 0


def test_a_teacher_too_large_for_its_gpu_is_named_with_the_keys_that_fit():
    huge = mp.ModelShape(num_params=20_000_000_000, hidden_size=6144, num_layers=48, vocab_size=32000, num_heads=48,
                         num_kv_heads=8, head_dim=128, intermediate_size=16384, largest_tensor=196_608_000,
                         embedding_params=2 * 32000 * 6144)
    cfg = distill("cluster.gpus_per_node=8", "cluster.backend=ray", "teacher.model_name=org/huge",
                  "teacher.precision=bfloat16", "teacher.logprob_batch_size=1", "distillation.val_at_start=false")
    plan = mp.memory_plan(cfg, STUDENT, device_bytes=80 * GiB, teacher_shapes={"teacher": huge})
    problem = mp.fit_problem(cfg, STUDENT, plan)
    assert plan.devices[1].peak()[0] == "logprobs" and plan.node_peak() == plan.devices[1].peak()[1]
    need = plan.node_peak() / GiB
    assert problem.startswith(f"memory plan: logprobs needs {need:.2f} GiB per GPU (teacher 'org/huge' {need:.2f} GiB "
                              "of it) but 72.00 GiB is usable (90% of 80.00 GiB)")
    assert problem.endswith("it would fit with any one of: teacher.num_workers=2")
    assert not mp.fits(plan) and "does not fit" in mp.format_plan(plan)


def test_cli_prints_the_teachers_rows(capsys):
    assert cli.main(["plan", "--config", "examples/configs/distill_tiny.yaml", "sft_warmup=null",
                     "teacher_warmup=null"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Memory plan of posttrain distill (tiny, 1 policy worker(s)):"
    assert out[2].split() == ["generation", "refit", "logprobs", "training", "validation", "teacher", "eval"]
    items = {line[:38].strip() for line in out[3:]}
    assert {"teacher parameters (fp32)", "teacher top-k forward", "teacher engine: KV cache"} <= items
    (peak,) = [line for line in out if line.startswith("peak ")]
    assert peak.endswith("fits (keeping 10% free)")
    # The time plan follows; distillation's logprobs phase is planned as one student forward.
    assert out[out.index(peak) + 1].startswith("Time plan per step on ")


@pytest.mark.parametrize("two", [False, True])
def test_read_teacher_shapes_reads_each_teachers_own_model(two):
    cfg = distill(*(["teacher=null", "teachers={a: {model_name: tiny}, b: {model_name: tiny-qwen2}}"] if two else []))
    shapes = mp.read_teacher_shapes(cfg, {"teachers.a": BIG} if two else None)
    if two:
        assert shapes["teachers.a"] is BIG and shapes["teachers.b"].num_params == \
            mp.model_shape(load_config("grpo", None, ["policy.tiny_arch=qwen2"]).policy).num_params
    else:
        assert shapes == {"teacher": mp.model_shape(cfg.teacher)}  # distill_tiny's teacher: the `small` preset
        assert shapes["teacher"].num_params > mp.model_shape(cfg.policy).num_params
