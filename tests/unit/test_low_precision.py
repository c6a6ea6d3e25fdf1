"""Low-precision generation (`policy.generation.precision`): the quantization functions and their
error bounds, the int8 / emulated-FP8 engine against float32, and the config's resolution of the
importance-sampling correction."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.config.loader import ConfigError, load_config
from posttrain.config.schema import generation_precision_note
from posttrain.errors import UserError
from posttrain.models.generation import quantization as q
from posttrain.models.generation.engine import NativeGenerationEngine
from posttrain.models.generation.low_precision import (
    Fp8Linear, Int8Linear, LowPrecisionLinear, apply_generation_precision, quantizable_linears, requantize,
)
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.hf import load_causal_lm, load_tokenizer
from test_generation_engine import EOS, PAD, chain_model, generated, right_padded


def spread_weight(rows: int = 300, cols: int = 200, seed: int = 0) -> torch.Tensor:
    """Odd-shaped (padded blocks), magnitudes from 1e-6 to 1e2 across columns (subnormals too)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * torch.logspace(-6, 2, cols)


def block_scales(scale: torch.Tensor, shape: tuple[int, int], block: int = q.BLOCK) -> torch.Tensor:
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


# ------------------------------------------------------------------------------------------ fp8
def test_fp8_block_round_trip_is_within_its_bound_and_the_bound_is_tight():
    weight = spread_weight()
    weight_q, scale = q.quantize_fp8_blocks(weight)
    assert weight_q.dtype == torch.float8_e4m3fn and weight_q.shape == (384, 256) and scale.shape == (3, 2)
    error = (weight - q.dequantize_fp8_blocks(weight_q, scale, weight.shape)).abs()
    scales = block_scales(scale, weight.shape)
    ratio = error / q.fp8_error_bound(weight, scales)
    assert ratio.max() <= 1.0
    assert ratio.max() > 0.9  # attained: the bound is not loose
    # The coarse form: never more than 2^-4 of the block's largest magnitude (amax = 448 s).
    assert (error <= q.FP8_RELATIVE_ERROR * q.FP8_MAX * scales).all()
    # The block's largest element maps to 448 exactly, so it round-trips to float32 rounding.
    largest = weight.abs().argmax()
    assert error.flatten()[largest] <= 1e-6 * weight.abs().max()


def test_fp8_zero_blocks_and_padding_are_exact_zeros_and_bad_weights_are_refused():
    weight = torch.zeros(130, 129)
    weight[0, 0] = 3.0
    weight_q, scale = q.quantize_fp8_blocks(weight)
    assert torch.equal(scale, torch.tensor([[3.0 / 448, 1.0], [1.0, 1.0]]))  # all-zero blocks: scale 1
    restored = q.dequantize_fp8_blocks(weight_q, scale, weight.shape)
    assert torch.equal(restored, weight)
    assert not weight_q[130:].float().any() and not weight_q[:, 129:].float().any()
    for bad in (float("inf"), float("nan")):
        weight[5, 5] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            q.quantize_fp8_blocks(weight)


def test_fp8_groups_are_per_token_and_within_the_bound():
    x = spread_weight(6, 300, seed=1)
    x_q, scale = q.quantize_fp8_groups(x)
    assert x_q.shape == (6, 384) and scale.shape == (6, 3)
    error = (x - q.dequantize_fp8_groups(x_q, scale, 300)).abs()
    assert (error <= q.fp8_error_bound(x, scale.repeat_interleave(128, 1)[:, :300])).all()
    # A token's quantization depends on that token only.
    alone_q, alone_scale = q.quantize_fp8_groups(x[2:3])
    assert torch.equal(alone_q.view(torch.uint8), x_q[2:3].view(torch.uint8)) and torch.equal(alone_scale, scale[2:3])
    # A non-finite activation makes its own token's outputs NaN, no other's.
    x[4, 7] = float("inf")
    weight_q, weight_scale = q.quantize_fp8_blocks(torch.randn(16, 300))
    out = q.fp8_matmul_emulated(x, weight_q, weight_scale, 16)
    assert out[4].isnan().all() and out[[0, 1, 2, 3, 5]].isfinite().all()


