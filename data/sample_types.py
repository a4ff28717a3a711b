"""Energon's standard sample types as conversations: a dataset made with `energon prepare` trains as it is.

    check_sample_types("/data/coco")        # {dataset dir: sample type}, every dataset of a dir or blend YAML;
                                            # UnsupportedSampleType naming the supported ones (before launch)
    turns, media = conversation_of(sample, caption_prompt=None)   # in the task encoder (data/loader.py)

The project's own datasets are CrudeWebdataset samples in its JSON schema (data/prepare.py). Anything else is one of
energon's typed samples, built by energon from the member map in the dataset's .nv-meta/dataset.yaml. The loader
reads them with TEXT_DECODER: energon's webdataset decoding of the text members (txt -> str, json -> object, so a
field map such as `context: json[question]` resolves) while media members stay bytes. Media are decoded by
data/media.py on the ranks that encode them, as for a prepared dataset: every rank reads the whole global
stream (data/loader.py), and decoding pixels there would cost every rank the whole batch's decode. Such datasets
have no media metadata, so every rank reads each sample's media bytes (logged once per dataset).

How each type becomes a conversation (user turn, assistant turn; the media tag first unless the text has one):
  CaptioningSample      user: data.caption_prompt (None: the project's caption prompt, data/formats/common.PROMPTS)
                        assistant: caption
  VQASample             user: context; assistant: the answer of the largest answer_weight (the first without)
  MultiChoiceVQASample  user: context and the choices as "A. ...", one a line; assistant: "X. correct choice"
  VidQASample           as VQASample, with the video
  InterleavedSample     one assistant turn: its texts, each image where it stands (a document to learn)
"""

from __future__ import annotations

from pathlib import Path

import webdataset
import yaml
from megatron.energon.flavors.webdataset.sample_decoder import SampleDecoder

from tessera.data.formats import PROMPTS
from tessera.data.tokens import MEDIA_TAGS

#: the project's own schema (data/prepare.py), read by the loader's cooker
CRUDE = "CrudeWebdataset"
#: energon sample type -> the media kind it carries
MEDIA_OF_TYPE = {"CaptioningSample": "image", "VQASample": "image", "MultiChoiceVQASample": "image",
                 "VidQASample": "video", "InterleavedSample": "image"}
SUPPORTED = (CRUDE, *MEDIA_OF_TYPE)


class UnsupportedSampleType(ValueError):
    """A dataset whose sample type has no conversation here; the message names it and the supported ones."""


class SampleTypeError(ValueError):
    """A typed sample that cannot become a conversation (no answer, a choice index out of range...)."""


class TextMembersDecoder(SampleDecoder):
    """energon's sample decoder for the text members only (webdataset's basic handlers: txt, json, cls...);
    media members stay bytes (see the module docstring). A text member that does not decode stays bytes: the
    task encoder then skips the sample with its reason instead of energon retrying it."""

    def __init__(self):
        super().__init__()
        self._decoder = webdataset.autodecode.Decoder([])

    def __call__(self, sample: dict) -> dict:
        out = {}
        for name, value in sample.items():
            if name.startswith("__") or not isinstance(value, bytes):
                out[name] = value
                continue
            try:
                out[name] = self._decoder({"__key__": sample.get("__key__", ""), name: value})[name]
            except Exception:  # noqa: BLE001 - kept raw; named where the sample is encoded
                out[name] = value
        # what the reader read, before decoding: the loader's data_read_bytes (data/loader.py)
        out["__member_bytes__"] = sum(len(v) for n, v in sample.items() if not n.startswith("__")
                                      and isinstance(v, bytes))
        return out

    def config(self) -> dict:
        return {"text_members_only": True}


TEXT_DECODER = TextMembersDecoder()


def _tagged(kind: str, text: str) -> str:
    tag = MEDIA_TAGS[kind]
    return text if tag in text else f"{tag}\n{text}"


def _best_answer(sample) -> str:
    answers = sample.answers
    if isinstance(answers, str):
        return answers
    if not answers:
        raise SampleTypeError(f"{type(sample).__name__} has no answers (a test split?): nothing to learn")
    weights = getattr(sample, "answer_weights", None)
    if weights is None:
        return answers[0]
    weights = [float(w) for w in weights]
    return answers[max(range(len(answers)), key=weights.__getitem__)]


def _text(value, field: str, sample) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise SampleTypeError(f"{type(sample).__name__}.{field} is not UTF-8 text") from None
    if not isinstance(value, str):
        raise SampleTypeError(f"{type(sample).__name__}.{field} is {type(value).__name__}, expected text")
    return value


def _media(value, field: str, sample) -> bytes:
    if not isinstance(value, bytes):
        raise SampleTypeError(f"{type(sample).__name__}.{field} is {type(value).__name__}, expected the media "
                              f"member's bytes (a custom sample_loader must pass them through undecoded)")
    return value


