"""`policy.optimizer.name: muon`: which parameters Muon gets, that one step updates both groups as
torch's Muon and AdamW would, and that its state survives a checkpoint (plain and DCP)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import AutoModelForSequenceClassification

from posttrain.config.schema import OptimizerConfig, SchedulerConfig
from posttrain.models.policy.muon import MuonWithAdamW, build_muon, muon_param_split, muon_update, newton_schulz
from posttrain.models.tiny import make_tiny_model, tiny_config
from posttrain.utils.lr_schedule import build_lr_scheduler

MATRICES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
CFG = OptimizerConfig(name="muon", lr=1e-2, weight_decay=0.1)


def kinds(named) -> set[str]:
    return {name.split(".")[-2] if name.endswith(".weight") else name for name, _ in named}


def loss_of(model, seed=0):
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied embeddings
def test_hidden_matrices_go_to_muon_the_rest_to_adamw(arch):
    model, _ = make_tiny_model(arch=arch)
    muon, adamw = muon_param_split(model)
    assert kinds(muon) == MATRICES
    assert all(p.ndim == 2 for _, p in muon)
    assert len(muon) == len(MATRICES) * model.config.num_hidden_layers
    # Embeddings, the LM head (tied for qwen2: one parameter) and every norm; qwen2's biases too.
    expected = {"embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"}
    expected |= {"lm_head"} if arch == "llama" else {"q_proj.bias", "k_proj.bias", "v_proj.bias"}
    got = {n.split(".")[-2] if n.endswith(".weight") else ".".join(n.split(".")[-2:]) for n, _ in adamw}
    assert got == expected
    assert len(muon) + len(adamw) == len(list(model.parameters()))

    # A reward model's score head ([1, hidden], 2-D) is an output head: AdamW.
    config = tiny_config(arch=arch, vocab_size=model.config.vocab_size)
    config.num_labels = 1
    reward = AutoModelForSequenceClassification.from_config(config)
    reward_muon, reward_adamw = muon_param_split(reward)
    assert kinds(reward_muon) == MATRICES and "score.weight" in {n for n, _ in reward_adamw}


def test_one_step_updates_both_groups_as_torch_muon_and_adamw_would():
    model, _ = make_tiny_model()
    reference = copy.deepcopy(model)
    optimizer = build_muon(model, CFG, newton_schulz_dtype=torch.bfloat16)  # torch's own Muon
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False]
    assert optimizer.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"

    muon_names = {n for n, _ in muon_param_split(reference)[0]}
    ref_muon = torch.optim.Muon([p for n, p in reference.named_parameters() if n in muon_names], lr=1e-2,
                                weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([p for n, p in reference.named_parameters() if n not in muon_names], lr=1e-2,
                                  weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(2):
        for m, opts in ((model, [optimizer]), (reference, [ref_muon, ref_adamw])):
            loss_of(m, seed=step).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert not torch.equal(p, before[name]), f"{name} did not change"
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert all("momentum_buffer" in optimizer.state[p] for g in optimizer.param_groups if g["use_muon"] for p in g["params"])
    assert all("exp_avg" in optimizer.state[p] for g in optimizer.param_groups if not g["use_muon"] for p in g["params"])


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (16, 16)])
def test_newton_schulz_in_bfloat16_is_torchs_and_float32_agrees_to_bfloat16_rounding(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    update = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coefficients, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7
    ours = newton_schulz(update, coefficients, steps, eps, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.shape == update.shape
    torch.testing.assert_close(ours, _zeropower_via_newtonschulz(update, coefficients, steps, eps), rtol=0, atol=0)
    in_float32 = newton_schulz(update, coefficients, steps, eps, torch.float32)
    assert in_float32.dtype == torch.float32
    # Orthogonalised: singular values near 1 (the quintic leaves them in about [0.5, 1.5]).
    singular = torch.linalg.svdvals(in_float32)
    assert singular.min() > 0.3 and singular.max() < 1.6
    assert (in_float32 - ours.float()).abs().max() < 0.05


def test_muon_update_is_torchs_step_in_bfloat16_and_exact_arithmetics_in_float32():
    """`muon_update` with bfloat16 is exactly `torch.optim.Muon.step`. In float32 (what a CPU
    without bfloat16 matmuls gets) two steps change the weights as the iteration in float64 does,
    to float32 rounding; torch's bfloat16 iteration is the approximate one (its five quintic steps
    amplify bfloat16's rounding: here a fifth of the change or more)."""
    changes = {}
    for how in ("torch", torch.bfloat16, torch.float32, torch.float64):
        model, _ = make_tiny_model()
        muon_params = [p for _, p in muon_param_split(model)[0]]
        before = [p.detach().clone() for p in muon_params]
        optimizer = torch.optim.Muon(muon_params, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        for step in range(2):
            loss_of(model, seed=step).backward()
            optimizer.step() if how == "torch" else muon_update(optimizer, how)
            optimizer.zero_grad()
        changes[how] = [p.detach() - start for p, start in zip(muon_params, before)]

    def relative(a, b):
        return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))

    assert relative(changes[torch.bfloat16], changes["torch"]) == 0.0
    assert relative(changes[torch.float32], changes[torch.float64]) < 1e-4
    assert relative(changes["torch"], changes[torch.float64]) > 1e-3


def test_the_newton_schulz_dtype_follows_the_device_unless_given(monkeypatch):
    import posttrain.cpu_precision as cpu_precision

    for fast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(cpu_precision, "cpu_bfloat16_is_fast", lambda fast=fast: fast)
        model, _ = make_tiny_model()
        assert build_muon(model, CFG).newton_schulz_dtype == expected
        assert build_muon(model, CFG, newton_schulz_dtype=torch.bfloat16).newton_schulz_dtype == torch.bfloat16


def test_the_lr_schedule_reaches_both_groups():
    model, _ = make_tiny_model()
    optimizer = build_muon(model, CFG)
    scheduler = build_lr_scheduler(optimizer, CFG, SchedulerConfig(warmup_steps=10))
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3, 1e-3])  # warm-up starts at 10%
    loss_of(model).backward()
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1.9e-3, 1.9e-3])


@pytest.mark.parametrize("how", ["state_dict", "dcp"])
def test_state_round_trip_resumes_exactly(how, tmp_path):
    """Two steps, save, then a third step: on the original and on a fresh optimizer loaded from
    the save (the plain state_dict, or torch.distributed.checkpoint's get/set_state_dict as the
    policy's checkpoints use), the weights after the third step are identical."""
    model, _ = make_tiny_model()
    optimizer = build_muon(model, CFG)
    for step in range(2):
        loss_of(model, seed=step).backward()
        optimizer.step()
        optimizer.zero_grad()
    resumed_model = copy.deepcopy(model)
    resumed = build_muon(resumed_model, CFG)
    if how == "state_dict":
        torch.save(optimizer.state_dict(), tmp_path / "optim.pt")
        resumed.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=False))
    else:
        model_state, optim_state = get_state_dict(model, (optimizer,))
        set_state_dict(resumed_model, (resumed,), model_state_dict=copy.deepcopy(model_state),
                       optim_state_dict=copy.deepcopy(optim_state))
    assert [g["use_muon"] for g in resumed.param_groups] == [True, False]
    for m, o in ((model, optimizer), (resumed_model, resumed)):
        loss_of(m, seed=2).backward()
        o.step()
    for (name, p), (_, q) in zip(model.named_parameters(), resumed_model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_no_parameters_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        MuonWithAdamW([], [], lr=1e-3, weight_decay=0.0)