def test_fp8_emulated_matmul_is_close_to_float32_and_cublas_scales_have_the_documented_layout():
    generator = torch.Generator().manual_seed(2)
    x, weight = torch.randn(5, 576, generator=generator), torch.randn(192, 576, generator=generator)
    weight_q, scale = q.quantize_fp8_blocks(weight)
    exact = x @ weight.T
    got = q.fp8_matmul_emulated(x, weight_q, scale, 192)
    assert got.shape == (5, 192)
    # Two e4m3 operands of relative error <= 2^-4 each: the product's error is far below 2^-3 of its largest.
    assert (got - exact).abs().max() / exact.abs().max() < 0.06
    cublas = q.cublas_block_scales(scale)  # K blocks 4.5 -> 5 -> padded to 8; K-major
    assert cublas.shape == (8, 2) and cublas.stride() == (1, 8)
    assert torch.equal(cublas[:5], scale.t()) and not cublas[5:].any()


def test_the_gpu_kernel_call_passes_scaled_mms_layout_checks_on_meta_tensors():
    """The CUDA path cannot run here (CPU's scaled_mm has no block scaling); torch's meta kernel
    checks the operands' dtypes, shapes and scale layouts, and gives the output's shape."""
    weight_q, scale = q.quantize_fp8_blocks(torch.randn(192, 576))  # padded to 256 x 640
    x = torch.empty(5, 576, device="meta", dtype=torch.bfloat16)  # 5 rows: padded to 8
    out = q.fp8_matmul(x, weight_q.to("meta"), q.cublas_block_scales(scale).to("meta"), 192)
    assert out.shape == (5, 192) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ int8
def test_int8_rows_round_trip_within_half_a_step_and_the_kernel_matches_its_emulation():
    weight = spread_weight(64, 256)
    weight[3] = 0.0
    weight_q, scale = q.quantize_int8_rows(weight)
    assert weight_q.dtype == torch.int8 and scale[3] == 1.0 and not weight_q[3].any()
    error = (weight - q.dequantize_int8_rows(weight_q, scale)).abs()
    assert (error <= scale[:, None] * (0.5 + 1e-6)).all()
    x = torch.randn(5, 256)
    kernel = q.int8_matmul(x, weight_q, scale, torch.ones_like(scale, dtype=torch.bfloat16))
    # The same products (exact in float32), summed in another order: equal up to one bfloat16 rounding.
    torch.testing.assert_close(kernel, q.int8_matmul_dequantized(x, weight_q, scale), rtol=2**-8, atol=0)
    with pytest.raises(ValueError, match="not a multiple of 16"):  # the kernel would read past the row
        q.int8_matmul(torch.randn(2, 200), torch.zeros(8, 200, dtype=torch.int8), torch.ones(8),
                      torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="NaN or infinite"):
        q.quantize_int8_rows(torch.tensor([[1.0, float("nan")]]))


# ------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_layers_keep_the_weights_names_and_state_dict(precision):
    model = load_causal_lm("tiny")
    before = model.state_dict()
    count = apply_generation_precision(model, precision, "cpu", emulate_fp8=True)
    layers = len(model.model.layers)
    assert count == 7 * layers  # q, k, v, o, gate, up, down
    assert sorted(quantizable_linears(model)) == []  # all replaced; lm_head stays an nn.Linear
    assert type(model.lm_head) is torch.nn.Linear
    after = model.state_dict()
    assert list(after) == list(before)  # refits and checksums see the same names
    assert all(after[name] is before[name] or torch.equal(after[name], before[name]) for name in before)
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Int8Linear if precision == "int8" else Fp8Linear)
    assert layer.weight is model.get_parameter("model.layers.0.self_attn.q_proj.weight")


def test_mixture_of_experts_models_quantize_their_attention_only():
    """transformers holds the experts as fused 3-D tensors and the router as a module of its own:
    both keep the engine's dtype; the attention projections are quantized."""
    model = load_causal_lm("tiny", tiny_arch="qwen3_moe")
    assert apply_generation_precision(model, "int8", "cpu") == 4 * len(model.model.layers)
    assert not isinstance(model.model.layers[0].mlp.gate, LowPrecisionLinear)


def test_requantize_follows_a_refit_in_place():
    model = load_causal_lm("tiny")
    apply_generation_precision(model, "int8", "cpu")
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # what a refit's in-place copy does
    assert torch.equal(layer(x), before)  # the quantized copy is stale until requantized
    assert requantize(model) == 7 * len(model.model.layers)
    torch.testing.assert_close(layer(x), 2 * before, rtol=1e-2, atol=1e-3)


