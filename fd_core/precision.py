"""Named precision modes: what each stores and rounds, how exact it is, what it needs, and the
one place where every rule about precision keys is checked.

A user picks a mode with ``model.precision``; the mode sets the four keys that used to be
combined by hand (``model.quantized_weights``, ``model.linear_weights``, ``model.linear_inputs``,
``model.attention_inputs``) and what ``cache.dtype = "auto"`` stores. Those keys still work on
their own (a config that sets them and no mode gets the mode they spell, or ``custom``); set
beside a mode, each must agree with it (a key left at its default takes the mode's value).
:func:`precision_problems` checks every rule at once, from what ``fd-serve --check`` runs
(``fd_core.selection.resolve``), before any kernel is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from fd_core.config import FdConfig, ModelSection
    from fd_core.contracts.platform import Platform
    from fd_core.model.kernels import KernelSet

#: The model keys a mode sets.
MODE_KEYS: Final = ("quantized_weights", "linear_weights", "linear_inputs", "attention_inputs")

#: What a mode may need (as the docs and errors say it): a float32 model, a GGUF source, the C++ kernels.
NEED_FLOAT32: Final = "a float32 model (model.dtype)"
NEED_GGUF: Final = "a GGUF model"
NEED_CPP: Final = "the C++ kernels"


@dataclass(frozen=True, slots=True)
class PrecisionMode:
    """One named mode: the model keys it sets, and what it means (for docs and ``--check``)."""

    name: str
    quantized_weights: str     # a GGUF's Q4_0-Q8_0 / Q4_K-Q6_K matrices: "dequantize" or "keep"
    linear_weights: str        # projections' and head's float32 weights: float32, bfloat16, int8
    linear_inputs: str         # their inputs: float32, bfloat16, int8
    attention_inputs: str      # attention's queries: float32 or bfloat16
    cache_dtype: str           # what cache.dtype "auto" stores ("auto": model.dtype)
    stores: str                # what is kept in memory
    rounds: str                # what is rounded on the way
    exactness: str             # against float32's outputs
    needs: tuple[str, ...]     # NEED_FLOAT32, NEED_GGUF, NEED_CPP

    def setting(self, key: str) -> str:
        """The value this mode gives ``model.<key>`` (a key of :data:`MODE_KEYS`)."""
        return str(getattr(self, key))


MODES: Final[dict[str, PrecisionMode]] = {mode.name: mode for mode in (
    PrecisionMode("float32", "dequantize", "float32", "float32", "float32", "auto",
                  "weights (a GGUF's dequantized) and KV in float32", "nothing",
                  "the reference: greedy tokens match Hugging Face transformers", ()),
    PrecisionMode("bf16-weights", "dequantize", "bfloat16", "float32", "float32", "auto",
                  "projection and head weights in bfloat16 (half their bytes)",
                  "those weights, once at load; products and sums stay float32",
                  "close to, not identical with, float32", (NEED_FLOAT32,)),
    PrecisionMode("bf16", "dequantize", "bfloat16", "bfloat16", "bfloat16", "bfloat16",
                  "projection and head weights and the KV cache in bfloat16",
                  "weights, linear inputs and attention queries (AMX tiles or vdpbf16ps where the CPU has "
                  "them); sums and softmax stay float32",
                  "further from float32 than bf16-weights (as vLLM's bfloat16)", (NEED_FLOAT32, NEED_CPP)),
    PrecisionMode("int8", "dequantize", "int8", "int8", "float32", "auto",
                  "projection and head weights as int8 codes within [-64, 64], a scale per output channel",
                  "weights per output channel, each input row to uint8 (scale and zero point); exact integer sums",
                  "the least exact mode (~93% top-1 agreement with float32 on SmolLM2-135M)", (NEED_FLOAT32,)),
    PrecisionMode("gguf-blocks", "keep", "float32", "float32", "float32", "auto",
                  "a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices in their blocks (3-7x fewer weight bytes)",
                  "nothing: the blocks are widened in registers; only the order of the sums differs",
                  "the same weight values as float32 of that file", (NEED_FLOAT32, NEED_GGUF, NEED_CPP)),
    PrecisionMode("gguf-blocks-int8", "keep", "float32", "int8", "float32", "auto",
                  "as gguf-blocks",
                  "the inputs of the kept matrices to int8 in blocks of 32 (as llama.cpp does), for integer "
                  "dot products (VNNI where the CPU has it)",
                  "as llama.cpp's on the same file", (NEED_FLOAT32, NEED_GGUF, NEED_CPP)),
)}

#: What ``model.precision`` reports for a combination of the old keys that no mode names.
CUSTOM: Final = "custom"


def modes_table() -> str:
    """The modes as a markdown table (docs/precision.md holds it; a test keeps the two equal)."""
    rows = ["| mode | stores | rounds | exactness | needs |", "|---|---|---|---|---|"]
    rows += [f"| `{m.name}` | {m.stores} | {m.rounds} | {m.exactness} | {', '.join(m.needs) or '—'} |"
             for m in MODES.values()]
    return "\n".join(rows)


def mode_of(model: ModelSection) -> str:
    """The mode ``model`` selects: ``model.precision``, else the mode its four keys spell, else
    :data:`CUSTOM`."""
    if model.precision is not None:
        return model.precision
    spelled = tuple(getattr(model, key) for key in MODE_KEYS)
    for mode in MODES.values():
        if tuple(mode.setting(key) for key in MODE_KEYS) == spelled:
            return mode.name
    return CUSTOM


def kv_cache_dtype(config: FdConfig) -> str:
    """The KV cache's storage dtype: ``cache.dtype``; for ``auto``, the mode's, else ``model.dtype``."""
    if config.cache.dtype != "auto":
        return config.cache.dtype
    mode = MODES.get(mode_of(config.model))
    return config.model.dtype if mode is None or mode.cache_dtype == "auto" else mode.cache_dtype


def precision_problems(config: FdConfig, platform: Platform | None) -> list[tuple[str, str]]:
    """Every broken precision rule, as (dotted key, message), all at once. A value a mode set is
    reported under ``model.precision``; one the user set, under its own key. ``platform`` (when
    known) answers whether the C++ kernels can run: declared capability and a compiler on PATH."""
    model = config.model
    mode = MODES.get(model.precision) if model.precision is not None else None

    def key_of(name: str) -> str:   # past the conflict check, a mode's keys hold the mode's values
        return "model.precision" if mode is not None else f"model.{name}"

    problems: list[tuple[str, str]] = []
    if mode is not None:
        for name in MODE_KEYS:
            if getattr(model, name) != mode.setting(name):
                problems.append((f"model.{name}", f"{getattr(model, name)!r} conflicts with model.precision = "
                                                  f"{mode.name!r}, which sets {mode.setting(name)!r}: remove "
                                                  f"model.{name} (the mode sets it)"))
        if problems:
            return problems   # the rules below would repeat the conflict in other words
    weights, inputs, queries, kept = model.linear_weights, model.linear_inputs, model.attention_inputs, \
        model.quantized_weights == "keep"
    stored = kv_cache_dtype(config)
    if weights != "float32" and model.dtype != "float32":
        problems.append((key_of("linear_weights"), f"{weights!r} linear weights round a float32 model's weights; "
                                                   f"model.dtype is {model.dtype!r}"))
    if weights == "int8" and inputs != "int8":
        problems.append((key_of("linear_inputs"), f"int8 weights are multiplied with int8 inputs: set "
                                                  f"model.linear_inputs = \"int8\" (not {inputs!r}), or "
                                                  f"model.precision = \"int8\""))
    if inputs == "bfloat16" and weights != "bfloat16":
        problems.append((key_of("linear_inputs"), "'bfloat16' inputs are multiplied with bfloat16 weights: set "
                                                  "model.linear_weights = \"bfloat16\" too, or model.precision = "
                                                  "\"bf16\""))
    if inputs == "int8" and not kept and weights != "int8":
        problems.append((key_of("linear_inputs"), "'int8' inputs are multiplied with weights kept in GGUF blocks "
                                                  "or with int8 weights: set model.precision = \"gguf-blocks-int8\" "
                                                  "or \"int8\""))
    if queries == "bfloat16" and stored not in ("bfloat16", "int8"):
        problems.append((key_of("attention_inputs"), f"'bfloat16' queries are multiplied with a bfloat16 or int8 "
                                                     f"cache; the cache stores {stored!r}: set cache.dtype = "
                                                     f"\"bfloat16\" (or leave it \"auto\" under model.precision "
                                                     f"= \"bf16\")"))
    if kept:
        problems += _kept_blocks_problems(config, key_of("quantized_weights"))
    cpp_problem = _cpp_kernels_problem(platform)
    if cpp_problem is not None:
        if kept:
            problems.append((key_of("quantized_weights"), f"keeping GGUF blocks needs {NEED_CPP}: {cpp_problem}"))
        if stored != model.dtype:
            problems.append(("cache.dtype" if config.cache.dtype != "auto" else "model.precision",
                             f"a {stored} KV cache with a {model.dtype} model needs {NEED_CPP}: {cpp_problem}"))
    return problems


def kernel_problems(config: FdConfig, kernels: KernelSet) -> list[tuple[str, str]]:
    """After the kernels were chosen: what the config needs that did not build here (a compiler
    or ABI failure that ``--check`` cannot foresee). ``kernels.describe()`` says why."""
    problems = []
    if config.model.quantized_weights == "keep" and kernels.chosen["linear"].name == "portable":
        problems.append(("model.quantized_weights", f"keeping GGUF blocks needs the C++ linear kernel; here: "
                                                    f"{kernels.describe()}"))
    if kv_cache_dtype(config) != config.model.dtype and kernels.reads_gather_inputs:
        problems.append(("cache.dtype", f"a {kv_cache_dtype(config)} KV cache with a {config.model.dtype} model "
                                        f"needs the C++ attention and RoPE + KV write kernels; here: "
                                        f"{kernels.describe()}"))
    return problems


def _kept_blocks_problems(config: FdConfig, key: str) -> list[tuple[str, str]]:
    from fd_core.errors import ModelLoadError
    from fd_core.model.loader import model_source_kind

    problems = []
    try:
        if model_source_kind(config.model.source) == "folder":
            problems.append((key, f"keeping GGUF blocks needs {NEED_GGUF}; {config.model.source!r} is a "
                                  "Hugging Face folder"))
    except ModelLoadError:
        pass   # reported under model.source
    if config.model.dtype != "float32":
        problems.append((key, f"keeping GGUF blocks needs {NEED_FLOAT32}, not {config.model.dtype!r}"))
    return problems


def _cpp_kernels_problem(platform: Platform | None) -> str | None:
    """Why the C++ kernels cannot run under ``platform`` (judged without building them), or None."""
    from fd_core.contracts.platform import CPP_KERNELS as CAPABILITY

    if platform is None:
        return None
    if CAPABILITY not in platform.capabilities:
        return f"platform {platform.name!r} does not declare {CAPABILITY!r} (e.g. [platform.options] kernels = " \
               "\"portable\", or a CPU without AVX2)"
    from fd_kernels.native import find_compiler

    if find_compiler() is None:
        return "no C++ compiler on PATH (install g++)"
    return None
