"""Encoders under context parallelism (hetero/plan/encoder_cp.py): the vision tower split by tokens
(models/vision_cp.py, hetero/parallel/cp_tile_attention.py), the audio encoder by items (hetero/training/stages.py).
The plans give every CP rank exactly the tokens the boundary plan expects of it, the sharded tower's output and
gradients are the one-device tower's, and training in CP layouts equals the homogeneous run (gloo ranks, fp32)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tessera.hetero.plan.boundary_plan import BoundaryBatch, plan_boundary
from tessera.hetero.plan.encoder_cp import block_patches, item_cp_index, item_owners, plan_vision_cp
from tessera.hetero.plan.layout import HeteroLayout
from tessera.hetero.tools.spawn import run_on_ranks
from tessera.models.vision import pixel_shuffle

GRIDS = [[(4, 4), (4, 4), (4, 6)], [], [(2, 2)], [(6, 4), (2, 8), (4, 4), (4, 4)]]


# ---- the plan (pure, milliseconds) ----

@pytest.mark.parametrize("cp,prefix", list(itertools.product([1, 2, 3, 4, 7], [0, 2])))
def test_plan_splits_each_row_as_the_boundary_plan_cuts_it(cp, prefix):
    """Every patch of every tile is computed by exactly one rank, every tile's prefix by exactly one rank (the
    holder of its first token), rank r hands on the boundary plan's source rows of CP rank r, and a tile's key rows
    are exactly its tokens in the gathered sequence."""
    plan = plan_vision_cp(GRIDS, shuffle=2, prefix_tokens=prefix, cp=cp)
    tiles = [g for row in GRIDS for g in row]
    seen = {t: [] for t in range(len(tiles))}
    owners = {t: [] for t in range(len(tiles))}
    for rank, parts in enumerate(plan.parts):
        for p in parts:
            assert p.grid == tiles[p.tile] and len(p.patches) % 4 == 0
            seen[p.tile].extend(p.patches.tolist())
            if p.prefix:
                owners[p.tile].append(rank)
    for t, (r, c) in enumerate(tiles):
        assert sorted(seen[t]) == list(range(r * c)), t
        assert len(owners[t]) == 1, t
    # the boundary plan's source rows per encoder CP rank (one DP rank, all rows)
    counts = [sum((r // 2) * (c // 2) for r, c in row) for row in GRIDS]
    positions = [np.arange(n) for n in counts]
    layout = HeteroLayout.parse(f"vision=cp{cp}@0-{cp - 1};language=dp1@{cp}-{cp}")
    boundary = plan_boundary(layout["vision"], layout["language"], BoundaryBatch.from_lists(max(counts) + 2, positions))
    for rank in range(cp):
        assert plan.tokens(rank) == boundary.forward.in_rows.get(rank, 0), rank
    # gathered sequence = every rank's local rows, rank after rank; a tile's key rows hold exactly its tokens
    tile_of_row = np.concatenate([np.repeat(p.tile, p.length(prefix)) for parts in plan.parts for p in parts]
                                 + [np.zeros(0, int)])
    assert len(tile_of_row) == sum(plan.lengths())
    for rank in range(cp):
        for p, keys in zip(plan.parts[rank], plan.key_index(rank)):
            r, c = p.grid
            assert len(keys) == r * c + prefix and (tile_of_row[keys] == p.tile).all()


def test_block_patches_follow_pixel_shuffle():
    """A shuffled token's patches, in order, are the channel blocks pixel_shuffle concatenates."""
    rows, cols, f = 4, 6, 2
    grid = torch.arange(rows * cols, dtype=torch.float32).reshape(1, rows, cols, 1)
    shuffled = pixel_shuffle(grid, f).reshape(-1, f * f)
    assert block_patches(np.arange(rows * cols // 4), cols, f).reshape(-1, 4).tolist() == shuffled.long().tolist()


def test_plan_refuses_a_grid_the_shuffle_does_not_divide():
    with pytest.raises(ValueError, match="3x4 is not divisible by the pixel-shuffle factor 2"):
        plan_vision_cp([[(3, 4)]], shuffle=2, prefix_tokens=0, cp=2)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_item_parallel_cp_keeps_each_ranks_boundary_part(cp):
    """Item-parallel CP (audio): items dealt to ranks balancing tokens; after the gather each rank's index picks,
    row by row, exactly the boundary plan's contiguous part of the row's tokens, in order."""
    tokens = [[7, 3, 12], [], [5], [1, 1, 9, 4]]
    owners = item_owners(tokens, cp)
    loads = [sum(n for row, own in zip(tokens, owners) for n, q in zip(row, own) if q == r) for r in range(cp)]
    assert max(loads) - min(loads) <= max(max(row, default=0) for row in tokens)
    # gathered sequence: rank after rank, each rank's items in (row, item) order, labelled (row, token in row)
    labels = []
    for q in range(cp):
        for r, (row, own) in enumerate(zip(tokens, owners)):
            for j, (n, o) in enumerate(zip(row, own)):
                if o == q:
                    labels += [(r, sum(row[:j]) + t) for t in range(n)]
    labels = np.array(labels)
    for rank in range(cp):
        want = [(r, t) for r, row in enumerate(tokens) if sum(row)
                for t in np.array_split(np.arange(sum(row)), cp)[rank]]
        assert labels[item_cp_index(tokens, owners, cp, rank)].tolist() == [list(w) for w in want]


# ---- the tower on gloo ranks vs one device ----

TUBELETS = {"radio_vit_tiny": True, "siglip_tiny": False}  # RADIO's video in tubelets of 2 frames (the release's)


def _rows(tile: int):
    g = torch.Generator().manual_seed(3)

    def px(n, h, w):
        return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8).numpy()

    return [[("image", px(2, tile, tile)), ("image", px(1, tile, 3 * tile // 2))],
            [],
            [("video", (px(3, tile, tile), None))],
            [("image", px(1, tile // 2, tile // 2)), ("image", px(3, tile, tile))]]


def _single(name: str, rows: list, seed: int = 0):
    """One-device module: each row's items encoded one by one (MediaModule.forward), the output's sum of
    squares backpropagated; its HF-layout state, per-row outputs and HF-layout gradients."""
    from tessera.models.multimodal import build_media_module
    from tessera.models.multimodal_hf import media_to_hf
    from tests._mcore_cpu import single_rank_world

    torch.manual_seed(seed)
    module = build_media_module(name, 24, single_rank_world(), tubelets=TUBELETS[name])
    outs = [module(row) for row in rows]
    sum(o.square().sum() for o in outs).backward()
    hf = {k: v.detach().clone() for k, v in media_to_hf("vision", module).items()}
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return module, hf, [o.detach() for o in outs], grads


def _cp_forward_backward(name: str, hf: dict, rows: list, configs: list[tuple[int, int]]):
    """Per (tp, cp): this rank's forward_cp output per row and its (TP-shard) parameter gradients."""
    from tessera.hetero.parallel.cp_tile_attention import TileCPCoreAttention
    from tessera.models.multimodal import build_media_module
    from tessera.models.multimodal_hf import PROJECTOR_ROOT, _load_params, vision_from_hf

    from tests._mcore_cpu import module_pgs

    out = {}
    for tp, cp in configs:
        pg = module_pgs(f"tp{tp},cp{cp}", "vision")
        module = build_media_module(name, 24, pg, core_attention=TileCPCoreAttention, tubelets=TUBELETS[name])
        root = PROJECTOR_ROOT["vision"]
        module.projector.load_state_dict({k[len(root):]: v for k, v in hf.items() if k.startswith(root)})
        _load_params(module.encoder.vit, vision_from_hf(hf, module.cfg, pg.tp.rank(), tp))
        per_row = [module.forward_cp([row]) for row in rows]  # one row at a time: each row's part
        together = module.forward_cp(rows)                      # all rows: parts concatenated in row order
        sum(o.square().sum() for o in per_row).backward()
        grads = {k: p.grad.numpy().copy() for k, p in module.named_parameters() if p.grad is not None}
        out[(tp, cp)] = dict(rank=pg.cp.rank(), tp_rank=pg.tp.rank(), rows=[o.detach().numpy() for o in per_row],
                             together=together.detach().numpy(), grads=grads)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["radio_vit_tiny", "siglip_tiny"])
def test_cp_tower_equals_one_device(name):
    """cp2 x tp2 and cp4 on four gloo ranks: every CP rank's output is its contiguous part of each row's tokens of
    the one-device tower (parts concatenated = the whole row; an image smaller than cp tokens leaves ranks without
    any; RADIO's video in tubelets, SigLIP's frame by frame), and gradients summed over the CP ranks equal the
    one-device ones (prefix tokens, position table, layer scales, projector, video embedder included)."""
    from tessera.models.encoders import encoder_config

    tile = encoder_config(name).tile
    rows = _rows(tile)
    module, hf, ref, ref_grads = _single(name, rows)
    configs = [(2, 2), (1, 4)]
    ranks = run_on_ranks(4, _cp_forward_backward, name, hf, rows, configs)
    for tp, cp in configs:
        results = [r[(tp, cp)] for r in ranks]
        for i, want in enumerate(ref):
            parts = [np.asarray(next(r["rows"][i] for r in results if r["rank"] == c)) for c in range(cp)]
            assert [len(p) for p in parts] == [len(a) for a in np.array_split(np.zeros(len(want)), cp)]
            got = torch.from_numpy(np.concatenate(parts))
            err = float((got - want).norm() / want.norm()) if len(want) else 0.0
            print(f"{name} tp{tp} cp{cp} row {i}: {len(want)} tokens, rel err {err:.2e}")
            assert err < 1e-5
        for r in results:  # all rows at once = the rows' parts in order
            assert np.allclose(r["together"], np.concatenate(r["rows"]), atol=1e-6)
        # replicated (non-TP-sharded) parameters: the CP sum over one TP rank's CP ranks is the whole gradient
        checked = []
        for key, want in ref_grads.items():
            # (a rank that owns no tile's prefix gives the prefix parameter no gradient)
            shards = [r["grads"][key] for r in results if r["tp_rank"] == 0 and key in r["grads"]]
            if shards[0].shape != tuple(want.shape):
                continue  # a TP shard (checked through the output)
            got = torch.from_numpy(sum(shards))
            err = float((got - want).norm() / want.norm())
            assert err < 1e-5, (tp, cp, key, err)
            checked.append(key)
        must = {"encoder.vit.pos_embed", "encoder.vit.embedder.weight", "projector.1.weight",
                "encoder.vit.layers.1.input_layernorm.weight"} | (
            {"encoder.vit.prefix", "encoder.vit.video_embedder.weight"} if "radio" in name else set())
        assert must <= set(checked) or tp > 1 and {"encoder.vit.pos_embed", "projector.1.weight"} <= set(checked), \
            sorted(checked)


# ---- training: loss and grad norm equal the homogeneous run's at every step ----

OMNI = {"audio": "fastconformer_tiny"}  # the tiny VL model + an audio encoder
# run name -> (layout, model fields, the run it must equal)
RUNS = {"reference": ("vision=dp4@0-3;language=dp4@0-3", {}, None),
        "colocated_cp2": ("vision=cp2,dp2@0-3;language=dp4@0-3", {}, "reference"),
        "vision_and_llm_cp2": ("vision=cp2,dp2@0-3;language=cp2,dp2@0-3", {}, "reference"),
        "vision_cp2_tp2": ("vision=tp2,cp2@0-3;language=dp4@0-3", {}, "reference"),
        "non_colocated_cp2": ("vision=cp2@0-1;language=tp2@2-3", {}, "reference"),
        "omni_reference": ("vision=dp4@0-3;audio=dp4@0-3;language=dp4@0-3", OMNI, None),
        "omni_all_cp2": ("vision=cp2,dp2@0-3;audio=cp2,dp2@0-3;language=cp2,dp2@0-3", OMNI, "omni_reference"),
        "omni_audio_cp2_own_ranks": ("vision=dp2@0-1;audio=cp2@2-3;language=tp2@0-1", OMNI, "omni_reference")}
CP_RUNS = {name: layout for name, (layout, _, ref) in RUNS.items() if ref}
STEPS = 6


def _all_runs(root: str) -> dict[str, str]:
    from pathlib import Path

    from tests.test_encoder_pp import _train

    return {name: _train(str(Path(root) / name), layout, fields, STEPS)["layout"]
            for name, (layout, fields, _) in RUNS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder_cp")
    return root, run_on_ranks(4, _all_runs, str(root), timeout=900)[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(CP_RUNS))
def test_encoder_cp_trains_as_the_homogeneous_run(runs, name):
    """The tiny VL model with its vision tower on cp2 (colocated, with a cp2 LLM, with TP, on ranks of its own), and
    with an audio encoder: vision, audio and LLM all cp2, audio cp2 on ranks of its own: loss and global grad norm
    within 1e-5 relative of the same model's homogeneous run at every step (with audio: the grad norm within
    AUDIO_NORM_DRIFT after step 1, tests/_run_curves.py)."""
    from tessera.hetero.plan.layout import HeteroLayout
    from tessera.hetero.training.metrics import read_metrics
    from tests._run_curves import AUDIO_NORM_DRIFT, check_first_step, curves, rel

    root, layouts = runs
    assert max(m.cp for k, m in HeteroLayout.parse(layouts[name]).modules.items() if k != "language") == 2
    loss_ref, norm_ref = curves(root / RUNS[name][2])
    loss, norm = curves(root / name)
    assert len(loss) == len(loss_ref) == STEPS and loss[-1] < loss[0]
    print(f"{name}: max rel loss diff {rel(loss, loss_ref):.2e}, grad norm {rel(norm, norm_ref):.2e}")
    check_first_step(name, loss, loss_ref, norm, norm_ref)
    drift = AUDIO_NORM_DRIFT if "audio" in RUNS[name][1] else 1e-5  # (tests/_run_curves.py: why)
    assert rel(loss, loss_ref) <= 1e-5 and rel(norm, norm_ref) <= drift
    assert all(r["boundary_bytes"] > 0 for r in read_metrics(root / name))


def test_what_encoder_cp_refuses():
    """Vision cp x pp at once, and EVS-pruned video under vision CP are refused, each named with its fix; audio CP
    (item-parallel) trains."""
    import re

    from tessera.hetero.plan.layout import HeteroLayout, LayoutError
    from tessera.hetero.plan.trainable import check_trainable, untrainable_reasons
    from tessera.models.multimodal import build_media_module

    has_tp = {"vision": True, "audio": False}
    for good in (*CP_RUNS.values(), "vision=cp4@0-3;language=tp2,cp2@4-7"):
        assert untrainable_reasons(HeteroLayout.parse(good), has_tp) == [], good
    with pytest.raises(LayoutError, match=re.escape("splits over cp or pp, not both; use cp2 or pp2")):
        check_trainable(HeteroLayout.parse("vision=cp2,pp2@0-3;language=dp4@0-3"), has_tp)
    # a run whose video is EVS-pruned takes each clip whole on one vision rank
    cp2, pp2 = (HeteroLayout.parse(f"vision={f}@0-1;language=tp2@2-3") for f in ("cp2", "pp2"))
    with pytest.raises(LayoutError, match=re.escape("video pruning (EVS) takes a whole clip on one rank; use cp1 "
                                                    "for vision, or model.video_pruning=0")):
        check_trainable(cp2, has_tp, video_pruned=True)
    assert untrainable_reasons(pp2, has_tp, video_pruned=True) == []
    # the video recipe prunes: the trainer's resolution refuses vision CP for it before launch
    import fiddle as fdl

    from tessera.recipes import registry
    from tessera.recipes.checks import resolve

    run = fdl.build(registry.recipe("nemotron_video_tiny"))
    run.layout = "vision=cp2@0-1;language=tp2@2-3"
    with pytest.raises(LayoutError, match=re.escape("model.video_pruning=0")):
        resolve(run, 4)

    class _Group:  # a CP group of two as the module sees it (size and rank only)
        def size(self):
            return 2

        def rank(self):
            return 0

    from tests._mcore_cpu import single_rank_world

    pgs = single_rank_world()
    cp2 = type("PGs", (), {"tp": pgs.tp, "pp": pgs.pp, "cp": _Group()})()
    with pytest.raises(ValueError, match=re.escape("video pruning (EVS) needs the vision encoder without context "
                                                   "parallelism; use cp1 for vision, or model.video_pruning=0")):
        build_media_module("radio_vit_tiny", 24, cp2, pruning_rate=0.5)
