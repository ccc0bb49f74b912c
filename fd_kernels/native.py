"""Build (once) and load fd-engine's C++ CPU kernels, as Paddle custom ops.

The sources in ``csrc/`` are compiled with ``paddle.utils.cpp_extension.load`` into a folder
keyed by the Paddle version, the ISA flags, a hash of the sources and their folder
(``$FD_CACHE_DIR/kernels/<key>``, default ``~/.cache/fd-engine/kernels``), and a cache shared by
machines with different CPUs never hands one a library built for another. Once a build succeeded
the folder holds a ``built`` marker, and later starts load the library directly (~0.1 s) instead of
letting Paddle's ``load`` start a build process that only finds it up to date (~1.5-3 s per start).
The ISA flags come from the capabilities the platform declared (``-mavx512f ...`` only where it
declared ``avx512f``), never ``-march=native``. Builds from several processes at once (data-parallel
ranks) are serialised by a file lock.

:func:`load_native` raises :class:`NativeKernelsUnavailable` with the reason (no compiler, the
build failed); the kernel table then falls back to the Paddle reference kernels and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from fd_kernels.linear import PORTABLE_LINEAR
from fd_kernels.moe import GROUPED, BoundExperts, Router
from fd_kernels.quantized import BlockQuantized, quantize_int8_channels

log = logging.getLogger(__name__)

_CSRC: Final = Path(__file__).parent / "csrc"
SOURCES: Final = tuple(_CSRC / name for name in ("paged_attention.cc", "rms_norm.cc", "rope_kv.cc", "swiglu.cc",
                                                  "packed_linear.cc", "quant_linear.cc", "int8_linear.cc",
                                                  "bf16_linear.cc", "bf16_mlp.cc", "decoder_layer.cc",
                                                  "moe_experts.cc"))
HEADERS: Final = tuple(sorted(_CSRC.glob("*.h")))
# OpenMP: the kernels run on Intel's runtime (libiomp5, which Paddle's MKL uses): one thread pool
# for the matmuls and these kernels, so neither spins against the other's threads. No FP traps or
# errno (the kernels use neither), so loops with comparisons, divisions and sqrt vectorise; the
# results are the same IEEE values.
_BASE_FLAGS: Final = ("-O3", "-fopenmp", "-std=c++17", "-fno-trapping-math", "-fno-math-errno")
_loaded: dict[str, ModuleType] = {}


class NativeKernelsUnavailable(Exception):
    """The C++ kernels cannot be used here; the message says why."""


def isa_flags(capabilities: Collection[str]) -> tuple[str, ...]:
    """Compiler flags for the declared ISA features (baseline x86-64 when none)."""
    declared = set(capabilities)
    if {"avx512f", "avx2", "fma"} <= declared:   # F, and VL where VNNI needs it: the probe declares no dq/bw
        avx512 = ("-mavx2", "-mfma", "-mavx512f")
        if {"avx512_vnni", "avx512vl"} <= declared:   # quant_linear.cc's int8 dot products (vpdpbusd)
            avx512 = (*avx512, "-mavx512vl", "-mavx512vnni")
        if "amx_bf16" in declared:   # the tiles of bf16_linear.cc (amx_bf16 implies amx_tile)
            return (*avx512, "-mamx-tile", "-mamx-bf16")
        if {"bf16_dot_products", "avx512_bf16"} <= declared:   # bf16_linear.cc's vdpbf16ps tiles
            return (*avx512, "-mavx512bf16")
        return avx512
    if {"avx2", "fma"} <= declared:
        return ("-mavx2", "-mfma", "-mavxvnni") if "avx_vnni" in declared else ("-mavx2", "-mfma")
    return ()


def cache_dir(flags: tuple[str, ...]) -> Path:
    """Where the library built with ``flags`` lives (see the module docstring)."""
    import paddle

    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(_BASE_FLAGS + flags).encode())
    # the library links to this Paddle installation's libraries by path (rpath), and Paddle's build
    # rebuilds when its include paths change: two virtualenvs sharing one folder rebuilt it in turn
    digest.update(str(paddle_libs()).encode())
    # Paddle also rebuilds when the sources' paths change: two checkouts of the same sources (git
    # worktrees, a CI clone beside a working copy) sharing one folder rebuilt it in turn
    digest.update(str(_CSRC.resolve()).encode())
    isa = "-".join(flag.removeprefix("-m") for flag in flags) or "baseline"
    root = os.environ.get("FD_CACHE_DIR")
    base = (Path(root) if root else Path.home() / ".cache" / "fd-engine") / "kernels"
    return base / f"paddle{paddle.__version__}-{isa}-{digest.hexdigest()[:12]}"


def paddle_libs() -> Path:
    """Paddle's bundled libraries (``libiomp5.so`` among them)."""
    import paddle

    return Path(paddle.__file__).parent / "libs"


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with (``$CXX``, else ``c++`` on PATH), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def load_native(capabilities: Collection[str]) -> ModuleType:
    """The ops module (``fd_paged_attention``, ``fd_rms_norm``, ``fd_rope_write_kv``, ``fd_swiglu``,
    ``fd_pack_weight``, ``fd_packed_linear``, ``fd_quant_linear``, ``fd_pack_bf16``, ``fd_bf16_linear``,
    ``fd_pack_int8``, ``fd_int8_linear``,
    ``fd_decoder_layers``, ``fd_moe_route``, ``fd_moe_experts``) built for
    ``capabilities``; builds on first use."""
    flags = isa_flags(capabilities)
    folder = cache_dir(flags)
    key = str(folder)
    if key in _loaded:
        return _loaded[key]
    if _loaded:   # Paddle registers an op name once per process
        raise NativeKernelsUnavailable(f"this process already loaded the C++ kernels built as {next(iter(_loaded))}")
    compiler = find_compiler()
    if compiler is None:
        raise NativeKernelsUnavailable("no C++ compiler on PATH (install g++ to build the C++ kernels)")
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another process may be building the same library
        module = _load_built(folder)
        if module is None:
            try:
                module = _build(folder, flags)
            except Exception as exc:   # a compiler or ABI failure: the reference kernels still work
                raise NativeKernelsUnavailable(f"building {folder.name} failed: {type(exc).__name__}: "
                                               f"{str(exc).strip()[-400:]}") from exc
            (folder / _BUILT_MARKER).touch()
    _loaded[key] = module
    return module


