"""What the guided-decoding kit drives a backend with: a small byte-level vocabulary and constraints it can judge.

The vocabulary is a byte-level BPE trained on a few lines of JSON and words (so tokens such as
``{"`` or ``":Ġ"`` cross the constraints' boundaries), with three special tokens — an end of
sequence, a second stop token and one that is neither — and padding ids past its tokens, built
as the engine builds a model's (``fd_core.model.tokenizer.Tokenizer.vocabulary``).

Each :class:`Sample` is a constraint of one kind with the means to judge an output: why a complete
output does not satisfy it, one output that does, and, where its outputs are few, all of them (the
mask is then known exactly).
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from fd_core.contracts.guided_decoding import Vocabulary
from fd_core.request import GuidedDecoding

#: The vocabulary's special tokens: the end of sequence (its eos id), a second stop token, and one
#: that is neither (a constraint's output never holds it).
END_TOKEN, STOP_TOKEN, OTHER_TOKEN = "<|end|>", "<|stop|>", "<|tool|>"
END, STOP, OTHER = 0, 1, 2
#: Tokens the BPE learns (the 256 bytes, the specials, merges) and the logits width: ids from the
#: one to the other are padding; the width is no multiple of 32, so the mask's last word has unused bits.
VOCAB_TOKENS: Final = 320
LOGITS_WIDTH: Final = 330
_TRAINING_TEXT: Final = (
    '{"name": "ada", "count": 42, "tags": ["red", "blue"], "ok": true}\n',
    '{"name": "bob", "count": 7, "tags": [], "ok": false}\n',
    '{"a": [1, true, null], "b": {"c": "x"}}\n',
    '<call>{"city": "Paris"}</call> <call>{"city": "Rome"}</call>\n',
    "[1,true,3] [true] ab-123 cd-45 red green blue bluegreen grün\n",
    'Grüße, 漢字 🙂 "quotes" \\n\t tabs and spaces\n',
)


@dataclass(frozen=True, slots=True)
class KitVocabulary:
    """The vocabulary a backend is built with, and each id's bytes in decoded text."""

    vocabulary: Vocabulary
    token_bytes: tuple[bytes, ...]   # per id below LOGITS_WIDTH; b"" for the special tokens and padding

    def describe(self, token_id: int) -> str:
        """How messages name a token: ``token 37 (b'{"')``, ``token 1 (<|stop|>)``, ``token 325 (padding)``."""
        tokens = self.vocabulary.tokens
        if token_id >= len(tokens):
            return f"token {token_id} (padding)"
        spelled = self.token_bytes[token_id]
        return f"token {token_id} ({spelled!r})" if spelled else f"token {token_id} ({tokens[token_id]})"


@functools.lru_cache(maxsize=1)
def kit_vocabulary() -> KitVocabulary:
    """The kit's vocabulary (trained deterministically; built once per process)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from fd_core.model.tokenizer import Tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TOKENS, special_tokens=[END_TOKEN, STOP_TOKEN, OTHER_TOKEN],
                                  initial_alphabet=byte_level.alphabet(), show_progress=False)
    backend.train_from_iterator(_TRAINING_TEXT * 4, trainer)
    tokenizer = Tokenizer(backend, bos_token=None, eos_tokens=[END_TOKEN], chat_template=None,
                          source="the guided-decoding conformance kit")
    assert tokenizer.vocab_size == VOCAB_TOKENS and tokenizer.eos_token_ids == (END,)
    spelled = tokenizer.token_bytes()
    return KitVocabulary(tokenizer.vocabulary(LOGITS_WIDTH), spelled + (b"",) * (LOGITS_WIDTH - len(spelled)))


def label(constraint: GuidedDecoding) -> str:
    """How messages name a constraint: ``regex '(ab|cd)-[0-9]{1,3}'``."""
    spec = constraint.spec
    return f"{constraint.kind} {spec if len(spec) <= 60 else spec[:57] + '...'!r}"


@dataclass(frozen=True, slots=True)
class Sample:
    """A constraint the kit compiles, and how it judges the outputs."""

    constraint: GuidedDecoding
    problem: Callable[[str], str | None]   # why a complete output does not satisfy it; None: it does
    target: str                 # an output that satisfies it (JSON laid out compactly)
    other: str | None           # a spec of the same kind whose outputs start differently (None: the kind has one)
    layout: bool = False        # whitespace outside JSON strings is the backend's choice
    words: frozenset[str] | None = None   # every output, where they are few: the mask is then known exactly
    ends: bool = True           # a walk that follows the mask ends soon (False: outputs nest without bound)

    @property
    def kind(self) -> str:
        return self.constraint.kind

    @property
    def label(self) -> str:
        return label(self.constraint)

    def continues(self, data: bytes) -> bool:
        """Whether ``data`` begins (or is) an output; only for a sample with ``words``."""
        assert self.words is not None
        return data in _prefixes(self.words)


@functools.cache
def _prefixes(words: frozenset[str]) -> frozenset[bytes]:
    return frozenset(word.encode()[:end] for word in words for end in range(len(word.encode()) + 1))


def decoded(data: bytes) -> str | None:
    """The output's text, or None while it ends inside a character. A backend may let a JSON string
    hold a UTF-16 surrogate's bytes (as xgrammar does); they decode as such."""
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def completes(sample: Sample, data: bytes) -> bool:
    """Whether ``data`` is a whole output of ``sample``."""
    text = decoded(data)
    return text is not None and sample.problem(text) is None


