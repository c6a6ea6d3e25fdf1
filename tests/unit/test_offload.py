"""Offloading the policy's training state during generation (models/policy/offload.py), the
per-phase memory measurements (utils/phase_memory.py) and the `policy.offload_during_generation` key."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from posttrain.config.schema import PolicyConfig
from posttrain.models.policy.offload import offload, offload_note, offloads_during_generation, reload
from posttrain.utils import memory
from posttrain.utils.phase_memory import MeasuresPhases, measured_phase, merge_peaks


def tiny_model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    model.register_buffer("scale", torch.ones(3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train_step(model, optimizer, seed: int, zero_grad: bool = True) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    ((model(x) * model.scale - y) ** 2).mean().backward()
    optimizer.step()


def training_tensors(model, optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor offloading must move: parameters, gradients, buffers, optimizer state."""
    named = [(f"param {n}", p) for n, p in model.named_parameters()]
    named += [(f"grad {n}", p.grad) for n, p in model.named_parameters() if p.grad is not None]
    named += [(f"buffer {n}", b) for n, b in model.named_buffers()]
    for i, state in enumerate(optimizer.state.values()):
        named += [(f"optimizer state {i} {k}", v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    return named


def test_offload_to_meta_leaves_no_training_tensor_on_the_source_device():
    model, optimizer = tiny_model_and_optimizer()
    train_step(model, optimizer, 1)
    train_step(model, optimizer, 2, zero_grad=False)  # keep gradients, as mid-accumulation
    before = training_tensors(model, optimizer)
    assert any(name.startswith("grad") for name, _ in before) and any("exp_avg" in name for name, _ in before)
    params = list(model.parameters())

    done = offload(model, optimizer, torch.device("meta"))

    left = [name for name, t in training_tensors(model, optimizer) if t.device.type != "meta"]
    assert not left, f"still on the CPU: {left}"
    assert all(p is q for p, q in zip(model.parameters(), params))  # in place: the optimizer's Parameter objects
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], params))
    assert done.bytes_moved == sum(t.numel() * t.element_size() for _, t in before)


def test_a_host_round_trip_is_bit_exact_and_training_goes_on_identically():
    model, optimizer = tiny_model_and_optimizer()
    twin, twin_optimizer = tiny_model_and_optimizer()
    for seed in (1, 2):
        train_step(model, optimizer, seed)
        train_step(twin, twin_optimizer, seed)
    before = {name: t.clone() for name, t in training_tensors(model, optimizer)}
    pointers = {name: t.data_ptr() for name, t in training_tensors(model, optimizer)}

    cpu = torch.device("cpu")
    done = offload(model, optimizer, cpu, copy=True)  # a real copy, as to a host on a GPU machine
    moved = {name: t for name, t in training_tensors(model, optimizer)}
    assert all(moved[name].data_ptr() != pointers[name] for name in pointers if moved[name].numel())
    assert reload(model, optimizer, done, cpu, copy=True) == done.bytes_moved > 0

    after = dict(training_tensors(model, optimizer))
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert optimizer.state[next(model.parameters())]["step"].device == cpu  # Adam's counter back where it was
    for seed in (3, 4, 5):
        train_step(model, optimizer, seed)
        train_step(twin, twin_optimizer, seed)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def test_lent_weights_stay_and_only_gradients_and_optimizer_state_move():
    model, optimizer = tiny_model_and_optimizer()
    train_step(model, optimizer, 1)
    train_step(model, optimizer, 2, zero_grad=False)
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}

    offload(model, optimizer, torch.device("meta"), move_parameters=False)

    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights  # the engine's tensors
    assert all(p.grad is None for p in model.parameters())  # stashed: autograd wants them on the parameter's device
    assert all(t.device.type == "meta" for s in optimizer.state.values() for t in s.values())


def test_lent_weights_get_their_gradients_back_bit_exactly():
    model, optimizer = tiny_model_and_optimizer()
    train_step(model, optimizer, 1)
    train_step(model, optimizer, 2, zero_grad=False)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    done = offload(model, optimizer, torch.device("cpu"), move_parameters=False, copy=True)
    reload(model, optimizer, done, torch.device("cpu"))
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name