def prepare_attention(capabilities: Collection[str]) -> Callable[..., Any]:
    """The C++ ``attention`` kernel variant: every row of a step (decode and prefill) in one op,
    reading the KV blocks in place; built for ``capabilities``; raises
    :class:`NativeKernelsUnavailable`. Uses the CPUs this process may run on (a data-parallel
    rank's share)."""
    op = load_native(capabilities).fd_paged_attention
    threads = _threads()

    def attention_cpp(q: Any, k_cache: Any, v_cache: Any, attn: Any, round_queries: bool = False,
                      window: int | None = None) -> Any:
        return op(q, k_cache, v_cache, attn.row_tables, attn.row_starts, attn.row_lens, 1.0, round_queries, threads,
                  window or 0)

    return attention_cpp


def prepare_rms_norm(capabilities: Collection[str]) -> Callable[..., Any]:
    """The C++ ``rms_norm`` variant (residual add fused in), safe on every ISA it is built for."""
    op = load_native(capabilities).fd_rms_norm
    threads = _threads()

    def rms_norm_cpp(x: Any, weight: Any, eps: float, residual: Any) -> tuple[Any, Any]:
        out, summed = op(x, x if residual is None else residual, weight, eps, residual is not None, threads)
        return out, summed

    return rms_norm_cpp


def prepare_swiglu(capabilities: Collection[str]) -> Callable[..., Any]:
    """The C++ ``swiglu`` variant: ``silu(gate) * up`` of the fused gate/up projection in one pass."""
    op = load_native(capabilities).fd_swiglu
    threads = _threads()

    def swiglu_cpp(x: Any) -> Any:
        return op(x, threads)

    return swiglu_cpp


