"""Recipe: a GAN with two optimizers, as an ``update_fn`` plus a ``state`` entry.

The generator's Adam is the loop's main optimizer (the loop clips, logs and steps it); the
discriminator's rides in every checkpoint as ``state["opt_d"]`` and this update steps it.
``koochak-train --config examples/recipes/gan.yaml`` (add ``train.ddp=true`` under torchrun, or
``train.fsdp.enabled=true``). Under DDP the D step's backward leaves G's parameters without
gradients, which is why ``gan.yaml`` sets ``train.find_unused_parameters`` (docs/loop.md, "A second
backward under DDP").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce


class GAN(nn.Module):
    def __init__(self, z: int = 4) -> None:
        super().__init__()
        self.z = z
        self.G = nn.Sequential(nn.Linear(z, 32), nn.ReLU(), nn.Linear(32, 2))
        self.D = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, part: str) -> torch.Tensor:
        # One forward for every part: DDP syncs and torch.compile compiles only through it.
        return self.D(self.G(x)) if part == "GD" else getattr(self, part)(x)


def gan_update(batches, model, opt_g, ctx):
    real = next(batches)
    z = torch.randn(len(real), 4, device=ctx.device)
    with torch.no_grad():
        fake = model(z, "G")
    ones = torch.ones(len(real), 1, device=ctx.device)
    zeros = torch.zeros_like(ones)
    d_loss = bce(model(torch.cat([real, fake]), "D"), torch.cat([ones, zeros]))
    ctx.state["opt_d"].zero_grad(set_to_none=True)
    d_loss.backward()
    ctx.state["opt_d"].step()
    g_loss = bce(model(z, "GD"), ones)
    g_loss.backward()  # the loop steps opt_g after its gradient gate (and zeroes D's grads)
    return {"loss": g_loss, "d_loss": d_loss.detach()}


def make_model(cfg=None) -> GAN:
    return GAN()


def g_optimizer(model, cfg=None) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.G.parameters(), lr=1e-3, betas=(0.5, 0.999))


def gan_state(model, cfg=None) -> dict:
    return {"opt_d": torch.optim.Adam(model.D.parameters(), lr=1e-3, betas=(0.5, 0.999))}
