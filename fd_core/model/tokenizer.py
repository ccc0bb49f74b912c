"""Turn text into token ids and back, and render chat messages into a prompt, for one model.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` built either from a Hugging Face
``tokenizer.json`` (plus ``tokenizer_config.json`` for the chat template and special tokens) or
from a GGUF file's ``tokenizer.*`` metadata (``tokenizer.ggml.model`` "gpt2": byte-level BPE;
"llama": SentencePiece BPE). Chat templates are Jinja2, rendered in a sandbox with the globals
Hugging Face templates expect (``raise_exception``, ``strftime_now``, ``bos_token``, ``eos_token``...).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from fd_core.errors import ModelLoadError, RequestError

if TYPE_CHECKING:
    import jinja2
    import tokenizers

    from fd_core.contracts.guided_decoding import Vocabulary

#: GGUF ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
_TOKEN_TYPE_NORMAL: Final = 1
_TOKEN_TYPE_UNKNOWN: Final = 2
_TOKEN_TYPE_CONTROL: Final = 3
_TOKEN_TYPE_USER_DEFINED: Final = 4

#: What stands in for message ``i``'s content while :meth:`Tokenizer.encode_chat` finds where the
#: template put it (private-use code points: no text a template writes holds them).
_CONTENT_MARK: Final = "\ue000{}\ue001"
_CONTENT_MARKS: Final = re.compile("\ue000(\\d+)\ue001")

#: SentencePiece's spelling of a space ("▁", U+2581) inside vocabulary entries.
_SPM_SPACE: Final = "\u2581"

#: Keys a GGUF may set for a SentencePiece vocabulary that :func:`_sentencepiece_bpe` cannot apply,
#: each with the only value it accepts. llama.cpp ignores them, so a file that sets them to anything
#: else is tokenized unlike its model's own tokenizer; such a file is refused instead.
_SPM_REFUSED: Final[Mapping[str, Any]] = {
    "tokenizer.ggml.pre": "default",  # a regex split before BPE: SentencePiece has none
    "tokenizer.ggml.remove_extra_whitespaces": False,  # trim and collapse runs of spaces
    "tokenizer.ggml.precompiled_charsmap": [],  # a normalization table (NFKC and the like)
}

#: Texts llama.cpp treats as end-of-generation when a GGUF marks them as control tokens.
_EOG_TEXTS: Final = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|eom_id|>"}
)

_LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> how llama.cpp splits text before BPE. "digits" is GPT-2's regex after
#: isolating every digit (llama.cpp's SMOLLM/STARCODER group); "gpt2" is GPT-2's regex alone.
_GGUF_PRE_TOKENIZERS: Final[Mapping[str, str]] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class Tokenizer:
    """Encode/decode text and render chat templates for one model.

    Build one with :meth:`from_folder` or :meth:`from_gguf_metadata`; the constructor takes an
    already configured ``tokenizers.Tokenizer`` (its post-processor decides what
    ``add_special_tokens=True`` adds, e.g. a BOS).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_tokens: Sequence[str],
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None,
        source: str,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.source = source  # path the tokenizer came from, for error messages
        ids = [self._required_id(t) for t in eos_tokens] + list(eos_token_ids)
        #: Ids that end generation, in first-seen order, without duplicates.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.bos_token_id: int | None = self._required_id(bos_token) if bos_token else None
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        if chat_template is not None:
            self._compiled = _compile_template(chat_template, source)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | Path, *, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load ``tokenizer.json`` and, when present, ``tokenizer_config.json`` and a chat template.

        ``extra_eos_token_ids`` (e.g. from ``generation_config.json``) are added to the
        tokenizer's own EOS token.
        """
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {path}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json") or {}
        eos = _token_text(config.get("eos_token"))
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_tokens=[eos] if eos else [],
            eos_token_ids=extra_eos_token_ids,
            chat_template=_folder_chat_template(folder, config),
            source=str(folder),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, source: str) -> Tokenizer:
        """Build the tokenizer a GGUF file's ``tokenizer.*`` metadata values describe.

        ``tokenizer.ggml.model`` is ``"gpt2"`` (byte-level BPE, :func:`_byte_level_bpe`) or
        ``"llama"`` (SentencePiece BPE, :func:`_sentencepiece_bpe`). Control and unknown tokens
        become special tokens and user-defined ones are matched whole, as llama.cpp does;
        ``add_special_tokens=True`` adds what ``tokenizer.ggml.add_bos_token`` /
        ``add_eos_token`` ask for (absent: llama.cpp's defaults, a BOS for "llama" only). Any
        other model, or a setting that cannot be honoured exactly, raises :class:`ModelLoadError`
        naming its key.
        """
        from tokenizers import AddedToken

        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"{source}: tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' "
                "(byte-level BPE) and 'llama' (SentencePiece BPE)"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [_TOKEN_TYPE_NORMAL] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level_bpe(metadata, tokens, source)
        else:
            backend = _sentencepiece_bpe(metadata, tokens, types, source)
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=False)
                if k in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN)
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types, strict=False)
                if k == _TOKEN_TYPE_USER_DEFINED
            ]
        )
        around = {}  # "bos"/"eos": the token add_special_tokens=True puts before/after the text
        for end, default in (("bos", kind == "llama"), ("eos", False)):
            add_key = f"tokenizer.ggml.add_{end}_token"
            if metadata.get(add_key, default):
                around[end] = _gguf_token(
                    metadata, f"tokenizer.ggml.{end}_token_id", tokens, source,
                    needed_by=f"adding a {end.upper()} ({add_key})",
                )
        if around:
            backend.post_processor = _gguf_post_processor(backend, around.get("bos"), around.get("eos"))
        bos = _gguf_token(metadata, "tokenizer.ggml.bos_token_id", tokens, source)
        eos_ids = gguf_eos_token_ids(metadata)
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=[tokens[i] for i in eos_ids[:1]],
            eos_token_ids=eos_ids,
            chat_template=metadata.get("tokenizer.chat_template"),
            source=source,
        )

    # -- ids and text -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def vocabulary(self, size: int) -> Vocabulary:
        """The vocabulary as a guided-decoding backend reads it; ``size``: the model's logits width."""
        from fd_core.contracts.guided_decoding import Vocabulary

        backend = self._backend
        tokens = tuple(backend.id_to_token(i) or "" for i in range(backend.get_vocab_size()))
        return Vocabulary(tokens=tokens, size=size, eos_token_ids=self.eos_token_ids, tokenizer_json=backend.to_str())

    def token_bytes(self) -> tuple[bytes, ...]:
        """Every token id's bytes as they stand in decoded text (``b""`` for special tokens): where the
        engine finds a reply's reasoning tags (``fd_core.model.token_bytes``)."""
        from fd_core.model.token_bytes import token_bytes

        return token_bytes(self._backend)

    def save(self, path: str | Path) -> None:
        """Write it as a Hugging Face ``tokenizer.json`` (to hand a loaded model to another engine)."""
        self._backend.save(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole.

        ``add_special_tokens`` adds what the tokenizer's post-processor adds (e.g. a BOS).
        Runs through ``encode_batch``, which releases the GIL (``encode`` holds it: a 4 MiB text
        stalled the server's event loop for 3.5 s while another thread tokenised it).
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary entries of ``ids`` as stored (byte-level spelling, e.g. ``"Ġthe"``)."""
        if isinstance(ids, int):
            return self._token(ids)
        return [self._token(i) for i in ids]

    def _token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise RequestError(
                "token_id", f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
            )
        return token

    def _required_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{self.source}: special token {token!r} is not in the vocabulary")
        return token_id

    def encode_chat(self, messages: list[dict[str, Any]], text: str, *, content_as_text: bool = True,
                    **template_kwargs: Any) -> list[int]:
        """Token ids of ``text``, the rendering of ``messages`` by :meth:`apply_chat_template` with
        ``template_kwargs``, where message content that spells a special token (``<|im_end|>``)
        stays text: the characters, not the control token, so a user cannot end their turn or forge
        a ``system`` one. ``content_as_text=False``: the whole text as :meth:`encode` reads it.

        Text without such spellings is encoded whole (the same ids as :meth:`encode`). Otherwise
        the template's parts and the contents are encoded apart (a content as plain text) and joined,
        so tokens do not cross a content's edges. A template that changes content (trims it, say)
        cannot be split so: such a request is refused (RequestError on ``messages``).
        """
        if not content_as_text or not any(self._spells_special(m.get("content")) for m in messages):
            return self.encode(text)
        marked = [{**m, "content": _CONTENT_MARK.format(i)} if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        pieces = _CONTENT_MARKS.split(self.apply_chat_template(marked, **template_kwargs))
        # split's even pieces are the template's text, the odd ones the indices of the contents between
        parts = [(piece, self._backend) if i % 2 == 0 else (messages[int(piece)]["content"], self._plain_text_backend)
                 for i, piece in enumerate(pieces)]
        if "".join(part for part, _ in parts) != text:
            raise RequestError("messages", "a message spells a special token of the model and its chat template "
                               "changes message content, so that text cannot be kept apart from the template's "
                               "special tokens; remove it, or set server.special_tokens_in_messages = \"special\"")
        import tokenizers

        encodings = [backend.encode_batch([part], add_special_tokens=False)[0] for part, backend in parts if part]
        merged = tokenizers.Encoding.merge(encodings, growing_offsets=True)
        return self._backend.post_process(merged, add_special_tokens=True).ids

    def _spells_special(self, content: Any) -> bool:
        pattern = self._special_spellings
        return isinstance(content, str) and pattern is not None and pattern.search(content) is not None

    @functools.cached_property
    def _special_spellings(self) -> re.Pattern[str] | None:
        """One pattern of every special token's text (one pass over a message, however many the
        vocabulary has: Llama 3 has 256), or None without special tokens."""
        tokens = sorted((t.content for t in self._backend.get_added_tokens_decoder().values() if t.special),
                        key=len, reverse=True)
        return re.compile("|".join(map(re.escape, tokens))) if tokens else None

    @functools.cached_property
    def _plain_text_backend(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads special-token spellings as text."""
        import tokenizers

        backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    # -- chat -------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template into a prompt string.

        ``template_kwargs`` (e.g. ``tools``) are passed to the template as variables. Raises
        :class:`RequestError` (field ``messages``) when the model has no chat template or the
        template rejects the conversation via ``raise_exception``.
        """
        import jinja2

        if self._compiled is None:
            raise RequestError(
                "messages",
                f"the model at {self.source} has no chat template (no chat_template in "
                "tokenizer_config.json / chat_template.jinja, or tokenizer.chat_template in the "
                "GGUF); send a plain prompt to /v1/completions instead",
            )
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **template_kwargs,
            )
        except jinja2.TemplateError as e:
            raise RequestError("messages", f"chat template rejected the messages: {e}") from e


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-generation ids of a GGUF model, the way llama.cpp finds them.

    The explicit ``eos``/``eot``/``eom`` ids first, then every control token whose text is a
    well-known end marker (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``...).
    """
    ids = [
        metadata[key]
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if metadata.get(key) is not None
    ]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    ids += [
        i
        for i, (t, k) in enumerate(zip(tokens, types, strict=False))
        if k == _TOKEN_TYPE_CONTROL and t in _EOG_TEXTS
    ]
    return tuple(dict.fromkeys(int(i) for i in ids))


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE: the file's merges, text split as ``tokenizer.ggml.pre`` says."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"), source)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int], source: str
) -> tokenizers.Tokenizer:
    """SentencePiece BPE as llama.cpp's SPM tokenizer and Llama 2's ``tokenizer.json`` run it.

    Spaces are spelt ``▁``, and one is prepended to each run of text between special tokens
    unless ``tokenizer.ggml.add_space_prefix`` is false (Gemma); the decoder drops it again.
    Characters missing from the vocabulary fall back to their UTF-8 bytes (``<0xNN>`` tokens).
    Without ``tokenizer.ggml.merges`` the merges come from ``tokenizer.ggml.scores``.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    for key, accepted in _SPM_REFUSED.items():
        if metadata.get(key, accepted) != accepted:
            raise ModelLoadError(
                f"{source}: {key} is set for a SentencePiece ('llama') vocabulary and cannot be "
                f"honoured; only {accepted!r} (or no key) is supported"
            )
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(
                f"{source}: a SentencePiece vocabulary without tokenizer.ggml.merges needs "
                f"tokenizer.ggml.scores, one per token ({len(tokens)})"
            )
        merges = _merges_by_score(tokens, types, scores)
    unk = _gguf_token(metadata, "tokenizer.ggml.unknown_token_id", tokens, source)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    spaces = [normalizers.Replace(" ", _SPM_SPACE)]
    decoder = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        spaces.insert(0, normalizers.Prepend(_SPM_SPACE))
        decoder.append(decoders.Strip(" ", 1, 0))
    backend.normalizer = normalizers.Sequence(spaces)
    backend.decoder = decoders.Sequence(decoder)
    return backend


def _merges_by_score(tokens: list[str], types: list[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges, best first, that join pieces as SentencePiece's scores say.

    SentencePiece joins the adjacent pair whose joined piece scores highest (the leftmost on a
    tie). Ranking every split of a normal piece into two normal pieces by that piece's score,
    then its id, joins the same pairs; Hugging Face's converter builds Llama's merges this way.
    Control, byte and unused pieces are never the result of a join.
    """
    ids = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=False)) if k == _TOKEN_TYPE_NORMAL}
    ranked = sorted(
        (-scores[i], i, ids[piece[:cut]], ids[piece[cut:]])
        for piece, i in ids.items()
        for cut in range(1, len(piece))
        if piece[:cut] in ids and piece[cut:] in ids
    )
    return [(tokens[left], tokens[right]) for _, _, left, right in ranked]


