"""Settings shared by the accelerator platforms: which devices a deployment may use."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class DeviceSettings(BaseModel):
    """``[platform.options]`` of an accelerator platform."""

    model_config = ConfigDict(extra="forbid")

    device_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="Physical device ids to use (sets the visible-devices variable); "
                          "None keeps the environment's choice.")

    def visible_devices(self) -> str | None:
        """The ids as a ``*_VISIBLE_DEVICES`` value, or None when not set."""
        return None if self.device_ids is None else ",".join(map(str, self.device_ids))
