"""Each token's bytes as they stand in the decoded text: what the engine reads reasoning tags from.

A vocabulary spells its tokens in its own way: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) maps
every byte to a printable character (``"Ġ"`` is a space, ``"Ċ"`` a newline); SentencePiece writes a
space as ``"▁"`` and a byte it has no piece for as ``"<0x0A>"``. The ``tokenizers`` decoder in the
tokenizer says which; :func:`token_bytes` undoes the spelling token by token, so that a
multi-byte character split over two tokens still gives its exact bytes (decoding one token alone
would give U+FFFD). A token is spelt as in running text: ``"▁the"`` is ``b" the"`` even where a
decoder strips the first space of a reply. Special tokens are no text (the default token processor
leaves them out of replies); other added tokens (Qwen3's ``</think>``) are their text.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import tokenizers

#: SentencePiece's byte pieces: ``<0x0A>`` is the byte 0x0A.
_BYTE_PIECE: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: SentencePiece's spelling of a space.
_SPM_SPACE: Final = "\u2581"


def token_bytes(backend: tokenizers.Tokenizer) -> tuple[bytes, ...]:
    """The bytes of every token id of ``backend`` (``b""`` for special tokens and unused ids)."""
    decoder = backend.decoder
    steps = _decoder_steps(None if decoder is None else json.loads(decoder.__getstate__()))
    kinds = {step.get("type") for step in steps}
    replaces = [(_pattern(step), step.get("content", "")) for step in steps
                if step.get("type") == "Replace" and _pattern(step)]
    replaces += [(step.get("replacement", _SPM_SPACE), " ") for step in steps if step.get("type") == "Metaspace"]
    out = [b""] * backend.get_vocab_size(with_added_tokens=True)
    for token, token_id in backend.get_vocab(with_added_tokens=False).items():
        if "ByteLevel" in kinds:
            out[token_id] = _byte_level(token)
        elif "ByteFallback" in kinds and (byte := _BYTE_PIECE.fullmatch(token)):
            out[token_id] = bytes([int(byte[1], 16)])
        else:
            for pattern, content in replaces:
                token = token.replace(pattern, content)
            out[token_id] = token.encode()
    for token_id, added in backend.get_added_tokens_decoder().items():
        out[token_id] = b"" if added.special else added.content.encode()
    return tuple(out)


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The decoder's steps, a ``Sequence`` flattened."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders", ()) for step in _decoder_steps(inner)]
    return [decoder]


def _pattern(step: dict[str, Any]) -> str:
    """The literal a ``Replace`` step replaces ("" for a regex: no tokenizer we load has one)."""
    pattern = step.get("pattern") or {}
    return pattern.get("String", "") if isinstance(pattern, dict) else ""


def _byte_level(token: str) -> bytes:
    """A byte-level BPE token's bytes (a character outside the byte alphabet stands for itself)."""
    try:
        return token.translate(_byte_level_alphabet()).encode("latin-1")
    except UnicodeEncodeError:
        byte_of = _byte_level_alphabet()
        return b"".join(chr(byte_of[ord(char)]).encode("latin-1") if ord(char) in byte_of else char.encode()
                        for char in token)


@functools.cache
def _byte_level_alphabet() -> dict[int, int]:
    """Code point -> byte of byte-level BPE (a ``str.translate`` table): printable Latin-1 bytes stand
    for themselves, the other 68 bytes (controls, space, 0x7F-0xA0, 0xAD) for U+0100 onwards, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: byte for byte in printable}
    others = sorted(set(range(256)) - set(printable))
    alphabet.update({256 + n: byte for n, byte in enumerate(others)})
    return alphabet
