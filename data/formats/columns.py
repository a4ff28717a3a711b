"""A flat table's columns mapped to a caption / transcript sample: --columns image=COL,text=COL (also video=, audio=,
prompt=), the way Megatron-Bridge's Hugging Face schema adapters map CommonVoice-style (audio + sentence) and
caption sets. The user turn is the media tag, a newline and the prompt: the `prompt` column's value per row, or
`prompt`'s text itself when no column has that name, or the kind's caption prompt (common.PROMPTS); the `text`
column is the answer. A Hugging Face folder builder's dataset (imagefolder / audiofolder / videofolder) needs no
--columns: its media column and the first of TEXT_COLUMNS it has are taken (for_folder)."""

from __future__ import annotations

from tessera.data.formats import checked
from tessera.data.formats.common import KINDS, PROMPTS, RecordError, local, text
from tessera.data.tokens import MEDIA_TAGS

#: the usual caption / transcript columns, in the order they are looked for
TEXT_COLUMNS = ("text", "caption", "transcription", "transcript", "sentence", "label_text", "description")
ROLES = KINDS + ("text", "prompt")


class ColumnsError(ValueError):
    """--columns that cannot apply to the data; the message names the column and the ones there are."""


class Columns:
    def __init__(self, mapping: dict[str, str], present: list[str], name: str):
        self.mapping, self.name = mapping, name
        kinds = [k for k in KINDS if k in mapping]
        if len(kinds) != 1 or "text" not in mapping:
            raise ColumnsError(f"{name}: give one media column (image=, video= or audio=) and text=COL, e.g. "
                               f"--columns audio=audio,text=sentence")
        self.kind = kinds[0]
        for role in (self.kind, "text"):
            if mapping[role] not in present:
                raise ColumnsError(f"{name}: the data has no column {mapping[role]!r} (for {role}=); its columns: "
                                   f"{sorted(present)}")
        prompt = mapping.get("prompt")
        self.prompt_column = prompt if prompt in present else None
        self.prompt = PROMPTS[self.kind].split("\n", 1)[1] if prompt is None else prompt

    @classmethod
    def parse(cls, spec: str, present: list[str]) -> "Columns":
        """--columns ROLE=COL,ROLE=COL against the data's columns `present`."""
        mapping = {}
        for part in filter(None, spec.split(",")):
            role, sep, column = part.partition("=")
            if not sep or role.strip() not in ROLES or not column.strip():
                raise ColumnsError(f"--columns {spec}: {part!r} is not ROLE=COLUMN with ROLE one of {ROLES}")
            mapping[role.strip()] = column.strip()
        return cls(mapping, present, f"--columns {spec}")

    @classmethod
    def for_folder(cls, kind: str, present: list[str]) -> "Columns":
        """A folder builder's columns: `kind` (the builder's media column) and the first usual text column."""
        found = next((c for c in TEXT_COLUMNS if c in present), None)
        if found is None:
            raise ColumnsError(f"the {kind}folder's metadata has none of the text columns {TEXT_COLUMNS} (it has "
                               f"{sorted(present)}): name yours with --columns {kind}={kind},text=COL")
        return cls({kind: kind, "text": found}, present, f"{kind}folder ({kind}, {found})")

    def __call__(self, rec: dict):
        source = rec.get(self.mapping[self.kind])
        if source is None:
            raise RecordError("missing_media", self.mapping[self.kind], f"a {self.kind}", self.name)
        said = text(rec.get(self.mapping["text"]), self.mapping["text"], self.name)
        prompt = self.prompt if self.prompt_column is None else text(rec.get(self.prompt_column), self.prompt_column,
                                                                      self.name)
        turns = [{"role": "user", "content": MEDIA_TAGS[self.kind] + "\n" + prompt},
                 {"role": "assistant", "content": said}]
        return checked(turns, [(self.kind, local(source, self.mapping[self.kind], self.name))], self.name, "text")
