"""A Flower deployment on one machine: SuperLink, SuperNodes and the ``flwr`` CLI.

For tests and demos of :mod:`fedcal.engine.flower` on 127.0.0.1. Everything
lives under one root directory::

    root/cli/config.toml   FLWR_HOME of the flwr CLI (the SuperLink connection)
    root/superlink/        FLWR_HOME of flower-superlink
    root/node-<name>/      FLWR_HOME of each flower-supernode
    root/worker-<name>/    working directory of a site's warm worker (if started)
    root/logs/<name>.log   output of every process started here
    root/pki/              CA, SuperLink certificate, SuperNode keys

Ports are picked free at start. Every process is started in its own session
and stopped by PID together with its descendants (SuperExec, flwr-serverapp,
flwr-clientapp), found through /proc. Each process gets its own FLWR_HOME,
telemetry and update checks off, runtime dependency installation off, and
this Python's ``bin`` first on PATH (SuperLink and SuperNode start their
helpers by name).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fedcal.core.atomic import write_bytes, write_text

HOST = "127.0.0.1"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {HOST}:{port} after {timeout:g} s")


def flower_env(flwr_home: Path, extra_path: str = "") -> dict[str, str]:
    """The environment of a Flower process: its own FLWR_HOME, no telemetry, this fedcal.

    PYTHONPATH starts with ``extra_path`` (if any), then the absolute directory
    holding the ``fedcal`` package this process imported, so every process
    started here (and the ClientApp/ServerApp processes they start) runs this
    very tree, whatever the current directory.
    """
    import fedcal

    env = dict(os.environ)
    here = str(Path(fedcal.__file__).resolve().parents[1])
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).is_absolute()]
    env["PYTHONPATH"] = os.pathsep.join([p for p in (extra_path, here) if p] + rest)
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
        NO_COLOR="1",
    )
    return env


def _answers(path: Path) -> bool:
    """Something listens on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


# ----------------------------------------------------------------------------
# processes
# ----------------------------------------------------------------------------
def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: ppid
    return out


