"""`policy.optimizer.name: muon`: Muon for the hidden layers' matrices, AdamW for everything else,
as one `torch.optim.Optimizer`.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; at scale:
Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982) orthogonalises each 2-D
parameter's momentum with a Newton-Schulz iteration (`torch.optim.Muon`). It is meant for the
matrices of the hidden layers only: embeddings, the output head (the LM head, a reward model's
score head), norms and biases are left to AdamW (`muon_param_split`). With Moonshot's learning-rate
adjustment (`policy.optimizer.muon_adjust_lr: match_rms_adamw`, the default) Muon's update has
AdamW's RMS, so both groups share `policy.optimizer.lr` and `weight_decay`.

`MuonWithAdamW` is a single optimizer whose param groups are tagged `use_muon`: the LR scheduler,
offloading, `state_dict` and torch's distributed checkpoints (`get_state_dict` /
`set_state_dict`, `checkpoint.py`) see one optimizer with two groups and need nothing special;
`step` runs `torch.optim.Muon`'s and `torch.optim.AdamW`'s own updates on their groups.

torch's Muon runs its Newton-Schulz iteration in bfloat16. On a CPU without bfloat16 matmul
instructions that is PyTorch's scalar GEMM (`posttrain/cpu_precision.py`): under AVX2 kernels SFT
with Muon took 4-10x AdamW's time. There the Muon groups take `muon_update` instead, the same
update with the iteration in float32 (`benchmarks/bfloat16_matmul.py` measures both).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim._muon import _adjust_lr  # torch's own learning-rate adjustment (pinned torch)

from posttrain.cpu_precision import matmul_dtype

# Modules whose weight is an output head: a sequence classifier's (reward model) or a value head.
# Muon is for hidden layers; a head's update is left to AdamW, as the LM head's.
HEAD_MODULE_NAMES = ("lm_head", "score", "classifier", "v_head", "value_head")


def muon_param_split(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """`(muon, adamw)`: the trainable `(name, parameter)`s Muon updates (2-D matrices of the hidden
    layers) and those AdamW updates (embeddings, output heads, norms, biases, and the 3-D fused
    expert weights of mixture-of-experts models)."""
    excluded: set[int] = set()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Embedding) or module is output
                or name.rsplit(".", 1)[-1] in HEAD_MODULE_NAMES):
            excluded.update(id(p) for p in module.parameters())
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (muon if param.ndim == 2 and id(param) not in excluded else adamw).append((name, param))
    return muon, adamw


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation of a 2-D `update`, computed in `dtype`
    (torch's `_zeropower_via_newtonschulz` with the dtype as a choice; it fixes bfloat16)."""
    a, b, c = coefficients
    x = update.to(dtype)
    transposed = update.size(0) > update.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transposed else x


@torch.no_grad()
def muon_update(muon: torch.optim.Muon, dtype: torch.dtype) -> None:
    """One step of `muon` (its groups and state, as `torch.optim.Muon.step` makes it) with the
    Newton-Schulz iteration in `dtype`. The state is torch's (`momentum_buffer`), so a checkpoint
    moves between the two."""
    for group in muon.param_groups:
        momentum = group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = param.grad
            state = muon.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(update.to(param.dtype), alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon_params`, AdamW on `adamw_params`, behind one optimizer (module doc).

    Args:
        muon_params / adamw_params: the parameters of each (see `muon_param_split`); either may be
            empty, not both.
        lr, weight_decay: shared by both (decoupled weight decay).
        betas, eps: AdamW's.
        momentum, nesterov, ns_steps, adjust_lr_fn: Muon's (`torch.optim.Muon`'s arguments).
        newton_schulz_dtype: what the Newton-Schulz iteration computes in: bfloat16 (torch's
            Muon) or float32 (`muon_update`); default: bfloat16 where its matmuls are fast (GPUs,
            CPUs with AVX512-BF16 or AMX), float32 on other CPUs.
    """

    def __init__(self, muon_params: list, adamw_params: list, *, lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: Optional[str] = "match_rms_adamw",
                 newton_schulz_dtype: Optional[torch.dtype] = None):
        if not muon_params and not adamw_params:
            raise ValueError("MuonWithAdamW got no parameters")
        if newton_schulz_dtype is None:
            device = muon_params[0].device if muon_params else "cpu"
            newton_schulz_dtype = matmul_dtype(torch.bfloat16, device)
        self.newton_schulz_dtype = newton_schulz_dtype
        # Each part's groups carry its own optimizer's full set of hyperparameters.
        self._muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn) if muon_params else None
        self._adamw = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay, betas=betas,
                                        eps=eps) if adamw_params else None
        groups = []
        for part, use_muon in ((self._muon, True), (self._adamw, False)):
            for group in part.param_groups if part is not None else []:
                groups.append({**group, "use_muon": use_muon})
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The groups and the state are this optimizer's (`load_state_dict` replaces the group
        # dicts), lent to each part for its update.
        for part, use_muon in ((self._muon, True), (self._adamw, False)):
            if part is not None:
                part.param_groups = [g for g in self.param_groups if g["use_muon"] == use_muon]
                part.state = self.state
                if use_muon and self.newton_schulz_dtype != torch.bfloat16:
                    muon_update(part, self.newton_schulz_dtype)
                else:
                    part.step()
        return loss


def build_muon(model: torch.nn.Module, opt: Any, newton_schulz_dtype: Optional[torch.dtype] = None) -> MuonWithAdamW:
    """`MuonWithAdamW` of `model`'s trainable parameters with the settings of `opt`
    (`policy.optimizer`: lr, weight_decay, betas, eps, muon_momentum, muon_ns_steps, muon_adjust_lr)."""
    muon, adamw = muon_param_split(model)
    return MuonWithAdamW([p for _, p in muon], [p for _, p in adamw], lr=opt.lr, weight_decay=opt.weight_decay,
                         betas=tuple(opt.betas), eps=opt.eps, momentum=opt.muon_momentum, ns_steps=opt.muon_ns_steps,
                         adjust_lr_fn=opt.muon_adjust_lr, newton_schulz_dtype=newton_schulz_dtype)
