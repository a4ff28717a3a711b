"""The multimodal model: {module key: encoder + projector} in front of the hybrid LLM.

Inputs are one microbatch as data/packing.PackedBatch carries it: token ids [N, S] and, per row, a dict
module -> media items in position order and module -> sorted placeholder positions. Each module encodes
its items in order, projects them to the LLM width, and the embeddings replace the text embeddings at
exactly those positions. The data side sized every placeholder from the same encoder config, so a count
mismatch means the two disagree: it raises naming the sample instead of shifting every later embedding.

    llm = HybridLM(hybrid_config_from_hf(configs.TINY_DENSE), pg)
    model = MultimodalModel(llm, {"vision": build_media_module("radio_vit_tiny", 64, pg),
                                  "audio": build_media_module("fastconformer_tiny", 64, pg, frozen=True)})
    loss = model(batch.tokens, batch.media, batch.positions, labels=batch.labels, keys=batch.keys)

Frozen modules: encoder parameters have requires_grad=False (no grads, and `trainable_parameters()`
leaves them out of the optimizer), run under no_grad and stay in eval mode (BatchNorm statistics fixed).
The projector of a frozen encoder still trains, as in VLM pre-training stage 1.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tessera.models.audio import SoundProjector
from tessera.models.encoder_families.base import EncoderIdentity
from tessera.models.encoders import encoder_config, family_of
from tessera.models.tiling import TileSource
from tessera.models.video import VideoEncoder, evs_prune, evs_tubelet_counts
from tessera.hetero.plan.encoder_cp import encoder_path, plan_vision_cp
from tessera.models.vision import Projector, pixel_shuffle
from tessera.models.vision_cp import encode_parts


def _pixels(item, device: torch.device) -> torch.Tensor:
    """uint8 tiles/frames [T, 3, tile, tile] on `device`; a TileSource is resized there (models/tiling.py)."""
    if isinstance(item, TileSource):
        return item.tiles(device)
    if isinstance(item, torch.Tensor):  # (the dry run's meta tiles)
        return item.to(device)
    return torch.as_tensor(np.asarray(item), device=device)


class MediaModule(nn.Module):
    """One module key's encoder (+ video path for vision) and projector; items in, [n, llm_hidden] out."""

    def __init__(self, cfg: EncoderIdentity, encoder: nn.Module, projector: nn.Module, video: VideoEncoder | None = None,
                 frozen: bool = False):
        super().__init__()
        self.cfg, self.encoder, self.projector, self.video = cfg, encoder, projector, video
        self.frozen = frozen
        self.tubelet_kept: list[list[int]] = []  # per pruned video of the last project() call (project)
        if frozen:
            self.encoder.requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.encoder.eval()
        # frozen means no tensor changes (NeMo's freeze() puts the module in eval): a norm layer with running
        # statistics whose own weights are frozen (a LoRA run's base conformer) keeps its statistics too
        for m in self.modules():
            own = list(m.parameters(recurse=False))
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and own and not any(p.requires_grad for p in own):
                m.eval()
        return self

    def num_tokens(self, kind: str, item) -> int:
        """Embeddings this module produces for one item (what data/tokens.EncoderTokens must announce).
        An image item is uint8 [n, 3, H, W]: n tiles, or one native-resolution image (omni); either way every
        one of its n images is an (H/patch) x (W/patch) patch grid, counted by EncoderTokens.grid_tokens."""
        from tessera.models.encoders import tokens_config

        if kind == "image":
            n, _, h, w = item.shape  # an array, a tensor or a TileSource
            return n * tokens_config(self.cfg).grid_tokens(h // self.cfg.patch, w // self.cfg.patch)
        if kind == "video":
            return self.video.num_tokens(*item[0].shape[:1], *item[0].shape[2:])  # frames, height, width
        if kind == "audio":
            return tokens_config(self.cfg).audio_tokens(len(item))
        raise ValueError(f"module {self.cfg.modality!r} cannot encode media of kind {kind!r}")

    @property
    def device(self) -> torch.device:
        """Where this module lives (its parameters): decoded items are moved here."""
        return next(self.parameters()).device

    @property
    def path(self) -> str:
        """How this module runs (hetero/plan/encoder_cp.encoder_path), from its tower's own cp and pp; an
        item-parallel CP encoder (item_cp) is an `items` module to itself: its stage deals the items."""
        tower = self.encoder.vit if self.cfg.modality == "vision" else self.encoder
        return encoder_path(self.cfg.modality, getattr(tower, "cp", 1), tower.pp)

    @property
    def pipelined(self) -> bool:
        """A pipeline stage (the encoder split over pp > 1 stages): run through forward_stage."""
        return self.path == "pipeline"

    def stage_tokens(self, items: list) -> list[tuple[int, int]]:
        """(tiles, tokens per tile) of each item between pipeline stages: vision, prefix + patches per tile; audio,
        one clip of the conformer's output rows (EncoderTokens.audio_encoder_rows)."""
        out = []
        if self.cfg.modality == "audio":
            for kind, wave in items:
                if kind != "audio":
                    raise ValueError(f"audio module got a {kind!r} item")
                out.append((1, self.encoder.tokens.audio_encoder_rows(len(wave))))
            return out
        p, prefix = self.cfg.patch, self.cfg.prefix_tokens
        for kind, item in items:
            if kind not in ("image", "video"):
                raise ValueError(f"vision module got a {kind!r} item")
            n, _, h, w = (item if kind == "image" else item[0]).shape  # tiles, or video frames (each one tile)
            if kind == "video":
                n = -(-n // self.video.temporal)  # (tubelets of `temporal` frames)
            out.append((n, prefix + (h // p) * (w // p)))
        return out

    def stage_shape(self, items: list) -> tuple[int, int]:
        """Shape of the activation between vision pipeline stages for `items`: [sum of tiles x tokens, hidden]
        ([0, hidden] when there are none: the stages still exchange the empty message the schedule holds)."""
        return sum(n * s for n, s in self.stage_tokens(items)), self.cfg.hidden

    def forward_stage(self, items: list, x: torch.Tensor | None = None) -> torch.Tensor:
        """One vision pipeline stage over `items`, each encoded on its own (as forward does, item by item).

        Between stages the activation is every item's hidden states concatenated, [sum over items of tiles x
        (prefix + patches), hidden] in (item, tile, token) order (stage_tokens sizes it); stage 0 reads the
        items' pixels (x is None), a later stage splits x back per item. The last stage returns the
        projected [tokens, llm_hidden] of the items, concatenated; another stage its layers' output. Video
        frames (or tubelets, VideoEncoder.tiles) go through as tiles, the last stage projects and prunes them as
        MediaModule.project does. Audio: each clip's conformer rows (_forward_audio_stage)."""
        modality = self.cfg.modality
        stage = self.encoder.vit if modality == "vision" else self.encoder
        self.tubelet_kept = []  # (set again by project on the last stage)
        if stage.first_stage != (x is None):
            raise ValueError(f"{modality} stage {stage.stage} of {stage.pp}: stage 0 reads the "
                             f"{'pixels' if modality == 'vision' else 'waveforms'} (x=None), a later stage takes the "
                             f"previous stage's output")
        if x is not None and tuple(x.shape) != self.stage_shape(items):
            raise ValueError(f"{modality} stage {stage.stage} got hidden states {tuple(x.shape)} for items of "
                             f"{self.stage_shape(items)}")
        if modality == "audio":
            return self._forward_audio_stage(items, x)
        vit, sizes = stage, self.stage_tokens(items)
        outs, offset, dev = [], 0, self.device
        for (kind, item), (n, s) in zip(items, sizes):
            pixels = item if kind == "image" else item[0]  # video frames (or tubelets) go through as tiles
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
                if x is None:
                    tiles = self.encoder.normalize(_pixels(pixels, dev))
                    h = vit.embed(self.video.tiles(tiles) if kind == "video" else tiles)  # [n, s, hidden]
                else:
                    h = x[offset:offset + n * s].reshape(n, s, -1)
                    offset += n * s
                hidden = vit.run_stage_layers(h.transpose(0, 1).contiguous())  # [s, n, hidden]
                if not vit.last_stage:
                    outs.append(hidden.transpose(0, 1).reshape(n * s, -1))
                    continue
                rows, cols = pixels.shape[-2] // self.cfg.patch, pixels.shape[-1] // self.cfg.patch
                grid = pixel_shuffle(vit.head(hidden, rows, cols), self.cfg.pixel_shuffle)
            outs.append(grid if kind == "video" else grid.flatten(0, 2))
        if vit.last_stage and outs:
            outs = [self.project([kind for kind, _ in items], outs)]
        return self._stage_output(outs, items, x, vit.last_stage)

    def _stage_output(self, outs: list, items: list, x: torch.Tensor | None, last_stage: bool) -> torch.Tensor:
        """What a pipeline stage hands on: its items' outputs concatenated; with no items, the empty embeddings
        (last stage), the received empty activation, or a new empty one (first stage)."""
        if outs:
            out = torch.cat(outs)
        elif last_stage:
            out = next(self.projector.parameters()).new_zeros(0, self.llm_hidden)
        elif x is not None:
            out = x  # no items: the empty activation goes on
        else:
            out = next(self.parameters()).new_zeros(self.stage_shape(items))
        if x is not None and x.requires_grad and (self.frozen or not items):
            # keep the received activation in the graph, so its (zero) gradient goes back to the previous stage
            out = out + 0 * x.sum()
        return out

    def _forward_audio_stage(self, items: list, x: torch.Tensor | None) -> torch.Tensor:
        """An audio pipeline stage over `items`, each clip on its own; between stages the clips' conformer outputs
        concatenated, [sum of rows, hidden]; the last stage returns the clips' projected embeddings."""
        enc = self.encoder
        outs, offset = [], 0
        for (_, wave), (_, rows) in zip(items, self.stage_tokens(items)):
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
                if x is None:
                    feats, feat_len = enc.features([torch.as_tensor(np.asarray(wave), device=self.device)])
                    hidden, out_len = enc.encode_features(feats, feat_len)
                else:
                    feat_len = torch.tensor([enc.tokens.audio_mel_frames(len(wave))], device=x.device)
                    hidden, out_len = enc.encode_received(x[None, offset:offset + rows], feat_len)
                    offset += rows
                outs.append(self.projector(enc.keep(hidden, out_len, feat_len)[0]) if enc.last_stage else hidden[0])
        return self._stage_output(outs, items, x, enc.last_stage)

    def forward_cp(self, rows: list[list]) -> torch.Tensor:
        """This context-parallel rank's part of the vision tokens of `rows` (each row's items in order), projected:
        [tokens, llm_hidden], for each row its contiguous part of the row's tokens (hetero/plan/encoder_cp.py),
        rows in order — what the boundary plan expects of this encoder CP rank. Every CP rank of the rows calls
        it (the tower's attention gathers over them). Video frames (or tubelets) go through as tiles (EVS pruning is
        refused at build under cp > 1)."""
        vit, p = self.encoder.vit, self.cfg.patch
        grids, tiles = [], []
        for items in rows:
            row = []
            for kind, item in items:
                if kind not in ("image", "video"):
                    raise ValueError(f"vision module got a {kind!r} item")
                pixels = self.encoder.normalize(_pixels(item if kind == "image" else item[0], self.device))
                pixels = self.video.tiles(pixels) if kind == "video" else pixels  # (tubelets: t frames each)
                row += [(pixels.shape[-2] // p, pixels.shape[-1] // p)] * len(pixels)
                tiles.extend(pixels)
            grids.append(row)
        if not tiles:  # no item in any row: every CP rank of the rows sees the same, so none runs the layers
            return next(self.projector.parameters()).new_zeros(0, self.llm_hidden)
        plan = plan_vision_cp(grids, self.cfg.pixel_shuffle, self.cfg.prefix_tokens, vit.cp)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            feats = encode_parts(vit, tiles, plan)
        return self.projector(feats)

    def _features(self, items: list) -> list[torch.Tensor]:
        # decoded items arrive as host arrays: each goes to the module's device once, in its stored dtype
        # (uint8 tiles/frames: 4x less to copy than after normalisation)
        dev = self.device
        if self.cfg.modality == "audio":
            for kind, _ in items:
                if kind != "audio":
                    raise ValueError(f"audio module got a {kind!r} item")
            return self.encoder([torch.as_tensor(np.asarray(w), device=dev) for _, w in items])
        out = []
        for kind, item in items:
            if kind == "image":
                out.append(self.encoder(_pixels(item, dev)))
            elif kind == "video":
                out.append(self.video(_pixels(item[0], dev)))
            else:
                raise ValueError(f"vision module got a {kind!r} item")
        return out

    def forward(self, items: list) -> torch.Tensor:
        entry = {"pipeline": "forward_stage", "token_cp": "forward_cp"}.get(self.path)
        if entry is not None:
            raise RuntimeError(f"this {self.cfg.modality} module runs as {self.path} "
                               f"(hetero/plan/encoder_cp.encoder_path): run it through {entry}")
        if not items:
            return next(self.projector.parameters()).new_zeros(0, self.llm_hidden)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            feats = self._features(items)
        return self.project([kind for kind, _ in items], feats)

    def project(self, kinds: list[str], feats: list[torch.Tensor]) -> torch.Tensor:
        """Items' encoder outputs ([tokens, d]; a video's token grid [F, h, w, d]) to [tokens, llm_hidden] in item
        order: one projector call over every token (it acts per token), then each video EVS-pruned on its
        projected embeddings, as the releases prune (transformers' NemotronH_Omni_Reasoning_V3Model.forward:
        compute_retention_mask of the video embeds). `tubelet_kept` then holds, per pruned video in order, how
        many tokens each of its tubelets kept."""
        flat = [f.flatten(0, -2) for f in feats]
        out = self.projector(torch.cat(flat))
        rate = self.video.pruning_rate if self.video is not None else 0.0
        self.tubelet_kept = []
        if not rate or "video" not in kinds:
            return out
        parts, kept = out.split([len(f) for f in flat]), []
        for kind, f, part in zip(kinds, feats, parts):
            if kind != "video":
                kept.append(part)
                continue
            tokens, chosen = evs_prune(part.reshape(*f.shape[:-1], -1), rate)
            kept.append(tokens)
            # each tubelet's kept count, for the row's <img> ... </img> chunks (data/packing.settle_tubelet_chunks)
            self.tubelet_kept.append(evs_tubelet_counts(chosen, f.shape[0], f.shape[1] * f.shape[2]))
        return torch.cat(kept)

    @property
    def llm_hidden(self) -> int:
        last = self.projector[3] if isinstance(self.projector, Projector) else self.projector.linear2
        return last.out_features


def build_media_module(name: str, llm_hidden: int, pg_collection, projector_hidden: int | None = None,
                       frozen: bool = False, tubelets: bool = False, pruning_rate: float = 0.0,
                       recompute: str = "none", core_attention=None, **overrides) -> MediaModule:
    """Encoder `name` from the registry (+ field overrides) with its projector to `llm_hidden`.
    projector_hidden defaults to the config's (a checkpoint's), else 4x the encoder's output width (Nano VL:
    5120 -> 20480; Omni audio: 1024 -> 4096). recompute: the encoder's activation recompute mode
    (models/recompute.py; a frozen encoder runs without grad, so it never recomputes). core_attention: the vision
    tower's core attention class (a context-parallel one under cp > 1, injected by the runtime)."""
    cfg = encoder_config(name, **overrides)
    projector_hidden = projector_hidden or cfg.projector_hidden
    # the family builds the encoder with its modality's interface (models/encoder_families/base.EncoderFamily.build)
    encoder = family_of(cfg).build(cfg, pg_collection, recompute=recompute, core_attention=core_attention)
    if cfg.modality == "vision":
        # a pipeline stage of the tower: the projector lives on its last stage only
        projector = Projector(encoder.out_dim, projector_hidden or 4 * encoder.out_dim, llm_hidden) \
            if encoder.vit.last_stage else None
        if encoder.vit.cp > 1 and pruning_rate:
            # EVS ranks a whole clip's tokens: its choice does not split at the token parts each CP rank hands on
            raise ValueError(f"encoder {name}: video pruning (EVS) needs the vision encoder without context "
                             f"parallelism; use cp1 for vision, or model.video_pruning=0")
        video = VideoEncoder(encoder, tubelets=tubelets, pruning_rate=pruning_rate)
        return MediaModule(cfg, encoder, projector, video, frozen)
    # a pipeline stage of the conformer: the projector lives on its last stage only
    projector = SoundProjector(encoder.out_dim, projector_hidden or 4 * encoder.out_dim, llm_hidden) \
        if encoder.last_stage else None
    return MediaModule(cfg, encoder, projector, None, frozen)


def scatter_media(text: torch.Tensor, row_embeds: list[dict], positions: list[dict], keys=None) -> torch.Tensor:
    """text [N, S, h] with row r's module-m positions replaced by row_embeds[r][m] (out of place)."""
    out = text.clone()
    for r, (embeds, pos) in enumerate(zip(row_embeds, positions)):
        name = keys[r] if keys is not None else f"row {r}"
        for module in set(embeds) | set(pos):
            e = embeds.get(module)
            p = torch.as_tensor(np.asarray(pos.get(module, np.zeros(0, np.int64))), dtype=torch.long)
            n = 0 if e is None else e.shape[0]
            if n != len(p):
                raise ValueError(f"sample {name}: {module} encoder produced {n} embeddings but the prompt has "
                                 f"{len(p)} placeholder positions (data-side token count and encoder config disagree)")
            if n and (int(p.min()) < 0 or int(p.max()) >= text.shape[1]):
                raise ValueError(f"sample {name}: {module} positions outside the row of length {text.shape[1]}")
            if n:
                out[r, p.to(out.device)] = e.to(out.dtype)
    return out


class MultimodalModel(nn.Module):
    def __init__(self, llm: nn.Module, media: dict[str, MediaModule]):
        super().__init__()
        if not (llm.pre_process and llm.post_process):
            raise ValueError("MultimodalModel runs a single-stage LLM; pipeline stages get the media "
                             "embeddings through the heterogeneous boundary instead")
        self.llm, self.media = llm, nn.ModuleDict(media)

    def trainable_parameters(self):
        """What the optimizer gets: frozen encoders contribute neither grads nor optimizer state."""
        return [p for p in self.parameters() if p.requires_grad]

    def embed(self, tokens: torch.Tensor, media: list[dict], positions: list[dict], keys=None) -> torch.Tensor:
        """[N, S, h]: text embeddings with every module's media embeddings scattered in."""
        unknown = sorted({m for row in media for m in row} - set(self.media))
        if unknown:
            raise ValueError(f"batch has media for modules {unknown}; this model has {sorted(self.media)}")
        row_embeds = [{m: self.media[m](items) for m, items in row.items() if items} for row in media]
        return scatter_media(self.llm.embedding(tokens), row_embeds, positions, keys)

    def forward(self, tokens, media, positions, labels=None, keys=None):
        """Vocab-parallel logits [N, S, V/tp], or per-token loss [N, S] with labels (-100 = ignore)."""
        hidden = self.embed(tokens, media, positions, keys).transpose(0, 1).contiguous()  # [S, N, h]
        return self.llm(decoder_input=hidden, labels=labels)
