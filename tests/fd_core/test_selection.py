"""Start-up resolution: worker env before the probe; every check that would fail later, at once."""

from __future__ import annotations

import os
from typing import ClassVar

import pytest

from fd_core.config import load_config
from fd_core.contracts.platform import DetectResult, MemoryProfile, Platform
from fd_core.errors import ConfigError
from fd_core.registry import Registry
from fd_core.selection import resolve
from fd_plugins.proposers.ngram import NgramProposer, NgramSettings
from fd_plugins.resource_managers.v1.manager import V1ResourceManager
from fd_plugins.schedulers.local import LocalScheduler
from fd_plugins.token_processors.default import DefaultTokenProcessor


class EnvProbe(Platform):
    """Records what the environment said when detect() ran."""

    name: ClassVar[str] = "envprobe"
    fd_hookspec_version: ClassVar[int] = 2
    seen: ClassVar[str | None] = None

    @classmethod
    def detect(cls) -> DetectResult:
        EnvProbe.seen = os.environ.get("FD_TEST_VISIBLE")
        return DetectResult(True, "always", 1)

    def worker_env(self) -> dict[str, str]:
        return {"FD_TEST_VISIBLE": "3,4"}

    def device_string(self, local_rank: int = 0) -> str:
        return "cpu"

    def supported_dtypes(self) -> tuple[str, ...]:
        return ("float32",)

    def memory_profile(self) -> MemoryProfile:
        return MemoryProfile(1 << 30, 1 << 30)


def _registry() -> Registry:
    return Registry.from_plugins({"platform": [EnvProbe], "scheduler": [LocalScheduler],
                                  "resource_manager": [V1ResourceManager], "token_processor": [DefaultTokenProcessor]})


def test_explicit_platform_env_is_applied_before_detection(monkeypatch):
    monkeypatch.delenv("FD_TEST_VISIBLE", raising=False)
    config = load_config(platform={"name": "envprobe"})
    resolve(config, _registry())                       # --check: no side effects
    assert EnvProbe.seen is None and "FD_TEST_VISIBLE" not in os.environ
    selection = resolve(config, _registry(), apply_worker_env=True)
    assert EnvProbe.seen == "3,4"
    assert selection.platform_reason == "explicit: always"


class NoPrefixCacheManager(V1ResourceManager):
    """A resource manager declaring it has no prefix cache (as v0 should)."""

    name: ClassVar[str] = "noprefix"
    supports_prefix_caching: ClassVar[bool] = False


def _checked(tmp_path, **sections):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")  # a .gguf path is judged by name and existence, not read
    registry = Registry.from_plugins({"platform": [EnvProbe], "scheduler": [LocalScheduler],
                                      "resource_manager": [V1ResourceManager, NoPrefixCacheManager],
                                      "token_processor": [DefaultTokenProcessor]})
    sections.setdefault("model", {})
    sections["model"].setdefault("source", str(model))
    return resolve(load_config(platform={"name": "envprobe"}, **sections), registry)


def test_a_valid_config_resolves_the_platform_instance_and_prefix_caching(tmp_path):
    selection = _checked(tmp_path)
    assert isinstance(selection.platform, EnvProbe)
    assert selection.enable_prefix_caching is True       # unset: what v1 supports
    assert _checked(tmp_path, cache={"enable_prefix_caching": False}).enable_prefix_caching is False
    assert _checked(tmp_path, resource_manager={"name": "noprefix"}).enable_prefix_caching is False


def test_prefix_caching_on_a_manager_without_it_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^cache\.enable_prefix_caching: resource manager 'noprefix' has no "):
        _checked(tmp_path, resource_manager={"name": "noprefix"}, cache={"enable_prefix_caching": True})


@pytest.mark.parametrize(("source", "expected"), [
    ("missing", "/missing' not found: no such file or folder, and not a known alias"),
    ("folder", "is a folder without config.json"),
    ("weights.bin", "is neither a model folder nor a .gguf file"),
])
def test_a_model_source_that_cannot_load_is_refused_before_loading(tmp_path, source, expected):
    (tmp_path / "folder").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^model\.source: ") as info:
        _checked(tmp_path, model={"source": str(tmp_path / source)})
    assert expected in str(info.value)


