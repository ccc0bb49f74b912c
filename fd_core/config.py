"""The configuration tree: one pydantic-settings model fed by CLI > env > TOML > defaults.

``FD_CACHE__BLOCK_SIZE=32`` sets ``cache.block_size``; ``--cache.block_size 32`` beats it.
Every section forbids unknown keys, so a misspelt key fails with its dotted path. A seam's own
plugin settings sit in ``<seam>.options`` and are validated against the selected plugin's
``settings_model`` by :mod:`fd_core.selection` (plugins are not imported here).
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
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
    max_model_len: int | None = Field(
        None, gt=0, description="Longest prompt + output; defaults to min(model limit, 2048).")
    seed: int = Field(0, description="Seed of the shared sampler for unseeded requests.")


class CacheSection(_Section):
    """The paged KV cache."""

    block_size: int = Field(16, gt=0, description="Tokens per KV block.")
    memory_utilization: float = Field(
        0.3, gt=0, le=1, description="Share of device memory the engine may use (weights + KV).")
    num_blocks: int | None = Field(None, gt=0, description="Explicit KV block count; overrides the profile.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes (v1).")


class EngineSection(_Section):
    """Batching limits every resource manager honours."""

    max_num_seqs: int = Field(32, gt=0, description="Most requests in one step.")
    max_num_batched_tokens: int = Field(512, gt=0, description="Most tokens computed in one step.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts over steps (v1).")

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


class ParallelSection(_Section):
    """Parallelism; only size 1 runs so far."""

    data_parallel_size: int = Field(1, gt=0)
    tensor_parallel_size: int = Field(1, gt=0)


class ServerSection(_Section):
    """The OpenAI-compatible HTTP front end."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = Field(None, description="When set, requests need 'Authorization: Bearer <key>'.")
    max_concurrency: int = Field(256, gt=0, description="In-flight requests beyond this get 429.")
    max_queue_size: int = Field(1024, gt=0, description="Requests queued in the engine beyond this get 429.")
    shutdown_timeout_s: float = Field(30.0, ge=0, description="How long SIGTERM waits for in-flight requests.")
    engine_start_timeout_s: float = Field(600.0, gt=0, description="How long to wait for the engine to load.")
    exit_after_engine_death_s: float = Field(
        2.0, ge=0, description="After the engine process dies, fd-serve answers 503 (/health: 'dead' and how "
                               "it died) for this long, then exits with code 3 so a supervisor restarts it.")


class PluginsSection(_Section):
    """Plugin discovery policy."""

    strict: bool = Field(False, description="Any plugin that fails to load stops start-up.")
    disabled: list[str] = Field(default_factory=list, description="'group/name' entries never imported.")


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
    platform: PlatformSection = PlatformSection()
    parallel: ParallelSection = ParallelSection()
    server: ServerSection = ServerSection()
    plugins: PluginsSection = PluginsSection()

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins; defaults come last implicitly. The CLI source, when given, is put
        # in front by pydantic-settings (CLI > init > env > TOML).
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = CONFIG_PATH.get()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    def seam_section(self, seam: str) -> SeamSection:
        """The section selecting the plugin of ``seam`` (e.g. ``"scheduler"``)."""
        return getattr(self, seam)

    def public_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, secrets masked (for ``--check`` and logs)."""
        return self.model_dump(mode="json")


def load_config(config_file: str | Path | None = None, cli_args: list[str] | None = None,
                **overrides: Any) -> FdConfig:
    """Build the config from defaults, a TOML file, ``FD_*`` env vars and dotted CLI flags.

    Raises ConfigError naming the first bad key's dotted path.
    """
    path = Path(config_file) if config_file is not None else None
    if path is not None and not path.is_file():
        raise ConfigError("--config", f"file not found: {str(path)!r}")
    token = CONFIG_PATH.set(path)
    try:
        kwargs: dict[str, Any] = dict(overrides)
        if cli_args:
            kwargs["_cli_settings_source"] = CliSettingsSource(
                FdConfig, cli_parse_args=cli_args, cli_prog_name="fd-serve",
                cli_implicit_flags=False)(args=cli_args)
        return FdConfig(**kwargs)
    except ValidationError as exc:
        raise config_error_from(exc) from exc
    except (ValueError, SystemExit) as exc:  # TOML syntax errors, argparse rejections
        raise ConfigError(str(path) if path else "cli", str(exc)) from exc
    finally:
        CONFIG_PATH.reset(token)


def config_error_from(exc: ValidationError, prefix: str = "") -> ConfigError:
    """Turn pydantic's first error into a ConfigError whose key is the dotted path."""
    first = exc.errors()[0]
    key = ".".join(str(part) for part in (prefix, *first["loc"]) if part != "")
    message = first["msg"]
    if len(exc.errors()) > 1:
        message += f" (and {len(exc.errors()) - 1} more)"
    return ConfigError(key, message)
