"""What each rank of a layout holds, counted on the real modules built on the meta device (no storage, no init).

    shards = rank_shards(spec, model_cfg, batch)   # in a process whose only default group may be a fake world

One rank per distinct shape does the work: per module and pipeline stage, the rank (tp 0, cp 0, dp 0, that
stage); every TP and EP rank of a stage holds shards of the same sizes. That rank joins torch's fake world
(FakeStore), creates every module's process groups (hetero/runtime/groups.py) and builds its modules exactly as
training does (hetero/build/model_build.build_rank_modules) under `meta_init()`. Per module and stage:
parameters (numel; routed experts, megatron's `allreduce=False`; TP-sharded, megatron's
`tensor_model_parallel`; trainable: frozen modules have none, a frozen encoder's projector still trains) and
the activations of one microbatch, measured by a meta forward under torch.autograd.graph.saved_tensors_hooks:
the bytes of every distinct storage autograd saves (views counted once, parameters not at all), attributed
to the layer that saved it (and each layer's input: what a full recompute keeps). Where the CPU build differs
from a GPU run, the GPU's saved tensors are counted (the dry run's memory header says so):
  - scaled_dot_product_attention as flash attention (its inputs and output, not the S^2 weights of the math
    path), rms_norm as CUDA's fused kernel (its input), and Mamba's SSD scan as mamba_ssm's fused kernel
    (inputs and output), also inside the head-parallel CP layers (the same kernels on 1/cp of the heads); the
    zigzag CP kernels (all-gather attention with materialised scores, torch SSD scan) run on GPU too, and
    what they keep counts;
  - MoE routing is data dependent (meta tensors hold no data): balanced routing, every local expert gets
    tokens * topk / experts of the gathered tokens (megatron's permute/unpermute as index_select/scatter_add);
  - torch.compile'd megatron fusions (squared ReLU) run eagerly.
A module whose meta forward fails has act=None and the reason; the caller falls back to the planner's formula.
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from dataclasses import dataclass

import torch
from torch import nn

from tessera.hetero.plan.layout import ENCODER_KEYS, LANGUAGE, HeteroLayout
from tessera.hetero.runspec.config import ModelConfig
from tessera.models.meta_device import meta_build, skip_init


@dataclass
class Shard:
    """One module's shard on one rank (module key, pipeline stage), as built."""

    key: str
    stage: int
    rank: int
    params: int = 0            # numel
    param_bytes: int = 0       # in the dtype training steps in (bf16 runs: every parameter cast to bf16)
    experts: int = 0           # routed-expert numel (distinct per EP rank)
    tp_sharded: int = 0        # numel split over TP (the rest is replicated on every TP rank)
    trainable: int = 0
    trainable_experts: int = 0
    buffer_bytes: int = 0
    act: float | None = None   # bytes saved for backward by one microbatch, no recompute
    act_full: float | None = None  # same with full recompute: layer inputs + outside layers (+ peak below)
    act_peak_layer: float = 0.0    # the largest layer's saved bytes (what a full recompute rebuilds at once)
    act_note: str = ""
    per_layer: dict | None = None  # saved bytes per layer index (None: outside the layers)
    seconds: float = 0.0


@dataclass(frozen=True)
class Batch:
    """One microbatch per rank: LLM rows and tokens per row (its CP share), encoder items per rank."""

    llm_rows: int
    llm_tokens: int
    vision_tiles: int = 0
    audio_clips: int = 0
    audio_clip_seconds: float = 30.0
    measure: tuple[str, ...] = (LANGUAGE, *ENCODER_KEYS)   # modules whose activations are measured


@contextlib.contextmanager
def meta_init():
    """Build (and run) modules on the meta device: factories go to meta, torch.nn.init is a no-op (init on meta
    tensors is slow and meaningless), megatron's explicit `device=torch.cuda.current_device()` is meta, its
    torch.compile'd fusions run eagerly, and MoE routing is balanced (module docstring)."""
    import torch._dynamo
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher as D

    saved = (torch.cuda.current_device, torch._dynamo.config.disable, D.dispatch_postprocess, D.combine_preprocess)
    torch.cuda.current_device = lambda: "meta"
    torch._dynamo.config.disable = True
    D.dispatch_postprocess, D.combine_preprocess = _balanced_dispatch, _balanced_combine
    try:
        with meta_build():
            yield
    finally:
        torch.cuda.current_device, torch._dynamo.config.disable, D.dispatch_postprocess, D.combine_preprocess = saved


