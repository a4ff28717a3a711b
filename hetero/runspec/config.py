"""What a training run is made of, as plain dataclasses: the fields recipes set and users override.

A recipe (recipes/registry.py) is a `run.Partial(recipes.train.train, model=run.Config(ModelConfig, ...),
...)`; nemo-run's CLI overrides any field with `model.vision=siglip_tiny`, `trainer.max_steps=20`,
`layout="vision=dp2@0-1;language=tp2@2-3"`. Module choices are registry *names* (models/configs.py for
the LLM, models/encoders.py for encoders), so swapping an encoder is one string override and the data
side derives its placeholder counts from the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.data.run_tokenizer import check_chat_template_setting
from tessera.hetero.plan.lora import DEFAULT_LORA_TARGETS, lora_targets, validate_lora
from tessera.hetero.plan.recompute import parse_recompute


# the learning-rate schedules (megatron-core's styles; hetero/optim/lr_schedule.py runs them)
LR_SCHEDULES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def check_lr_schedule(style: str, wsd_decay_style: str) -> None:
    if style not in LR_SCHEDULES:
        raise ValueError(f"optim.lr_schedule={style!r}: choose one of {', '.join(LR_SCHEDULES)}")
    if wsd_decay_style not in WSD_DECAY_STYLES:
        raise ValueError(f"optim.lr_wsd_decay_style={wsd_decay_style!r}: choose one of {', '.join(WSD_DECAY_STYLES)}")


@dataclass
class LoraConfig:
    """Low-rank adapters (`model.lora.rank=8`): the base weights freeze, W x + (alpha/rank) B A x trains."""

    rank: int = 0                           # 0 = no LoRA (full fine-tuning)
    alpha: float = 32.0                     # scale = alpha / rank
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS  # layer names to adapt, from LORA_TARGETS
    dropout: float = 0.0                    # only 0 is implemented
    export: str = "both"                    # trainer.export_hf writes "merged" weights, the "adapters" alone, or "both"

    def __post_init__(self):
        self.targets = lora_targets(self.targets)
        validate_lora(self.rank, self.alpha, self.targets, self.dropout, self.export)


@dataclass
class ModelConfig:
    llm: str = "nemotron_h_tiny_dense"      # models.configs.REGISTRY name
    vision: str | None = "radio_vit_tiny"   # models.encoders.REGISTRY name (modality vision); None = no vision
    audio: str | None = None                # models.encoders.REGISTRY name (modality audio); None = no audio
    freeze_vision: bool = False             # encoder frozen; its projector still trains
    freeze_audio: bool = False
    freeze_llm: bool = False
    video_pruning: float = 0.0              # fraction of video tokens dropped (EVS-style), 0 = keep all
    checkpoint: str | None = None           # initialise from an HF directory or a Tessera checkpoint
    dtype: str = "float32"                  # "float32" | "bfloat16"
    # MoE LLMs: the expert bias always balances (aux-loss-free); > 0 adds megatron's seq_aux_loss with this
    # coefficient (Megatron-Bridge's Nemotron-H default: 1e-4)
    moe_aux_loss_coeff: float = 0.0
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: train adapters only (hetero/build/lora.py)
    # activation recompute: none|selective|full for every module, or per module "language=full,vision=selective"
    # (hetero/plan/recompute.py; what each mode covers: models/recompute.py)
    recompute: str = "none"

    def __post_init__(self):
        parse_recompute(self.recompute)


@dataclass
class DataConfig:
    path: str | None = None                 # prepared dataset / blend YAML; None = synthetic data in run_dir
    # validation sets: a dataset / blend YAML, "synthetic" (a held-out synthetic set) or "NAME=PATH;NAME=PATH";
    # "auto" (the tiny recipes') = the synthetic set for synthetic data, else data.path's own val split (none
    # without one); None = no validation (hetero/training/validation.py)
    val_path: str | None = None
    # SentencePiece .model or tokenizer.json; None = model.checkpoint's own, else the dataset's (and either must
    # agree with the checkpoint's config.json: data/run_tokenizer.py)
    tokenizer: str | None = None
    # the prompt format: "release" = model.checkpoint's own chat template and media wrapping when it ships a chat
    # template (the format it was trained and is served in), else the project's; "project" = the project's turns
    # (ChatML) always (data/run_tokenizer.run_chat_template, data/release_prompt.py)
    chat_template: str = "release"
    # the user turn of caption-only samples (energon CaptioningSample datasets, data/sample_types.py), its media
    # tag first unless it holds one; None = the project's caption prompt
    caption_prompt: str | None = None
    seq_length: int = 256                   # packed row length (divisible by 2 x the LLM's CP)
    rows_per_microbatch: int = 4            # global rows per microbatch (divisible by every module's DP)
    microbatches: int = 2                   # microbatches per optimizer step
    num_workers: int = 0
    # vl/video: image tiles per image (plus thumbnail). omni (native resolution): each image is one patch grid
    # of one tile's patches .. (max_tiles + 1) tiles' patches (models/media_tokens.EncoderTokens.patch_budget)
    max_tiles: int = 2
    video_frames: int = 4
    seed: int = 1234
    # each encoder's items of a microbatch go to its DP ranks by their FLOPs (largest first to the least loaded:
    # hetero/plan/encoder_balance.py), not with the rows; the numbers are the same either way (each item is
    # encoded alone), only the slowest encoder rank gets faster. False: each DP rank encodes its rows' items
    balance_encoders: bool = True
    # media per packed row as the layout planner prices it (layout=auto, `nemo tessera plan`); None = from
    # the fields above (max_tiles + thumbnail tiles, video_frames when pruning video, 30 s of audio)
    tiles_per_row: float | None = None
    frames_per_row: float | None = None
    audio_seconds_per_row: float | None = None

    def __post_init__(self):
        check_chat_template_setting(self.chat_template)


@dataclass
class OptimConfig:
    lr: float = 1e-3                        # LLM (and default for every module)
    lr_vision: float | None = None          # None = lr
    lr_audio: float | None = None
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0                  # global grad-norm clip across all modules; 0 = off
    # ZeRO-1 (megatron/NeMo's use_distributed_optimizer): fp32 masters and Adam states sharded over each
    # module's DP group (routed experts: expert-DP); bf16 runs (hetero/optim/zero.py)
    use_distributed_optimizer: bool = False
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1               # decay to lr * min_lr_ratio at max_steps
    # megatron-core's schedules (hetero/optim/lr_schedule.py): cosine | linear | constant |
    # inverse-square-root | WSD (the peak until the last lr_wsd_decay_steps, None = the last 10% of max_steps)
    lr_schedule: str = "cosine"
    lr_wsd_decay_steps: int | None = None
    lr_wsd_decay_style: str = "linear"      # WSD's decay: linear | cosine | exponential | minus_sqrt

    def __post_init__(self):
        check_lr_schedule(self.lr_schedule, self.lr_wsd_decay_style)


@dataclass
class TrainerConfig:
    max_steps: int = 20
    seed: int = 1234
    log_every: int = 1
    save_every: int = 0                     # 0 = save only at the end (and on SIGTERM/SIGUSR1)
    save_interval_minutes: float = 0.0      # > 0: also save when this much wall time passed since the last save
    keep_last: int | None = None            # keep the newest N checkpoints (None = all); `latest` is never deleted
    keep_every: int = 0                     # > 0: also keep every step divisible by it, permanently
    async_save: bool = False                # write checkpoints in a helper process while training goes on
    run_dir: str | None = None              # None = runs/<name>-<timestamp>
    resume: bool = True                     # continue from run_dir's last complete checkpoint if any
    progress: bool = True                   # a tqdm bar on a terminal (in a log the step lines are the progress)
    tensorboard: bool = True
    timeout_s: int = 300                    # collective timeout: a dead rank ends the job within this
    export_hf: str | None = None            # after the last step, write the model in HF layout here
    val_every: int = 0                      # with data.val_path: validate every N steps (0 = after the last only)
    val_steps: int = 2                      # global batches (rows_per_microbatch x microbatches) per set and pass
    wandb_project: str | None = None        # also log to Weights & Biases (hetero/training/tracking.py)
    wandb_mode: str | None = None           # "offline" (no network: `wandb sync` later) | "online"; None = WANDB_MODE
    wandb_entity: str | None = None
    # elastic (issue 36): > 0 launches through torchrun's elastic agent, --nnodes MIN:MAX with MIN this and MAX
    # run.executor.nodes; a job that loses nodes restarts on the survivors, one that gets nodes back grows, and
    # each restart re-resolves the layout for its world and resumes from the last checkpoint (recipes/elastic.py)
    elastic_min_nodes: int = 0
    elastic_max_restarts: int = 3           # restarts after a failure (torchrun --max-restarts; a node joining: none)
    # gradients reduced in buckets of about grad_bucket_elements (megatron DDP's 40M default), each started while
    # backward still runs once its gradients are final (megatron's overlap_grad_reduce); bitwise the same sums
    # either way (hetero/optim/grad_buckets.py). Off: every bucket reduced after backward (the full recipes: on)
    overlap_grad_reduce: bool = False
    grad_bucket_elements: int = 40_000_000

    def __post_init__(self):
        check_elastic(self.elastic_min_nodes, self.elastic_max_restarts)


def check_elastic(min_nodes: int, max_restarts: int) -> None:
    """trainer.elastic_min_nodes / elastic_max_restarts: whole numbers >= 0 (the CLI checks them before launch)."""
    for name, v in (("elastic_min_nodes", min_nodes), ("elastic_max_restarts", max_restarts)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"trainer.{name}={v!r} must be a whole number >= 0 (elastic_min_nodes=0: a fixed-size "
                             f"job; N: keep training on N or more nodes)")


@dataclass
class RunConfig:
    """Everything `recipes.train.train` takes, in one object (what --dryrun prints)."""

    name: str = "tessera"
    layout: str = ""                        # "" = every module data-parallel on all ranks; "auto" = planner
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