def test_refusals_name_the_key_and_the_device():
    with pytest.raises(UserError, match=r"^policy.generation.precision=fp8: the engine runs on cpu, which has no FP8 matmul"):
        apply_generation_precision(load_causal_lm("tiny"), "fp8", "cpu")
    with pytest.raises(UserError, match=r"^policy.generation.precision=int8 is the native engine's CPU path.*runs on cuda"):
        apply_generation_precision(torch.nn.Linear(4, 4), "int8", "cuda")
    assert apply_generation_precision(torch.nn.Linear(4, 4), "bfloat16", "cpu") == 0


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_low_precision_engine_greedy_text_equals_float32_on_a_known_output_model(precision):
    """chain_model's logits have margins of 4 (and its o_proj / down_proj are all-zero blocks): the
    quantized engine writes float32's greedy text, token for token."""
    reference = NativeGenerationEngine(chain_model(), None, pad_token_id=PAD, eos_token_id=EOS)
    model = chain_model()
    apply_generation_precision(model, precision, "cpu", emulate_fp8=True)
    engine = NativeGenerationEngine(model, None, pad_token_id=PAD, eos_token_id=EOS)
    ids, lengths = right_padded([[2], [10, 11], [4, 5, 6]])
    expected = reference.generate(ids, lengths, max_new_tokens=7, greedy=True)
    got = engine.generate(ids, lengths, max_new_tokens=7, greedy=True)
    assert [generated(got, r) for r in range(3)] == [generated(expected, r) for r in range(3)]
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], atol=0.05, rtol=0)


def forced_logprobs(model: torch.nn.Module, out: dict) -> torch.Tensor:
    """`[B, S+T]` log p(token) under `model` (full vocabulary, temperature 1), 0 at position 0."""
    ids = out["output_ids"]
    mask = (torch.arange(ids.shape[1])[None] < out["unpadded_sequence_lengths"][:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    chosen = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), chosen], dim=1)


# Largest |logprob difference| from float32 on the tiny model's greedy tokens (measured: int8 0.0073,
# fp8 0.035 max; 0.0030 and 0.011 mean), with room for the random model's other prompts.
TOLERANCE = {"int8": 0.03, "fp8": 0.12}
OWN_TOLERANCE = {"int8": 1e-5, "fp8": 1e-2}


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_engine_returns_the_low_precision_models_logprobs(precision):
    """The tiny random model's near-tied logits let greedy text diverge, so this compares logprobs on
    the quantized engine's own tokens: they are the quantized model's forward's (to float rounding)
    and within TOLERANCE of float32's, and differ from float32's (the trainer sees the gap)."""
    tokenizer = load_tokenizer("tiny")
    float32 = load_causal_lm("tiny")
    model = copy.deepcopy(float32)
    apply_generation_precision(model, precision, "cpu", emulate_fp8=True)
    rows = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Say hello", "12*7=")]
    ids, lengths = right_padded(rows)
    engine = NativeGenerationEngine(model, tokenizer, pad_token_id=PAD, eos_token_id=tokenizer.eos_token_id)
    out = engine.generate(ids.masked_fill(ids == PAD, tokenizer.pad_token_id), lengths, max_new_tokens=12, greedy=True)
    generated_mask = out["logprobs"] != 0
    own = (out["logprobs"] - forced_logprobs(model, out))[generated_mask].abs()
    gap = (out["logprobs"] - forced_logprobs(float32, out))[generated_mask].abs()
    # fp8 quantizes each token's activations to 3 mantissa bits: where the engine's decode GEMMs
    # and the forward's round a float32 sum an ulp apart, a value can land on the other side of an
    # fp8 rounding step (measured up to 2.8e-3 on an AMX Xeon, 0 on AVX2 kernels). int8's
    # activations are bfloat16 and stay within float rounding.
    assert own.max() < OWN_TOLERANCE[precision]
    assert own.mean() < gap.mean() / 3  # the engine's numbers are the quantized model's, not float32's
    assert 1e-4 < gap.max() < TOLERANCE[precision]


# ------------------------------------------------------------------------------------------ config
def grpo(*overrides: str):
    return load_config("grpo", overrides=["sft_warmup=null", *overrides])


