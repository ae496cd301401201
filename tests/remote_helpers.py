"""A real S3 API server on localhost for the remote tier's tests and benchmark: moto in
server mode, over HTTP, used through s3fs as with real S3."""

from __future__ import annotations

import logging
import socket
import uuid

import moto.server as moto_server  # test extra: missing, it fails the suite, never skips
import s3fs


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class S3Server:
    """moto's S3 server on a loopback port, with one bucket."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request
        self.port = _free_port()
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            # one attempt: a vanished server refuses the connection at once. The timeouts
            # leave a loaded 2-core machine room (1 s to connect and 5 s to read timed out
            # an upload to this server while the other xdist worker compiled)
            "config_kwargs": {
                "connect_timeout": 5,
                "read_timeout": 20,
                "retries": {"max_attempts": 1},
            },
            "skip_instance_cache": True,
        }
        fs = s3fs.S3FileSystem(**self.options)
        fs.call_s3("create_bucket", Bucket="fleet")

    def url(self) -> str:
        return f"s3://fleet/{uuid.uuid4().hex[:8]}"

    def stop(self) -> None:
        self.server.stop()
