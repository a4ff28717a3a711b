"""A rank reads only its shards of a released checkpoint, and keeps nothing else (issue 14: no rank holds more
than its own shards).

The oracle for the values is the eager import of the whole checkpoint (safetensors' load_file, the path the
parity tests tie to transformers); the oracle for what a rank needs is the HF key names themselves: its PP
stage's `backbone.layers.<i>` by megatron's split (num_layers // pp per stage, the remainder on the last), its
EP rank's `experts.<j>`, the embedding on the first stage, `norm_f` and `lm_head` on the last.
"""

from __future__ import annotations

import itertools
import re

import pytest

from tessera.models.nemotron_h_hf import LazyCheckpoint, hybrid_config_from_hf, hf_to_megatron, load_hf_state_dict


def _needed(keys, layers: int, pp: int, pp_rank: int, experts: int, ep: int, ep_rank: int) -> set[str]:
    per = layers // pp
    first = pp_rank * per
    last = layers if pp_rank == pp - 1 else first + per
    local = experts // ep
    out = set()
    for k in keys:
        m = re.match(r"backbone\.layers\.(\d+)\.(?:mixer\.experts\.(\d+)\.)?", k)
        if m:
            if first <= int(m[1]) < last and (m[2] is None or ep_rank * local <= int(m[2]) < (ep_rank + 1) * local):
                out.add(k)
        elif k == "backbone.embeddings.weight":
            if pp_rank == 0:
                out.add(k)
        elif pp_rank == pp - 1:  # backbone.norm_f.weight, lm_head.weight
            out.add(k)
    return out


@pytest.mark.parametrize("tp,pp,ep", [(2, 2, 2), (1, 2, 4), (2, 1, 1)])
def test_rank_reads_only_its_tensors_and_keeps_only_its_shard(ckpts, tp, pp, ep):
    full = load_hf_state_dict(ckpts["moe"])
    config = hybrid_config_from_hf(ckpts["moe"], tp=tp, pp=pp, ep=ep)
    layers, experts = len(config.hybrid_pattern), config.num_moe_experts
    for tp_rank, pp_rank, ep_rank in itertools.product(range(tp), range(pp), range(ep)):
        lazy = LazyCheckpoint(ckpts["moe"])
        shard = hf_to_megatron(lazy, config, tp_rank, pp_rank, ep_rank)
        eager = hf_to_megatron(full, config, tp_rank, pp_rank, ep_rank)
        assert shard.keys() == eager.keys()
        assert all(shard[k].equal(eager[k]) for k in shard)
        assert lazy.read == _needed(full, layers, pp, pp_rank, experts, ep, ep_rank), (tp_rank, pp_rank, ep_rank)
        # the rank retains its shard only: no tensor of it is a view keeping a whole checkpoint tensor alive
        for k, t in shard.items():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{k} holds a larger tensor"


def test_lazy_checkpoint_shapes_come_from_the_headers(ckpts):
    lazy = LazyCheckpoint(ckpts["moe"])
    full = load_hf_state_dict(ckpts["moe"])
    assert {k: lazy.shape(k) for k in lazy} == {k: tuple(v.shape) for k, v in full.items()}
    assert not lazy.read, "a shape was read by loading the tensor"