def test_the_correction_defaults_on_when_generation_precision_differs():
    assert grpo().loss_fn.use_importance_sampling_correction is False  # auto: the trainer's precision
    assert grpo("policy.generation.precision=float32").loss_fn.use_importance_sampling_correction is False
    for differing in ("int8", "bfloat16"):
        cfg = grpo(f"policy.generation.precision={differing}")
        assert cfg.loss_fn.use_importance_sampling_correction is True
        assert generation_precision_note(cfg).startswith(
            f"[posttrain] policy.generation.precision={differing} differs from the training precision float32: "
            "loss_fn.use_importance_sampling_correction is on")
    # auto training on GPUs is bfloat16: a bfloat16 engine is the same precision there.
    same = grpo("policy.generation.precision=bfloat16", "policy.precision=auto", "cluster.gpus_per_node=1")
    assert same.loss_fn.use_importance_sampling_correction is False and generation_precision_note(same) is None
    assert not grpo("policy.generation.precision=bfloat16", "policy.precision=bfloat16").loss_fn.use_importance_sampling_correction
    assert grpo("policy.generation.precision=fp8", "cluster.gpus_per_node=1").loss_fn.use_importance_sampling_correction
    # The user's false is kept, with a warning line; truncation applies with the default on.
    kept = grpo("policy.generation.precision=int8", "loss_fn.use_importance_sampling_correction=false")
    assert kept.loss_fn.use_importance_sampling_correction is False
    assert generation_precision_note(kept).startswith("[posttrain] warning: policy.generation.precision=int8 differs")
    assert grpo("policy.generation.precision=int8", "grpo.partial_rollouts.enabled=true").grpo.partial_rollouts.enabled


def test_truncation_needs_no_explicit_correction_when_the_correction_defaults_on():
    tis = ["loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio=2.0"]
    cfg = grpo("policy.generation.precision=bfloat16", *tis)
    assert cfg.loss_fn.use_importance_sampling_correction is True
    assert cfg.loss_fn.truncated_importance_sampling_type == "icepop"
    # Without a precision gap the correction stays off, and truncation without it is refused;
    # so is an explicit false beside a gap.
    for refused in ([], ["policy.generation.precision=bfloat16", "loss_fn.use_importance_sampling_correction=false"]):
        with pytest.raises(ConfigError, match="truncated_importance_sampling_type is set but "
                                              "loss_fn.use_importance_sampling_correction is false"):
            grpo(*refused, *tis)


@pytest.mark.parametrize("overrides, message", [
    (["policy.generation.precision=fp8"], r"policy.generation.precision=fp8 needs GPUs with FP8 matmuls .*cluster.gpus_per_node=0"),
    (["policy.generation.precision=int8", "policy.generation.backend=vllm"], r"policy.generation.precision=int8 is the native engine's .*vLLM"),
    (["policy.generation.precision=int8", "cluster.gpus_per_node=1"], r"policy.generation.precision=int8 is the native engine's CPU path"),
    (["policy.generation.precision=int4"], r"policy.generation.precision"),
])
def test_unrunnable_precisions_are_refused_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        grpo(*overrides)


def test_the_spec_loads_the_engine_in_the_generation_dtype_or_the_trainers():
    spec = lambda gen, train="float32": GenerationSpec("tiny", generation={"precision": gen}, precision=train)  # noqa: E731
    assert [spec(p).engine_precision for p in ("auto", "float32", "bfloat16", "int8")] == [
        "float32", "float32", "bfloat16", "float32"]
    assert spec("fp8", "auto").engine_precision == "auto" and spec("float32", "bfloat16").engine_precision == "float32"
    assert issubclass(Fp8Linear, LowPrecisionLinear) and issubclass(Int8Linear, LowPrecisionLinear)


def test_vllms_refit_probe_allows_for_the_precision_gap():
    """An engine in another precision than the trainer differs by the rounding itself (on SmolLM2's
    probe: bfloat16 0.117, fp8 emulated 0.489): the probe's tolerance widens only then."""
    from posttrain.models.generation.vllm_generation import (
        MIXED_PRECISION_PROBE_TOLERANCE, PROBE_TOLERANCE, VllmGeneration,
    )

    def tolerance(generation: str, training: str, engine_dtype: torch.dtype) -> float:
        backend = object.__new__(VllmGeneration)  # no engines: only the tolerance's inputs
        backend.spec = GenerationSpec("tiny", generation={"precision": generation, "backend": "vllm"}, precision=training)
        backend.config, backend._engine_dtype = backend.spec.config, engine_dtype
        return backend._probe_tolerance()

    assert tolerance("auto", "float32", torch.float32) == PROBE_TOLERANCE[torch.float32]
    assert tolerance("bfloat16", "bfloat16", torch.bfloat16) == PROBE_TOLERANCE[torch.bfloat16]
    assert tolerance("bfloat16", "float32", torch.bfloat16) == MIXED_PRECISION_PROBE_TOLERANCE["bfloat16"] > 0.117 * 2
    assert tolerance("fp8", "auto", torch.bfloat16) == MIXED_PRECISION_PROBE_TOLERANCE["fp8"] > 0.489 * 2
