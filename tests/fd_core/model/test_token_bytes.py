"""Each token's bytes as they stand in decoded text: byte-level vocabularies (tokenizer.json and GGUF),
added tokens; SentencePiece ones are checked in test_gguf_sentencepiece.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from fd_core.model.gguf_loader import load_gguf
from fd_core.model.token_bytes import token_bytes
from fd_core.model.tokenizer import Tokenizer
from fd_core.testing.tiny_model import write_tiny_gguf
from tests.fd_core.model.test_tokenizer import TEXTS


@pytest.fixture(scope="module")
def tokenizers_(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Tokenizer]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf", tiny_folder)
    return [Tokenizer.from_folder(tiny_folder), Tokenizer.from_gguf_metadata(load_gguf(path)[2], source=str(path))]


@pytest.mark.parametrize("text", TEXTS)
def test_the_bytes_of_a_text_s_tokens_join_into_its_decoded_text(tokenizers_: list[Tokenizer], text: str) -> None:
    for tok in tokenizers_:
        table = tok.token_bytes()
        assert len(table) == tok.vocab_size
        ids = tok.encode(text)
        assert b"".join(table[i] for i in ids) == tok.decode(ids).encode()   # special tokens are no text
        # a character split over several tokens still gives its exact bytes, token by token
        for token_id in ids:
            if "\ufffd" not in (alone := tok.decode([token_id])):
                assert table[token_id] == alone.encode()


def test_added_tokens_are_their_text_and_special_ones_none(tiny_folder: Path) -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(tiny_folder / "tokenizer.json"))
    backend.add_tokens([AddedToken("</think>", special=False)])
    backend.add_special_tokens([AddedToken("<|tool|>", special=True)])
    table = token_bytes(backend)
    assert table[backend.token_to_id("</think>")] == b"</think>"
    assert table[backend.token_to_id("<|tool|>")] == b"" == table[backend.token_to_id("<|im_end|>")]
