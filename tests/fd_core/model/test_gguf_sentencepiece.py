"""SentencePiece ('llama') GGUF vocabularies tokenize exactly as the model's Hugging Face tokenizer.

The reference is a tokenizer.json spelt as Llama 2's (BPE with byte fallback, spaces as ``▁`` with
one prepended, ``<s>`` added; Gemma's spelling without the prepended space), its vocabulary
trained here on a small corpus. That vocabulary is exported to a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` exports a SentencePiece model (tokens in SentencePiece's order, scores,
token types, special ids and flags) and loaded back with :func:`load_tokenizer`. Where they load
here, SentencePiece itself and transformers' GGUF tokenizer are further oracles.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from fd_core.errors import ModelLoadError
from fd_core.model.loader import load_tokenizer
from fd_core.model.tokenizer import Tokenizer

SP = "\u2581"  # SentencePiece's space
SPECIALS = ("<unk>", "<s>", "</s>")
CONTROL = ("[INST]", "[/INST]")  # more control tokens, as Mistral's
USER_DEFINED = ("<|tool|>",)  # matched whole in text, not special

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine schedules requests,
batches them and streams tokens back to the client as soon as they are sampled.
In 2024 there were 366 days; in 2023 there were 365. Numbers like 3.14159 matter.
def add(a, b):
    return a + b
Les modèles de langage prédisent le mot suivant. Die Katze schläft auf dem Sofa.
你好，世界。今天天气很好。 Hello, world! How are you today?   Three spaces.
"""

#: Plain texts. The trained alphabet lacks most capitals, the digits 7 and 8, most accents, tabs,
#: emoji, Arabic, Korean and most CJK: those characters go through <0xNN> byte tokens.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "   ",
    " leading space",
    "  two leading spaces",
    "trailing spaces  ",
    "multiple   inner    spaces and\ttabs\t",
    "\n",
    "line one\nline two\n\n  indented line\n",
    "In 2024 there were 366 days; 7 8 1234567890 3.14159",
    "Emoji: 😀 🎉 🚀 👍🏽 and a flag 🇫🇷",
    "naïve café Ünïcödé — “quotes” ÀÉÎÕÜ",
    "你好，世界。日本語のテキスト 한국어",
    "مرحبا بالعالم",
    "zero\u200bwidth, NBSP\u00a0here, a NUL \x00 and DEL \x7f",
    "def add(a, b):\n    return a + b\n",
]
#: Texts with special or user-defined tokens written in them: those stay whole, and the text after
#: one gets its own prepended space (as in Llama 2's tokenizer.json and llama.cpp).
TEXTS_WITH_TOKENS = [
    "[INST] What is 2+2? [/INST]",
    "<s>hello</s>",
    "a<s>b",
    "call <|tool|> now",
    "<|tool|>x",
    "<unk> is unknown",
]

#: How each GGUF spells its tokenizer; None: the key is not written, llama.cpp's default applies.
VARIANTS: dict[str, dict[str, Any]] = {
    # convert_hf_to_gguf.py from a tokenizer.model (Llama 2, Mistral): scores, no merges, no flags
    "llama": {"add_space_prefix": None, "add_bos": None, "add_eos": None, "merges": False},
    # the merges written in the file, every flag spelt out
    "merges": {"add_space_prefix": True, "add_bos": True, "add_eos": False, "merges": True},
    # Gemma's spaces (no prepended one); and an EOS after the text instead of a BOS before it
    "no-prefix": {"add_space_prefix": False, "add_bos": False, "add_eos": True, "merges": False},
}


def _train() -> tuple[list[str], list[tuple[str, str]]]:
    """A SentencePiece-style BPE vocabulary in SentencePiece's order, and its merges.

    The order of Llama's tokenizer.model: <unk> <s> </s>, the 256 byte tokens, the merged pieces
    in the order they were learned, the single characters; then the extra control and
    user-defined tokens.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = Backend(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SP), normalizers.Replace(" ", SP)])
    # SentencePiece never merges across a space: train word by word
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(SPECIALS), limit_alphabet=60, show_progress=False
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 3, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    chars = [t for t in model["vocab"] if len(t) == 1]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [*SPECIALS, *byte_tokens, *(a + b for a, b in merges), *chars, *CONTROL, *USER_DEFINED]
    assert len(set(tokens)) == len(tokens)
    return tokens, merges


def _scores_and_types(tokens: list[str]) -> tuple[list[float], list[int]]:
    """What the converter reads of each piece: SentencePiece's score (best merge first) and type."""
    first_normal, end_normal = 3 + 256, len(tokens) - len(CONTROL) - len(USER_DEFINED)
    scores, types = [], []
    for i, tok in enumerate(tokens):
        normal = first_normal <= i < end_normal
        scores.append(float(first_normal - i) if normal else 0.0)
        if normal:
            types.append(1)
        elif tok == "<unk>":
            types.append(2)
        elif tok in SPECIALS or tok in CONTROL:
            types.append(3)
        elif tok in USER_DEFINED:
            types.append(4)
        else:
            types.append(6)  # <0xNN>
    return scores, types


