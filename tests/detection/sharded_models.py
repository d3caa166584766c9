"""The sharded tests' models: plain ``torch.nn`` parts, sharded as FSDP2's tutorial shards them
(``fully_shard`` each block, then the root), with odd sizes so that shards are uneven.

One definition for the test files that train them, so that a change of size or layout is made
once and every file tests the same kind of model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointedNet", "ResidualNet", "mse_loss", "shard_layers", "two_linear"]


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ResidualNet(nn.Module):
    """An input layer, two residual blocks (LayerNorm, MLP), a head; no buffers."""

    def __init__(self, inputs: int = 6, width: int = 12, hidden: int = 20) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.layers = nn.ModuleList([_Block(width, hidden), _Block(width, hidden)])
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class CheckpointedNet(ResidualNet):
    """The same network with each block under activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return self.head(h)


def shard_layers(model: ResidualNet, mesh: DeviceMesh) -> ResidualNet:
    """FSDP2's tutorial: ``fully_shard`` each block, then the root."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def two_linear() -> nn.Module:
    """Two Linear layers with odd sizes, each and the root ``fully_shard``-ed over every rank:
    uneven shards, an empty one at world size 4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
