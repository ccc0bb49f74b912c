"""Contract of the Connector seam: ships prompt KV from a prefill instance to a decode instance.

In a split (prefill/decode) deployment the prefill side computes the prompt's KV and first
token, then :meth:`Connector.send` ships them; the decode side preallocates blocks, takes the
transfer from :meth:`Connector.receive`, copies the KV into its blocks and decodes on.

Invariants:
- A transfer is delivered at most once; ``receive`` returns transfers in the order sent per
  request id.
- ``send`` does not keep references to the arrays after it returns (callers may reuse blocks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    import numpy as np
    from pydantic import BaseModel


@dataclass(slots=True)
class KVTransfer:
    """The prompt KV of one request, as shipped from prefill to decode."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int                      # sampled on the prefill side
    # layer index -> (K, V), each [num_tokens, num_kv_heads, head_dim]
    layers: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"KVTransfer(id={self.request_id!r}, tokens={len(self.prompt_token_ids)}, layers={len(self.layers)})"


class Connector(SeamPlugin, ABC):
    """Moves KV between a prefill instance and a decode instance."""

    def __init__(self, settings: BaseModel | None, *, role: Literal["prefill", "decode"]) -> None:
        self.settings = settings
        self.role = role

    @abstractmethod
    def send(self, transfer: KVTransfer) -> None:
        """Ship one request's prompt KV to the decode side (prefill role)."""

    @abstractmethod
    def receive(self, timeout: float | None) -> KVTransfer | None:
        """Next transfer for this decode instance, or None after ``timeout`` seconds."""

    def close(self) -> None:
        """Release sockets or shared memory; called once at shutdown."""
