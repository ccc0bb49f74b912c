"""Named precision modes (``model.precision``): what each sets, how the old keys map to them, and
every rule checked at once by what ``fd-serve --check`` runs, by key, without building kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fd_core.config import load_config
from fd_core.errors import ConfigError
from fd_core.model.kernels import PORTABLE_KERNELS
from fd_core.precision import CUSTOM, MODE_KEYS, MODES, kernel_problems, kv_cache_dtype, mode_of
from fd_core.selection import resolve
from fd_core.testing.tiny_model import write_tiny_gguf

PORTABLE = {"name": "cpu", "options": {"kernels": "portable"}}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", tiny_model_dir, tensor_type="Q8_0"))


def _problems(**sections) -> list[str]:
    """The ``key: message`` lines resolve() reports for a config (empty when it passes)."""
    try:
        resolve(load_config(**sections))
    except ConfigError as exc:
        first, *rest = str(exc).split("\n")
        return [first, *rest]
    return []


@pytest.mark.parametrize("name", sorted(MODES))
def test_a_mode_sets_its_keys_and_its_cache(name: str, tiny_model_dir, tiny_gguf) -> None:
    mode = MODES[name]
    source = tiny_gguf if mode.quantized_weights == "keep" else tiny_model_dir
    config = load_config(model={"source": source, "precision": name})
    assert {key: getattr(config.model, key) for key in MODE_KEYS} == {key: mode.setting(key) for key in MODE_KEYS}
    assert mode_of(config.model) == name
    assert kv_cache_dtype(config) == ("bfloat16" if name == "bf16" else "float32")


@pytest.mark.parametrize(("keys", "mode"), [
    ({}, "float32"),
    ({"linear_weights": "bfloat16"}, "bf16-weights"),
    ({"linear_weights": "bfloat16", "linear_inputs": "bfloat16", "attention_inputs": "bfloat16"}, "bf16"),
    ({"linear_weights": "int8", "linear_inputs": "int8"}, "int8"),
    ({"quantized_weights": "keep"}, "gguf-blocks"),
    ({"quantized_weights": "keep", "linear_inputs": "int8"}, "gguf-blocks-int8"),
    ({"linear_weights": "bfloat16", "attention_inputs": "bfloat16"}, CUSTOM),
])
def test_the_old_keys_alone_spell_a_mode(keys: dict, mode: str) -> None:
    assert mode_of(load_config(model=keys).model) == mode


def test_an_old_key_beside_a_mode_must_agree_with_it(tiny_model_dir) -> None:
    assert _problems(model={"source": tiny_model_dir, "precision": "bf16", "linear_weights": "bfloat16"},
                     cache={"dtype": "int8"}) == []
    assert _problems(model={"source": tiny_model_dir, "precision": "int8", "linear_weights": "bfloat16",
                            "linear_inputs": "bfloat16"}) == [
        "model.linear_weights: 'bfloat16' conflicts with model.precision = 'int8', which sets 'int8': remove "
        "model.linear_weights (the mode sets it)",
        "model.linear_inputs: 'bfloat16' conflicts with model.precision = 'int8', which sets 'int8': remove "
        "model.linear_inputs (the mode sets it)"]


def test_a_key_left_at_its_default_takes_the_modes_value() -> None:
    config = load_config(model={"precision": "bf16", "linear_inputs": "float32"})
    assert config.model.linear_inputs == "bfloat16"


@pytest.mark.parametrize(("model", "cache", "platform", "expected"), [
    ({"linear_weights": "bfloat16", "dtype": "bfloat16"}, {}, None,
     "model.linear_weights: 'bfloat16' linear weights round a float32 model's weights; model.dtype is 'bfloat16'"),
    ({"precision": "int8", "dtype": "bfloat16"}, {}, None,
     "model.precision: 'int8' linear weights round a float32 model's weights; model.dtype is 'bfloat16'"),
    ({"linear_weights": "int8"}, {}, None, "model.linear_inputs: int8 weights are multiplied with int8 inputs"),
    ({"linear_inputs": "bfloat16"}, {}, None, "model.linear_inputs: 'bfloat16' inputs are multiplied with bfloat16 "
                                              "weights"),
    ({"linear_inputs": "int8"}, {}, None, "model.linear_inputs: 'int8' inputs are multiplied with weights kept in "
                                          "GGUF blocks or with int8 weights"),
    ({"attention_inputs": "bfloat16"}, {}, None, "model.attention_inputs: 'bfloat16' queries are multiplied with a "
                                                 "bfloat16 or int8 cache; the cache stores 'float32'"),
    ({"precision": "bf16"}, {"dtype": "float32"}, None, "model.precision: 'bfloat16' queries are multiplied with a "
                                                        "bfloat16 or int8 cache; the cache stores 'float32'"),
    ({"precision": "gguf-blocks"}, {}, None, "model.precision: keeping GGUF blocks needs a GGUF model; "),
    ({"quantized_weights": "keep"}, {}, PORTABLE, "model.quantized_weights: keeping GGUF blocks needs the C++ "
                                                  "kernels: platform 'cpu' does not declare 'cpp_kernels'"),
    ({}, {"dtype": "bfloat16"}, PORTABLE, "cache.dtype: a bfloat16 KV cache with a float32 model needs the C++ "
                                          "kernels: platform 'cpu' does not declare 'cpp_kernels'"),
    ({"precision": "bf16"}, {}, PORTABLE, "model.precision: a bfloat16 KV cache with a float32 model needs the C++ "
                                          "kernels"),
])
def test_each_rule_names_its_key(tiny_model_dir, model: dict, cache: dict, platform: dict | None,
                                 expected: str) -> None:
    sections = {"model": {"source": tiny_model_dir, **model}, "cache": cache}
    if platform is not None:
        sections["platform"] = platform
    problems = _problems(**sections)
    assert any(line.startswith(expected) for line in problems), problems


def test_no_rule_fires_for_the_default_config(tiny_model_dir) -> None:
    assert _problems(model={"source": tiny_model_dir}) == []


def test_check_reports_every_precision_problem_at_once_without_building_kernels(tiny_model_dir, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    env["FD_CACHE_DIR"] = str(tmp_path / "cache")   # where a kernel build would land
    deploy = tmp_path / "deploy.toml"
    deploy.write_text('[platform.options]\nkernels = "portable"\n')
    result = subprocess.run(
        [sys.executable, "-m", "fd_core.cli", "--check", "--config", str(deploy), "--model.source", tiny_model_dir,
         "--model.attention_inputs", "bfloat16", "--model.linear_inputs", "bfloat16",
         "--model.quantized_weights", "keep", "--cache.dtype", "int8"],
        capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("fd-serve: error:")]
    keys = [line.removeprefix("fd-serve: error: ").split(":", 1)[0] for line in errors]
    assert keys == ["model.linear_inputs", "model.quantized_weights", "model.quantized_weights", "cache.dtype"], errors
    assert not Path(env["FD_CACHE_DIR"], "kernels").exists(), "--check built kernels"


def test_kernels_that_did_not_build_are_named_after_the_choice(tiny_model_dir) -> None:
    config = load_config(model={"source": tiny_model_dir, "precision": "bf16"})
    assert [key for key, _ in kernel_problems(config, PORTABLE_KERNELS)] == ["cache.dtype"]
    assert kernel_problems(load_config(model={"source": tiny_model_dir}), PORTABLE_KERNELS) == []


def test_docs_precision_md_holds_the_modes_table() -> None:
    from fd_core.precision import modes_table

    text = (Path(__file__).resolve().parents[3] / "docs" / "precision.md").read_text()
    assert modes_table() in text, ("regenerate the table: "
                                   "python -c 'from fd_core.precision import modes_table; print(modes_table())'")
