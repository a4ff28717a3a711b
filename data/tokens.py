"""Prompt encoding: chat template, tokenizer, media placeholders sized by the encoder config.

A conversation is a list of {"role": "system"|"user"|"assistant", "content": str} turns. The content holds
media tags (<image>, <video>, <audio>); the i-th tag of a kind refers to the i-th media item of that kind.
Each tag expands, as its prompt template says (data/templates.py: the released families' wrapping, e.g. omni's
<img> <image>xN </img>), around exactly the number of embeddings its encoder will produce, computed by
EncoderTokens from the *decoded* media (tiles, frames, waveform samples), so the LLM sequence and the encoder
output can only disagree if EncoderTokens disagrees with the model config — which tests/test_data_tokens.py
checks against NeMo's audio encoder and against the pixel-shuffle arithmetic, and tests/test_prompt_parity.py
against the released Omni processor's input_ids.

Template (ChatML-like; loss only on assistant content and its closing <|im_end|>, never on media tokens):
    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{content}<|im_end|>\\n
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessera.models.media_tokens import EncoderTokens  # noqa: F401  (re-exported: the encoders define it)
from tessera.hetero.plan.layout import AUDIO, VISION
from tessera.models.media_tokens import evs_nominal_tubelet_counts

from tessera.data.templates import (DEFAULT_TEMPLATE, IM_END, IM_START, SPECIAL_TOKENS,  # noqa: F401
                                    PromptTemplate, prompt_template, tubelet_chunks)

#: A media item's tag in a conversation's text (Tessera's data format; the template decides what it becomes).
MEDIA_TAGS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
#: Which encoder module produces the embeddings of a media kind (module keys as in hetero/plan/layout.py).
MODULE_OF_KIND = {"image": VISION, "video": VISION, "audio": AUDIO}
MEDIA_TAG_RE = re.compile("(" + "|".join(re.escape(t) for t in MEDIA_TAGS.values()) + ")")
KIND_OF_TAG = {t: k for k, t in MEDIA_TAGS.items()}


class PromptError(ValueError):
    """A conversation that cannot be aligned with its media; the message is the logged skip reason."""


class Tokenizer:
    """SentencePiece (.model) or HF tokenizers (tokenizer.json) behind one small interface."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path.endswith(".json"):
            from tokenizers import Tokenizer as HFTokenizer

            self._hf = HFTokenizer.from_file(self.path)
            self._encode = lambda s: self._hf.encode(s, add_special_tokens=False).ids
            self._id = self._hf.token_to_id
        else:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_file=self.path)
            self._encode = self._sp.encode
            self._id = lambda p: (i if (i := self._sp.piece_to_id(p)) != self._sp.unk_id() else None)
        missing = [t for t in SPECIAL_TOKENS if self._id(t) is None]
        if missing:
            raise ValueError(f"tokenizer {self.path} lacks the special tokens {missing} (the prompt templates' "
                             f"turn and media tokens, data/templates.py); train it with them as user-defined "
                             f"symbols (data.tokens.train_sentencepiece does)")
        self.special = {t: self._id(t) for t in SPECIAL_TOKENS}
        pad = self._id("<pad>")
        self.pad_id = pad if pad is not None else self.special[IM_END]
        self._templates: dict[tuple[str, str], np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size() if hasattr(self, "_hf") else self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text)) if text else []

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """ids of `text` in one piece, as a release's processor tokenizes it, and each one's character offsets
        (data/release_prompt.py); a release ships tokenizer.json."""
        if not hasattr(self, "_hf"):
            raise ValueError(f"tokenizer {self.path} is a SentencePiece model: a release's prompt format is "
                             f"tokenized with its tokenizer.json (set data.tokenizer to it, or "
                             f"data.chat_template=project)")
        out = self._hf.encode(text, add_special_tokens=False)
        return out.ids, out.offsets

    def template(self, special: str, text: str = "") -> np.ndarray:
        """int32 ids of a template piece: an optional special token, then `text` tokenized on its own
        (cached: every turn repeats the same few pieces)."""
        key = (special, text)
        if key not in self._templates:
            ids = ([self.special[special]] if special else []) + self.encode(text)
            self._templates[key] = np.asarray(ids, dtype=np.int32)
            self._templates[key].flags.writeable = False
        return self._templates[key]

    def __getstate__(self):  # processors are not picklable; energon ships the task encoder to workers
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