class PackedLinear:
    """Float32 weights packed once into MKL's GEMM layout (``csrc/packed_linear.cc``), or rounded to
    bfloat16 and stored in 16-bit panels with ``bfloat16=True`` (``csrc/bf16_linear.cc``), or
    quantized per output channel to int8 for MKL's integer GEMM with ``int8=True``
    (``csrc/int8_linear.cc``);
    block-quantized ones kept as they are (``csrc/quant_linear.cc``): both widened inside the matmul.
    Other dtypes go through the portable linear. Same contract as ``fd_kernels.linear.PortableLinear``."""

    name = "mkl_packed"

    def __init__(self, ops: ModuleType, mkl: Path) -> None:
        self._ops = ops
        self._mkl = str(mkl)
        self._threads = _threads()

    def prepare(self, weight: Any, *, transposed: bool = False, bfloat16: bool = False,
                bfloat16_inputs: bool = False, int8_inputs: bool = False, int8: bool = False) -> Any:
        """The packed weight (a uint8 tensor that must stay where it is) and its output width, or the
        quantized weight's codes, scales and mins as tensors. ``bfloat16`` and ``int8`` apply to
        float32 weights; ``bfloat16_inputs`` (with ``bfloat16``) rounds each input as well: AMX tiles
        where built in; ``int8_inputs`` quantizes a block-quantized weight's inputs to int8 blocks:
        integer dot products. ``int8``: int8 codes per output channel times uint8 inputs per row
        (``fd_kernels.quantized.int8_linear_exact`` defines the result)."""
        if isinstance(weight, BlockQuantized):
            return _Quantized(weight, int8_inputs)
        if str(weight.dtype) not in ("paddle.float32", "float32"):
            return PORTABLE_LINEAR.prepare(weight, transposed=transposed)
        width = weight.shape[0] if transposed else weight.shape[1]
        if int8:
            return _Int8(self._ops, weight, transposed, self._mkl)
        if bfloat16:
            return _Bf16(self._ops.fd_pack_bf16(weight, transposed), width, bfloat16_inputs)
        return _Packed(self._ops.fd_pack_weight(weight, transposed, self._mkl), width)

    def __call__(self, x: Any, prepared: Any, bias: Any = None) -> Any:
        if isinstance(prepared, _Packed):
            out = self._ops.fd_packed_linear(x, prepared.data, prepared.width)
        elif isinstance(prepared, _Bf16):
            out = self._ops.fd_bf16_linear(x, prepared.data, prepared.width, self._threads, self._mkl,
                                           prepared.round_inputs)
        elif isinstance(prepared, _Int8):
            out = self._ops.fd_int8_linear(x, prepared.data, prepared.scales, prepared.code_sums, prepared.width,
                                           self._threads)
        elif isinstance(prepared, _Quantized):
            out = self._ops.fd_quant_linear(x, prepared.codes, prepared.scales, prepared.mins, prepared.bits,
                                            self._threads, self._mkl, prepared.round_inputs)
        else:
            return PORTABLE_LINEAR(x, prepared, bias)
        return out if bias is None else out + bias


class _Packed:
    """A float32 weight in MKL's packed layout."""

    __slots__ = ("data", "width")
    kind = 0             # fd_moe_experts' code for this layout
    round_inputs = False   # its inputs stay float32

    def __init__(self, data: Any, width: int) -> None:
        self.data, self.width = data, width

    def operands(self) -> tuple[Any, Any, Any]:
        """The fused ops' three tensors of this linear: the packed weight (twice more: nothing else)."""
        return self.data, self.data, self.data


class _Int8:
    """A float32 weight as int8 codes per output channel, packed for MKL's integer GEMM, with the
    channels' scales and code sums (what a row's zero point multiplies)."""

    __slots__ = ("data", "scales", "code_sums", "width")
    kind = 2               # fd_moe_experts' code for this layout
    round_inputs = False   # (its inputs are quantized per row by the kernel itself)

    def __init__(self, ops: ModuleType, weight: Any, transposed: bool, mkl: str) -> None:
        import numpy as np
        import paddle

        dense = weight.numpy()
        codes, scales = quantize_int8_channels(dense if transposed else dense.T)
        self.width = codes.shape[0]
        self.data = ops.fd_pack_int8(paddle.to_tensor(codes), mkl)
        self.scales = paddle.to_tensor(scales)
        self.code_sums = paddle.to_tensor(codes.sum(axis=1, dtype=np.int32))

    def operands(self) -> tuple[Any, Any, Any]:
        """The fused ops' three tensors of this linear."""
        return self.data, self.scales, self.code_sums


