"""Capacity models, built once per input and reused while the inputs do not change.

Building a ``CapacityModel`` (length-mix statistics, the token budget, both pool
models) costs far more than a solve, and its inputs — the length mix, the profile,
the TPOT SLO, the KV link — change rarely. The cache is an object its owner (a
control loop, a back-test policy, a benchmark) creates and passes to ``decide``,
so two controllers never share or evict each other's models.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from controller.config import ControllerConfig
from queueing.lengths import LengthSamples
from queueing.profile import IterationProfile
from queueing.solver import CapacityModel, KvLink


def _lengths_key(lengths: LengthSamples) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(lengths.prompt_tokens.tobytes())
    digest.update(lengths.output_tokens.tobytes())
    return digest.hexdigest()


class CapacityModels:
    """A bounded least-recently-used cache of capacity models, keyed by their inputs."""

    def __init__(self, *, size: int = 8) -> None:
        if size < 1:
            raise ValueError(f"size: must be >= 1, got {size!r}")
        self.size = size
        self._models: OrderedDict[tuple[Any, ...], CapacityModel] = OrderedDict()

    def __len__(self) -> int:
        return len(self._models)

    def get(
        self, lengths: LengthSamples, profile: IterationProfile, config: ControllerConfig
    ) -> CapacityModel:
        """The model for these inputs, built on first use."""
        link = KvLink(bytes_per_s=config.kv_link_gbps * 1e9 / 8.0)
        key = (_lengths_key(lengths), profile, config.slo.tpot_p99_s, link)
        model = self._models.get(key)
        if model is None:
            model = CapacityModel.build(
                lengths, profile, tpot_slo_s=config.slo.tpot_p99_s, link=link
            )
            self._models[key] = model
            if len(self._models) > self.size:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(key)
        return model
