"""Initial weights from a seed, one unit at a time, the same in every layout.

    state = SeededState(model_cfg, hf_fields, seed)     # nothing built yet: key -> shape from a meta build
    load_full_state(modules, state, groups)             # builds only the units this rank's shards read

A *unit* is a piece of the model whose tensors are drawn together: the LLM's embedding; its head (final
norm + output layer); each layer (for an MoE layer: its norm, router and shared experts); each routed expert
of each MoE layer; each media module (encoder + projector). Unit u is built alone, at full size (TP1, on the
CPU), right after `torch.manual_seed(hash(seed, u))`, with the constructors the model itself uses (so
megatron's / NeMo's init rules, not ours), and exported to HF keys by the same converters as the whole model.
A tensor's initial value therefore depends on (seed, its unit) only: every layout and every rank sees the
same values (what loss parity between layouts needs), and a rank loading its shard builds only the units
its shard touches, one at a time, dropping each before the next: host memory = its shard + the largest unit
(for a 30B-A3B LLM: one 352M-row embedding, or one layer without its routed experts), not the whole model.
Routed experts are units of their own so that an EP rank draws only its experts.

Encoders are one unit each (<= 0.7B parameters for the released towers): their layers are NeMo's / RADIO's
constructors, which have no per-layer entry point here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import replace

import torch
from megatron.core.transformer.spec_utils import build_module

from tessera.hetero.build.model_build import hf_shapes, media_keys, media_module, single_rank_pgs
from tessera.hetero.runspec.modules import module_specs
from tessera.models.hybrid_llm import MOE, build_hybrid_layer_specs, final_norm_and_output_layer, vocab_embedding
from tessera.models.multimodal_hf import media_to_hf
from tessera.models.nemotron_h_hf import (HF, embedding_to_hf, expert_to_hf, head_to_hf, hybrid_config_from_hf,
                                          layer_to_hf)

LLM = "language_model."
LAYERS = HF.split("{")[0]  # backbone.layers.


def unit_seed(seed: int, unit: tuple) -> int:
    """A 63-bit seed for `unit` (a tuple of str/int) under the run's seed: stable across processes/versions."""
    digest = hashlib.sha256(repr((int(seed),) + tuple(unit)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def llm_unit(key: str) -> tuple:
    """The unit of an LLM key (without the language_model. prefix)."""
    if key == "backbone.embeddings.weight":
        return ("embedding",)
    if key in ("backbone.norm_f.weight", "lm_head.weight"):
        return ("head",)
    layer, _, rest = key[len(LAYERS):].partition(".")
    if rest.startswith("mixer.experts."):
        return ("expert", int(layer), int(rest.split(".")[2]))
    return ("layer", int(layer))


def full_hf_state(model_cfg, hf_fields: dict, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial weights (HF layout) from `seed`, identical on every rank: every unit built
    once (one-device references, scripts/convert_hf.py). Training reads SeededState lazily instead."""
    return SeededState(model_cfg, hf_fields, seed).materialize()


class SeededState(Mapping):
    """The whole model's initial HF-layout state dict from `seed`, read tensor by tensor (like LazyCheckpoint):
    a tensor's unit is built on first access and kept until a tensor of another unit is read.
    `built` lists the units built, in order (each rank's loading builds each of its units once)."""

    def __init__(self, model_cfg, hf_fields: dict, seed: int, pgs=None, specs: dict | None = None):
        self.model_cfg, self.seed = model_cfg, seed
        self.specs = specs or module_specs(model_cfg)  # the run's (build_run), resolved once
        self.pgs = pgs or single_rank_pgs()
        self.config = hybrid_config_from_hf(hf_fields)  # TP1/PP1/EP1: units are built whole
        self._shapes = hf_shapes(model_cfg, hf_fields, self.specs)
        owner = {k: ("media", key) for key, keys in media_keys(model_cfg, hf_fields, self.specs).items() for k in keys}
        self._unit = {k: owner.get(k) or llm_unit(k[len(LLM):]) for k in self._shapes}
        self._cached: tuple[tuple | None, dict] = (None, {})
        self.built: list[tuple] = []
        self.peak_unit_elements = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        unit = self._unit[key]
        if self._cached[0] != unit:
            self._cached = (None, {})  # the previous unit goes first: one unit in memory at a time
            self._cached = (unit, self.build(unit))
            self.built.append(unit)
            self.peak_unit_elements = max(self.peak_unit_elements, sum(t.numel() for t in self._cached[1].values()))
        return self._cached[1][key]

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, key) -> bool:
        return key in self._shapes

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def unit_of(self, key: str) -> tuple:
        return self._unit[key]

    def unit_elements(self) -> dict[tuple, int]:
        """Elements per unit (from the shapes: nothing is built)."""
        out: dict[tuple, int] = {}
        for k, shape in self._shapes.items():
            out[self._unit[k]] = out.get(self._unit[k], 0) + math.prod(shape)
        return out

    def materialize(self) -> dict[str, torch.Tensor]:
        """Every tensor (each unit built once), in the model's key order."""
        by_unit: dict[tuple, list[str]] = {}
        for k in self._shapes:
            by_unit.setdefault(self._unit[k], []).append(k)
        values = {k: self[k] for keys in by_unit.values() for k in keys}
        return {k: values[k] for k in self._shapes}

    def build(self, unit: tuple) -> dict[str, torch.Tensor]:
        """The HF tensors of `unit`, built alone from its seed (the caller's RNG state is left as it was)."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(unit_seed(self.seed, unit))
            kind = unit[0]
            if kind == "media":
                key = unit[1]
                spec = self.specs[key]
                return media_to_hf(key, media_module(spec, self.model_cfg, self.config.hidden_size, self.pgs))
            config, tp = self.config, self.pgs.tp
            if kind == "embedding":
                out = embedding_to_hf([vocab_embedding(config, tp).weight], config)
            elif kind == "head":
                norm, output = final_norm_and_output_layer(config, tp)
                out = head_to_hf(norm.weight, [output.weight], config)
            elif kind == "layer":
                out = self._layer(unit[1])
            else:
                out = self._expert(unit[1], unit[2])
            return {LLM + k: v.detach().clone().contiguous() for k, v in out.items()}

    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        symbol = self.config.hybrid_pattern[i]
        # one layer; replace() keeps the config's init methods, whose output-layer scale depends on the depth
        donor = replace(self.config, hybrid_pattern=symbol)
        if symbol == MOE:  # routed experts are units of their own: here they are built 1 wide and dropped
            donor = replace(donor, moe_ffn_hidden_size=1)
        layer = build_module(build_hybrid_layer_specs(donor)[symbol], config=donor, layer_number=1,
                             pg_collection=self.pgs)
        sd = layer.state_dict()
        hf = layer_to_hf(symbol, lambda tp_rank, ep_rank: sd, "", HF.format(i), donor)
        return {k: v for k, v in hf.items() if ".mixer.experts." not in k}

    def _expert(self, i: int, e: int) -> dict[str, torch.Tensor]:
        # megatron's expert module (SequentialMLP on CPU) with one local expert, as MoELayer builds it
        spec = build_hybrid_layer_specs(self.config)[MOE].submodules.mlp.submodules.experts
        experts = build_module(spec, 1, self.config, pg_collection=self.pgs)
        sd = experts.state_dict()
        return expert_to_hf(f"{HF.format(i)}mixer.experts.{e}.", sd["local_experts.0.linear_fc1.weight"],
                            sd["local_experts.0.linear_fc2.weight"])

