"""A third-party package adds or replaces a model architecture without touching the core: found
through the ``fd_register_models`` hook of a real installed distribution, chosen before the
built-in, refused (naming both) when two packages claim one architecture, picked by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fd_core.config import load_config
from fd_core.engine.llm import LLM
from fd_core.errors import ModelLoadError
from fd_core.model.architectures import ArchitecturePlugins
from fd_core.request import SamplingParams
from fd_core.selection import resolve
from fd_core.testing.tiny_model import make_tiny_llama

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

FAMILY = """
from fd_plugins.models.llama import LlamaFamily

class {cls}(LlamaFamily):
    name = "{name}"
    hf_architectures = {architectures!r}
    gguf_architectures = ()

    def parse_hf_config(self, config, generation):   # a renamed Llama: the built-in decoder runs it
        return super().parse_hf_config({{**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}},
                                       generation)

@fd_core.hookimpl
def fd_register_models():
    return [{cls}]
"""


def _family(install_plugin, module: str, cls: str, name: str, architectures: tuple[str, ...]) -> None:
    install_plugin(module, FAMILY.format(cls=cls, name=name, architectures=architectures))


def test_a_package_adds_an_architecture_the_core_does_not_know(install_plugin, tmp_path: Path) -> None:
    llama = make_tiny_llama(tmp_path / "llama")
    toy = make_tiny_llama(tmp_path / "toy")
    config = json.loads((toy / "config.json").read_text())
    (toy / "config.json").write_text(json.dumps({**config, "architectures": ["ToyForCausalLM"], "model_type": "toy"}))
    with pytest.raises(ModelLoadError, match="architecture 'ToyForCausalLM' is not supported"):
        LLM(model=str(toy))
    _family(install_plugin, "toy_models", "ToyFamily", "toy", ("ToyForCausalLM",))
    with LLM(model=str(toy), cache={"num_blocks": 32}) as served, \
            LLM(model=str(llama), cache={"num_blocks": 32}) as reference:
        assert type(served.engine.runner.model).__name__ == "LlamaForCausalLM"
        tokens = [llm.generate([[5, 6, 7]], GREEDY)[0].token_ids for llm in (served, reference)]
        assert tokens[0] == tokens[1]


def test_a_package_claiming_a_built_in_architecture_goes_first(install_plugin, tmp_path: Path) -> None:
    _family(install_plugin, "faster_llama", "FasterLlama", "faster", ("LlamaForCausalLM",))
    chosen = ArchitecturePlugins().for_hf(["LlamaForCausalLM"], "config.json")
    assert (type(chosen).__name__, chosen.name) == ("FasterLlama", "faster")
    assert type(ArchitecturePlugins().for_hf(["Qwen3ForCausalLM"], "config.json")).__name__ == "LlamaFamily"


def test_two_packages_claiming_one_architecture_are_named_until_one_is_chosen(install_plugin,
                                                                            tmp_path: Path) -> None:
    _family(install_plugin, "claims_one", "ClaimsOne", "one", ("LlamaForCausalLM",))
    _family(install_plugin, "claims_two", "ClaimsTwo", "two", ("LlamaForCausalLM",))
    with pytest.raises(ModelLoadError, match=r"claimed by several plugins .*claims_one.*claims_two.*"
                                             r"architecture\.name"):
        ArchitecturePlugins().for_hf(["LlamaForCausalLM"], "config.json")
    folder = make_tiny_llama(tmp_path / "llama")
    selection = resolve(load_config(model={"source": str(folder)}, architecture={"name": "two"}))
    assert type(selection.architecture_plugins().for_hf(["LlamaForCausalLM"], "config.json")).__name__ == "ClaimsTwo"
