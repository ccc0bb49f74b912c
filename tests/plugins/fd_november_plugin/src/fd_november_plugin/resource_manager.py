"""A resource manager of hookspec version 1, whose contract had ``abort`` and let the manager end
requests itself; version 2 changed that, so this one must be refused with the fix named."""

from typing import ClassVar

from fd_plugins.resource_managers.v0 import V0ResourceManager


class AbortingResourceManager(V0ResourceManager):
    name: ClassVar[str] = "november"
    fd_hookspec_version: ClassVar[int] = 1

    def abort(self, request_id):
        self.finish_requests([r for r in self.running if r.request_id == request_id], None)
