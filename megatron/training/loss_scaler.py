"""Loss scaling for --fp16 (and a fixed --loss-scale under bf16), by Megatron's rules, on any
device (megatron-core's scalers keep their state on CUDA).

fp16 keeps 5 exponent bits: gradients smaller than 2^-24 flush to zero. The loss is multiplied by
`scale` before backward and the fp32 main gradients divided by it before the step. A step whose
gradients hold an inf or a NaN anywhere is skipped.

Dynamic scaling (the default): an overflow costs one unit of hysteresis; once `hysteresis`
overflows have been spent the scale is multiplied by `backoff` (never below `min_scale`), and each
further overflow shrinks it again. After `window` clean steps in a row the scale is multiplied by
`growth` and the hysteresis is restored. With --loss-scale the scale is fixed; overflowing steps
are still skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LossScaler:
    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    growth: float = 2.0
    backoff: float = 0.5
    window: int = 1000
    hysteresis: int = 2
    clean_steps: int = 0
    hysteresis_left: int = field(default=-1)

    def __post_init__(self):
        if self.hysteresis_left < 0:
            self.hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """After each step: `found_inf` if any gradient of any rank was not finite."""
        if not self.dynamic:
            return
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth

    # Megatron's checkpoint keys; a fixed scale has none (megatron-core's ConstantGradScaler): it
    # is the flag's, whatever a checkpoint says
    def state_dict(self) -> dict:
        if not self.dynamic:
            return {}
        return {"scale": self.scale, "growth_tracker": self.clean_steps, "hysteresis_tracker": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        if not self.dynamic or not state:  # a fixed scale's checkpoint: start from --initial-loss-scale
            return
        self.scale = float(state["scale"])
        self.clean_steps = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_tracker"])


def loss_scaler(args) -> Optional[LossScaler]:
    """The scaler a run trains with, as megatron-core builds it: --loss-scale fixes one under any
    precision validation lets it (bf16 included); --fp16 otherwise scales dynamically; bf16 and
    fp32 need none."""
    if args.loss_scale is not None:
        return LossScaler(args.loss_scale, dynamic=False)
    if not args.fp16:
        return None
    return LossScaler(args.initial_loss_scale, min_scale=args.min_loss_scale, window=args.loss_scale_window,
                      hysteresis=args.hysteresis)
