"""AdamW: torch's fused/foreach kernels for fp32 states, or :class:`LowPrecisionAdamW` whose moments
are stored in bf16 and whose every update is computed in fp32. Weight decay on matrices only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.schema import OptimizerConfig
from shardwise.models.moe import Router


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str,
                    router_lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """AdamW with two groups: 2-D+ parameters (matrices, embeddings) decay, 1-D ones (norms) don't;
    with ``router_lr_scale`` other than 1, a third for the MoE routers' weights at that fraction of
    the learning rate (the scheduler scales each group's own peak).

    ``auto`` picks the fused kernel (one kernel for all parameters; CPU and CUDA both have one).
    ``state_dtype=bf16`` selects :class:`LowPrecisionAdamW`.
    """
    scaled = set()
    if router_lr_scale != 1.0:
        scaled = {id(m.gate.weight) for m in model.modules() if isinstance(m, Router)}
    decay, no_decay, routers = [], [], []
    for p in model.parameters():
        if p.requires_grad:
            (routers if id(p) in scaled else decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if routers:
        groups.append({"params": routers, "weight_decay": cfg.weight_decay, "lr": cfg.lr * router_lr_scale})
    if cfg.state_dtype == "bf16":
        return LowPrecisionAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 state_dtype=torch.bfloat16)
    impl = "fused" if fused_kernel(cfg, device_type) else cfg.implementation
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "for-loop": {"foreach": False}, "auto": {}}[impl]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


def fused_kernel(cfg: OptimizerConfig, device_type: str) -> bool:
    """Whether :func:`build_optimizer` gives torch's fused AdamW (one kernel for every parameter,
    which also takes the gradient clip's divisor and the skip of a non-finite step)."""
    if cfg.state_dtype != "fp32":
        return False
    return cfg.implementation == "fused" or (cfg.implementation == "auto" and device_type in ("cpu", "cuda"))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with ``exp_avg`` / ``exp_avg_sq``
    stored in ``state_dtype`` (bf16: 4 bytes per parameter instead of 8).

    Each step, per parameter: upcast the moments to fp32, update them and the parameter in fp32,
    round the moments back to nearest. The first step therefore equals fp32 AdamW exactly; after
    that the moments carry bf16's ~3 significant digits. ``exp_avg_sq`` moves by ``1 - beta2`` of
    itself per step, so with beta2 close to 1 (0.999) updates smaller than bf16's resolution (2^-8
    relative) are lost to rounding; the default beta2 = 0.95 is well clear of that.

    ``master_weights=True`` keeps an fp32 copy of low-precision (bf16) parameters in the state: the
    update lands on the copy and the parameter is its rounding (no update is lost when it is
    smaller than the parameter's bf16 spacing). With fp32 parameters it is not needed.

    Parameters may be FSDP2 DTensors; the math runs on the local shards (elementwise), and the
    states are DTensors of the same placement, so distributed checkpoints reshard them. The
    per-parameter loop keeps the fp32 temporaries to one parameter's size.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.bfloat16,
                 master_weights: bool = False) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.master_weights = master_weights

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype,
                                               memory_format=torch.preserve_format)
        if self.master_weights and p.dtype != torch.float32:
            state["master"] = p.detach().to(torch.float32, copy=True)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if self.state[p] else self._init_state(p)
                state["step"] = state["step"] + 1  # not in place: a loaded state dict may share it
                t = float(state["step"])
                grad = _local(p.grad).float()
                m = _local(state["exp_avg"])
                v = _local(state["exp_avg_sq"])
                target = _local(state["master"]) if "master" in state else _local(p)
                w = target if target.dtype == torch.float32 else target.float()
                m32 = m.float().lerp_(grad, 1 - beta1)  # beta1 * m + (1 - beta1) * g
                v32 = v.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if wd:
                    w.mul_(1 - lr * wd)
                step_size = lr / (1 - beta1**t)
                denom = (v32 / (1 - beta2**t)).sqrt_().add_(eps)
                w.addcdiv_(m32, denom, value=-step_size)
                m.copy_(m32)  # round to the state dtype
                v.copy_(v32)
                if w is not target:
                    target.copy_(w)
                if "master" in state:
                    _local(p).copy_(w)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every floating-point state to its parameter's dtype on load (which would
        turn bf16 moments into fp32 and round an fp32 master copy to bf16): the moments and the
        master copy are taken again from ``state_dict`` in their own dtypes."""
        incoming = {pid: dict(st) for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params, strict=True):
            for key, dtype in (("exp_avg", self.state_dtype), ("exp_avg_sq", self.state_dtype),
                               ("master", torch.float32)):
                if key in incoming.get(pid, {}):
                    self.state[p][key] = incoming[pid][key].to(device=p.device, dtype=dtype, copy=True)


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer-state bytes per parameter element (step counters aside)."""
    n = sum(_local(p).numel() for g in optimizer.param_groups for p in g["params"])
    total = sum(_local(v).numel() * v.element_size() for st in optimizer.state.values()
                for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    return total / max(n, 1)
