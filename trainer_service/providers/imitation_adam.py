"""Adam over tensors packed in one buffer, saved and loaded in ``torch.optim.Adam``'s format."""

from __future__ import annotations

import inspect
from typing import Any

import torch


class PackedAdam:
    """Adam over equally shaped tensors stacked along the first dimension of one buffer.

    The update is ``torch.optim.Adam``'s own single-tensor update (no weight decay, no amsgrad,
    no maximize) written out once for the whole buffer. It is elementwise, so each parameter's
    numbers are the ones ``torch.optim.Adam`` computes; what changes is the cost: torch runs its
    kernels once per parameter tensor behind per-step Python bookkeeping, which on a policy of a
    few hundred numbers costs more than sampling and scoring a whole group of motions.

    :attr:`param_groups` holds the hyperparameters (a new ``lr`` takes effect at the next
    :meth:`step`). :meth:`state_dict` is a plain Adam state dict (``torch.optim.Adam``'s
    ``state_dict()`` of the buffer's slices, written out: the group's values and Adam's defaults
    for the rest of its constructor's arguments), so a checkpoint loads into ``torch.optim.Adam``
    and back; :meth:`load_state_dict` loads with a ``torch.optim.Adam`` over the buffer's slices,
    which from then on holds the hyperparameters. Making one imports ``torch._dynamo`` (~1 CPU-s,
    once per process), which a job that only trains and writes checkpoints has no use for.

    Args:
        packed: The parameters, ``[tensors, ...]``; :meth:`step` updates it in place.
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Added to the denominator.
    """

    def __init__(
        self,
        packed: torch.Tensor,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        # torch.optim.Adam's own checks, at once rather than when its Adam is first made.
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        self.packed = packed
        self.exp_avg = torch.zeros_like(packed)
        self.exp_avg_sq = torch.zeros_like(packed)
        self.steps = 0
        self._groups: list[dict[str, Any]] = [
            {"params": list(packed.unbind(0)), "lr": lr, "betas": betas, "eps": eps}
        ]
        self._torch_adam: torch.optim.Adam | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The parameter groups (one, over the buffer's slices): ``torch.optim.Adam``'s once it
        is made."""
        return self._groups if self._torch_adam is None else self._torch_adam.param_groups

    @property
    def _adam(self) -> torch.optim.Adam:
        """The ``torch.optim.Adam`` that (de)serialises, made with the current hyperparameters
        the first time it is needed."""
        if self._torch_adam is None:
            (group,) = self._groups
            self._torch_adam = torch.optim.Adam(
                group["params"], lr=group["lr"], betas=group["betas"], eps=group["eps"]
            )
        return self._torch_adam

    def step(self, grad: torch.Tensor) -> None:
        """Takes one step along ``grad`` (shaped as the buffer)."""
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        self.steps += 1
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**self.steps
        bias_correction2_sqrt = (1 - beta2**self.steps) ** 0.5
        denom = (self.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        self.packed.addcdiv_(self.exp_avg, denom, value=-lr / bias_correction1)

    def state_dict(self) -> dict[str, Any]:
        """The state as ``torch.optim.Adam.state_dict()`` has it (no state before a step)."""
        if self._torch_adam is None:
            (group,) = self._groups
            saved = {**_adam_defaults(), **{k: v for k, v in group.items() if k != "params"}}
            saved["betas"] = tuple(float(beta) for beta in saved["betas"])
            saved["params"] = list(range(len(group["params"])))
            moments: dict[int, dict[str, torch.Tensor]] = {}
            if self.steps:
                moments = {
                    i: {
                        "step": torch.tensor(float(self.steps), dtype=torch.float32),
                        "exp_avg": self.exp_avg[i],
                        "exp_avg_sq": self.exp_avg_sq[i],
                    }
                    for i in range(len(group["params"]))
                }
            return {"state": moments, "param_groups": [saved]}
        self._adam.state.clear()
        if self.steps:
            for i, param in enumerate(self._adam.param_groups[0]["params"]):
                self._adam.state[param] = {
                    "step": torch.tensor(float(self.steps), dtype=torch.float32),
                    "exp_avg": self.exp_avg[i],
                    "exp_avg_sq": self.exp_avg_sq[i],
                }
        state = self._adam.state_dict()
        self._adam.state.clear()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state :meth:`state_dict` (or a ``torch.optim.Adam`` of as many tensors of
        the same shapes) wrote.

        Raises:
            ValueError: The state does not fit, uses an Adam variant this update does not
                compute (weight decay, amsgrad, maximize), or its tensors took different
                numbers of steps.
        """
        self._adam.load_state_dict(state_dict)
        group = self._adam.param_groups[0]
        variants = {k: group.get(k) for k in ("weight_decay", "amsgrad", "maximize")}
        if any(variants.values()):
            raise ValueError(f"an Adam state with {variants} does not load into PackedAdam")
        entries = [self._adam.state.get(param) for param in group["params"]]
        self._adam.state.clear()
        steps = {0 if entry is None else int(entry["step"]) for entry in entries}
        if len(steps) != 1:
            raise ValueError(f"the packed tensors took different numbers of steps: {steps}")
        for i, entry in enumerate(entries):
            if entry is None:
                self.exp_avg[i].zero_()
                self.exp_avg_sq[i].zero_()
            else:
                self.exp_avg[i].copy_(entry["exp_avg"])
                self.exp_avg_sq[i].copy_(entry["exp_avg_sq"])
        (self.steps,) = steps


def _adam_defaults() -> dict[str, Any]:
    """The hyperparameters ``torch.optim.Adam`` records in a parameter group, at its defaults
    (its constructor's keyword arguments; inspected, not made: see :class:`PackedAdam`)."""
    parameters = inspect.signature(torch.optim.Adam.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.name not in ("self", "params")}
