"""Contract of the model-architecture seam: which checkpoints a plugin serves and how it runs them.

A plugin declares the Hugging Face ``architectures`` names (``config.json``) and GGUF
``general.architecture`` names it serves. For a checkpoint it:

1. parses the config into its own typed shape (:meth:`ModelArchitecture.parse_hf_config`),
   refusing every key it does not understand by raising :class:`ArchitectureConfigError`
   naming that key: a config key that is ignored may mean a different model, and a model that
   loads must be right;
2. says which tensors, of which shapes, a checkpoint of that shape holds
   (:meth:`~ModelArchitecture.weight_shapes`; the loader refuses a checkpoint with any other set);
3. builds the forward pass (:meth:`~ModelArchitecture.build`) from the kernel table the
   platform's capabilities chose (``fd_core.model.kernels.KernelSet``) and the precision the
   config asks for, so that every architecture gets the C++ kernels, the precision modes and the
   paged KV cache. The built-in Llama-family plugin builds ``fd_core.model.llama``'s decoder;
   a third-party one may reuse it with its own weights layout or write its own.

Selection: ``architecture.name = "auto"`` (the default) runs a checkpoint with the installed
plugin that declares its architecture, a third-party plugin before the built-in one (so that a
package can replace how an architecture runs); naming a plugin uses it for any checkpoint.
``fd_core.testing.conformance.architecture`` checks a plugin against Hugging Face transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    import numpy as np
    import paddle
    from pydantic import BaseModel

    from fd_core.model.kernels import KernelSet
    from fd_core.runner.attention_metadata import AttentionMetadata
    from fd_core.runner.kv_cache import LayerKVCache


class ArchitectureConfigError(ValueError):
    """A config key the plugin cannot serve; ``key`` is its path (``rope_scaling.rope_type``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class ModelShape(Protocol):
    """What the engine core reads from a parsed config (a plugin's shape has more). A frozen
    dataclass: the loader replaces ``eos_token_ids`` with the tokenizer's full list."""

    architecture: str            # the name the checkpoint declared, e.g. "LlamaForCausalLM"
    vocab_size: int
    num_hidden_layers: int       # one KV cache per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int  # the positions the model serves (the context limit)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


class CausalLM(Protocol):
    """A built model: one forward pass over a step's tokens through the paged KV cache."""

    def forward(self, input_ids: paddle.Tensor, attn: AttentionMetadata,
                kv_caches: Sequence[LayerKVCache]) -> paddle.Tensor:
        """Run ``input_ids [T]`` at ``attn``'s positions, writing their K/V into ``kv_caches``;
        float32 logits ``[S, vocab]`` of the tokens at ``attn.sample_indices`` (each sampling row's
        last token, then the prompt positions whose logprobs a request asks for), in that order."""


@dataclass(frozen=True, slots=True)
class ModelPrecision:
    """How the config asks the model to compute (``model.*`` keys; docs/precision.md)."""

    dtype: str = "float32"
    linear_weights: str = "float32"
    linear_inputs: str = "float32"
    attention_inputs: str = "float32"


class ModelArchitecture(SeamPlugin, ABC):
    """Parses, checks and builds the models of the architectures it declares."""

    #: Hugging Face ``architectures`` entries it serves (``config.json``).
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    #: GGUF ``general.architecture`` values it serves.
    gguf_architectures: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: BaseModel | None = None) -> None:
        self.settings = settings

    @abstractmethod
    def parse_hf_config(self, config: Mapping[str, Any], generation: Mapping[str, Any]) -> ModelShape:
        """The shape ``config.json`` describes (``generation`` is ``generation_config.json`` or
        ``{}``); raises :class:`ArchitectureConfigError` naming the first key it cannot serve."""

    def parse_gguf(self, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]) -> ModelShape:
        """The shape a GGUF file's metadata describes; raises :class:`ArchitectureConfigError`.
        Plugins without ``gguf_architectures`` need not implement it."""
        raise ArchitectureConfigError("general.architecture", f"{type(self).__name__} does not read GGUF files")

    def tiny_hf_configs(self) -> dict[str, dict[str, Any]]:
        """Case name -> a tiny ``config.json`` (as a checkpoint would carry it) for each feature it
        serves, every switch on somewhere: the conformance kit builds random transformers models
        of them and checks this plugin's greedy tokens against transformers'. Each declared Hugging
        Face architecture needs one at least."""
        return {}

    @abstractmethod
    def weight_shapes(self, shape: ModelShape) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor a checkpoint of ``shape`` holds, after
        :meth:`prepare_weights` (no more, no less)."""

    def prepare_weights(self, shape: ModelShape,
                        weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rename or split the checkpoint's tensors into :meth:`weight_shapes`' layout (a fused
        checkpoint's ``qkv_proj`` split, say); the default keeps them as they are."""
        return weights

    @abstractmethod
    def build(self, shape: ModelShape, weights: Mapping[str, Any], *, kernels: KernelSet,
              precision: ModelPrecision) -> CausalLM:
        """The model, ready to run; ``weights`` match :meth:`weight_shapes` (matrices may be
        ``fd_kernels.quantized.BlockQuantized``). Raise ValueError for a precision it cannot run."""
