"""The router's configuration: one ``[router]`` section fed by CLI > env > TOML > defaults.

``--router.port 9100`` beats ``FD_ROUTER__PORT=9100``, which beats ``[router] port = 9100`` in
the ``--config`` file. The section forbids unknown keys, so a misspelt key fails with its dotted
path, like :func:`fd_core.config.load_config`; every problem is reported at once as one
:class:`~fd_core.errors.ConfigError` (a line each, ``router.backends.1: ...``).
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Final
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from fd_core.config import config_error_from, sources_with_toml
from fd_core.config_reference import KeyDoc
from fd_core.errors import ConfigError

#: The TOML file of the router config being loaded (a ContextVar: loading is re-entrant).
ROUTER_CONFIG_PATH: contextvars.ContextVar[Path | None] = contextvars.ContextVar("fd_router_config_path",
                                                                                 default=None)
#: The section name, in the TOML file and in the flags (``--router.port``).
SECTION: Final = "router"


def _backend_url(value: str) -> str:
    """An fd-serve base URL, normalised: lower-case scheme and host, no trailing ``/``."""
    text = value.strip()
    example = "e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError for a port that is no number or out of range
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a URL ({exc}); {example}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL of an fd-serve instance; {example}")
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r}: a backend URL has no query or fragment; {example}")
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    netloc = host if port is None else f"{host}:{port}"
    if parts.username is not None:
        netloc = f"{parts.netloc.rsplit('@', 1)[0]}@{netloc}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def _backend_list(urls: list[str]) -> list[str]:
    if not urls:
        raise ValueError("at least one backend is needed: the base URL of each fd-serve instance, "
                         "e.g. --router.backends http://127.0.0.1:8000,http://127.0.0.1:8001")
    first: dict[str, int] = {}
    for i, url in enumerate(urls):
        if url in first:
            raise ValueError(f"{url!r} is listed twice (entries {first[url]} and {i}); list each backend once")
        first[url] = i
    return urls


class RouterSection(BaseModel):
    """``fd-serve router``: an OpenAI-compatible front forwarding each request to one backend fd-serve."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field("127.0.0.1", description="Address the router listens on.")
    port: int = Field(9000, ge=0, le=65535, description="Port the router listens on.")
    backends: Annotated[list[Annotated[str, AfterValidator(_backend_url)]], AfterValidator(_backend_list)] = Field(
        default_factory=list, validate_default=True, description=(
            "Base URL of each fd-serve instance (http://host:port), at least one, each once. Requests go to "
            "those whose role is mixed or decode, never to a prefill instance."))
    health_interval_s: float = Field(1.0, gt=0, description="How often each backend's /health is polled.")
    health_timeout_s: float = Field(5.0, gt=0, description=(
        "A /health poll not answered within this long marks the backend down until the next poll answers."))
    connect_timeout_s: float = Field(3.0, gt=0, description=(
        "How long connecting to a backend may take; a backend that cannot be reached is marked down and "
        "the request goes to the next one."))
    request_timeout_s: float = Field(1800.0, gt=0, description=(
        "How long the router waits for a backend's next bytes (a non-streaming answer, or the next event of "
        "a stream) before it gives the request up (502, or an error event)."))
    max_concurrency: int = Field(1024, gt=0, description="Requests in flight through the router beyond this get 429.")
    max_body_bytes: int = Field(8 * 2**20, gt=0, description=(
        "Request bodies larger than this (bytes, default 8 MiB) get 413 and are not forwarded."))
    body_timeout_s: float = Field(30.0, gt=0, description=(
        "How long a client may take to send a request body; a slower one gets 408. The body is read before "
        "the request takes one of router.max_concurrency slots."))
    max_header_bytes: int = Field(128 * 2**10, ge=1024, description=(
        "Request heads (request line and headers) larger than this (bytes, default 128 KiB) get 431."))
    shutdown_timeout_s: float = Field(30.0, ge=0, description=(
        "How long SIGTERM waits for requests in flight before the router stops."))


class RouterConfig(BaseSettings):
    """The router's whole configuration. Load it with :func:`load_router_config`."""

    model_config = SettingsConfigDict(
        env_prefix="FD_", env_nested_delimiter="__", extra="forbid",
        nested_model_default_partial_update=True, validate_assignment=True,
    )

    # validate_default: with no [router] section at all, router.backends still says it is missing
    router: RouterSection = Field(default_factory=dict, validate_default=True)  # type: ignore[arg-type]

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return sources_with_toml(settings_cls, init_settings, env_settings, ROUTER_CONFIG_PATH.get())


def load_router_config(config_file: str | Path | None = None, cli_args: list[str] | None = None,
                       **overrides: Any) -> RouterConfig:
    """The router config from defaults, the ``[router]`` section of a TOML file, ``FD_ROUTER__*``
    variables and ``--router.KEY VALUE`` flags; raises one ConfigError listing every bad key."""
    path = Path(config_file) if config_file is not None else None
    if path is not None and not path.is_file():
        raise ConfigError("--config", f"file not found: {str(path)!r}")
    cli_keys = {arg[2:].split("=", 1)[0] for arg in cli_args or () if arg.startswith("--")}

    def env_var(key: str) -> str | None:
        if key in cli_keys or key.split(".")[0] in overrides:
            return None
        parts = key.split(".")
        while parts and parts[-1].isdigit():  # router.backends.1 comes from FD_ROUTER__BACKENDS
            parts.pop()
        name = "FD_" + "__".join(parts).upper()
        return next((var for var in os.environ if var.upper() == name), None)

    token = ROUTER_CONFIG_PATH.set(path)
    try:
        kwargs: dict[str, Any] = dict(overrides)
        if cli_args:
            kwargs["_cli_settings_source"] = CliSettingsSource(
                RouterConfig, cli_parse_args=cli_args, cli_prog_name="fd-serve router",
                cli_implicit_flags=False, cli_exit_on_error=False)(args=cli_args)
        return RouterConfig(**kwargs)
    except ValidationError as exc:
        raise config_error_from(exc, env_var=env_var) from exc
    except ValueError as exc:  # TOML syntax errors, CLI parse errors (pydantic-settings' SettingsError)
        raise ConfigError(str(path) if path else "cli", str(exc)) from exc
    finally:
        ROUTER_CONFIG_PATH.reset(token)


def router_keys() -> Iterator[KeyDoc]:
    """Every key of the ``[router]`` section, in declaration order (for ``fd-serve router --help``)."""
    for key, field in RouterSection.model_fields.items():
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        # backends: a comma-separated list on the command line (a JSON list works too)
        type_text = "url,..." if key == "backends" else getattr(field.annotation, "__name__", str(field.annotation))
        yield KeyDoc(SECTION, key, type_text, "—" if default in (None, []) else repr(default),
                     field.description or "")