class _Bf16:
    """A weight in ``fd_pack_bf16``'s bfloat16 panels (``round_inputs``: its inputs rounded too)."""

    __slots__ = ("data", "width", "round_inputs")
    bits = 16   # the fused layer's code for these panels
    kind = 1    # fd_moe_experts' code for these panels

    def __init__(self, data: Any, width: int, round_inputs: bool) -> None:
        self.data, self.width, self.round_inputs = data, width, round_inputs

    def operands(self) -> tuple[Any, Any, Any]:
        """The fused ops' three tensors of this linear: the panels (twice more: no scales or mins)."""
        return self.data, self.data, self.data


class _Quantized:
    """``fd_quant_linear``'s operands: a block-quantized weight's codes, scales and mins
    (``round_inputs``: its inputs quantized to int8 blocks)."""

    __slots__ = ("bits", "codes", "scales", "mins", "width", "round_inputs")

    def __init__(self, weight: BlockQuantized, round_inputs: bool) -> None:
        import paddle

        self.bits, self.width, self.round_inputs = weight.bits, weight.shape[0], round_inputs
        self.codes, self.scales, self.mins = (paddle.to_tensor(a) for a in (weight.codes, weight.scales, weight.mins))

    @property
    def kind(self) -> int:
        """fd_moe_experts' code for these blocks: their bits."""
        return self.bits

    def operands(self) -> tuple[Any, Any, Any]:
        """The fused ops' three tensors of this linear."""
        return self.codes, self.scales, self.mins


@dataclass(frozen=True, slots=True)
class FusedBinding:
    """What :meth:`FusedDecoderLayer.bind` keeps for one layer, or :meth:`FusedDecoderLayer.join`
    for a run of them: ``fd_decoder_layers``' operands (per layer, in layer order; see
    ``csrc/decoder_layer.cc`` for their order), the layers' RMSNorm weights (``norms``: input,
    post-attention, then q and k where the layer has q/k norms; before ``join`` only the latter), and
    ``max_tokens``, the step size from which the layers run op by op instead."""

    tensors: list[Any]        # qkv, o, then gate_up, down or the router, correction and experts' linears
    bits: list[int]           # per layer four: qkv, o, gate_up, down (0 for a MoE layer's last two)
    widths: list[int]
    round_inputs: list[int]   # per linear: its input rounded to its weights' kind (bfloat16 or int8)
    max_tokens: int
    norms: list[Any] = field(default_factory=list)
    qk_norms: list[int] = field(default_factory=list)   # per layer: 1 where it has q/k norms
    top_k: list[int] = field(default_factory=list)      # per layer: its experts' top_k, 0 for a dense MLP
    renormalize: list[int] = field(default_factory=list)
    norm_min: list[float] = field(default_factory=list)
    expert_kinds: list[int] = field(default_factory=list)    # the MoE layers' expert linears, in order
    expert_widths: list[int] = field(default_factory=list)
    expert_round_inputs: list[int] = field(default_factory=list)