FSDP_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from posttrain.models.policy.offload import offload, reload
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model[0]); fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    def step(seed):
        g = torch.Generator().manual_seed(seed)
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
        optimizer.step()
    step(1)
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    saved = [p.to_local().clone() for p in params]
    done = offload(model, optimizer, torch.device("cpu"), copy=True)
    done = reload(model, optimizer, done, torch.device("cpu"), copy=True)
    assert all(torch.equal(p.to_local(), s) for p, s in zip(model.parameters(), saved))
    step(2)  # FSDP2 all-gathers from the new shards
    assert all(p is q for p, q in zip(model.parameters(), params))
    offload(model, optimizer, torch.device("meta"))
    left = [p for p in model.parameters() if p.to_local().device.type != "meta"]
    left += [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and (v.to_local() if isinstance(v, DTensor) else v).device.type != "meta"]
    assert not left, left
    print("FSDP2 OK")
""")


def test_fsdp2_shards_move_in_place_and_train_after_a_round_trip(tmp_path):
    """A 1-rank gloo FSDP2 model in a process of its own (a process group would outlive the test)."""
    result = subprocess.run([sys.executable, "-c", FSDP_SCRIPT, str(tmp_path / "store")], capture_output=True,
                            text=True, timeout=300)
    assert "FSDP2 OK" in result.stdout, result.stderr[-3000:]


# ----------------------------------------------------------------------------- the config key
def test_offload_during_generation_defaults_to_auto_and_validates():
    assert PolicyConfig().offload_during_generation is None
    assert PolicyConfig(offload_during_generation=True).offload_during_generation is True
    assert PolicyConfig.model_validate({"offload_during_generation": "false"}).offload_during_generation is False
    with pytest.raises(ValueError):
        PolicyConfig.model_validate({"offload_during_generation": "sometimes"})
    with pytest.raises(ValueError, match="offload_during_generation"):
        PolicyConfig.model_validate({"offload_during_generations": True})


def test_offload_during_generation_from_an_override():
    from posttrain.config import load_config

    cfg = load_config("grpo", overrides=["policy.offload_during_generation=true"])
    assert cfg.policy.offload_during_generation is True


@pytest.mark.parametrize(
    "setting, on_gpus, colocated, fsdp_cpu_offload, moves",
    [
        (None, True, True, False, True),    # auto: colocated on GPUs
        (None, False, True, False, False),  # auto: CPU workers
        (None, True, False, False, False),  # auto: generation on GPUs of its own
        (False, True, True, False, False),
        (True, True, True, False, True),
        (True, False, True, False, False),  # CPU: a no-op, with a note
        (True, True, True, True, False),    # FSDP2 keeps the state on the host already
    ],
)
def test_when_offloading_moves_anything(setting, on_gpus, colocated, fsdp_cpu_offload, moves):
    cfg = PolicyConfig.model_validate({
        "offload_during_generation": setting, "num_workers": 2 if fsdp_cpu_offload else 1,
        "train_global_batch_size": 2, "fsdp_cpu_offload": fsdp_cpu_offload,
        "generation": {"colocated": {"enabled": colocated}},
    })
    assert offloads_during_generation(cfg, on_gpus) is moves
    note = offload_note(cfg, on_gpus)
    assert (note is not None) == (setting is True and not moves)
    if note:
        assert note.count("\n") == 0 and "nothing to move" in note


# ----------------------------------------------------------------------------- phase memory
class Worker(MeasuresPhases):
    device = torch.device("cpu")

    @measured_phase("logprobs")
    def outer(self, inner: bool) -> int:
        return self.inner() if inner else 1

    @measured_phase("training")
    def inner(self) -> int:
        return 2


def test_a_phase_records_its_peak_and_a_nested_one_is_part_of_the_outer():
    worker = Worker()
    assert worker.outer(inner=True) == 2
    assert worker.outer(inner=False) == 1
    report = worker.take_phase_memory()
    assert sorted(report) == ["memory/logprobs/peak_rss_gb"]
    assert report["memory/logprobs/peak_rss_gb"] > 0
    assert worker.take_phase_memory() == {}


def test_merge_peaks_keeps_the_highest_of_each():
    assert merge_peaks([{"a": 1.0, "b": 5.0}, {}, {"a": 3.0}, None]) == {"a": 3.0, "b": 5.0}


def test_a_phase_restart_does_not_hide_the_processs_peak_from_an_outer_measurement():
    memory.reset_peak_rss()
    ballast = torch.ones(64 * 2**20, dtype=torch.uint8) + 1  # 64 MiB touched, then freed
    high = memory.peak_rss_bytes()
    del ballast
    Worker().outer(inner=False)  # restarts the kernel's mark inside
    assert memory.peak_rss_bytes() >= high
    assert memory.kernel_peak_rss_bytes() < high or not memory.restart_peak_rss()
