"""Hook implementations written against hookspec version 1 (whose hooks have not changed since):
every finished request's id and reason, one line each, to the file ``NOVEMBER_FINISHED_LOG`` names."""

import os

import fd_core

fd_hookspec_version = 1


@fd_core.hookimpl
def fd_request_finished(request, output):
    path = os.environ.get("NOVEMBER_FINISHED_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"{request.request_id} {output.finish_reason.value}\n")
