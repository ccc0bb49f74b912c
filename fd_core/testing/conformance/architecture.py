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
this host's cpu platform picks; in the bf16 precision mode (weights, inputs, attention and KV
cache in bfloat16), teacher-forced over transformers' tokens, it must keep transformers' top-1
token at almost every step and lose it only to a near-tie. See :data:`ARCHITECTURE_CHECKS`.
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

__all__ = ["ARCHITECTURE_CHECKS", "check_architecture", "greedy_decode", "run_architecture_checks"]

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
MATCHES: Final = "greedy tokens and logits equal transformers' on every tiny config"
#: How far (a share of transformers' logit range) float32 logits may be from transformers'.
LOGITS_TOLERANCE: Final = 1e-3
BF16: Final = "the bf16 mode keeps transformers' top-1 token"
#: The bf16 precision mode (docs/precision.md) as ModelRunner options.
BF16_MODE: Final = {"kv_dtype": "bfloat16", "linear_weights": "bfloat16", "linear_inputs": "bfloat16",
                    "attention_inputs": "bfloat16"}
#: Its bar: top-1 agreement over all cases' teacher-forced steps, and how close (a share of
#: transformers' logit range) the two logits of a disagreement must be. The built-in plugin's 20
#: cases: 710 of 720 steps, every disagreement within 1.0% (AMD EPYC Zen 3); tiny random models
#: have flatter logits, so more near-ties, than trained ones.
BF16_SHARE: Final = 0.98
BF16_TIE: Final = 0.02


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
                expected, expected_logits = _transformers_greedy(oracle, folder, prompts)
                arch, weights = _checked_load(plugin, folder)
                for kernels_name, kernels in kernel_sets.items():
                    got, logits = greedy_decode(plugin, arch, weights, prompts, NEW_TOKENS, kernels=kernels)
                    where = f"case {case!r} seed {seed} kernels {kernels_name}: prompt"
                    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
                        if want != have:
                            raise broken(SEAM, MATCHES, f"{where} {i} decoded {have}, transformers {want}")
                    for i, (ours, theirs) in enumerate(zip(logits, expected_logits, strict=True)):
                        error = np.abs(ours - theirs).max() / (theirs.max() - theirs.min())
                        if error > LOGITS_TOLERANCE:   # the same tokens, so the same contexts
                            raise broken(SEAM, MATCHES, f"{where} {i}: logits off by {error:.2%} of their range")


def _bf16_agreement(plugin: ModelArchitecture) -> None:
    oracle = _oracle()
    from fd_core.model.kernels import select_kernels
    from fd_plugins.platforms.cpu import CpuPlatform

    kernels = select_kernels(CpuPlatform().capabilities)
    if kernels.chosen["linear"].name != "mkl_packed":
        raise Skip(f"the bf16 mode needs the C++ kernels, not chosen here ({kernels.describe()})")
    steps = agreed = 0
    for case, config in plugin.tiny_hf_configs().items():
        with tempfile.TemporaryDirectory(prefix="fd-conformance-") as tmp:
            folder = _random_checkpoint(oracle, config, 0, Path(tmp) / case, keep_config=True)
            prompts = _prompts(config["vocab_size"], 0)
            expected, oracle_logits = _transformers_greedy(oracle, folder, prompts)
            arch, weights = _checked_load(plugin, folder)
            _, logits = greedy_decode(plugin, arch, weights, prompts, NEW_TOKENS, kernels=kernels, forced=expected,
                                      **BF16_MODE)
        for ours, theirs in zip(logits, oracle_logits, strict=True):
            for mine, truth in zip(ours, theirs, strict=True):
                best, picked = int(truth.argmax()), int(mine.argmax())
                steps, agreed = steps + 1, agreed + (best == picked)
                gap = (truth[best] - truth[picked]) / (truth.max() - truth.min())
                if gap > BF16_TIE:
                    raise broken(SEAM, BF16, f"case {case!r}: the bf16 mode picked token {picked} where transformers' "
                                             f"{best} leads by {gap:.1%} of its logit range")
    if agreed < BF16_SHARE * steps:
        raise broken(SEAM, BF16, f"top-1 agreed at {agreed} of {steps} teacher-forced steps")


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