class FusedDecoderLayer:
    """The C++ ``decoder_layer`` (``csrc/decoder_layer.cc``): RMSNorm, q/k/v, q/k norms (Qwen3),
    RoPE + KV write, attention, o, RMSNorm, and gate/up, SwiGLU and down or the routed experts
    (``csrc/moe_experts.cc``) of a run of consecutive layers (every layer of the model, normally)
    in one op, through the same kernels as the op-by-op path (same results, no per-op or per-layer
    dispatch). Binds layers without a q/k/v bias whose weights (experts' included) are
    block-quantized or bfloat16 and whose experts :class:`FusedExperts` bound, for steps of fewer
    than the binding's ``max_tokens`` tokens.
    Called inside this op, MKL gave results that varied in the last bits from run to run (float32
    packed weights; seen on an AMD EPYC, one thread included; op by op they are reproducible, and
    MKL's strict reproducibility mode removes it), so MKL stays out of it."""

    name = "cpp"

    #: Steps of this many tokens or more run op by op: compute-bound, they gain nothing from one
    #: dispatch per run, and there the linears hand their matmuls to MKL (``kGemmRows`` in
    #: ``csrc/quant_linear.cc`` and ``csrc/bf16_linear.cc``), which this op never calls.
    max_tokens = 128
    #: The limit for bfloat16 panels with rounded inputs in a build that multiplies bfloat16 itself
    #: (AMX tiles or vdpbf16ps): none. Those never reach MKL, and the op runs the MLP as one fused
    #: pass itself (``csrc/bf16_mlp.cc``), so steps of every size gain from the one
    #: dispatch (a 4096-token prefill step of SmolLM2 among them). Were AMX's tiles refused at run
    #: time, such a step would multiply in float32 without MKL: the same values, summed in another order.
    bf16_products_max_tokens = sys.maxsize

    def __init__(self, ops: ModuleType, bf16_products: bool) -> None:
        self._op = ops.fd_decoder_layers
        self._threads = _threads()
        self._bf16_products = bf16_products

    def bind(self, linears: Sequence[Any], qkv_bias: Any, qk_norms: tuple[Any, Any] | None = None,
             experts: Sequence[tuple[Any, Any]] | None = None, bound_experts: Any = None) -> FusedBinding | None:
        """The op's operands for a layer, or ``None`` (see ``fd_kernels.decoder_layer``): ``linears``
        its qkv, o, gate_up and down (the last two None in a MoE layer); ``qk_norms`` its q and k
        heads' RMSNorm weights; a MoE layer's ``experts`` (gate_up, down) per expert as prepared and
        ``bound_experts`` as :meth:`FusedExperts.bind` bound them."""
        moe = experts is not None
        dense = list(linears[:2]) if moe else list(linears)
        expert_linears = [prepared for pair in experts for prepared in pair] if moe else []
        if (qkv_bias is not None or (moe and not isinstance(bound_experts, ExpertOperands))
                or not all(isinstance(prepared, (_Quantized, _Bf16)) for prepared in dense + expert_linears)):
            return None
        rounded = all(isinstance(prepared, _Bf16) and prepared.round_inputs for prepared in dense + expert_linears)
        tensors = [t for prepared in dense for t in prepared.operands()]
        if moe:
            tensors += [bound_experts.router, bound_experts.correction, *bound_experts.tensors]
        unused = [0, 0] if moe else []   # a MoE layer's gate_up and down codes
        return FusedBinding(
            tensors, [prepared.bits for prepared in dense] + unused, [prepared.width for prepared in dense] + unused,
            [int(prepared.round_inputs) for prepared in dense] + unused,
            self.bf16_products_max_tokens if self._bf16_products and rounded else self.max_tokens,
            norms=list(qk_norms or ()), qk_norms=[int(qk_norms is not None)], top_k=[bound_experts.top_k if moe else 0],
            renormalize=[int(moe and bound_experts.renormalize)], norm_min=[bound_experts.norm_min if moe else 0.0],
            expert_kinds=list(bound_experts.kinds) if moe else [],
            expert_widths=list(bound_experts.widths) if moe else [],
            expert_round_inputs=list(bound_experts.round_inputs) if moe else [])

    def join(self, bindings: Sequence[FusedBinding], norms: Sequence[tuple[Any, Any]]) -> FusedBinding:
        """One binding for consecutive layers (``bindings`` from :meth:`bind`; ``norms``: each
        layer's input and post-attention RMSNorm weights), run by one call."""
        def joined(name: str) -> list[Any]:
            return [value for b in bindings for value in getattr(b, name)]

        layer_norms = [w for pair, b in zip(norms, bindings, strict=True) for w in (*pair, *b.norms)]
        return FusedBinding(joined("tensors"), joined("bits"), joined("widths"), joined("round_inputs"),
                            min(b.max_tokens for b in bindings), layer_norms,
                            joined("qk_norms"), joined("top_k"),
                            joined("renormalize"), joined("norm_min"), joined("expert_kinds"),
                            joined("expert_widths"), joined("expert_round_inputs"))

    def __call__(self, run: FusedBinding, x: Any, residual: Any, k_caches: Sequence[Any], v_caches: Sequence[Any],
                 attn: Any, cos: Any, sin: Any, num_heads: int, head_dim: int, eps: float,
                 round_queries: bool = False) -> tuple[Any, Any]:
        """``(out, residual stream)`` after the run's layers, their K/V written into the caches
        (``round_queries``: see the ``attention`` kernels)."""
        out, summed = self._op(x, x if residual is None else residual, attn.positions_tensor, cos, sin,
                               attn.slots_tensor, attn.row_tables, attn.row_starts, attn.row_lens, k_caches,
                               v_caches, run.norms, run.tensors, run.bits, run.widths, num_heads, head_dim, eps,
                               residual is not None, run.round_inputs, round_queries, self._threads, run.qk_norms,
                               run.top_k, run.renormalize, run.norm_min, run.expert_kinds, run.expert_widths,
                               run.expert_round_inputs)[:2]
        return out, summed


