"""Conformance kit for model-architecture plugins: checked against Hugging Face transformers.

Use it from a plugin's own pytest (it needs ``torch`` and ``transformers``: ``pip install
fd-engine[hf]``; without them the parity check is skipped, saying so)::

    from fd_core.testing.conformance import check_architecture

    def test_my_architecture_conforms():
        check_architecture(MyArchitecture)

For every case of the plugin's :meth:`~fd_core.contracts.architecture.ModelArchitecture.tiny_hf_configs`
and every seed, transformers builds a random model of that config and saves it; the plugin loads
the folder (seed 0: ``config.json`` as the case writes it, the way an older checkpoint carries it;
seed 1: as transformers writes it) and must greedy-decode the same tokens as transformers'
``generate``, batched through the paged KV cache, with the portable kernels and with the ones
this host's cpu platform picks. See :data:`ARCHITECTURE_CHECKS` for the invariants.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fd_core.contracts.architecture import ArchitectureConfigError
from fd_core.testing.conformance._factories import plugin_settings
from fd_core.testing.conformance._report import Check, SeamReport, Skip, broken, run_checks

if TYPE_CHECKING:
    from fd_core.contracts.architecture import ModelArchitecture
    from fd_core.model.kernels import KernelSet

__all__ = ["ARCHITECTURE_CHECKS", "check_architecture", "greedy_tokens", "run_architecture_checks"]

SEAM: Final = "architecture"
#: Seeds of the random models; seed 0 keeps the case's config.json, seed 1 takes transformers'.
SEEDS: Final = (0, 1)
#: Tokens each prompt decodes, and the prompts' lengths (one prefill step for all, then decode).
NEW_TOKENS: Final = 12
PROMPT_LENGTHS: Final = (5, 17, 40)
BLOCK_SIZE: Final = 16
#: A key no config has: it must be refused, by name.
UNKNOWN_KEY: Final = "fd_conformance_unknown_key"

DECLARES: Final = "each declared architecture has a tiny config"
REFUSES: Final = "an unknown config key is refused by name"
MATCHES: Final = "greedy tokens equal transformers' on every tiny config"


def check_architecture(cls: type[ModelArchitecture], *, options: Mapping[str, Any] | None = None,
                       skip: Collection[str] = ()) -> SeamReport:
    """Run every architecture check; return the report, or raise ConformanceError naming the broken invariants."""
    return run_architecture_checks(cls, options=options, skip=skip).raise_for_failures()


def run_architecture_checks(cls: type[ModelArchitecture], *, options: Mapping[str, Any] | None = None,
                            skip: Collection[str] = ()) -> SeamReport:
    """Like :func:`check_architecture`, but never raises for a broken invariant: every check gets a row."""
    plugin = cls(plugin_settings(cls, options))
    return run_checks(SEAM, cls.__name__, ARCHITECTURE_CHECKS, skip=skip, args=(plugin,))


def _declares(plugin: ModelArchitecture) -> None:
    configs = plugin.tiny_hf_configs()
    covered = {name for config in configs.values() for name in config.get("architectures", ())}
    missing = sorted(set(plugin.hf_architectures) - covered)
    if missing:
        raise broken(SEAM, DECLARES, f"no tiny config has architecture {', '.join(missing)}")
    if not plugin.hf_architectures and not plugin.gguf_architectures:
        raise broken(SEAM, DECLARES, "the plugin declares no architecture")


def _refuses_unknown_keys(plugin: ModelArchitecture) -> None:
    for case, config in plugin.tiny_hf_configs().items():
        try:
            plugin.parse_hf_config({**config, UNKNOWN_KEY: 1}, {})
        except ArchitectureConfigError as exc:
            if exc.key != UNKNOWN_KEY:
                raise broken(SEAM, REFUSES, f"case {case!r}: refused key {exc.key!r}, not {UNKNOWN_KEY!r}") from exc
        else:
            raise broken(SEAM, REFUSES, f"case {case!r}: {UNKNOWN_KEY!r} was accepted")


@dataclass(frozen=True, slots=True)
class _Oracle:
    """torch and transformers, imported."""

    torch: Any
    transformers: Any


def _oracle() -> _Oracle:
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise Skip(f"needs torch and transformers (pip install fd-engine[hf]): {exc}") from exc
    return _Oracle(torch, transformers)


def _matches_transformers(plugin: ModelArchitecture) -> None:
    oracle = _oracle()
    from fd_core.model.kernels import PORTABLE_KERNELS, select_kernels
    from fd_plugins.platforms.cpu import CpuPlatform

    kernel_sets = {"portable": PORTABLE_KERNELS}
    host = select_kernels(CpuPlatform().capabilities)
    if host.describe() != PORTABLE_KERNELS.describe():
        kernel_sets["host"] = host
    for case, config in plugin.tiny_hf_configs().items():
        for seed in SEEDS:
            with tempfile.TemporaryDirectory(prefix="fd-conformance-") as tmp:
                folder = _random_checkpoint(oracle, config, seed, Path(tmp) / case, keep_config=seed == 0)
                prompts = _prompts(config["vocab_size"], seed)
                expected = _transformers_greedy(oracle, folder, prompts)
                for kernels_name, kernels in kernel_sets.items():
                    got = _plugin_greedy(plugin, folder, prompts, kernels)
                    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
                        if want != have:
                            raise broken(SEAM, MATCHES, f"case {case!r} seed {seed} kernels {kernels_name}: prompt "
                                                        f"{i} decoded {have}, transformers {want}")


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(1000 + seed)
    return [rng.integers(1, vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


def _random_checkpoint(oracle: _Oracle, config: Mapping[str, Any], seed: int, folder: Path, *,
                       keep_config: bool) -> Path:
    """A random transformers model of ``config`` saved in ``folder``; weights drawn with a spread
    that makes greedy choices clear (transformers' init is near-uniform), norms away from 1."""
    torch, transformers = oracle.torch, oracle.transformers
    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    hf_config.architectures = list(config["architectures"])
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
            else:
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    if keep_config:
        (folder / "config.json").write_text(json.dumps(dict(config)))
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def _transformers_greedy(oracle: _Oracle, folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    torch = oracle.torch
    model = oracle.transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # decode every token, as the kit's runner does (an EOS included)
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


def _plugin_greedy(plugin: ModelArchitecture, folder: Path, prompts: list[list[int]],
                   kernels: KernelSet) -> list[list[int]]:
    from fd_core.model.hf_loader import load_hf_folder

    arch, weights = load_hf_folder(folder, plugin)
    expected = plugin.weight_shapes(arch)
    got = {name: tuple(w.shape) for name, w in weights.items()}
    if got != expected:
        raise broken(SEAM, MATCHES, f"{folder.name}: the checkpoint's tensors {sorted(got.items() - expected.items())} "
                                    f"differ from weight_shapes() {sorted(expected.items() - got.items())}")
    return greedy_tokens(plugin, arch, weights, prompts, NEW_TOKENS, kernels=kernels)


def greedy_tokens(plugin: ModelArchitecture, arch: Any, weights: Mapping[str, Any], prompts: list[list[int]],
                  new_tokens: int, *, kernels: KernelSet, **runner_options: Any) -> list[list[int]]:
    """Greedy continuations of ``prompts`` through a :class:`~fd_core.runner.model_runner.ModelRunner`
    of ``plugin``'s model: every prompt prefilled in one step, then batched decode steps, each
    request's blocks scattered over the pool."""
    from fd_core.outputs import ScheduledRequest, StepPlan
    from fd_core.request import Request
    from fd_core.runner.model_runner import ModelRunner

    blocks_each = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    order = np.random.default_rng(0).permutation(len(prompts) * blocks_each).tolist()
    runner = ModelRunner(plugin, arch, weights, num_blocks=len(prompts) * blocks_each, block_size=BLOCK_SIZE,
                         sampler=_ArgmaxSampler(), kernels=kernels, **runner_options)
    requests = [Request(f"p{i}", list(p)) for i, p in enumerate(prompts)]
    tables = {r.request_id: order[i * blocks_each:(i + 1) * blocks_each] for i, r in enumerate(requests)}
    for _ in range(new_tokens):
        rows = [ScheduledRequest(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens,
                                 tables[r.request_id], sample=True) for r in requests]
        result = runner.execute(StepPlan(rows))
        for r in requests:
            r.num_computed_tokens = r.num_tokens
            r.output_token_ids.append(result.sampled[r.request_id].token_id)
    return [r.output_token_ids for r in requests]


class _ArgmaxSampler:
    """Greedy: the argmax of each row."""

    def sample(self, logits: Any, requests: list[Any]) -> list[Any]:
        from fd_core.outputs import SampledToken

        return [SampledToken(token_id=int(row.argmax())) for row in logits.numpy()]

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""


#: The architecture kit, in the order it runs.
ARCHITECTURE_CHECKS: Final = (
    Check("declares", DECLARES, _declares),
    Check("refuses_unknown_keys", REFUSES, _refuses_unknown_keys),
    Check("matches_transformers", MATCHES, _matches_transformers),
)