def _transformers_greedy(oracle: _Oracle, folder: Path,
                         prompts: list[list[int]]) -> tuple[list[list[int]], list[np.ndarray]]:
    """transformers' greedy tokens and logits ``[NEW_TOKENS, vocab]`` per prompt, one prompt at a time."""
    torch = oracle.torch
    model = oracle.transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # decode every token, as the kit's runner does (an EOS included)
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(torch.cat(out.logits).numpy())
    return tokens, logits


def _checked_load(plugin: ModelArchitecture, folder: Path) -> tuple[Any, dict[str, Any]]:
    """The folder's shape and weights through the plugin; its tensors must be exactly ``weight_shapes()``."""
    from fd_core.model.hf_loader import load_hf_folder

    arch, weights = load_hf_folder(folder, plugin)
    expected = plugin.weight_shapes(arch)
    got = {name: tuple(w.shape) for name, w in weights.items()}
    if got != expected:
        raise broken(SEAM, MATCHES, f"{folder.name}: the checkpoint's tensors {sorted(got.items() - expected.items())} "
                                    f"differ from weight_shapes() {sorted(expected.items() - got.items())}")
    return arch, weights


def greedy_decode(plugin: ModelArchitecture, arch: Any, weights: Mapping[str, Any], prompts: list[list[int]],
                  new_tokens: int, *, kernels: KernelSet, forced: list[list[int]] | None = None,
                  **runner_options: Any) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens and logits ``[new_tokens, vocab]`` per prompt through a
    :class:`~fd_core.runner.model_runner.ModelRunner` of ``plugin``'s model: every prompt prefilled
    in one step, then batched decode steps, each request's blocks scattered over the pool. With
    ``forced`` (teacher forcing) each step appends the forced token instead of ours, so every
    step's logits are over the oracle's context."""
    from fd_core.outputs import ScheduledRequest, StepPlan
    from fd_core.request import Request
    from fd_core.runner.model_runner import ModelRunner

    blocks_each = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    order = np.random.default_rng(0).permutation(len(prompts) * blocks_each).tolist()
    sampler = _ArgmaxSampler()
    runner = ModelRunner(plugin, arch, weights, num_blocks=len(prompts) * blocks_each, block_size=BLOCK_SIZE,
                         sampler=sampler, kernels=kernels, **runner_options)
    requests = [Request(f"p{i}", list(p)) for i, p in enumerate(prompts)]
    tables = {r.request_id: order[i * blocks_each:(i + 1) * blocks_each] for i, r in enumerate(requests)}
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(new_tokens):
        rows = [ScheduledRequest(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens,
                                 tables[r.request_id], sample=True) for r in requests]
        result = runner.execute(StepPlan(rows))
        for i, r in enumerate(requests):
            r.num_computed_tokens = r.num_tokens
            tokens[i].append(result.sampled[r.request_id].token_id)
            r.output_token_ids.append(tokens[i][-1] if forced is None else forced[i][step])
    return tokens, [np.stack(sampler.logits[r.request_id]) for r in requests]


class _ArgmaxSampler:
    """Greedy: the argmax of each row (rows kept per request)."""

    def __init__(self) -> None:
        self.logits: dict[str, list[np.ndarray]] = {}

    def sample(self, logits: Any, requests: list[Any]) -> list[Any]:
        from fd_core.outputs import SampledToken

        rows = logits.numpy()
        for row, request in zip(rows, requests, strict=True):
            self.logits.setdefault(request.request_id, []).append(row)
        return [SampledToken(token_id=int(row.argmax())) for row in rows]

    def forget(self, request_id: str) -> None:
        self.logits.pop(request_id, None)


#: The architecture kit, in the order it runs.
ARCHITECTURE_CHECKS: Final = (
    Check("declares", DECLARES, _declares),
    Check("refuses_unknown_keys", REFUSES, _refuses_unknown_keys),
    Check("matches_transformers", MATCHES, _matches_transformers),
    Check("bf16_agreement", BF16, _bf16_agreement),
)
