"""A conversation in a release's own prompt format: its chat template, then its processor's media expansion.

    prompt = encode_release_conversation(tok, chat_template, turns, media_kinds, media_tokens, "omni")

What a model fine-tuned from a release (model.checkpoint=DIR with a chat template, data/run_tokenizer.
run_chat_template) trains on, so that it answers in the format it was released in and is served in:
  1. the turns rendered by DIR's chat template (chat_template.jinja, else tokenizer_config.json's) as
     transformers' apply_chat_template renders them (its Jinja environment, render_jinja_template, with the
     tokenizer's named special tokens: data/run_tokenizer.ChatTemplate); a turn with media as the parts
     transformers' processors hand a template ({"type": "image"}, ...) when the template writes them as the
     processor's tags, else as text holding those tags (data/templates.PROCESSOR_TAGS: <image>, <video>,
     <so_embedding>);
  2. each processor tag of the rendered text replaced as the release's processor replaces it (data/templates.py:
     <img> <image>xN </img>, <so_start> <so_embedding>xN <so_end>, a video's labelled tubelet chunks joined by
     "\\n"; the vl family's video is Tessera's own run of <video>), N from the encoders
     (data/tokens.media_placeholders);
  3. that text tokenized in one piece, as processor(text=...) tokenizes it (the release's tokenizer.json).
tests/test_release_prompt_format.py checks the ids against transformers' apply_chat_template + the released
Omni processor, and the loss mask against transformers' assistant mask.

The loss covers what the model generates in each assistant turn: the characters a render of the conversation up
to that turn adds after the render of the turns before it with the generation prompt (their common prefix: a
generation prompt that opens a reasoning block the turn then closes, e.g. "<think>" against "<think></think>",
leaves the turn's own part), through its end-of-turn text, not the whitespace after it. A template that marks
the assistant's part itself ({% generation %}) is taken at its word, as transformers' return_assistant_tokens_mask
takes it. A template whose render of a conversation is not the render of its prefixes (one that rewrites earlier
turns) has no such spans: refused naming data.chat_template=project. Media tokens never are targets; a token is a
target when it holds a target character, as transformers' assistant mask counts them.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from tessera.data.run_tokenizer import ChatTemplate
from tessera.data.templates import PROCESSOR_TAGS, prompt_template, PromptTemplate
from tessera.data.tokens import MEDIA_TAGS, MODULE_OF_KIND, EncodedPrompt, PromptError, Tokenizer, next_media

_TESSERA_TAG_RE = re.compile("|".join(re.escape(t) for t in MEDIA_TAGS.values()))
_TO_PROCESSOR = {MEDIA_TAGS[k]: PROCESSOR_TAGS[k] for k in MEDIA_TAGS}
_KIND_OF_TESSERA_TAG = {t: k for k, t in MEDIA_TAGS.items()}
_PROCESSOR_TAG_RE = re.compile("|".join(re.escape(t) for t in PROCESSOR_TAGS.values()))
_KIND_OF_PROCESSOR_TAG = {t: k for k, t in PROCESSOR_TAGS.items()}
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A release's chat template that does not render the run's conversations (a run-level problem, not a skip)."""


@lru_cache(maxsize=8)
def takes_media_parts(chat_template: ChatTemplate) -> bool:
    """Whether the template writes a media part of a turn ({"type": "image"}, as transformers' processors are
    handed conversations) as the processor's tag: then a turn with media is given to it as parts, so the template
    places (and may wrap) its media tags itself; else as text holding the processor's tags."""
    probe = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}]
    try:
        text, _ = _render(chat_template, probe)
    except ChatTemplateError:
        return False
    return PROCESSOR_TAGS["image"] in text


def release_messages(turns: list[dict], chat_template: ChatTemplate) -> list[dict]:
    """The turns as the template takes them (takes_media_parts): {"role", "content"}, a turn with media as parts
    [{"type": "text", "text": ...}, {"type": "image"}, ...] in its order, else text with the processor's tags."""
    parts = takes_media_parts(chat_template)
    out = []
    for turn in turns:
        role, content = turn.get("role"), turn.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise PromptError(f"malformed turn {str(turn)[:80]!r}: needs role system/user/assistant and text")
        if parts and _TESSERA_TAG_RE.search(content):
            pieces = _TESSERA_TAG_RE.split(content)
            tags = _TESSERA_TAG_RE.findall(content)
            content = [p for i, text in enumerate(pieces)
                       for p in ([{"type": "text", "text": text}] if text else [])
                       + ([{"type": _KIND_OF_TESSERA_TAG[tags[i]]}] if i < len(tags) else [])]
        else:
            content = _TESSERA_TAG_RE.sub(lambda m: _TO_PROCESSOR[m.group(0)], content)
        out.append({"role": role, "content": content})
    return out