def _balanced_dispatch(self, hidden_states, probs):
    """MoEAllGatherTokenDispatcher.dispatch_postprocess with every local expert getting its even share."""
    self.hidden_shape_before_permute = hidden_states.shape
    local = len(self.local_expert_indices)
    per = hidden_states.shape[0] * self.config.moe_router_topk // self.config.num_moe_experts
    self._meta_index = torch.empty(per * local, dtype=torch.long, device=hidden_states.device)
    lo = self.local_expert_indices[0]
    self.local_probs = probs[:, lo:lo + local].T.reshape(-1)[:per * local].clone()  # masked_select's size
    self.routing_map = None
    return hidden_states.index_select(0, self._meta_index), torch.full((local,), per, device="cpu"), self.local_probs


def _balanced_combine(self, hidden_states):
    out = hidden_states.new_zeros(self.hidden_shape_before_permute)  # megatron's unpermute: a scatter_add
    return out.scatter_add(0, self._meta_index[:, None].expand(-1, out.shape[-1]), hidden_states)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


class SavedBytes:
    """saved_tensors_hooks that add up distinct storages autograd keeps, per layer of `layers`."""

    def __init__(self, module: nn.Module, layers: list[nn.Module] | None):
        self.skip = {_storage(p)[0] for p in module.parameters()}
        self.seen: set[int] = set()
        self.kept: list[torch.Tensor] = []  # counted storages stay alive: a freed one's address could be reused
        self.where: int | None = None       # index of the running layer, None outside the layers
        self.per_layer: dict[int | None, int] = {}
        self.layer_inputs = 0
        self.hooks = []
        for i, layer in enumerate(layers or ()):
            self.hooks.append(layer.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            self.hooks.append(layer.register_forward_hook(self._leave))

    def _enter(self, i):
        def hook(_, args, kwargs):  # the hidden states: first argument (NeMo passes it by keyword)
            self.where = i
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if x is not None:
                self.layer_inputs += x.numel() * x.element_size()
        return hook

    def _leave(self, *_):
        self.where = None

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        key, nbytes = _storage(t)
        if key in self.skip or key in self.seen:
            return
        self.seen.add(key)
        self.kept.append(t)
        self.per_layer[self.where] = self.per_layer.get(self.where, 0) + nbytes

    def pack(self, t):
        self.add(t)
        return t

    def opaque(self, fn, outputs: bool = True):
        """fn counted as a fused kernel: its tensor inputs (and outputs), nothing it saves inside."""
        def run(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = fn(*args, **kwargs)
            for t in (*args, *(out if isinstance(out, tuple) else (out,) if outputs else ())):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.add(t)
            return out
        return run

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _layer_list(module: nn.Module) -> list[nn.Module] | None:
    """The module's layer stack: the outermost ModuleList (a vision pipeline stage: ModuleDict) called `layers`
    (HybridLM, ViT, conformer; not, say, the conformer subsampling's `layers` inside it)."""
    stacks = [(n.count("."), m) for n, m in module.named_modules()
              if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and n.split(".")[-1] == "layers"]
    if not stacks:
        return None
    m = min(stacks, key=lambda t: t[0])[1]
    return list(m.values()) if isinstance(m, nn.ModuleDict) else list(m)


def count_params(module: nn.Module, shard: Shard, bytes_per_param: int | None) -> None:
    for p in module.parameters():
        n = p.numel()
        expert = not getattr(p, "allreduce", True)
        shard.params += n
        shard.param_bytes += n * (bytes_per_param or p.element_size())
        shard.experts += n if expert else 0
        shard.tp_sharded += n if getattr(p, "tensor_model_parallel", False) else 0
        shard.trainable += n if p.requires_grad else 0
        shard.trainable_experts += n if (p.requires_grad and expert) else 0
    shard.buffer_bytes += sum(b.numel() * b.element_size() for b in module.buffers())


@contextlib.contextmanager
def _fused_kernels(acc: SavedBytes):
    from tessera.models.mamba2 import Mamba2Mixer

    F = torch.nn.functional
    sdpa, norm, scan = F.scaled_dot_product_attention, F.rms_norm, Mamba2Mixer.scan
    F.scaled_dot_product_attention = acc.opaque(sdpa)
    F.rms_norm = acc.opaque(norm, outputs=False)  # CUDA's fused rms_norm keeps its input (+ 1 float per row)
    # the zigzag CP mixer has its own scan (torch ops, also on GPU): what it keeps counts
    Mamba2Mixer.scan = lambda self, *a, **k: acc.opaque(lambda *b, **c: scan(self, *b, **c))(*a, **k)
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.rms_norm, Mamba2Mixer.scan = sdpa, norm, scan


def _forward(key: str, module: nn.Module, batch: Batch, cfg_dtype: torch.dtype):
    """One microbatch through this rank's module; returns what backward would start from."""
    meta = dict(device="meta")
    if key == LANGUAGE:
        rows, toks = batch.llm_rows, batch.llm_tokens
        labels = torch.zeros(rows, toks, dtype=torch.long, **meta) if module.post_process else None
        hidden = lambda n: torch.zeros(n, rows, module.config.hidden_size, dtype=cfg_dtype,  # noqa: E731
                                       requires_grad=True, **meta)
        if module.pre_process and any(p.requires_grad for p in module.parameters()):
            return module(torch.zeros(rows, toks, dtype=torch.long, **meta), labels)
        if module.pre_process:  # frozen: backward still runs through it to the projectors' embeddings
            return module(None, labels, decoder_input=hidden(toks))
        module.set_input_tensor(hidden(toks // (module.pg_collection.tp.size() if module.config.sequence_parallel
                                                else 1)))  # stages pass 1/tp of the sequence under SP
        return module(None, labels)
    frozen = getattr(module, "frozen", False)
    if module.cfg.modality == "vision":
        tile, cp = module.cfg.tile, module.encoder.vit.cp
        tiles = torch.zeros(batch.vision_tiles * cp, 3, tile, tile, dtype=torch.uint8, **meta)
        if cp > 1:  # one row of the CP group's tiles; this rank computes its part, gathering K/V (fake world)
            return module.forward_cp([[("image", tiles)]])
        if module.pipelined:  # this stage's layers, on the previous stage's activation after the first
            items = [("image", tiles)]
            x = None if module.encoder.vit.first_stage else torch.zeros(
                module.stage_shape(items), dtype=cfg_dtype, requires_grad=not frozen, **meta)
            return module.forward_stage(items, x)
        with torch.set_grad_enabled(not frozen):
            return module.projector(module.encoder(tiles))
    cfg, clips, enc = module.cfg, batch.audio_clips, module.encoder
    frames = int(batch.audio_clip_seconds / cfg.window_stride) + 1
    feats = torch.zeros(clips, cfg.n_mels, frames, dtype=cfg_dtype, **meta)
    lengths = torch.full((clips,), frames, dtype=torch.long, **meta)
    with torch.set_grad_enabled(not frozen):
        if enc.first_stage:
            out, _ = enc.encode_features(feats, lengths)
        else:  # a later conformer stage: the previous stage's rows (one clip's STFT frames, subsampled)
            rows = enc.tokens.audio_subsampled(frames + 1)
            out, _ = enc.encode_received(torch.zeros(clips, rows, cfg.hidden, dtype=cfg_dtype,
                                                     requires_grad=not frozen, **meta), lengths)
    return module.projector(out) if enc.last_stage else out


def measure_activations(key: str, module: nn.Module, batch: Batch, shard: Shard, dtype: torch.dtype) -> None:
    """shard.act / act_full / act_peak_layer from one meta forward (module docstring); on failure act stays None
    and act_note says where it failed."""
    if key != LANGUAGE and not (batch.vision_tiles if module.cfg.modality == "vision" else batch.audio_clips):
        shard.act = shard.act_full = 0.0
        shard.act_note = "measured (no items in the workload)"
        return
    layers = _layer_list(module)
    acc = SavedBytes(module, layers)
    module.train()
    try:
        with meta_init(), _fused_kernels(acc), torch.autograd.graph.saved_tensors_hooks(acc.pack, lambda t: t):
            _forward(key, module, batch, dtype)
    except Exception as e:  # noqa: BLE001 - any failure means: use the formula, and say why
        frames = traceback.extract_tb(e.__traceback__)
        where = next((f for f in reversed(frames) if "/torch/" not in f.filename and f.filename != __file__),
                     frames[-1])
        shard.act_note = f"meta forward failed ({type(e).__name__}: {str(e)[:80]} at {where.name}:{where.lineno})"
        return
    finally:
        acc.close()
    inside = {i: b for i, b in acc.per_layer.items() if i is not None}
    outside = acc.per_layer.get(None, 0)
    shard.act = float(outside + sum(inside.values()))
    shard.act_peak_layer = float(max(inside.values(), default=0))
    shard.act_full = float(outside + acc.layer_inputs)
    shard.act_note, shard.per_layer = "measured", dict(acc.per_layer)


def model_config(names: dict[str, str], frozen: set[str] = frozenset(), dtype: str = "bfloat16",
                 checkpoint: str | None = None) -> ModelConfig:
    """The ModelConfig of a model with these registry names (module key -> name) and frozen modules. checkpoint: a
    released checkpoint directory whose config.json defines the modules (its LLM and encoders replace `names`, as
    in a run)."""
    return ModelConfig(llm=names[LANGUAGE], **{k: names.get(k) for k in ENCODER_KEYS}, dtype=dtype,
                       checkpoint=checkpoint, freeze_llm=LANGUAGE in frozen,
                       **{f"freeze_{k}": k in frozen for k in ENCODER_KEYS})


def _llm_fields(model_cfg) -> dict:
    """The LLM's config fields: its checkpoint's when it has one (as a run builds it), else the registry's."""
    from tessera.hetero.build.model_build import llm_fields
    from tessera.hetero.checkpoint.source import checkpoint_llm_fields

    return checkpoint_llm_fields(getattr(model_cfg, "checkpoint", None)) or llm_fields(model_cfg, 0)


def representative_ranks(layout: HeteroLayout) -> list[int]:
    """One rank per (module, pipeline stage): tp 0, cp 0, dp 0 of that stage."""
    return sorted({m.rank_of(pp=s) for m in layout.modules.values() for s in range(m.pp)})


def rank_shards(spec: str, model_cfg, batch: Batch) -> list[Shard]:
    """Every (module, stage) shard of the layout, counted at its representative rank (fake world, meta device)."""
    shards: dict[tuple[str, int], Shard] = {}
    for rank in representative_ranks(HeteroLayout.parse(spec)):
        for s in shards_at(spec, model_cfg, rank, batch, skip=set(shards)):
            shards[(s.key, s.stage)] = s
    return [shards[k] for k in sorted(shards)]


def shards_at(spec: str, model_cfg, rank: int, batch: Batch | None = None, meta: bool = True,
              skip: set[tuple[str, int]] = frozenset()) -> list[Shard]:
    """The shards of the modules `rank` hosts (but the (key, stage)s in `skip`), built as training builds them
    in torch's fake world of the layout's size (meta=False: for real, on the CPU). Run it in a process of its own:
    it creates and destroys the default process group."""
    from tessera.hetero.runtime.cpu_shims import apply_cpu_shims
    from tessera.hetero.runtime.groups import build_module_groups
    from tessera.hetero.runtime.world import fake_world
    from tessera.hetero.build.model_build import build_rank_modules, module_configs

    apply_cpu_shims()
    layout = HeteroLayout.parse(spec)
    dtype = getattr(torch, model_cfg.dtype)
    wide = None if dtype == torch.float32 else dtype.itemsize
    out = []
    with fake_world(rank, layout.world_size):
        groups = build_module_groups(layout)
        configs = module_configs(layout, _llm_fields(model_cfg))
        # megatron's init_method is captured before meta_init patches torch.nn.init; with
        # perform_initialization=False it would also skip the tensor_model_parallel marks
        configs[LANGUAGE].init_method = configs[LANGUAGE].output_layer_init_method = skip_init
        wanted = {k for k, g in groups.items() if g.is_member and (k, g.coord.pp) not in skip}
        t0 = time.perf_counter()
        with meta_init() if meta else contextlib.nullcontext():
            modules = build_rank_modules(model_cfg, layout, groups, configs)
        build_s = time.perf_counter() - t0
        for key in sorted(wanted):
            t = time.perf_counter()
            s = Shard(key, groups[key].coord.pp, rank)
            count_params(modules[key], s, wide)
            if batch is not None and key in batch.measure and meta:
                module = modules[key].to("meta", dtype)  # training casts every module to its dtype (optim.py)
                measure_activations(key, module, batch, s, dtype)
            else:
                s.act_note = "not measured"
            s.seconds = build_s / len(wanted) + time.perf_counter() - t
            out.append(s)
    return out


def seeded_init_units(model_cfg) -> dict[tuple, int]:
    """Elements of every unit the initialisation from a seed builds (hetero/build/seeded_init.py), from a
    meta-device build in a one-rank fake world. Run it in a process of its own (it creates and destroys the
    default process group)."""
    from tessera.hetero.runtime.cpu_shims import apply_cpu_shims
    from tessera.hetero.runtime.world import fake_world
    from tessera.hetero.build import model_build
    from tessera.hetero.build.seeded_init import SeededState

    apply_cpu_shims()
    try:
        with fake_world(0, 1):
            return SeededState(model_cfg, _llm_fields(model_cfg), 0).unit_elements()
    finally:
        model_build._single_rank_pgs = None  # its groups died with the default group


def batch_for(layout: HeteroLayout, rows_per_dp: int, seq_length: int, items_per_row: dict[str, float],
              clip_seconds: float = 30.0) -> Batch:
    """One microbatch per rank: `rows_per_dp` rows per LLM DP replica (global rows: that x LLM dp), the LLM's
    CP share of each row, and each encoder's items (vision: tiles and frames; audio: clips) of its DP x CP
    share of the rows (as hetero.planner.cost prices them)."""
    rows = rows_per_dp * layout[LANGUAGE].dp_size
    share = lambda key: rows / layout[key].dp_size / layout[key].cp if key in layout.modules else 0.0  # noqa: E731
    return Batch(rows_per_dp, seq_length // layout[LANGUAGE].cp,
                 math.ceil(share("vision") * items_per_row.get("vision", 0.0)),
                 math.ceil(share("audio") * items_per_row.get("audio", 0.0)), clip_seconds)