def conversation_of(sample, caption_prompt: str | None = None) -> tuple[list[dict], list[tuple[str, bytes]]]:
    """(turns, [(kind, bytes)]) of one of energon's typed samples (module docstring); SampleTypeError."""
    name = type(sample).__name__
    kind = MEDIA_OF_TYPE.get(name)
    if name == "CaptioningSample":
        prompt = PROMPTS[kind] if caption_prompt is None else _tagged(kind, caption_prompt)
        return ([{"role": "user", "content": prompt},
                 {"role": "assistant", "content": _text(sample.caption, "caption", sample)}],
                [(kind, _media(sample.image, "image", sample))])
    if name in ("VQASample", "VidQASample"):
        field = "video" if name == "VidQASample" else "image"
        return ([{"role": "user", "content": _tagged(kind, _text(sample.context, "context", sample))},
                 {"role": "assistant", "content": _text(_best_answer(sample), "answers", sample)}],
                [(kind, _media(getattr(sample, field), field, sample))])
    if name == "MultiChoiceVQASample":
        choices, right = sample.choices or [], int(sample.correct_choice_idx)
        if not 0 <= right < len(choices):
            raise SampleTypeError(f"MultiChoiceVQASample.correct_choice_idx {right} is not one of its "
                                  f"{len(choices)} choices")
        letters = [f"{chr(ord('A') + i)}. {_text(c, 'choices', sample)}" for i, c in enumerate(choices)]
        question = _text(sample.context, "context", sample) + "\n" + "\n".join(letters)
        return ([{"role": "user", "content": _tagged(kind, question)},
                 {"role": "assistant", "content": letters[right]}],
                [(kind, _media(sample.image, "image", sample))])
    if name == "InterleavedSample":
        text, media = "", []
        for i, part in enumerate(sample.sequence):
            if isinstance(part, bytes):
                media.append((kind, part))
                text += MEDIA_TAGS[kind]
            else:
                text += _text(part, f"sequence[{i}]", sample)
        return [{"role": "assistant", "content": text}], media
    raise UnsupportedSampleType(f"energon sample type {name} has no conversation here; supported: "
                                f"{', '.join(SUPPORTED)}")


# ---- before launch: which sample types a data.path holds ------------------------------------------------------

def dataset_sample_type(directory: Path, config: str = "dataset.yaml") -> str:
    """The sample type named by DIR/.nv-meta/<config>: `sample_type: {__class__}`, or a dataset class (the older
    form, e.g. CaptioningWebdataset, CrudeWebdataset)."""
    path = directory / ".nv-meta" / config
    if not path.is_file():
        raise UnsupportedSampleType(f"{directory} has no {path}: prepare it with `energon prepare {directory}` "
                                    f"or scripts/prepare_data.py")
    spec = yaml.safe_load(path.read_text()) or {}
    cls = (spec.get("sample_type") or {}).get("__class__") if isinstance(spec.get("sample_type"), dict) else None
    if cls is None:
        cls = spec.get("__class__", "?")
        if cls.endswith("Webdataset") and cls != CRUDE:  # CaptioningWebdataset -> CaptioningSample
            cls = cls.removesuffix("Webdataset") + "Sample"
    return cls


def _datasets_of_blend(path: Path, seen: set) -> dict[str, str]:
    """{dataset dir: sample type} of every dataset a metadataset YAML names (nested YAMLs followed)."""
    if path in seen:
        return {}
    seen.add(path)
    out: dict[str, str] = {}

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("path")
            if isinstance(ref, str) and "://" not in ref:  # an object-store dataset: energon's to check
                target = Path(ref).expanduser()
                target = target if target.is_absolute() else path.parent / target
                if target.suffix in (".yaml", ".yml") and target.is_file():
                    out.update(_datasets_of_blend(target, seen))
                elif target.is_dir():
                    out[str(target)] = dataset_sample_type(target, node.get("dataset_config", "dataset.yaml"))
                else:
                    raise UnsupportedSampleType(f"blend {path} names {ref}, which is neither a dataset directory "
                                                f"nor a metadataset YAML")
            for key, value in node.items():
                if key != "path":
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load(path.read_text()))
    return out


def check_sample_types(path: str | Path) -> dict[str, str]:
    """{dataset dir: sample type} of a prepared dataset or a blend YAML; UnsupportedSampleType when one of them
    has a sample type no conversation is made of (named, with the supported ones and the fix)."""
    if "://" in str(path) or not Path(path).expanduser().exists():
        return {}  # not on this machine's file system: energon reads (and names) it
    path = Path(path).expanduser()
    types = _datasets_of_blend(path, set()) if path.is_file() else {str(path): dataset_sample_type(path)}
    bad = {d: t for d, t in types.items() if t not in SUPPORTED}
    if bad:
        listed = "; ".join(f"{d} is {t}" for d, t in bad.items())
        raise UnsupportedSampleType(
            f"{listed}: Tessera turns these energon sample types into conversations: {', '.join(SUPPORTED)} "
            f"(CrudeWebdataset in the project's JSON schema). Re-run `energon prepare` with one of them, or write "
            f"the data as a manifest and run scripts/prepare_data.py")
    return types
