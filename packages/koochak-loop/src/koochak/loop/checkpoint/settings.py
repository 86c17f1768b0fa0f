"""The checkpoint component's own typed config, built once from the spec's flat ``train.*`` keys.

Users keep writing ``train.ckpt_every``, ``keep_last_k``, ``checkpoint_dir``, ``checkpoint_async``,
``checkpoint_parts``, ``checkpoint_replicas``, ``keep_best_*``, ... (there is no second YAML
form); ``CheckpointConfig.of(train)`` gathers them into one record with the layout decided once
(``sharded`` under FSDP), the first tier resolved for this node (``{node}``) and the replication
settings, and the saver is built from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from koochak.loop.checkpoint.tiers import (
    Location,
    ReplicationSettings,
    Tier,
    checkpoint_tiers,
    is_node_local,
    replication_settings,
)
from koochak.loop.config import TrainConfig, as_train_config


@dataclass(frozen=True)
class CheckpointConfig:
    location: Location  # the first tier, on this node ({node} resolved)
    node_local: bool  # train.checkpoint_dir holds {node}: one directory per node
    every: int | None  # train.ckpt_every; None: only the terminal checkpoint
    max_steps: int | None
    keep_last_k: int | None  # None: every checkpoint
    keep_best: tuple[int, str, str] | None  # (keep_best_k, keep_best_metric, keep_best_mode)
    parts: int | str  # train.checkpoint_parts
    async_publish: bool  # train.checkpoint_async
    sharded: bool  # the layout: every rank writes its shards (train.fsdp.enabled)
    replication: ReplicationSettings | None  # train.checkpoint_replicas and their settings
    run_id: str | None  # train.run_id (None: decided at start, tier_marker.run_identity)
    tiers: tuple[Tier, ...]  # every tier, first tier (location) first: what the claim marks

    @classmethod
    def of(cls, train: TrainConfig | Mapping[str, Any]) -> CheckpointConfig:
        cfg = as_train_config(train)
        where = cfg.checkpoint_dir or cfg.out_dir
        tiers = checkpoint_tiers(cfg)
        return cls(
            location=tiers[0].location,
            node_local=is_node_local(where),
            every=cfg.ckpt_every or None,
            max_steps=cfg.max_steps,
            keep_last_k=cfg.keep_last_k or None,
            keep_best=(cfg.keep_best_k, str(cfg.keep_best_metric), cfg.keep_best_mode)
            if cfg.keep_best_k
            else None,
            parts=cfg.checkpoint_parts,
            async_publish=cfg.checkpoint_async,
            sharded=cfg.fsdp.enabled,
            replication=replication_settings(cfg, tiers),
            run_id=cfg.run_id,
            tiers=tiers,
        )

    @property
    def locations(self) -> tuple[Location, ...]:
        """Every tier's location, first tier first (what resume selects over)."""
        return tuple(tier.location for tier in self.tiers)