def _render(chat_template: ChatTemplate, messages: list[dict], **kwargs) -> tuple[str, list]:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:  # with the tokenizer's named special tokens, as apply_chat_template renders it
        (text,), generation = render_jinja_template([messages], chat_template=chat_template.jinja,
                                                    **dict(chat_template.tokens), **kwargs)
    except Exception as e:  # the template's own raise_exception, a variable it needs and is not given
        raise ChatTemplateError(f"the release's chat template does not render this conversation ({type(e).__name__}: "
                                f"{e}); set data.chat_template=project to train the project's turns instead") from None
    return text, generation[0] if generation else []  # [(start, end)] of {% generation %} blocks, when asked


def assistant_spans(chat_template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the [start, end) characters of each assistant turn's generated part) (module
    docstring)."""
    if _GENERATION_RE.search(chat_template.jinja):
        text, generation = _render(chat_template, messages, return_assistant_tokens_mask=True)
        return text, [(s, e) for s, e in generation]
    text, _ = _render(chat_template, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, _ = _render(chat_template, messages[:i], add_generation_prompt=True)
        upto, _ = _render(chat_template, messages[:i + 1])
        if not text.startswith(upto):
            raise ChatTemplateError(
                f"the release's chat template renders turn {i + 1} of a conversation otherwise once later turns "
                f"follow ({upto[-80:]!r} is not how the whole conversation begins): its assistant turns cannot be "
                f"told apart for the loss; set data.chat_template=project, or mark them with {{% generation %}}")
        start = next((j for j, (a, b) in enumerate(zip(prompt, upto)) if a != b), min(len(prompt), len(upto)))
        end = len(upto.rstrip())
        spans.append((start, max(start, end)))
    return text, spans


def encode_release_conversation(tok: Tokenizer, chat_template: ChatTemplate, turns: list[dict], media_kinds: list[str],
                                media_tokens: list[int | list[tuple[str, int]]],
                                template: str | PromptTemplate) -> EncodedPrompt:
    """What data/tokens.encode_conversation returns (same arguments: media in storage order, an item's embedding
    count or its tubelet chunks; `template` the family's media wrapping), in the release's prompt format."""
    template = prompt_template(template)
    text, spans = assistant_spans(chat_template, release_messages(turns, chat_template))
    queues = {k: [(i, n) for i, (kk, n) in enumerate(zip(media_kinds, media_tokens)) if kk == k] for k in MEDIA_TAGS}
    # the expanded text, each run of context tokens written once (expanded in the ids: the tag is a special token,
    # so the tokens around it do not depend on how often it repeats); `marks`: its [start, end) target characters
    pieces: list[str] = []
    contexts: dict[int, tuple] = {}  # char offset of a context tag -> (its token, count, item, media kind)
    marks: list[tuple[int, int]] = []
    length = 0

    def add(piece: str, in_text_at: int | None):
        """Append a piece of the rendered text (which keeps its characters' targets) or of a media expansion
        (in_text_at None: never a target)."""
        nonlocal length
        for s, e in spans if in_text_at is not None else ():
            lo, hi = max(s, in_text_at), min(e, in_text_at + len(piece))
            if lo < hi:
                marks.append((length + lo - in_text_at, length + hi - in_text_at))
        pieces.append(piece)
        length += len(piece)

    at = 0
    for match in _PROCESSOR_TAG_RE.finditer(text):
        add(text[at:match.start()], at)
        at = match.end()
        kind = _KIND_OF_PROCESSOR_TAG[match.group(0)]
        wrap, item, chunks = next_media(queues, kind, MEDIA_TAGS[kind], template)
        for c, (label, count) in enumerate(chunks):
            add(("\n" if c else "") + label + wrap.start, None)
            contexts[length] = (wrap.context, count, item, kind)
            add(wrap.context, None)
            add(wrap.end, None)
    add(text[at:], at)
    left = {k: len(q) for k, q in queues.items() if q}
    if left:
        raise PromptError(f"more media than placeholders: {left} item(s) without a tag")

    ids, offsets = tok.encode_with_offsets("".join(pieces))
    edges = np.zeros(length + 1, dtype=np.int64)
    for s, e in marks:
        edges[s] += 1
        edges[e] -= 1
    marked = np.concatenate([[0], np.cumsum(np.cumsum(edges)[:-1] > 0)])  # target characters before each offset
    tokens, target, out_spans, position = [], [], [], 0
    for token, (start, end) in zip(ids, offsets):
        if start in contexts and token == tok.special[contexts[start][0]]:
            _, count, item, kind = contexts.pop(start)
            out_spans.append((MODULE_OF_KIND[kind], position, count, item))
            tokens.append(np.full(count, token, dtype=np.int32))
            target.append(np.zeros(count, dtype=bool))
            position += count
            continue
        # a token that holds a target character is a target (transformers' assistant mask: char_to_token)
        tokens.append(np.asarray([token], dtype=np.int32))
        target.append(np.asarray([marked[min(max(end, start + 1), length)] > marked[start]]))
        position += 1
    assert not contexts, f"context tokens not found where written: {contexts}"
    if not tokens:
        return EncodedPrompt(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool), out_spans)
    return EncodedPrompt(np.concatenate(tokens), np.concatenate(target), out_spans)
