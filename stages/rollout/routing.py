"""MoE routing replay on the engine side: the rows `Sample.routed_experts` stores, from an engine's output.

A row is one position the trainer forwards (prompt + response tokens but the last) and holds, layer by
layer over the model's MoE layers only, the top-k experts the engine routed that position to. SGLang
(`--enable-return-routed-experts`, `return_routed_experts` per request) returns base64 int32 of shape
[positions, num_hidden_layers, k], dense layers included; `RoutingRows.decode` keeps the MoE layers.
The torch engine records the same rows with hooks on its routers (stages/rollout/torch_engine.py).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.models import moe_layer_flags


@dataclass(frozen=True)
class RoutingRows:
    layers: int  # num_hidden_layers (SGLang's rows cover all of them)
    moe_layers: tuple[int, ...]  # which of them route
    top_k: int

    @classmethod
    def of_model(cls, model_path: str | Path) -> RoutingRows:
        """From the model folder's config.json; ValueError naming the model when it has no experts."""
        hc = json.loads((Path(model_path) / "config.json").read_text())
        if not hc.get("num_experts_per_tok"):
            raise ValueError(
                f"trainer.routing_replay records the engine's expert choices, but {model_path} "
                f"({hc.get('model_type')}) is not an MoE model; turn trainer.routing_replay off"
            )
        flags = moe_layer_flags(hc)
        return cls(len(flags), tuple(i for i, f in enumerate(flags) if f), int(hc["num_experts_per_tok"]))

    def decode(self, encoded: str) -> np.ndarray:
        """SGLang's base64 routed_experts -> [positions, moe_layers * k] int16."""
        flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
        per_position = self.layers * self.top_k
        if len(flat) % per_position:
            raise ValueError(
                f"routed_experts from the engine has {len(flat)} ids, not whole rows of {self.layers} layers x "
                f"top-{self.top_k}: the engine serves another model than the trainer's config describes"
            )
        rows = flat.reshape(-1, self.layers, self.top_k)[:, list(self.moe_layers)]
        return rows.reshape(len(rows), -1).astype(np.int16)