def _reference_json(tokens: list[str], merges: list[tuple[str, str]], variant: dict[str, Any]) -> str:
    """The variant's Hugging Face tokenizer.json, spelt as Llama 2's (Gemma's without the prefix)."""
    ids = {t: i for i, t in enumerate(tokens)}
    head = ["<s>"] if variant["add_bos"] is not False else []
    tail = ["</s>"] if variant["add_eos"] else []

    def added(tok: str, special: bool) -> dict[str, Any]:
        return {"id": ids[tok], "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": special}

    def template(*pieces: str) -> list[dict[str, Any]]:
        return [{"Sequence": {"id": p, "type_id": 0}} if p in "AB" else {"SpecialToken": {"id": p, "type_id": 0}}
                for p in pieces]

    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": SP}]
    decoders = [{"type": "Replace", "pattern": {"String": SP}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if variant["add_space_prefix"] is not False:
        normalizers.insert(0, {"type": "Prepend", "prepend": SP})
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return json.dumps({
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(t, True) for t in (*SPECIALS, *CONTROL)] + [added(t, False) for t in USER_DEFINED],
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": template(*head, "A", *tail),
            "pair": template(*head, "A", *tail, *head, "B", *tail),
            "special_tokens": {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in (*head, *tail)},
        },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": ids, "merges": [list(m) for m in merges]},
    })


def _write_gguf(path: Path, tokens: list[str], merges: list[tuple[str, str]], variant: dict[str, Any]) -> Path:
    """A vocabulary-only llama GGUF, with the keys convert_hf_to_gguf.py writes for SentencePiece."""
    import gguf

    scores, types = _scores_and_types(tokens)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    if variant["merges"]:
        writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    for key, add in (("add_bos", writer.add_add_bos_token), ("add_eos", writer.add_add_eos_token),
                     ("add_space_prefix", writer.add_add_space_prefix)):
        if variant[key] is not None:
            add(variant[key])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[tuple[str, str]]]:
    return _train()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request: pytest.FixtureRequest, vocab, tmp_path_factory: pytest.TempPathFactory):
    """(variant name, GGUF path, reference tokenizers.Tokenizer, our Tokenizer loaded from the file)."""
    from tokenizers import Tokenizer as Backend

    tokens, merges = vocab
    variant = VARIANTS[request.param]
    path = _write_gguf(tmp_path_factory.mktemp("spm") / f"{request.param}.gguf", tokens, merges, variant)
    return request.param, path, Backend.from_str(_reference_json(tokens, merges, variant)), load_tokenizer(str(path))


