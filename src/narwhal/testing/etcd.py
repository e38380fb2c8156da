"""A real single-member etcd on 127.0.0.1 for the replica tests and ``bench/replicas.py``
(Debian's ``etcd-server``, installed by ``make test-deps``): free ports, its own data
directory, started, stopped (and started again on the same data), killed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from narwhal.testing import procs
from narwhal.testing.ports import free_ports

__all__ = ["EtcdServer", "etcd_binary"]


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class EtcdServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.client_port, self.peer_port = free_ports(2)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """As narwhal-serve's ``--coordination`` takes it."""
        return f"etcd://{self.endpoint}"

    def start(self, timeout: float = 30) -> EtcdServer:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (make test-deps installs etcd-server)")
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            binary,
            "--name",
            "narwhal-test",
            "--data-dir",
            str(self.directory / "data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"narwhal-test={peer}",
            "--log-level",
            "warn",
        ]
        log = self.directory / "etcd.log"
        self.process = procs.start(argv, log)
        procs.wait_ready(
            lambda: procs.http_ok(f"{client}/health"),
            timeout,
            process=self.process,
            name="etcd",
            log=log,
            interval=0.05,
        )
        return self

    def stop(self) -> None:
        if self.process is not None:
            procs.stop(self.process, 10)
            self.process = None

    def kill(self) -> None:
        if self.process is not None:
            procs.kill(self.process, group=True)
            self.process = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