def prepare_decoder_layer(capabilities: Collection[str]) -> FusedDecoderLayer:
    """The C++ ``decoder_layer`` variant (see :class:`FusedDecoderLayer`)."""
    flags = isa_flags(capabilities)
    return FusedDecoderLayer(load_native(capabilities), bf16_products="-mamx-bf16" in flags or "-mavx512bf16" in flags)


@dataclass(frozen=True, slots=True)
class ExpertOperands:
    """What :meth:`FusedExperts.bind` keeps for one MoE layer: ``fd_moe_experts``' operands."""

    router: Any            # [E, hidden] float32: expert e's router row
    correction: Any        # [E] float32: the score correction (zeros where the layer has none)
    top_k: int
    renormalize: bool
    norm_min: float
    tensors: list[Any]     # three per linear, expert 0's gate_up, its down, expert 1's gate_up, ...
    kinds: list[int]       # per linear: its prepared kind's code (see csrc/moe_experts.cc)
    widths: list[int]      # per linear: its output width
    round_inputs: list[int]   # per linear: its input rounded to its weights' kind (bfloat16 or int8)


class FusedExperts:
    """The C++ ``moe_experts`` (``csrc/moe_experts.cc``): a MoE layer's routing and its used experts'
    gate/up, SwiGLU and down over their grouped tokens in one op, through the linear kernels
    :class:`PackedLinear` calls (see ``fd_kernels.moe``). Binds layers whose every expert linear
    :class:`PackedLinear` prepared in C++ (float32 packed, bfloat16 panels, int8 channels, blocks);
    the others run as ``fd_kernels.moe.GROUPED`` does."""

    def __init__(self, ops: ModuleType, mkl: Path) -> None:
        self._op = ops.fd_moe_experts
        self._mkl = str(mkl)
        self._threads = _threads()

    def bind(self, router: Router, experts: Sequence[tuple[Any, Any]]) -> ExpertOperands | BoundExperts:
        """The op's operands for this layer, or :data:`~fd_kernels.moe.GROUPED`'s binding."""
        import paddle

        linears = [prepared for pair in experts for prepared in pair]
        if not all(isinstance(prepared, (_Packed, _Bf16, _Int8, _Quantized)) for prepared in linears):
            return GROUPED.bind(router, experts)
        rows = router.weight.T.contiguous()
        correction = (paddle.zeros([rows.shape[0]], dtype="float32") if router.correction is None
                      else router.correction.reshape([-1]))
        return ExpertOperands(rows, correction, router.top_k, router.renormalize, router.norm_min,
                              [t for prepared in linears for t in prepared.operands()],
                              [prepared.kind for prepared in linears], [prepared.width for prepared in linears],
                              [int(prepared.round_inputs) for prepared in linears])

    def __call__(self, h: Any, bound: ExpertOperands | BoundExperts, linear: Any, swiglu: Callable[..., Any]) -> Any:
        """The routed experts' output ``[T, hidden]`` (``linear`` and ``swiglu``: for an unbound layer)."""
        if not isinstance(bound, ExpertOperands):
            return GROUPED(h, bound, linear, swiglu)
        return self._op(h, bound.router, bound.correction, bound.tensors, bound.top_k, bound.renormalize,
                        bound.norm_min, bound.kinds, bound.widths, bound.round_inputs, self._threads, self._mkl)


def prepare_moe_experts(capabilities: Collection[str]) -> FusedExperts:
    """The C++ ``moe_experts`` variant (see :class:`FusedExperts`); it needs what the C++ ``linear``
    variant needs."""
    mkl = _mkl_library()
    return FusedExperts(load_native(capabilities), mkl)


