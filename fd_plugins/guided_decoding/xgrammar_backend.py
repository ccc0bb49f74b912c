"""The ``xgrammar`` guided-decoding backend: constraints compiled by xgrammar, masks filled by its matchers.

xgrammar (``pip install 'fd-engine[guided]'``; it needs torch, whose CPU build is enough) compiles
a JSON schema, a regex, an EBNF grammar or a structural tag against the model's vocabulary once
(its compiler caches equal constraints) and walks a pushdown automaton per sequence. A list of
choices becomes a grammar with one alternative per choice; ``json_object`` is the schema
``{"type": "object"}``.

JSON whitespace: with ``any_whitespace = false`` (the default) a schema's output is laid out as
``{"a": 1, "b": [2, 3]}`` (one space after ``:`` and ``,``), so a small model cannot wander into
endless newlines inside an object; ``true`` allows any whitespace the JSON grammar does.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field

from fd_core.contracts.guided_decoding import (
    ConstraintError,
    ConstraintMatcher,
    GuidedDecodingBackend,
    GuidedDecodingUnavailable,
    Vocabulary,
)
from fd_core.hookspecs import FD_HOOKSPEC_VERSION

if TYPE_CHECKING:
    import numpy as np

    from fd_core.request import GuidedDecoding

#: xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: " and some with the C++ check that
#: failed ("Check failed: (...) is false: "): the client needs only the rest.
_SOURCE_PREFIX: Final = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: \(.*?\) is false: )?")


class XGrammarSettings(BaseModel):
    """``[guided_decoding.options]`` of the xgrammar backend."""

    model_config = ConfigDict(extra="forbid")

    any_whitespace: bool = Field(False, description=(
        "JSON schemas allow any whitespace between tokens (true) or lay JSON out as {\"a\": 1, \"b\": 2} (false: "
        "small models cannot loop on whitespace)."))
    compile_threads: int = Field(1, ge=1, le=64, description="Threads xgrammar compiles one constraint with.")
    cache_mb: int = Field(256, ge=0, description="Memory for compiled constraints (0: unlimited).")


class XGrammarMatcher(ConstraintMatcher):
    """One sequence's xgrammar ``GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        import torch  # xgrammar fills torch tensors; from_numpy shares the array's memory

        self._matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class XGrammarBackend(GuidedDecodingBackend):
    """Guided decoding through xgrammar's compiler and matchers."""

    name: ClassVar[str] = "xgrammar"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    supports_rollback: ClassVar[bool] = True
    settings_model: ClassVar[type[BaseModel]] = XGrammarSettings

    def __init__(self, settings: BaseModel | None, *, vocabulary: Vocabulary) -> None:
        super().__init__(settings, vocabulary=vocabulary)
        try:
            import xgrammar
        except ImportError as exc:
            raise GuidedDecodingUnavailable(
                f"the xgrammar backend needs the xgrammar package ({exc}): pip install 'fd-engine[guided]'") from None
        options = settings if isinstance(settings, XGrammarSettings) else XGrammarSettings()
        self._xgr = xgrammar
        self._any_whitespace = options.any_whitespace
        # xgrammar reads from the tokenizers JSON how the vocabulary spells bytes (byte-level, byte fallback, raw).
        # Special tokens are no text (replies leave them out): spelt "", xgrammar never allows them, where it
        # would take "<|im_start|>" inside a JSON string as those 12 characters. No stop ids here: xgrammar
        # would allow one a matcher is not given anywhere, as an empty token; each matcher gets its own.
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(vocabulary.tokenizer_json)
        special = _special_ids(vocabulary.tokenizer_json)
        tokens = ["" if token_id in special else token for token_id, token in enumerate(vocabulary.tokens)]
        info = xgrammar.TokenizerInfo(tokens, metadata["vocab_type"], vocab_size=vocabulary.size, stop_token_ids=[],
                                      add_prefix_space=metadata["add_prefix_space"])
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=options.compile_threads,
                                                  cache_limit_bytes=options.cache_mb << 20 or -1)
        self._lock = threading.Lock()
        self._figures = {"compiles": 0.0, "compile_seconds": 0.0}

    def compile(self, constraint: GuidedDecoding) -> Any:
        begin = time.perf_counter()
        try:
            compiled = self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstraintError(_SOURCE_PREFIX.sub("", str(exc).strip())) from None
        with self._lock:
            self._figures["compiles"] += 1
            self._figures["compile_seconds"] += time.perf_counter() - begin
        return compiled

    def _compile(self, constraint: GuidedDecoding) -> Any:
        kind, spec = constraint.kind, constraint.spec
        if kind == "json":
            try:
                schema = json.loads(spec)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
            return self._compiler.compile_json_schema(json.dumps(_bounded_strings_as_patterns(schema)),
                                                      any_whitespace=self._any_whitespace, strict_mode=True)
        if kind == "json_object":   # a schema, not the built-in JSON grammar: the whitespace rule applies too
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=self._any_whitespace)
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        if kind == "choice":
            return self._compiler.compile_grammar(_choice_grammar(spec))
        if kind == "grammar":
            return self._compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return self._compiler.compile_structural_tag(spec)
        raise ValueError(f"unknown constraint kind {kind!r}")

    def matcher(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> ConstraintMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids)))

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._figures, "cache_bytes": float(self._compiler.get_cache_size_bytes())}


#: What a length-bounded string may hold (see :func:`_bounded_strings_as_patterns`).
_PLAIN_STRING_CHARACTER: Final = r'[^"\\\x00-\x1f]'
#: Largest length bound written as a pattern: xgrammar 0.2.8's pattern automaton grows with the bound
#: (~0.35 s to compile at 64, ~0.7 s at 128 on the default model's vocabulary) and fails from ~200.
MAX_PATTERN_LENGTH_BOUND: Final = 64


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with each string's ``minLength`` / ``maxLength`` (without a pattern, format, enum
    or const, and bounds up to :data:`MAX_PATTERN_LENGTH_BOUND`) written as the equal ``pattern``.

    xgrammar 0.2.8 compiles a length-bounded string as characters other than quote, backslash, CR
    and LF, so a tab or another control character could appear raw, which JSON forbids (Python's
    ``json.loads`` refuses it); it compiles a pattern over JSON string content correctly. The
    pattern also leaves out quotes and backslashes, as xgrammar's own rule does. Larger bounds keep
    xgrammar's rule.
    """
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounds = [out.get(key) for key in ("minLength", "maxLength") if key in out]
    if (out.get("type") == "string" and bounds and all(type(b) is int and 0 <= b <= MAX_PATTERN_LENGTH_BOUND
                                                        for b in bounds)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_PLAIN_STRING_CHARACTER}{{{low},{high}}}$"
    return out


def _special_ids(tokenizer_json: str) -> set[int]:
    """Ids of the tokenizer's special added tokens (``"special": true``)."""
    return {added["id"] for added in json.loads(tokenizer_json).get("added_tokens", ()) if added.get("special")}


def _choice_grammar(spec: str) -> str:
    """An EBNF grammar whose language is exactly the choices listed in ``spec`` (a JSON list of strings)."""
    try:
        choices = json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"the choices are not a JSON list: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("the choices must be a non-empty list of non-empty strings")
    # a JSON string literal is an EBNF one: xgrammar reads the same escapes
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
