"""A guided-decoding backend that ends every matcher on the vocabulary's eos ids, whatever stop ids the
request has (breaks "the mask allows the matcher's stop ids ... just where the output is complete")."""

from __future__ import annotations

from typing import Any, ClassVar

import fd_core
from fd_core.contracts.guided_decoding import ConstraintMatcher
from fd_plugins.guided_decoding.xgrammar_backend import XGrammarBackend


class IgnoresStopIds(XGrammarBackend):
    """The xgrammar backend, making its matchers with the vocabulary's eos ids instead of the request's."""

    name: ClassVar[str] = "ignores-stop-ids"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION

    def matcher(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> ConstraintMatcher:
        return super().matcher(compiled, self.vocabulary.eos_token_ids)