def test_every_problem_is_reported_at_once_naming_env_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("FD_PARALLEL__TENSOR_PARALLEL_SIZE", "4")
    with pytest.raises(ConfigError) as info:
        _checked(tmp_path, model={"dtype": "float16"}, scheduler={"options": {"ttl_s": -1, "bogus": 1}})
    assert str(info.value).splitlines() == [
        "scheduler.options.ttl_s: Input should be greater than 0",
        "scheduler.options.bogus: Extra inputs are not permitted",
        "parallel.tensor_parallel_size: 4 is not supported yet: only 1 runs in this version "
        "(from FD_PARALLEL__TENSOR_PARALLEL_SIZE)",
        "model.dtype: 'float16' is not supported by platform 'envprobe'; it supports ['float32']"]


def test_v0_with_prefix_caching_on_names_the_key():
    config = load_config(resource_manager={"name": "v0"}, cache={"enable_prefix_caching": True})
    with pytest.raises(ConfigError, match=r"cache\.enable_prefix_caching: resource manager 'v0' has no prefix cache"):
        resolve(config)
    assert resolve(load_config(resource_manager={"name": "v0"})).enable_prefix_caching is False
    assert resolve(load_config(resource_manager={"name": "v1"})).enable_prefix_caching is True


def _proposer_selection(tmp_path, **proposer):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    registry = Registry.from_plugins({"platform": [EnvProbe], "scheduler": [LocalScheduler],
                                      "resource_manager": [V1ResourceManager],
                                      "token_processor": [DefaultTokenProcessor], "proposer": [NgramProposer]})
    config = load_config(platform={"name": "envprobe"}, model={"source": str(model)}, proposer=proposer)
    return config, resolve(config, registry)


def test_no_proposer_is_selected_by_default_and_a_named_one_is_built_with_its_options(tmp_path):
    _, selection = _proposer_selection(tmp_path)
    assert "proposer" not in selection.plugins and "proposer" not in selection.summary()
    config, selection = _proposer_selection(tmp_path, name="ngram", num_speculative_tokens=6,
                                            options={"min_n": 3, "max_n": 5})
    selected = selection.plugins["proposer"]
    assert selected.settings == NgramSettings(min_n=3, max_n=5, adaptive=True)
    # what the engine builder does
    proposer = selected.create(max_proposed_tokens=config.proposer.num_speculative_tokens, vocab_size=512)
    assert isinstance(proposer, NgramProposer) and proposer.max_proposed_tokens == 6 and proposer.vocab_size == 512
    assert proposer.options.min_n == 3


@pytest.mark.parametrize(("proposer", "problem"), [
    ({"name": "eagle"}, "proposer.name: plugin fd.proposers/eagle: no such proposer; available: none, ngram "
                        "('none': no speculative decoding)"),
    ({"options": {"min_n": 2}}, "proposer.options: given, but proposer.name is 'none'; name the proposer plugin "
                                "they are for, or remove them"),
    ({"name": "ngram", "options": {"min_n": 5, "max_n": 3, "window": 2}},
     "proposer.options.max_n: must be at least min_n (5), got 3\nproposer.options.window: Extra inputs are not "
     "permitted"),
])
def test_a_bad_proposer_choice_names_the_key(tmp_path, proposer, problem):
    with pytest.raises(ConfigError) as info:
        _proposer_selection(tmp_path, **proposer)
    assert str(info.value) == problem


@pytest.mark.parametrize(("proposer", "problem"), [
    ({"name": "ngram", "num_speculative_tokens": 0}, "Input should be greater than or equal to 1"),
    ({"name": "ngram", "num_speculative_tokens": 17}, "Input should be less than or equal to 16"),
    ({"num_speculative_tokens": 8}, "set to 8, but proposer.name is 'none' (no speculative decoding): name the "
                                    "proposer it is for (the built-in one is 'ngram'), or leave it at 4"),
])
def test_num_speculative_tokens_is_bounded_and_needs_a_proposer(proposer, problem):
    with pytest.raises(ConfigError) as info:
        load_config(proposer=proposer)
    assert str(info.value) == f"proposer.num_speculative_tokens: {problem}"
