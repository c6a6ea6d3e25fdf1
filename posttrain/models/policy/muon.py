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
"""

from __future__ import annotations

from typing import Any, Optional

import torch

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


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon_params`, AdamW on `adamw_params`, behind one optimizer (module doc).

    Args:
        muon_params / adamw_params: the parameters of each (see `muon_param_split`); either may be
            empty, not both.
        lr, weight_decay: shared by both (decoupled weight decay).
        betas, eps: AdamW's.
        momentum, nesterov, ns_steps, adjust_lr_fn: Muon's (`torch.optim.Muon`'s arguments).
    """

    def __init__(self, muon_params: list, adamw_params: list, *, lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: Optional[str] = "match_rms_adamw"):
        if not muon_params and not adamw_params:
            raise ValueError("MuonWithAdamW got no parameters")
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
                part.step()
        return loss


def build_muon(model: torch.nn.Module, opt: Any) -> MuonWithAdamW:
    """`MuonWithAdamW` of `model`'s trainable parameters with the settings of `opt`
    (`policy.optimizer`: lr, weight_decay, betas, eps, muon_momentum, muon_ns_steps, muon_adjust_lr)."""
    muon, adamw = muon_param_split(model)
    return MuonWithAdamW([p for _, p in muon], [p for _, p in adamw], lr=opt.lr, weight_decay=opt.weight_decay,
                         betas=tuple(opt.betas), eps=opt.eps, momentum=opt.muon_momentum, ns_steps=opt.muon_ns_steps,
                         adjust_lr_fn=opt.muon_adjust_lr)
