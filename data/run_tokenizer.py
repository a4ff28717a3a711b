"""Which tokenizer a run uses, and whether it agrees with the checkpoint it starts from: one rule, applied before
launch (recipes/prelaunch.check_inputs) and on every rank (hetero/training/loop._resolve).

    choice = run_tokenizer(data.tokenizer, model.checkpoint, data.path)      # TokenizerChoice(path, source)
    check_agreement(Tokenizer(choice.path), model.checkpoint, model_vocab, choice.source)   # or TokenizerMismatch

Which one:
  1. data.tokenizer, when set;
  2. else the checkpoint's own: model.checkpoint=DIR holding tokenizer.json (else tokenizer.model). A release
     ships its tokenizer next to config.json (a Tessera export writes the run's there, hf_export.py); a released
     model fine-tuned with any other tokenizer learns garbage without a word;
  3. else the data set's own, DATA_DIR/tokenizer.json (else tokenizer.model), which scripts/prepare_data.py writes.
Agreement with DIR/config.json, whichever tokenizer was chosen: each media tag's id in the tokenizer (the tags the
release's processor looks up, data/templates.PROCESSOR_TAGS) must be config.json's image/video/audio_token_id
(the positions the model scatters encoder embeddings to), and the tokenizer must fit the model's vocabulary (a
model may pad its own; a larger tokenizer indexes past the embedding). A checkpoint without config.json (a Tessera
checkpoints/ directory) is held to the vocabulary of the model built from it.

The chat template (data.chat_template, run_chat_template): a run from a release trains in the release's own prompt
format, DIR's chat template with its processor's media wrapping (data/release_prompt.py), as it was trained and is
served; "project" trains the project's turns (ChatML, data/tokens.encode_conversation, data/templates.CHAT_TEMPLATE)
instead, and chat_template_note says before launch when DIR's template renders a conversation otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tessera.data.blend import blend_members, shared_tokenizer
from tessera.data.templates import CHAT_TEMPLATE, PROCESSOR_TAGS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # in the order a directory's own is chosen
# What a release ships besides its weights and config.json for serving: tokenizer, prompt, processors,
# generation defaults. The export of a run that used the release's tokenizer copies them as they are.
RELEASE_FILES = (*TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json", "processor_config.json", "preprocessor_config.json",
                 "video_preprocessor_config.json", "generation_config.json")


#: data.chat_template: "release" = model.checkpoint's own chat template when it ships one (else the project's);
#: "project" = the project's turns (ChatML) whatever the checkpoint ships
CHAT_TEMPLATE_SETTINGS = ("release", "project")


#: the named special tokens transformers hands a chat template as variables (PreTrainedTokenizerBase
#: .SPECIAL_TOKENS_ATTRIBUTES, apply_chat_template's special_tokens_map): `{{ eos_token }}` in a release's template
TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    """A release's chat template (Jinja) and the named special tokens its tokenizer renders it with."""

    jinja: str
    tokens: tuple[tuple[str, str], ...] = ()  # (name, token string): bos_token, eos_token, ... (TEMPLATE_TOKEN_NAMES)


class TokenizerMismatch(ValueError):
    """The run's tokenizer and the checkpoint's config.json disagree, or no tokenizer exists."""


@dataclass(frozen=True)
class TokenizerChoice:
    path: str
    source: str  # which setting it comes from: "data.tokenizer", "model.checkpoint=DIR", "data.path=DIR"


def own_tokenizer(directory) -> Path | None:
    """DIR's tokenizer file (tokenizer.json before tokenizer.model), or None."""
    if not directory or not Path(directory).expanduser().is_dir():
        return None
    return next((p for name in TOKENIZER_FILES if (p := Path(directory).expanduser() / name).is_file()), None)


def run_tokenizer(tokenizer: str | None, checkpoint: str | None, dataset: str | None) -> TokenizerChoice:
    """The tokenizer a run with these settings uses (module docstring); TokenizerMismatch when there is none."""
    if tokenizer:
        return TokenizerChoice(str(Path(tokenizer).expanduser()), "data.tokenizer")
    for directory, setting in ((checkpoint, "model.checkpoint"), (dataset, "data.path")):
        if (own := own_tokenizer(directory)) is not None:
            return TokenizerChoice(str(own), f"{setting}={directory}")
    where = f", nor has model.checkpoint={checkpoint} one" if checkpoint else ""
    members = blend_members(dataset)
    if members is not None:  # a blend: the one tokenizer its datasets carry (data/blend.py)
        try:
            shared = shared_tokenizer(members, own_tokenizer)
        except ValueError as e:
            raise TokenizerMismatch(f"data.path={dataset}: {e}") from None
        if shared is not None:
            return TokenizerChoice(str(shared), f"data.path={dataset} (its datasets' tokenizer)")
        raise TokenizerMismatch(f"data.path={dataset} is a blend whose datasets carry no tokenizer{where}: set "
                                f"data.tokenizer=PATH, or prepare them with scripts/prepare_data.py --tokenizer PATH")
    raise TokenizerMismatch(f"data.path={dataset} has no tokenizer ({Path(str(dataset)) / 'tokenizer.model'} is "
                            f"missing, and tokenizer.json too{where}): set data.tokenizer=PATH (the model's "
                            f"SentencePiece .model or tokenizer.json), or re-run scripts/prepare_data.py for this "
                            f"dataset (it writes DIR/tokenizer.model; --tokenizer PATH copies yours)")