def train_sentencepiece(texts: list[str], prefix: str | Path, vocab_size: int = 512) -> Path:
    """Train a small BPE SentencePiece model with the template/media tokens as single pieces."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        user_defined_symbols=list(SPECIAL_TOKENS), pad_id=3, pad_piece="<pad>", hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2)
    path = Path(f"{prefix}.model")
    path.write_bytes(model.getvalue())
    return path


@dataclass
class EncodedPrompt:
    """One tokenized sample. `spans` are (module, start, length, item) per media tag in text order (a video
    written in tubelet chunks has one span per chunk, consecutive, of the same item); `item` indexes the sample's
    media list, so encoders must consume items in span order."""

    tokens: np.ndarray  # int32 [L]
    target: np.ndarray  # bool [L]: token is predicted (assistant content or closing <|im_end|>)
    spans: list[tuple[str, int, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


def media_placeholders(enc: EncoderTokens, template: str | PromptTemplate, kind: str, units: int | tuple,
                       times: list[float] | None = None) -> int | list[tuple[str, int]]:
    """What encode_conversation writes for one media item: its embedding count (enc.tokens), or for a video of a
    per-tubelet template (omni) its tubelet chunks, labelled with its sampled frames' `times` when the clip has a
    frame rate (data/templates.tubelet_chunks). Under EVS a chunk's count is known only after encoding: the
    chunks then hold the clip's kept tokens at nominal counts (evs_nominal_tubelet_counts), which the trainer
    settles to the counts EVS chose (data/packing.settle_tubelet_chunks; the row's length does not change)."""
    n = enc.tokens(kind, units)
    wrap = prompt_template(template).media.get(kind)
    if kind != "video" or wrap is None or not wrap.per_tubelet:
        return n
    tubelets, per_tubelet = enc.tubelet_tokens(units)
    chunks = tubelet_chunks(units if isinstance(units, int) else units[0], enc.video_temporal, per_tubelet, times)
    if enc.video_pruning:
        chunks = [(label, c) for (label, _), c in zip(chunks, evs_nominal_tubelet_counts(tubelets, per_tubelet, n))]
    assert len(chunks) == tubelets and sum(c for _, c in chunks) == n, (chunks, n)
    return chunks


def next_media(queues: dict[str, list], kind: str, tag: str, template: PromptTemplate):
    """(wrap, item, chunks) for a `tag` placeholder: the template's wrapping of `kind`, the next `kind` item of
    `queues` (taken), and its chunks [(label, tokens)] (one unlabelled chunk for a plain count). PromptError when
    no item is left or the template takes no such media."""
    if not queues[kind]:
        raise PromptError(f"more {tag} placeholders than {kind} items (missing modality)")
    wrap = template.media.get(kind)
    if wrap is None:
        raise PromptError(f"the {template.name} prompt template has no {kind} media (its released model takes none)")
    item, n = queues[kind].pop(0)
    return wrap, item, n if isinstance(n, list) else [("", n)]


def encode_conversation(tok: Tokenizer, turns: list[dict], media_kinds: list[str],
                        media_tokens: list[int | list[tuple[str, int]]],
                        template: str | PromptTemplate = DEFAULT_TEMPLATE) -> EncodedPrompt:
    """Tokenize `turns`, expanding the k-th tag of each kind to media_tokens of the k-th item of that kind,
    wrapped as `template` (data/templates.py) says; each span covers the embedding positions only.

    media_kinds/media_tokens describe the sample's media items in storage order. An item's media_tokens is its
    embedding count, or for a video of a per-tubelet template its chunks [(label, tokens)]
    (data/templates.tubelet_chunks): label start context x tokens end per chunk, joined by "\n", one span per
    chunk (all of the same item). Raises PromptError when tags and media disagree: a media item with no tag would
    be computed but never attended to, a tag with no item would make the LLM read another sample's
    embeddings — both are silent misalignments."""
    template = prompt_template(template)
    queues: dict[str, list[tuple[int, int | list]]] = {
        k: [(i, n) for i, (kk, n) in enumerate(zip(media_kinds, media_tokens)) if kk == k] for k in MEDIA_TAGS}
    # pieces, not tokens: a video's placeholders are thousands of ids, and per-token Python lists cost more
    # than the decode of a small clip (scripts/bench_loader.py)
    tokens: list[np.ndarray] = []
    target: list[np.ndarray] = []
    spans: list[tuple[str, int, int, int]] = []
    length = 0

    def add(ids: np.ndarray, is_target: bool):
        nonlocal length
        tokens.append(ids)
        target.append(np.full(len(ids), is_target))
        length += len(ids)

    def add_text(text: str, is_target: bool):
        if text:
            add(np.asarray(tok.encode(text), dtype=np.int32), is_target)

    for turn in turns:
        role, content = turn.get("role"), turn.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise PromptError(f"malformed turn {str(turn)[:80]!r}: needs role system/user/assistant and text")
        learn = role == "assistant"
        add(tok.template(IM_START, f"{role}\n"), False)
        text = ""  # text not yet tokenized: a chunk label is tokenized with the text before it, as one string
        for part in MEDIA_TAG_RE.split(content):
            if part not in KIND_OF_TAG:
                text += part
                continue
            kind = KIND_OF_TAG[part]
            wrap, item, chunks = next_media(queues, kind, part, template)
            for c, (label, count) in enumerate(chunks):
                # a target text and a label (never a target) are tokenized apart
                label = ("\n" if c else "") + label
                if learn or not label:
                    add_text(text, learn)
                    text = ""
                add_text(text + label, False)
                text = ""
                if wrap.start:
                    add(tok.template(wrap.start), False)
                spans.append((MODULE_OF_KIND[kind], length, count, item))
                add(np.full(count, tok.special[wrap.context], dtype=np.int32), False)
                if wrap.end:
                    add(tok.template(wrap.end), False)
        add_text(text, learn)
        add(tok.template(IM_END), learn)
        add(tok.template("", "\n"), False)
    left = {k: len(q) for k, q in queues.items() if q}
    if left:
        raise PromptError(f"more media than placeholders: {left} item(s) without a tag")
    if not tokens:
        return EncodedPrompt(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool), spans)
    return EncodedPrompt(np.concatenate(tokens), np.concatenate(target), spans)
