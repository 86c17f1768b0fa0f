"""Recipe: sharpness-aware minimisation (SAM) as an ``update_fn``: two forward/backward passes
per update, the second at the weights moved uphill by ``rho`` along the gradient; the loop then
clips, logs and steps with the second gradients at the original weights.
``koochak-train --config examples/recipes/sam.yaml``.
"""

from __future__ import annotations

import torch
from koochak.loop import micro_step

RHO = 0.05


def sam_update(batches, model, optimizer, ctx):
    batch = next(batches)
    out = micro_step(model, batch, ctx)  # gradients at w
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        uphill = [p.grad * (RHO / (norm + 1e-12)) for p in params]
        torch._foreach_add_(params, uphill)  # w + e
    optimizer.zero_grad(set_to_none=True)
    micro_step(model, batch, ctx)  # gradients at w + e
    with torch.no_grad():
        torch._foreach_sub_(params, uphill)  # back to w; the loop steps from here
    return out