def _gguf_token(
    metadata: Mapping[str, Any], key: str, tokens: Sequence[str], source: str, *, needed_by: str | None = None
) -> str | None:
    """Text of the token whose id the metadata ``key`` holds; None when the key is absent.

    ``needed_by`` names the setting that cannot work without it: then an absent key is an error.
    """
    token_id = metadata.get(key)
    if token_id is None:
        if needed_by is not None:
            raise ModelLoadError(f"{source}: {key} is missing, and {needed_by} needs it")
        return None
    if not 0 <= token_id < len(tokens):
        raise ModelLoadError(f"{source}: {key}={token_id} is outside the vocabulary (size {len(tokens)})")
    return tokens[token_id]


def _gguf_post_processor(
    backend: tokenizers.Tokenizer, bos: str | None, eos: str | None
) -> tokenizers.processors.TemplateProcessing:
    """Put ``bos`` before and ``eos`` after each sequence (None: nothing there)."""
    from tokenizers import processors

    head, tail = [bos] if bos else [], [eos] if eos else []
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([single, *head, "$B", *tail])
    special_tokens = [(t, backend.token_to_id(t)) for t in dict.fromkeys([*head, *tail])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


def _gguf_pre_tokenizer(pre: str, source: str) -> tokenizers.pre_tokenizers.PreTokenizer:
    from tokenizers import Regex, pre_tokenizers

    split = _GGUF_PRE_TOKENIZERS.get(pre)
    if split is None:
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.pre={pre!r} is not supported; "
            f"supported: {sorted(_GGUF_PRE_TOKENIZERS)}"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
    if split == "gpt2":
        return byte_level
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def _compile_template(template: str, source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with Hugging Face's template globals."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"{source}: chat template does not compile: {e}") from e


def _folder_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template of a Hugging Face folder, wherever this version of HF put it."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = (_read_json(folder / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _token_text(token: str | Mapping[str, Any] | None) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (tokenizer_config.json spells it both ways)."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token