def prepare_linear(capabilities: Collection[str]) -> PackedLinear:
    """The C++ ``linear`` variant: weights packed for MKL's GEMM, which must be in Paddle's wheel
    (``libmklml_intel.so``)."""
    mkl = _mkl_library()
    return PackedLinear(load_native(capabilities), mkl)


def _mkl_library() -> Path:
    """Paddle's MKL (its GEMM entry points), which a CPU wheel ships; raises
    :class:`NativeKernelsUnavailable` where it does not."""
    mkl = paddle_libs() / "libmklml_intel.so"
    if not mkl.exists():
        raise NativeKernelsUnavailable(f"Paddle's wheel has no {mkl.name} (MKL's packed GEMM)")
    return mkl


def _threads() -> int:
    """The kernels' thread count: ``OMP_NUM_THREADS`` (the platform's ``num_threads``, which the
    engine puts in the environment before it prepares the kernels, as MKL reads it), at most the
    CPUs this process may run on (a data-parallel rank's share); those CPUs when it is unset."""
    usable = len(os.sched_getaffinity(0))
    wanted = os.environ.get("OMP_NUM_THREADS", "").strip()
    return min(usable, int(wanted)) if wanted.isdigit() and int(wanted) > 0 else usable


def prepare_rope_write_kv(capabilities: Collection[str]) -> Callable[..., Any]:
    """The C++ ``rope_write_kv`` variant: one op per layer rotates q and k and writes k and v
    into the cache (see ``fd_kernels.paged_attention.rope_write_kv_reference`` for the contract)."""
    op = load_native(capabilities).fd_rope_write_kv
    threads = _threads()

    def rope_write_kv_cpp(cos: Any, sin: Any, attn: Any, num_heads: int) -> Callable[[Any, Any, Any], Any]:
        def layer(qkv: Any, k_cache: Any, v_cache: Any) -> Any:
            return op(qkv, attn.positions_tensor, cos, sin, k_cache, v_cache, attn.slots_tensor, num_heads,
                      threads)[0]

        return layer

    return rope_write_kv_cpp


#: Written into a kernels folder once its library was built and loaded.
_BUILT_MARKER: Final = "built"
_MODULE_NAME: Final = "fd_native_kernels"


def _load_built(folder: Path) -> ModuleType | None:
    """The library a finished build left in ``folder`` (the folder's key already covers the sources,
    flags and Paddle), or None: not built yet, or this Paddle lacks the loader used here."""
    if not (folder / _BUILT_MARKER).exists():
        return None
    try:
        # the function Paddle's own ``load`` ends with (private; every Paddle 3.x has it)
        from paddle.utils.cpp_extension.extension_utils import _import_module_from_library
    except ImportError:
        return None
    with _output_to_build_log(folder):
        return _import_module_from_library(_MODULE_NAME, str(folder / _MODULE_NAME), False)


def _build(folder: Path, flags: tuple[str, ...]) -> ModuleType:
    if not any(folder.glob("**/*.so")):
        log.info("building the C++ kernels into %s (once per Paddle version, ISA and source)", folder)
    with _output_to_build_log(folder), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # e.g. "No ccache found"
        from paddle.utils.cpp_extension import load

        libs = paddle_libs()
        # see _BASE_FLAGS; --as-needed drops the libgomp that -fopenmp adds
        link = ["-Wl,--as-needed", f"-L{libs}", "-l:libiomp5.so", f"-Wl,-rpath,{libs}"]
        return load(name=_MODULE_NAME, sources=[str(s) for s in SOURCES],
                    extra_cxx_cflags=[*_BASE_FLAGS, *flags], extra_ldflags=link,
                    build_directory=str(folder), verbose=False)


@contextlib.contextmanager
def _output_to_build_log(folder: Path) -> Iterator[None]:
    """Send this process's stdout and stderr to ``folder/build.log`` for the block: Paddle's build
    and loader print compiler lines, warnings and log lines there."""
    saved = os.dup(1), os.dup(2)
    with open(folder / "build.log", "a") as build_log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(build_log.fileno(), 1)
        os.dup2(build_log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