def checkpoint_config(checkpoint: str | None) -> dict:
    """DIR/config.json of an HF-layout checkpoint of an architecture Tessera loads; {} for anything else
    (no checkpoint, a Tessera checkpoints/ directory: recipes/prelaunch.check_checkpoint names bad ones)."""
    from tessera.models.released import CheckpointConfigError, read_config

    if not checkpoint or not (Path(checkpoint).expanduser() / "config.json").is_file():
        return {}
    try:
        return read_config(checkpoint)
    except CheckpointConfigError:
        return {}


def disagreements(tok, config: dict, model_vocab: int | None = None) -> list[str]:
    """What `tok` (data/tokens.Tokenizer) and the checkpoint's config.json disagree on, one phrase each.
    model_vocab: the built model's vocabulary when known (else config.json's)."""
    from tessera.models.released import llm_fields_of, media_token_ids

    out = []
    for kind, want in media_token_ids(config).items():
        tag = PROCESSOR_TAGS[kind]
        if tok.special.get(tag) != want:
            out.append(f"{kind}_token_id {want} in config.json, but {tag} is {tok.special.get(tag)} in the tokenizer")
    vocab = model_vocab if model_vocab is not None else llm_fields_of(config)["vocab_size"] if config else None
    if vocab is not None and tok.vocab_size > vocab:
        out.append(f"the tokenizer has {tok.vocab_size} tokens, the model's vocabulary only {vocab}")
    return out


def check_agreement(tok, checkpoint: str | None, model_vocab: int | None = None, source: str = "") -> None:
    """Refuse a tokenizer that disagrees with the checkpoint, naming both and every disagreeing id."""
    problems = disagreements(tok, checkpoint_config(checkpoint), model_vocab)
    if not problems:
        return
    model = f"the checkpoint {checkpoint} (its config.json)" if checkpoint else "the model"
    own = own_tokenizer(checkpoint)
    fix = (f"drop data.tokenizer to use its own, {own}" if own is not None and source == "data.tokenizer" else
           "set data.tokenizer=PATH to the tokenizer the checkpoint was trained with"
           + (" (its own disagrees with its config.json)" if own is not None else ""))
    raise TokenizerMismatch(f"tokenizer {tok.path} ({source or 'given'}) disagrees with {model}: "
                            f"{'; '.join(problems)}. Training with it would teach the model other ids: {fix}")


def chat_template_of(directory) -> str | None:
    """DIR's chat template: chat_template.jinja, else tokenizer_config.json's (the default of named ones)."""
    if not directory:
        return None
    d = Path(directory).expanduser()
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    if (d / "tokenizer_config.json").is_file():
        template = json.loads((d / "tokenizer_config.json").read_text()).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        return template if isinstance(template, str) else None
    return None


def check_chat_template_setting(setting: str) -> None:
    if setting not in CHAT_TEMPLATE_SETTINGS:
        raise ValueError(f"data.chat_template={setting!r} is not one of {', '.join(CHAT_TEMPLATE_SETTINGS)}: "
                         f"release (the default) trains in model.checkpoint's own prompt format, project in the "
                         f"project's turns (ChatML)")


def template_tokens(directory) -> tuple[tuple[str, str], ...]:
    """DIR's named special tokens as transformers loads them for its chat template: tokenizer_config.json's, else
    special_tokens_map.json's (a token is a string or an added-token dict with its "content")."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = Path(directory).expanduser() / name
        config = json.loads(path.read_text()) if path.is_file() else {}
        for key in TEMPLATE_TOKEN_NAMES:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
    return tuple((k, found[k]) for k in TEMPLATE_TOKEN_NAMES if k in found)


def run_chat_template(setting: str, checkpoint: str | None) -> ChatTemplate | None:
    """The chat template a run's conversations are rendered with: model.checkpoint's own under "release" when it
    ships one (data/release_prompt.py); None = the project's turns (data/tokens.encode_conversation)."""
    check_chat_template_setting(setting)
    jinja = chat_template_of(checkpoint) if setting == "release" else None
    return None if jinja is None else ChatTemplate(jinja, template_tokens(checkpoint))


def chat_template_note(directory) -> str | None:
    """A line when DIR's chat template renders a conversation otherwise than the project's turns a run with
    data.chat_template=project trains."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = chat_template_of(directory)
    if template is None:
        return None
    probe = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
             {"role": "assistant", "content": "Hello."}]
    try:
        (theirs,), _ = render_jinja_template([probe], chat_template=template)
    except Exception as e:  # a template's own raise_exception or a missing variable: still only a note
        theirs = f"(not renderable offline: {type(e).__name__}: {e})"
    (ours,), _ = render_jinja_template([probe], chat_template=CHAT_TEMPLATE)
    if theirs == ours:
        return None
    return (f"note: data.chat_template=project: training writes turns as {ours!r} (data/tokens.encode_conversation), "
            f"not as the chat template of {directory} renders them, {theirs!r}, which its export still ships "
            f"(drop data.chat_template to train in the release's own format)")