def _json(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"it is not JSON ({exc})"


ITEM_SCHEMA: Final = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "tags", "ok"],
    "additionalProperties": False,
}


def _item_problem(text: str) -> str | None:
    """What of ITEM_SCHEMA the text breaks (the schema is small enough to judge by hand, without a
    JSON-schema library)."""
    value, why = _json(text)
    if why is not None:
        return why
    if not isinstance(value, dict) or set(value) != set(ITEM_SCHEMA["required"]):
        return f"the schema wants an object with exactly the keys name, count, tags and ok, got {value!r}"
    name, count, tags, ok = value["name"], value["count"], value["tags"], value["ok"]
    if not isinstance(name, str) or not re.fullmatch("[a-z]{1,6}", name):
        return f"name must be 1 to 6 letters a-z, got {name!r}"
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 99:
        return f"count must be an integer in [0, 99], got {count!r}"
    if not isinstance(tags, list) or len(tags) > 3 or any(tag not in ("red", "green", "blue") for tag in tags):
        return f"tags must be at most 3 of red, green, blue, got {tags!r}"
    if not isinstance(ok, bool):
        return f"ok must be a boolean, got {ok!r}"
    return None


def _object_problem(text: str) -> str | None:
    value, why = _json(text)
    return why if why is not None else None if isinstance(value, dict) else f"it is not an object: {value!r}"


REGEX: Final = r"(ab|cd)-[0-9]{1,3}"
CHOICES: Final = ("red", "green", "blue", "bluegreen", "grün")   # "blue" is complete and may go on
GRAMMAR: Final = 'root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= digit | "true"\ndigit ::= [0-9]'
_GRAMMAR_ITEMS: Final = (*"0123456789", "true")
CITY_TAG: Final = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<call>", "end": "</call>",
    "content": {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}}


def _tag_problem(text: str) -> str | None:
    if not (text.startswith("<call>") and text.endswith("</call>")):
        return "it is not <call>...</call>"
    value, why = _json(text[len("<call>"):-len("</call>")])
    return why if why is not None else None if value in ({"city": "Paris"}, {"city": "Rome"}) else (
        f"the call's JSON must be {{\"city\": \"Paris\" or \"Rome\"}}, got {value!r}")


def _one_of(words: frozenset[str], what: str) -> Callable[[str], str | None]:
    return lambda text: None if text in words else f"it is not {what}"


_REGEX_WORDS: Final = frozenset(f"{head}-{digits}" for head in ("ab", "cd") for length in (1, 2, 3)
                                for digits in ("".join(d) for d in itertools.product("0123456789", repeat=length)))
_GRAMMAR_WORDS: Final = frozenset("[" + ",".join(items) + "]" for count in (1, 2, 3)
                                  for items in itertools.product(_GRAMMAR_ITEMS, repeat=count))
_CHOICE_WORDS: Final = frozenset(CHOICES)

#: One constraint of each kind the contract knows (``fd_core.request.GUIDED_KINDS``).
SAMPLES: Final = (
    Sample(GuidedDecoding("json", json.dumps(ITEM_SCHEMA)), _item_problem,
           '{"name":"ada","count":42,"tags":["red","blue"],"ok":true}',
           other='{"type": "array", "items": {"type": "integer"}, "maxItems": 2}', layout=True),
    Sample(GuidedDecoding("json_object"), _object_problem, '{"a":[1,true,null],"b":{"c":"x"}}', other=None,
           layout=True, ends=False),
    Sample(GuidedDecoding("regex", REGEX), lambda text: None if re.fullmatch(REGEX, text) else f"it does not match "
           f"{REGEX!r}", "cd-507", other="x+", words=_REGEX_WORDS),
    Sample(GuidedDecoding("choice", json.dumps(list(CHOICES), ensure_ascii=False)),
           _one_of(_CHOICE_WORDS, f"one of {CHOICES}"), "bluegreen", other='["xyz"]', words=_CHOICE_WORDS),
    Sample(GuidedDecoding("grammar", GRAMMAR), _one_of(_GRAMMAR_WORDS, "a list of 1 to 3 digits or true"),
           "[true,4]", other='root ::= "x"', words=_GRAMMAR_WORDS),
    Sample(GuidedDecoding("structural_tag", json.dumps(CITY_TAG)), _tag_problem, '<call>{"city":"Rome"}</call>',
           other=json.dumps({**CITY_TAG, "format": {**CITY_TAG["format"], "begin": "<x>"}}), layout=True),
)


@dataclass(frozen=True, slots=True)
class Invalid:
    """A constraint that cannot compile, and a word its error must quote (None: any clear message)."""

    constraint: GuidedDecoding
    names: str | None

    @property
    def kind(self) -> str:
        return self.constraint.kind

    @property
    def label(self) -> str:
        return label(self.constraint)


INVALID: Final = (
    Invalid(GuidedDecoding("json", '{"type": "object", "properties": {'), None),   # not JSON
    Invalid(GuidedDecoding("json", '{"type": "object", "properties": {"a": {"type": "unicorn"}}}'), "unicorn"),
    Invalid(GuidedDecoding("regex", "(ab"), None),
    Invalid(GuidedDecoding("choice", '["red",'), None),
    Invalid(GuidedDecoding("choice", "[]"), None),
    Invalid(GuidedDecoding("grammar", 'root ::= "a" missing_rule'), "missing_rule"),
    Invalid(GuidedDecoding("structural_tag", '{"type": "structural_tag", "format": {"type": "unicorn"}}'), "unicorn"),
)
