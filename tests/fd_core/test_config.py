"""Config sources, precedence and error paths."""

from __future__ import annotations

import pytest

from fd_core.config import load_config
from fd_core.errors import ConfigError
from tests.conftest import run_fd_serve


@pytest.fixture
def deploy(tmp_path, monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("FD_")]:
        monkeypatch.delenv(key)
    path = tmp_path / "deploy.toml"
    path.write_text("[cache]\nblock_size = 32\nnum_blocks = 100\n\n[server]\nport = 9001\n")
    return path


def test_file_values_beat_defaults(deploy):
    config = load_config(deploy)
    assert (config.cache.block_size, config.cache.num_blocks, config.server.port) == (32, 100, 9001)
    assert config.scheduler.name == "local"


def test_env_beats_file_and_cli_beats_env(deploy, monkeypatch):
    monkeypatch.setenv("FD_CACHE__BLOCK_SIZE", "64")
    assert load_config(deploy).cache.block_size == 64
    config = load_config(deploy, cli_args=["--cache.block_size", "128"])
    assert config.cache.block_size == 128
    assert config.cache.num_blocks == 100  # untouched keys of the same section survive


def test_errors_name_the_key_path(deploy):
    deploy.write_text("[cache]\nblock_size = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(deploy)
    assert str(info.value) == "cache.block_size: Input should be greater than 0"
    assert info.value.key == "cache.block_size"


def test_unknown_keys_are_errors(deploy):
    deploy.write_text("[cache]\nblok_size = 16\n")
    with pytest.raises(ConfigError, match=r"^cache\.blok_size: Extra inputs are not permitted"):
        load_config(deploy)
    deploy.write_text("[cash]\nblock_size = 16\n")
    with pytest.raises(ConfigError, match=r"^cash: Extra inputs are not permitted"):
        load_config(deploy)


def test_cross_field_rule_names_its_section(deploy):
    deploy.write_text("[engine]\nmax_num_seqs = 64\nmax_num_batched_tokens = 32\n")
    with pytest.raises(ConfigError, match=r"^engine: .*max_num_batched_tokens \(32\) must be >= max_num_seqs \(64\)"):
        load_config(deploy)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")


def test_cli_reports_key_path_and_precedence(deploy):
    result = run_fd_serve("--config", str(deploy), "--check", "--cache.block_size", "0")
    assert result.returncode == 2
    assert "cache.block_size: Input should be greater than 0" in result.stderr
    result = run_fd_serve("--config", str(deploy), "--check", "--server.port", "9100",
                          env={"FD_SERVER__PORT": "9050", "FD_CACHE__BLOCK_SIZE": "48"})
    assert result.returncode == 0, result.stderr
    assert '"port": 9100' in result.stdout and '"block_size": 48' in result.stdout


def test_cli_takes_a_kv_pool_size_with_units(deploy):   # deploy.toml sets cache.num_blocks
    result = run_fd_serve("--config", str(deploy), "--check", "--cache.memory", "4GiB")
    assert result.returncode == 2
    assert "cache.num_blocks and cache.memory each size the KV pool" in result.stderr
    assert "`--cache.num_blocks null` unsets" in result.stderr
    result = run_fd_serve("--config", str(deploy), "--check", "--cache.memory", "4GiB", "--cache.num_blocks", "null")
    assert result.returncode == 0, result.stderr
    assert '"memory": 4294967296' in result.stdout and '"num_blocks": null' in result.stdout
    result = run_fd_serve("--config", str(deploy), "--check", "--cache.memory", "lots")
    assert result.returncode == 2 and "cache.memory: " in result.stderr


def test_docs_config_reference_is_up_to_date():
    from pathlib import Path

    from fd_core.config_reference import render

    committed = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert committed == render(), "regenerate: python -m fd_core.config_reference > docs/config.md"


def test_every_error_is_reported_at_once(deploy):
    deploy.write_text("[cache]\nblock_size = 0\n\n[server]\nport = -1\nmax_concurrency = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(deploy)
    assert str(info.value).splitlines() == [
        "cache.block_size: Input should be greater than 0",
        "server.port: Input should be greater than or equal to 0",
        "server.max_concurrency: Input should be greater than 0"]
    assert info.value.key == "cache.block_size"


def test_an_env_value_names_its_variable_unless_the_cli_overrides_it(deploy, monkeypatch):
    monkeypatch.setenv("FD_CACHE__BLOCK_SIZE", "0")
    with pytest.raises(ConfigError, match=r"^cache\.block_size: .* 0 \(from FD_CACHE__BLOCK_SIZE\)$"):
        load_config(deploy)
    monkeypatch.setenv("FD_CACHE__BLOCK_SIZE", "8")
    with pytest.raises(ConfigError) as info:
        load_config(deploy, cli_args=["--cache.block_size", "0"])
    assert str(info.value) == "cache.block_size: Input should be greater than 0"
    assert load_config(deploy).env_var_of("cache.block_size") == "FD_CACHE__BLOCK_SIZE"
    assert load_config(deploy, cache={"block_size": 4}).env_var_of("cache.block_size") is None


@pytest.mark.parametrize("key", ["", " ", "\t\n"])
def test_an_empty_or_blank_api_key_is_refused(key):
    with pytest.raises(ConfigError, match=r"^server\.api_key: must not be empty or blank"):
        load_config(server={"api_key": key})
    assert load_config(server={"api_key": " k "}).server.api_key.get_secret_value() == " k "


def test_data_parallel_size_takes_a_count_or_auto_from_every_source(deploy, monkeypatch):
    deploy.write_text('[parallel]\ndata_parallel_size = "auto"\n')
    assert load_config(deploy).parallel.data_parallel_size == "auto"
    assert load_config(deploy, ["--parallel.data_parallel_size", "3"]).parallel.data_parallel_size == 3
    monkeypatch.setenv("FD_PARALLEL__DATA_PARALLEL_SIZE", "2")
    assert load_config().parallel.data_parallel_size == 2
    for bad in ("many", "0", "-1", "2.5"):
        with pytest.raises(ConfigError) as info:
            load_config(cli_args=["--parallel.data_parallel_size", bad])
        assert info.value.key == "parallel.data_parallel_size"
        assert str(info.value) == f"parallel.data_parallel_size: {bad!r}: a number of ranks (1 or more) or \"auto\""
