"""Recipe: a custom gradient transform (gradient centralisation: each weight matrix's gradient
loses its mean over the inputs) as an ``update_fn`` wrapped around the default update. The loop
then clips, logs and steps as usual. ``koochak-train --config examples/recipes/grad_transform.yaml``.

The same transform could be an ``on_before_optimizer_step`` hook (it sees the gradients unscaled
and clipped); as an update it runs before the clip, so the clip measures what is stepped.
"""

from __future__ import annotations

import torch
from koochak.loop import standard_update


def centralized_update(batches, model, optimizer, ctx):
    out = standard_update(batches, model, optimizer, ctx)  # micro-steps x grad_accum
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.dim() > 1:
                    p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.grad.dim())), keepdim=True))
    return out