def descendants(pid: int) -> list[int]:
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int, start: str | None = None) -> bool:
    """Running (not a zombie) and, if ``start`` is given, still the same process (no PID reuse)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and (start is None or fields[19] == start)


def stop_tree(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
    """Signal ``proc`` and its descendants by PID; SIGKILL whatever is left after ``grace``.

    Each PID is remembered with its start time and only signalled while it
    still names the same process, so a recycled PID is never hit.
    """

    def snapshot(pids: list[int]) -> dict[int, str]:
        return {p: f[19] for p in pids if (f := _stat(p)) is not None}

    procs = snapshot([proc.pid, *descendants(proc.pid)])
    for pid, start in procs.items():
        if alive(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p, s) for p, s in procs.items()):
        proc.poll()
        time.sleep(0.1)
    procs.update(snapshot([p for p in descendants(proc.pid) if p not in procs]))
    for pid, start in procs.items():
        if alive(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


# ----------------------------------------------------------------------------
# TLS certificates and SuperNode keys
# ----------------------------------------------------------------------------
def make_tls(pki: Path, host: str = HOST) -> dict[str, Path]:
    """A CA and a SuperLink certificate for ``host`` (SAN IP + DNS localhost), EC P-384."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fedcal test CA"))
        .issuer_name(name("fedcal test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name(host))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(host)), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = {"ca": pki / "ca.crt", "cert": pki / "superlink.pem", "key": pki / "superlink.key"}
    write_bytes(paths["ca"], ca.public_bytes(pem))
    write_bytes(paths["cert"], cert.public_bytes(pem))
    private_key = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_bytes(paths["key"], private_key, mode=0o600)
    return paths


def make_node_key(pki: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode key pair: EC P-384 in OpenSSH format (what Flower accepts)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pki.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = pki / name, pki / f"{name}.pub"
    private_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    write_bytes(private, private_key, mode=0o600)
    ssh = serialization.Encoding.OpenSSH
    write_bytes(
        public,
        key.public_key().public_bytes(ssh, serialization.PublicFormat.OpenSSH)
        + f" {name}\n".encode(),
    )
    return private, public


# ----------------------------------------------------------------------------
# the deployment
# ----------------------------------------------------------------------------
@dataclass
class SuperNode:
    name: str
    proc: subprocess.Popen
    log: Path
    offset: int = 0  # where this process's output starts in ``log`` (a restart appends)

    def node_id(self, timeout: float = 60.0) -> int:
        """The id the SuperLink gave this node (read from this process's part of its log)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_bytes()[self.offset :].decode(errors="replace")
            found = re.search(r"SuperNode ID: (\d+)", text)
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"SuperNode {self.name} exited with {self.proc.returncode}")
            time.sleep(0.2)
        raise TimeoutError(f"SuperNode {self.name} did not connect within {timeout:g} s")


@dataclass
class LocalDeployment:
    """SuperLink + SuperNodes on 127.0.0.1; secure (TLS + SuperNode auth) unless told not to."""

    root: Path
    tls: bool = True
    auth: bool = True
    connection: str = "local"
    port: int = 0
    pki: dict[str, Path] = field(default_factory=dict)
    superlink: subprocess.Popen | None = None
    nodes: dict[str, SuperNode] = field(default_factory=dict)
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    _logs: list[IO] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.auth and not self.tls:
            raise ValueError("SuperNode authentication requires TLS")
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        if self.tls:
            self.pki = make_tls(self.root / "pki")

    def _start(
        self, name: str, cmd: list[str], home: Path, extra_path: str = ""
    ) -> tuple[subprocess.Popen, Path]:
        home.mkdir(parents=True, exist_ok=True)
        log = self.root / "logs" / f"{name}.log"
        fh = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(fh)
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=flower_env(home, extra_path),
            cwd=home,
            start_new_session=True,
        )
        return proc, log

    def start_superlink(self) -> None:
        self.port = free_port()
        cmd = [str(BIN / "flower-superlink"), "--host", HOST, "--port", str(self.port)]
        cmd += ["--disable-runtime-dependency-installation"]
        if self.tls:
            cmd += ["--ssl-ca-certfile", str(self.pki["ca"])]
            cmd += ["--ssl-certfile", str(self.pki["cert"]), "--ssl-keyfile", str(self.pki["key"])]
        else:
            cmd += ["--insecure"]
        if self.auth:
            cmd += ["--enable-supernode-auth"]
        self.superlink, _ = self._start("superlink", cmd, self.root / "superlink")
        wait_port(self.port)
        conn = [f'[superlink]\ndefault = "{self.connection}"\n', f"[superlink.{self.connection}]"]
        conn.append(f'address = "{HOST}:{self.port}"')
        conn.append(f"root-certificates = '{self.pki['ca']}'" if self.tls else "insecure = true")
        (self.root / "cli").mkdir(exist_ok=True)
        write_text(self.root / "cli" / "config.toml", "\n".join(conn) + "\n")

    def start_supernode(
        self, name: str, node_config: str, key: Path | None = None, extra_path: str = ""
    ) -> SuperNode:
        """Start (or restart, under the same name and home) a SuperNode.

        ``extra_path`` goes first on its PYTHONPATH (e.g. a directory with a
        ``sitecustomize.py`` that makes this node misbehave, for tests).
        """
        cmd = [str(BIN / "flower-supernode"), "--superlink", f"{HOST}:{self.port}"]
        cmd += ["--port", str(free_port()), "--node-config", node_config]
        cmd += ["--root-certificates", str(self.pki["ca"])] if self.tls else ["--insecure"]
        if key is not None:
            cmd += ["--auth-supernode-private-key", str(key)]
        log = self.root / "logs" / f"node-{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        proc, log = self._start(f"node-{name}", cmd, self.root / f"node-{name}", extra_path)
        self.nodes[name] = SuperNode(name, proc, log, offset)
        return self.nodes[name]

    def start_worker(self, name: str, node_config: str) -> subprocess.Popen:
        """Start (or restart) the warm worker of a site (:mod:`fedcal.engine.flower.worker`).

        ``node_config`` is the site's SuperNode ``--node-config`` with a
        ``worker-socket``; returns once the worker listens there.
        """
        from flwr.common.config import parse_config_args

        socket_path = Path(str(parse_config_args([node_config])["worker-socket"]))
        cmd = [sys.executable, "-m", "fedcal.engine.flower.worker", "--node-config", node_config]
        proc, log = self._start(f"worker-{name}", cmd, self.root / f"worker-{name}")
        self.workers[name] = proc
        deadline = time.monotonic() + 120.0
        while not _answers(socket_path):
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited with {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {name} not listening on {socket_path} after 120 s")
            time.sleep(0.1)
        return proc

    # -- the flwr CLI ------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 180.0) -> dict:
        """Run ``flwr ... --format json`` and return its JSON answer (raises on failure)."""
        res = subprocess.run(
            [str(BIN / "flwr"), *args, "--format", "json"],
            capture_output=True,
            text=True,
            env=flower_env(self.root / "cli"),
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
        start = res.stdout.find("{")
        answer = json.loads(res.stdout[start:]) if start >= 0 else {}
        if res.returncode != 0 or not answer.get("success", False):
            raise RuntimeError(f"flwr {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
        return answer

    def register(self, public_key: Path) -> int:
        """Register a SuperNode's public key; returns the node id it will connect with."""
        return int(self.flwr("supernode", "register", str(public_key), self.connection)["node-id"])

    def supernodes(self) -> list[dict]:
        return self.flwr("supernode", "ls", self.connection)["nodes"]

    def run(self, app: Path, run_config: Path) -> int:
        """``flwr run`` the app with a run-config TOML file; returns the run id."""
        answer = self.flwr("run", str(app), self.connection, "--run-config", str(run_config))
        return int(answer["run-id"])

    def status(self, run_id: int) -> dict:
        return self.flwr("ls", self.connection, "--run-id", str(run_id))["runs"][0]

    def wait(self, run_id: int, timeout: float = 600.0) -> dict:
        """Poll until the run is finished (``flwr run`` itself does not say how a run ended)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(run_id)
            if status["status"].startswith("finished"):
                return status
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} not finished after {timeout:g} s: {status}")
            time.sleep(1.0)

    def stop(self) -> None:
        for node in self.nodes.values():
            stop_tree(node.proc)
        for proc in self.workers.values():
            stop_tree(proc)
        if self.superlink is not None:
            stop_tree(self.superlink)
        for fh in self._logs:
            fh.close()
        self._logs.clear()

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sensor_state(saved: dict, sensor_id: str, tree: str = "state") -> dict:
    """One sensor's row of a tree of a loaded site state (``client.load_state``), flat."""
    from fedcal.core.tree import flatten

    k = list(saved["sensor_ids"]).index(sensor_id)
    return {name: t[k] for name, t in flatten(saved[tree]).items()}