@pytest.mark.parametrize("text", TEXTS + TEXTS_WITH_TOKENS)
def test_ids_and_text_equal_the_reference(case, text: str) -> None:
    _, _, reference, ours = case
    for add_special_tokens in (True, False):
        ids = reference.encode(text, add_special_tokens=add_special_tokens).ids
        assert ours.encode(text, add_special_tokens=add_special_tokens) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(case, text: str) -> None:
    ours = case[3]
    assert ours.decode(ours.encode(text)) == text
    assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_sentencepiece_spaces_and_byte_fallback(case) -> None:
    name, _, _, ours = case
    prefix = [SP] if VARIANTS[name]["add_space_prefix"] is not False else []
    pieces = ours.convert_ids_to_tokens(ours.encode("  the 😀", add_special_tokens=False))
    # every space is one ▁ of its own, plus the prepended one; the emoji is four UTF-8 bytes
    assert pieces == [*prefix, SP, f"{SP}the", SP, "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_text_with_its_spaces_and_bytes(case, text: str) -> None:
    name, _, _, ours = case
    ids = ours.encode(text, add_special_tokens=False)
    joined = b"".join(ours.token_bytes()[i] for i in ids).decode()
    # spelt as in running text: the space the tokenizer prepends is there (the decoder drops it)
    prepended = " " if VARIANTS[name]["add_space_prefix"] is not False and text else ""
    assert joined == prepended + ours.decode(ids)


def test_special_tokens(case) -> None:
    name, _, _, ours = case
    variant = VARIANTS[name]
    assert (ours.bos_token, ours.bos_token_id, ours.eos_token_ids) == ("<s>", 1, (2,))
    ids = ours.encode("[INST]hi")
    assert (ids[0] == 1) is (variant["add_bos"] is not False)  # llama.cpp adds a BOS unless told not to
    assert (ids[-1] == 2) is bool(variant["add_eos"])
    assert ours.convert_ids_to_tokens(ours.encode("[INST]", add_special_tokens=False)) == ["[INST]"]
    assert ours.decode(ids) == "hi"  # special tokens are skipped


def test_transformers_gguf_tokenizer_agrees(case) -> None:
    """transformers' own GGUF tokenizer, where it follows SentencePiece.

    It splits with ``Metaspace(prepend_scheme="first")``, which prepends no space to text that
    already starts with one or follows a special token, and ignores add_space_prefix=false for a
    'llama' architecture; SentencePiece, llama.cpp and Llama 2's tokenizer.json prepend one there.
    Those texts and that variant are left out.
    """
    transformers = pytest.importorskip("transformers")
    name, path, _, ours = case
    if VARIANTS[name]["add_space_prefix"] is False:
        pytest.skip("transformers builds a llama GGUF's tokenizer with the prepended space regardless")
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # an old transformers without GGUF tokenizers, or one that wants the hub
        pytest.skip(f"transformers cannot load this GGUF's tokenizer offline: {e!r}")
    texts = [t for t in TEXTS if not t[:1].isspace()]
    for add_special_tokens in (True, False):
        assert [ours.encode(t, add_special_tokens=add_special_tokens) for t in texts] == [
            hf.encode(t, add_special_tokens=add_special_tokens) for t in texts
        ]


@pytest.mark.parametrize("add_dummy_prefix", [True, False])
def test_sentencepiece_itself_agrees(add_dummy_prefix: bool) -> None:
    """A real SentencePiece BPE model (Llama's trainer settings) exported as convert_hf_to_gguf.py does."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 3), model_writer=model, model_type="bpe", vocab_size=400,
        hard_vocab_limit=False, byte_fallback=True, split_digits=True, add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False, normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        character_coverage=0.98, minloglevel=3,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = range(sp.vocab_size())
    types = [2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 5 if sp.IsUnused(i) else 6 if sp.IsByte(i) else 1
             for i in ids]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        # the converter pads the vocabulary to the embedding size with unused [PADi] tokens
        "tokenizer.ggml.tokens": [sp.IdToPiece(i) for i in ids] + ["[PAD1]", "[PAD2]"],
        "tokenizer.ggml.scores": [sp.GetScore(i) for i in ids] + [-1000.0, -1000.0],
        "tokenizer.ggml.token_type": types + [5, 5],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": add_dummy_prefix,
    }
    ours = Tokenizer.from_gguf_metadata(metadata, source="sp.gguf")
    for text in TEXTS:
        assert ours.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert ours.decode(ours.encode(text)) == sp.decode(sp.encode(text)), text


def _metadata(**changes: Any) -> dict[str, Any]:
    """A small SentencePiece vocabulary's metadata; ``changes`` set (None: drop) ``tokenizer.ggml.*`` keys."""
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", SP, "a", "b", "c", f"{SP}a", "ab", "bc", "abc"],
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -10.0, -11.0, -12.0, -13.0, -3.0, -4.0, -1.0, -2.0],
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    metadata.update({f"tokenizer.ggml.{k}": v for k, v in changes.items()})
    return {k: v for k, v in metadata.items() if v is not None}


def test_merges_follow_the_scores() -> None:
    """The best-scoring join first, and any split of a piece joins into it (a + bc -> abc, never
    learnt as a merge), as SentencePiece joins pieces."""
    tok = Tokenizer.from_gguf_metadata(_metadata(), source="t.gguf")
    assert tok.convert_ids_to_tokens(tok.encode("abc ab")) == ["<s>", SP, "abc", f"{SP}a", "b"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "t5"}, r"tokenizer\.ggml\.model='t5' is not supported"),
        ({"pre": "llama-bpe"}, r"tokenizer\.ggml\.pre is set .* only 'default'"),
        ({"remove_extra_whitespaces": True}, r"tokenizer\.ggml\.remove_extra_whitespaces is set"),
        ({"precompiled_charsmap": [0, 1, 2]}, r"tokenizer\.ggml\.precompiled_charsmap is set"),
        ({"scores": None}, r"without tokenizer\.ggml\.merges needs tokenizer\.ggml\.scores"),
        ({"scores": [0.0]}, r"tokenizer\.ggml\.scores, one per token \(11\)"),
        ({"bos_token_id": None}, r"tokenizer\.ggml\.bos_token_id is missing, and adding a BOS"),
        ({"add_eos_token": True, "eos_token_id": None}, r"tokenizer\.ggml\.eos_token_id is missing"),
        ({"unknown_token_id": 99}, r"tokenizer\.ggml\.unknown_token_id=99 is outside the vocabulary"),
    ],
)
def test_settings_that_cannot_be_honoured_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_gguf_metadata(_metadata(**changes), source="t.gguf")


def test_the_accepted_values_of_those_settings_load() -> None:
    accepted = _metadata(pre="default", remove_extra_whitespaces=False, precompiled_charsmap=[])
    assert Tokenizer.from_gguf_metadata(accepted, source="t.gguf").encode("a") == [1, 7]
    no_bos = Tokenizer.from_gguf_metadata(_metadata(bos_token_id=None, add_bos_token=False), source="t.gguf")
    assert (no_bos.bos_token, no_bos.encode("a")) == (None, [7])
