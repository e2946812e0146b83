"""A real 3-node Docker Swarm on this one machine, for the swarm tests (tests/test_swarm.py).

Each node is a separate ``dockerd`` in a network namespace of its own, with its own data root,
exec root, socket and managed containerd; the nodes are joined by veth pairs to a bridge in a
"hub" namespace (the wire between hosts), and the host reaches them through one more veth:

    host (10.199.77.1) --veth-- [hub ns: bridge br0] --veth-- n0 (10.199.77.10, manager)
                                                     --veth-- n1 (10.199.77.11, worker)
                                                     --veth-- n2 (10.199.77.12, worker)

The bridge lives in its own namespace because the host's bridged traffic goes through the host's
iptables FORWARD chain (br_netfilter), whose policy the host's Docker engine sets to DROP.

Why not simpler: ``ip netns exec`` remounts /sys and hides the cgroup mounts dockerd needs
("Devices cgroup isn't mounted"), so daemons start under ``nsenter --net=...``; the kernel has no
IPVS, so service VIPs and the ingress routing mesh do not work (the stack uses ``endpoint_mode:
dnsrr`` and host-mode ports); nothing here can pull from a public registry, so stacks are deployed
with ``--resolve-image never`` and, when the images are loaded beforehand (``offline``), the
daemons run with ``DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1`` (else every task stalls ~20 s asking
Docker Hub).

What it offers: `Swarm` (a context manager: builds everything, tears everything down in
``finally``, also on SIGTERM), image distribution from the host engine (``docker save | docker
load`` to all nodes at once, or a registry on loopback, timed), ``docker stack deploy``, waits for
convergence, and faults: cut a node's link, partition two nodes (iptables inside a namespace),
heal, kill a task's container. Everything it creates is named with the prefix ``lqsw``
(namespaces, veths, the tmpfs) or lives under `BASE_DIR` / `RUN_DIR`, so `cleanup_leftovers` can
remove what a killed earlier run left behind (by pid files and by those names only); the daemons
die with the process that started them (PR_SET_PDEATHSIG), even on SIGKILL. The host's own engine
is only read from (images are saved or pushed from it) and never joins a swarm.

Measured here (2 shared cores, data roots on a tmpfs): swarm up ~10-20 s; the five images to all
three nodes by save|load ~75-85 s, by a registry (push, then three pulls) ~260 s; teardown ~8 s.
On the ext4 disk (mounted with `discard`) loading took ~110 s and deleting a node's data ~45 s.

Run by hand:  python -m tests._swarm up | down | measure   (as root)
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import ctypes
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# LARQL_SWARM_PREFIX (with LARQL_SWARM_SUBNET): a second swarm beside one already running on this
# machine (two checkouts testing at once); cleanup only ever touches its own prefix's leftovers.
PREFIX = os.environ.get("LARQL_SWARM_PREFIX", "lqsw")
BASE_DIR = Path(os.environ.get("LARQL_SWARM_DIR", "/var/lib/larql-swarm-test"
                               + ("" if PREFIX == "lqsw" else f"-{PREFIX}")))
RUN_DIR = Path(f"/run/{PREFIX}")  # sockets and exec roots: unix socket paths must stay short
SUBNET = os.environ.get("LARQL_SWARM_SUBNET", "10.199.77")  # /24 of the namespaces' wire
HOST_IP = f"{SUBNET}.1"
HUB_NS = f"{PREFIX}-hub"
HOST_VETH = f"{PREFIX}-host"
# Overlay networks get addresses from here (Swarm's default 10.0.0.0/8 pool would be fine too;
# a pool of our own keeps them recognisable).
ADDR_POOL = os.environ.get("LARQL_SWARM_ADDR_POOL", "10.198.0.0/16")
# The dispatcher heartbeat decides when the manager declares a silent node down (3 periods) and
# reschedules its tasks. 10 s gives fault tests a 30 s window in which a cut or partitioned node is
# still "ready" to Swarm: the grid's own failover and eviction are what is tested, not Swarm's.
DISPATCHER_HEARTBEAT = os.environ.get("LARQL_SWARM_DISPATCHER_HEARTBEAT", "10s")
CMD_TIMEOUT = 120.0
TAG = os.environ.get("LARQL_IMAGE_TAG", "latest")


def log(msg: str) -> None:
    print(f"[swarm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- running commands -----------------------------------------------------------------------

class CommandError(RuntimeError):
    pass


def sh(*cmd: str | Path, timeout: float = CMD_TIMEOUT, check: bool = True, input: str | None = None,
       env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [str(c) for c in cmd]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        raise CommandError(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from None
    if check and proc.returncode != 0:
        raise CommandError(f"exit {proc.returncode}: {' '.join(argv)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return sh("ip", *(("-n", ns) if ns else ()), *args, check=check, timeout=30)


def until(what: str, fn: Callable[[], object], timeout: float, interval: float = 0.5,
          describe: Callable[[], str] | None = None) -> object:
    """Call ``fn`` until it returns something truthy; bounded by ``timeout`` (raises TimeoutError)."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            value = fn()
            if value:
                return value
        except (CommandError, httpx.HTTPError, OSError, ValueError, KeyError) as e:
            last_error = f" (last error: {str(e)[:500]})"
        if time.monotonic() > deadline:
            extra = f"\n{describe()}" if describe else ""
            raise TimeoutError(f"{what}: not after {timeout:.0f}s{last_error}{extra}")
        time.sleep(interval)


def _pdeathsig() -> None:
    """In a child before exec: SIGTERM when the test process dies, so no daemon outlives a kill -9."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


# ---- preconditions ---------------------------------------------------------------------------

def problem() -> str | None:
    """Why a swarm cannot be built here, or None."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, dockerd)"
    for tool in ("dockerd", "docker", "nsenter", "ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


# ---- a node ----------------------------------------------------------------------------------

@dataclass
class Node:
    index: int
    role: str = "worker"
    proc: subprocess.Popen | None = None
    swarm_id: str = ""

    @property
    def name(self) -> str:
        return f"{PREFIX}-n{self.index}"  # the namespace, the Swarm hostname, the veth in the hub

    @property
    def ns(self) -> str:
        return self.name

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def root(self) -> Path:
        return BASE_DIR / f"n{self.index}"

    @property
    def run(self) -> Path:
        return RUN_DIR / f"n{self.index}"

    @property
    def sock(self) -> Path:
        return self.run / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.run / "docker.pid"

    @property
    def log_path(self) -> Path:
        return self.root / "dockerd.log"

    def nsenter(self, *cmd: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns}", *cmd]

    def docker(self, *args: str | Path, timeout: float = CMD_TIMEOUT, check: bool = True,
               input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        return sh("docker", "-H", f"unix://{self.sock}", *args, timeout=timeout, check=check, input=input, env=env)

    def in_ns(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        return sh(*self.nsenter(*cmd), timeout=timeout, check=check)

    def daemon_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# ---- cleanup (also of a killed earlier run) -------------------------------------------------

def _our_mounts() -> list[str]:
    prefixes = (str(BASE_DIR) + "/", str(RUN_DIR) + "/")
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].replace("\\040", " ")
            if mnt.startswith(prefixes) or mnt in (str(BASE_DIR), str(RUN_DIR)):
                out.append(mnt)
    return out


def _pids_using(paths: Iterable[str]) -> list[int]:
    """Processes whose command line names one of our paths (shims of our daemons' containerds)."""
    needles = [p.encode() for p in paths]
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            pids.append(int(d.name))
    return pids


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie counts as gone
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        if not pids:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def cleanup_leftovers() -> None:
    """Remove every trace of a swarm of ours: daemons (by pid file), their shims, mounts, namespaces,
    veths, data. Idempotent; safe when nothing is there. Never touches the host's own engine."""
    # 1. daemons, by pid file (dockerd stops its containerd and containers on SIGTERM)
    pids = []
    if RUN_DIR.is_dir():
        for pidfile in RUN_DIR.glob("n*/docker.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(pidfile.read_text().strip())
                # only a process that is really one of ours: its command line names our exec root
                if str(pidfile.parent).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    for pid in _wait_gone(pids, 30):
        _kill(pid, signal.SIGKILL)
    # 2. whatever still runs from our paths (containerd, shims, a registry of ours)
    stray = _pids_using([str(RUN_DIR) + "/", str(BASE_DIR) + "/"])
    for pid in stray:
        _kill(pid, signal.SIGTERM)
    for pid in _wait_gone(stray, 10):
        _kill(pid, signal.SIGKILL)
    _wait_gone(stray, 5)
    # 3. mounts under our roots (overlays, container netns and shm), innermost first
    for mnt in sorted(_our_mounts(), key=len, reverse=True):
        sh("umount", "-l", mnt, check=False, timeout=30)
    # 4. namespaces (their veths go with them) and the host's veth
    for ns in sh("ip", "netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0].strip()
        if name.startswith(f"{PREFIX}-"):
            sh("ip", "netns", "del", name, check=False)
    if Path(f"/sys/class/net/{HOST_VETH}").exists():
        ip("link", "del", HOST_VETH, check=False)
    # 5. data (a tmpfs is gone with its umount above; `rm -rf` is much faster than rmtree here)
    for d in (RUN_DIR, BASE_DIR):
        if d.exists():
            sh("rm", "-rf", "--one-file-system", d, check=False, timeout=900)


# ---- the swarm -------------------------------------------------------------------------------

@dataclass
class Swarm:
    """``with Swarm() as s:`` three dockerds in namespaces, one swarm (n0 manager); always torn down."""

    size: int = 3
    # True: a node never pulls for a task (DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1), images are loaded
    # beforehand; without it every task of a plain local name stalls ~20 s asking Docker Hub.
    # False: nodes pull from our registry when a task lands on them, as on real hosts.
    offline: bool = True
    nodes: list[Node] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    # images loaded by distribute(): on every node, on the manager only
    images: set[str] = field(default_factory=set)
    manager_images: set[str] = field(default_factory=set)
    _registry: list[subprocess.Popen] = field(default_factory=list)
    _down: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("a swarm needs a node")
        self.nodes = [Node(i, "manager" if i == 0 else "worker") for i in range(self.size)]

    @property
    def manager(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[Node]:
        return self.nodes[1:]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if name in (n.name, n.swarm_id, n.ip):
                return n
        raise KeyError(name)

    # ---- up / down ----------------------------------------------------------------------

    def __enter__(self) -> "Swarm":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self, timeout: float = 180) -> None:
        why = problem()
        if why:
            raise RuntimeError(f"cannot build a swarm here: {why}")
        t0 = time.monotonic()
        cleanup_leftovers()
        atexit.register(self.down)  # a last resort; `with` / finally is the normal path
        self._trap_sigterm()
        self._storage()
        self._network()
        self._daemons(timeout)
        self._swarm()
        self.timings["swarm up"] = time.monotonic() - t0
        log(f"swarm of {self.size} nodes up in {self.timings['swarm up']:.1f}s "
            f"(manager {self.manager.ip}, workers {', '.join(w.ip for w in self.workers)})")

    def _trap_sigterm(self) -> None:
        """SIGTERM (a CI runner stopping the job, `timeout`) raises KeyboardInterrupt like Ctrl-C, so
        the `finally` that tears the swarm down runs; the previous handler is back after `down`.
        (A SIGKILL cannot be caught: the daemons then die with us (PR_SET_PDEATHSIG) and the next
        run's `cleanup_leftovers` removes the rest.)"""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous not in (signal.SIG_DFL, None):
            return  # someone else handles SIGTERM: leave it to them

        def interrupt(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, interrupt)
        self._restore_sigterm = lambda: signal.signal(signal.SIGTERM, previous)

    def _storage(self) -> None:
        """The nodes' data roots on a tmpfs when memory allows (LARQL_SWARM_TMPFS=auto|1|0).

        Measured here: loading the images into three data roots on the ext4 disk took ~105-120 s
        and deleting them ~45 s per node (the disk is mounted with `discard`, so every freed extent
        is trimmed synchronously); on a tmpfs both take a fraction of that, and teardown is one umount.
        """
        BASE_DIR.mkdir(parents=True, exist_ok=True)
        want = os.environ.get("LARQL_SWARM_TMPFS", "auto")
        size_gb = int(os.environ.get("LARQL_SWARM_TMPFS_GB", "10"))
        if want == "auto":
            # The tmpfs holds ~5 GiB when the grid runs (three image stores, the embed server's
            # lm_head copy); its size is only a cap. Leave room for the grid's own processes.
            avail_gb = _mem_available_gb()
            want = "1" if avail_gb >= 12 else "0"
            if want == "0":
                log(f"data roots on disk: only {avail_gb:.0f} GiB of memory available (a tmpfs wants 12)")
        if want == "1":
            sh("mount", "-t", "tmpfs", "-o", f"size={size_gb}g,mode=0711", f"{PREFIX}-data", BASE_DIR)
            self.timings["tmpfs GiB"] = size_gb

    def _network(self) -> None:
        sh("ip", "netns", "add", HUB_NS)
        ip("link", "set", "lo", "up", ns=HUB_NS)
        ip("link", "add", "br0", "type", "bridge", ns=HUB_NS)
        ip("link", "set", "br0", "up", ns=HUB_NS)
        ip("link", "add", HOST_VETH, "type", "veth", "peer", "name", "host", "netns", HUB_NS)
        ip("link", "set", "host", "master", "br0", "up", ns=HUB_NS)
        ip("addr", "add", f"{HOST_IP}/24", "dev", HOST_VETH)
        ip("link", "set", HOST_VETH, "up")
        for n in self.nodes:
            sh("ip", "netns", "add", n.ns)
            ip("link", "set", "lo", "up", ns=n.ns)
            # the node's end is its eth0; the hub's end is named after the node (cut_link's handle)
            ip("link", "add", n.name, "type", "veth", "peer", "name", "eth0", "netns", n.ns, ns=HUB_NS)
            ip("link", "set", n.name, "master", "br0", "up", ns=HUB_NS)
            ip("addr", "add", f"{n.ip}/24", "dev", "eth0", ns=n.ns)
            ip("link", "set", "eth0", "up", ns=n.ns)
            # Route everything else via the host side: the host forwards nothing (FORWARD is DROP),
            # so the nodes reach the host's veth address and each other, and nothing beyond.
            ip("route", "add", "default", "via", HOST_IP, ns=n.ns)

    def _daemon_config(self, n: Node, driver: str) -> dict:
        cfg = {
            "data-root": str(n.root / "data"),
            "exec-root": str(n.run / "exec"),
            "pidfile": str(n.pidfile),
            "hosts": [f"unix://{n.sock}"],
            "storage-driver": driver,
            "cgroup-parent": f"/{n.name}",  # the node's containers apart from the host's /docker
            "log-driver": "json-file",
            "log-opts": {"max-size": "10m", "max-file": "2"},
            "shutdown-timeout": 5,
            "mtu": 1400,
            "max-concurrent-downloads": 6,
            "max-concurrent-uploads": 6,
        }
        reg = self._registry_address()
        if reg:
            cfg["insecure-registries"] = [reg]
        return cfg

    def _start_daemon(self, n: Node, driver: str) -> None:
        n.root.mkdir(parents=True, exist_ok=True)
        n.run.mkdir(parents=True, exist_ok=True)
        cfg_path = n.root / "daemon.json"
        cfg_path.write_text(json.dumps(self._daemon_config(n, driver), indent=1))
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        if self.offline:
            env["DOCKER_SERVICE_PREFER_OFFLINE_IMAGE"] = "1"
        logf = open(n.log_path, "ab")
        try:
            # --config-file: the node must never read the host engine's /etc/docker/daemon.json
            # A UTS namespace of its own too: Swarm names a node by its hostname, and `docker
            # service ps` reports tasks by node hostname.
            argv = n.nsenter("unshare", "--uts", "sh", "-c", 'hostname "$0" && exec dockerd --config-file "$1"',
                             n.name, str(cfg_path))
            n.proc = subprocess.Popen(argv, stdout=logf,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                      start_new_session=True, preexec_fn=_pdeathsig)
        finally:
            logf.close()

    def _daemon_ready(self, n: Node) -> bool:
        if n.proc is not None and n.proc.poll() is not None:
            raise CommandError(f"dockerd of {n.name} exited ({n.proc.returncode}):\n{n.daemon_log()}")
        return n.sock.exists() and n.docker("version", "--format", "{{.Server.Version}}", check=False,
                                            timeout=10).returncode == 0

    def _daemons(self, timeout: float) -> None:
        driver = os.environ.get("LARQL_SWARM_STORAGE_DRIVER", "overlay2")
        for n in self.nodes:
            self._start_daemon(n, driver)
        for n in self.nodes:
            try:
                until(f"dockerd of {n.name}", lambda n=n: self._daemon_ready(n), timeout, 0.3,
                      describe=n.daemon_log)
            except CommandError:
                if driver == "fuse-overlayfs":
                    raise
                # overlay2 cannot run on some hosts (an overlay root, a missing d_type): the
                # host engine's own choice here is fuse-overlayfs; fall back to it once.
                log(f"{n.name}: dockerd failed with {driver}; retrying all nodes with fuse-overlayfs")
                self._stop_daemons()
                os.environ["LARQL_SWARM_STORAGE_DRIVER"] = "fuse-overlayfs"
                return self._daemons(timeout)

    def _swarm(self) -> None:
        m = self.manager
        m.docker("swarm", "init", "--advertise-addr", m.ip, "--listen-addr", f"{m.ip}:2377",
                 "--default-addr-pool", ADDR_POOL, "--dispatcher-heartbeat", DISPATCHER_HEARTBEAT)
        token = m.docker("swarm", "join-token", "-q", "worker").stdout.strip()
        for w in self.workers:
            w.docker("swarm", "join", "--token", token, "--advertise-addr", w.ip, "--listen-addr",
                     f"{w.ip}:2377", f"{m.ip}:2377", timeout=60)
        until("every node ready", lambda: all(s == "Ready" for s in self.node_states().values())
              and len(self.node_states()) == self.size, 60, 0.5)
        for n in self.nodes:
            info = json.loads(n.docker("info", "--format", "{{json .Swarm}}").stdout)
            n.swarm_id = info["NodeID"]

    def node_states(self) -> dict[str, str]:
        out = self.manager.docker("node", "ls", "--format", "{{.Hostname}} {{.Status}} {{.Availability}}").stdout
        return {line.split()[0]: line.split()[1] for line in out.strip().splitlines() if line.strip()}

    def _stop_daemons(self) -> None:
        procs = [n.proc for n in self.nodes if n.proc is not None]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for n in self.nodes:
            n.proc = None

    def down(self) -> None:
        """Leave the swarm on every node, stop the daemons, remove namespaces, veths and data."""
        if self._down:
            return
        self._down = True
        t0 = time.monotonic()
        try:
            for n in reversed(self.nodes):  # workers first, the manager last
                if n.proc is not None and n.proc.poll() is None:
                    with contextlib.suppress(CommandError):
                        n.docker("swarm", "leave", "--force", timeout=30, check=False)
            self._stop_registry()
            t1 = time.monotonic()
            self._stop_daemons()
            self.timings["daemons stop"] = time.monotonic() - t1
        finally:
            t2 = time.monotonic()
            cleanup_leftovers()
            self.timings["cleanup"] = time.monotonic() - t2
            with contextlib.suppress(Exception):
                atexit.unregister(self.down)
            restore = getattr(self, "_restore_sigterm", None)
            if restore is not None and threading.current_thread() is threading.main_thread():
                restore()
        log(f"swarm torn down in {time.monotonic() - t0:.1f}s (daemons {self.timings.get('daemons stop', 0):.1f}s, "
            f"cleanup {self.timings.get('cleanup', 0):.1f}s)")

    # ---- images ---------------------------------------------------------------------------

    def _registry_address(self) -> str | None:
        port = getattr(self, "_registry_port", None)
        return f"{HOST_IP}:{port}" if port else None

    def distribute(self, images: list[str], method: str = "load", manager_only: list[str] = ()) -> float:
        """Put ``images`` (from the host engine) on every node, and ``manager_only`` on the manager
        alone (services placed on managers: half the bytes for the workers). ``load``: one ``docker
        save`` stream fanned out to a ``docker load`` per node; ``registry``: push to a registry on
        loopback, the nodes pull. Returns the seconds it took (also in ``timings``)."""
        wanted = [*images, *manager_only]
        missing = [i for i in wanted if sh("docker", "image", "inspect", i, check=False, timeout=30).returncode]
        if missing:
            raise CommandError(f"not on the host engine (docker/build-images.sh builds them): {', '.join(missing)}")
        t0 = time.monotonic()
        if method == "load":
            with cf.ThreadPoolExecutor(2) as ex:  # the manager's own images load beside the shared ones
                jobs = [ex.submit(self._save_load, list(images), self.nodes)] if images else []
                if manager_only:
                    jobs.append(ex.submit(self._save_load, list(manager_only), [self.manager]))
                for j in jobs:
                    j.result()
        elif method == "registry":
            self._via_registry(list(images), self.nodes)
            if manager_only:
                self._via_registry(list(manager_only), [self.manager])
        else:
            raise ValueError(f"unknown distribution method {method!r}")
        dt = time.monotonic() - t0
        self.images |= set(images)
        self.manager_images |= set(manager_only)
        self.timings[f"images via {method}"] = dt
        log(f"{len(wanted)} images on {self.size} nodes via {method} in {dt:.1f}s")
        return dt

    def _save_load(self, images: list[str], nodes: list[Node]) -> None:
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        loads = [subprocess.Popen(["docker", "-H", f"unix://{n.sock}", "load", "-q"], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for n in nodes]
        # One reader, N writers: each load gets the same bytes; a writer thread per load so one
        # slow daemon does not stall the others beyond the pipe buffers.
        queues: list[queue.Queue] = [queue.Queue(maxsize=64) for _ in loads]

        def feed(i: int) -> None:
            q, p = queues[i], loads[i]
            try:
                while (chunk := q.get()) is not None:
                    p.stdin.write(chunk)
            except BrokenPipeError:
                while q.get() is not None:  # keep draining so the reader never blocks on us
                    pass
            finally:
                with contextlib.suppress(BrokenPipeError, OSError):
                    p.stdin.close()

        threads = [threading.Thread(target=feed, args=(i,), daemon=True) for i in range(len(loads))]
        for t in threads:
            t.start()
        try:
            assert save.stdout is not None
            while chunk := save.stdout.read(1 << 20):
                for q in queues:
                    q.put(chunk, timeout=600)
        finally:
            for q in queues:
                q.put(None, timeout=600)
            for t in threads:
                t.join(600)
        # Every pipe closed here: an unclosed one is an unraisable ResourceWarning in a later test.
        with save.stdout, save.stderr:
            if save.wait(600) != 0:
                raise CommandError(f"docker save failed: {save.stderr.read().decode()[-2000:]}")
        for n, p in zip(nodes, loads, strict=True):
            with p.stderr:
                err = p.stderr.read()
            if p.wait(600) != 0:
                raise CommandError(f"docker load on {n.name} failed: {err.decode()[-2000:]}")

    def _start_registry_process(self, addr: str, storage: Path) -> subprocess.Popen:
        exe = shutil.which("docker-registry")
        if exe is None:
            raise CommandError("docker-registry not found (apt-get install docker-registry)")
        cfg = storage.parent / f"registry-{addr.replace(':', '-')}.yml"
        cfg.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {storage}\n"
                       f"  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n")
        p = subprocess.Popen([exe, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_pdeathsig)
        self._registry.append(p)
        host, port = addr.rsplit(":", 1)

        def up() -> bool:
            if p.poll() is not None:
                raise CommandError(f"docker-registry on {addr} exited: {p.stderr.read().decode()[-1000:]}")
            return httpx.get(f"http://{addr}/v2/", timeout=2).status_code == 200

        until(f"registry on {addr}", up, 30, 0.2)
        return p

    def _stop_registry(self) -> None:
        for p in self._registry:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
            if p.stderr is not None:
                p.stderr.close()
        self._registry.clear()

    def _ensure_registry(self) -> tuple[str, str]:
        """One registry storage, served twice: on 127.0.0.1 for the host engine to push to (an
        engine allows a loopback registry without TLS, so the host engine's config is untouched),
        and on the host's veth address for the nodes to pull from (their daemon.json lists it in
        insecure-registries; reloaded with SIGHUP). Returns (push address, pull address)."""
        port = getattr(self, "_registry_port", None)
        if port is None:
            storage = BASE_DIR / "registry"
            storage.mkdir(parents=True, exist_ok=True)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self._start_registry_process(f"127.0.0.1:{port}", storage)
            self._start_registry_process(f"{HOST_IP}:{port}", storage)
            self._registry_port = port
            for n in self.nodes:
                (n.root / "daemon.json").write_text(json.dumps(self._daemon_config(n, self._driver(n)), indent=1))
                _kill(n.proc.pid, signal.SIGHUP)  # insecure-registries is reloadable
            until("nodes trust the registry", lambda: all(
                f"{HOST_IP}:{port}" in n.docker("info", "--format", "{{json .RegistryConfig}}").stdout
                for n in self.nodes), 30, 0.3)
        return f"127.0.0.1:{port}", f"{HOST_IP}:{port}"

    def _via_registry(self, images: list[str], nodes: list[Node]) -> None:
        local, remote = self._ensure_registry()
        pushed = []
        try:
            # Sequential pushes: shared base layers are uploaded once, then "already exist".
            for image in images:
                ref = f"{local}/{image}"
                sh("docker", "tag", image, ref, timeout=60)
                pushed.append(ref)
                sh("docker", "push", "-q", ref, timeout=1800)
        finally:
            for ref in pushed:  # only our extra tags go; the images stay
                sh("docker", "rmi", ref, check=False, timeout=60)

        def pull(n: Node) -> None:
            for image in images:
                n.docker("pull", "-q", f"{remote}/{image}", timeout=1800)
                n.docker("tag", f"{remote}/{image}", image)
                n.docker("rmi", f"{remote}/{image}", check=False)

        with cf.ThreadPoolExecutor(len(nodes)) as ex:
            list(ex.map(pull, nodes))

    def _driver(self, n: Node) -> str:
        return json.loads((n.root / "daemon.json").read_text())["storage-driver"]

    def ensure_image(self, n: Node, ref: str) -> None:
        """``ref`` on node ``n``: already there (loaded), or pulled (a registry image that only the
        nodes running its tasks have pulled so far)."""
        if n.docker("image", "inspect", ref, check=False, timeout=30).returncode != 0:
            n.docker("pull", "-q", ref, timeout=1800)

    def _published(self, name: str) -> str | None:
        """In registry mode, the registry name a derived image is pushed under (else None)."""
        if self.offline:
            return None
        _, pull_addr = self._ensure_registry()
        return f"{pull_addr}/{name}"

    def tag_everywhere(self, source: str, target: str) -> str:
        """Make ``target`` the same image as ``source`` wherever a task may need it; returns the
        reference to deploy: ``target`` on every node (offline), or pushed to our registry."""
        ref = self._published(target)
        if ref:
            m = self.manager
            self.ensure_image(m, source)
            m.docker("tag", source, ref)
            m.docker("push", "-q", ref, timeout=600)
            return ref
        for n in self.nodes:
            self.ensure_image(n, source)
            n.docker("tag", source, target)
        return target

    def build_everywhere(self, tag: str, dockerfile: str, base: str) -> str:
        """Build a small image FROM ``base`` (no context; nothing pulled from outside) wherever a task
        may need it, like `tag_everywhere`; returns the reference to deploy."""
        ref = self._published(tag)

        def build(n: Node, name: str) -> None:
            self.ensure_image(n, base)
            n.docker("build", "-q", "-t", name, "-", input=dockerfile, timeout=300, env={"DOCKER_BUILDKIT": "0"})

        if ref:
            build(self.manager, ref)
            self.manager.docker("push", "-q", ref, timeout=600)
            return ref
        with cf.ThreadPoolExecutor(len(self.nodes)) as ex:
            list(ex.map(build, self.nodes, [tag] * len(self.nodes)))
        return tag

    # ---- stacks and services ----------------------------------------------------------------

    def deploy(self, name: str, files: list[Path], env: dict[str, str] | None = None, timeout: float = 180) -> None:
        args = []
        for f in files:
            args += ["-c", str(f)]
        self.manager.docker("stack", "deploy", "--resolve-image", "never", "--detach=true", *args, name,
                            timeout=timeout, env=env)

    def remove_stack(self, name: str, timeout: float = 180) -> None:
        """``docker stack rm``, then wait until its tasks' containers and its networks are gone
        (the ports they published free again), so another stack can be deployed at once."""
        if not self.services(name):
            return
        t0 = time.monotonic()
        self.manager.docker("stack", "rm", name, timeout=60)
        label = f"label=com.docker.stack.namespace={name}"

        def gone() -> bool:
            return not self.services(name) and not any(
                n.docker("ps", "-q", "--filter", label).stdout.strip() for n in self.nodes) \
                and not self.manager.docker("network", "ls", "-q", "--filter", label).stdout.strip()

        until(f"stack {name} removed", gone, timeout, 1.0, describe=lambda: self.describe(name))
        log(f"stack {name} removed in {time.monotonic() - t0:.1f}s")

    def services(self, stack: str) -> dict[str, dict]:
        out = self.manager.docker("stack", "services", stack, "--format", "{{json .}}").stdout
        svcs = {}
        for line in out.strip().splitlines():
            s = json.loads(line)
            svcs[s["Name"]] = s
        return svcs

    def tasks(self, service: str, running_only: bool = True) -> list[dict]:
        """Tasks of a service: name, node (hostname), current state, error; running ones by default."""
        args = ["service", "ps", service, "--no-trunc", "--format", "{{json .}}"]
        if running_only:
            args[3:3] = ["--filter", "desired-state=running"]
        out = self.manager.docker(*args).stdout
        return [json.loads(line) for line in out.strip().splitlines() if line.strip()]

    def inspect_service(self, service: str) -> dict:
        return json.loads(self.manager.docker("service", "inspect", service).stdout)[0]

    def converged(self, stack: str) -> bool:
        """Every service of the stack has its wanted replicas running (and healthy, when it has a
        health check: Swarm reports a task running only once its container is healthy)."""
        svcs = self.services(stack)
        if not svcs:
            return False
        for s in svcs.values():
            have, _, want = s["Replicas"].partition("/")
            want = want.split(" ")[0]
            if have != want:
                return False
        return True

    def wait_converged(self, stack: str, timeout: float = 600) -> float:
        t0 = time.monotonic()
        until(f"stack {stack} converged", lambda: self.converged(stack), timeout, 1.0,
              describe=lambda: self.describe(stack))
        return time.monotonic() - t0

    def describe(self, stack: str) -> str:
        """Services, their tasks' states and errors: what a failed wait prints."""
        lines = []
        with contextlib.suppress(CommandError):
            for name, s in self.services(stack).items():
                lines.append(f"{name}: {s['Replicas']} {s['Image']}")
                for t in self.tasks(name, running_only=False)[:6]:
                    lines.append(f"    {t['Name']} on {t['Node']}: {t['CurrentState']} {t.get('Error', '')}")
        with contextlib.suppress(CommandError):
            lines.append(self.manager.docker("node", "ls").stdout)
        return "\n".join(lines)

    def task_nodes(self, service: str) -> list[Node]:
        return [self.node(t["Node"]) for t in self.tasks(service) if t["CurrentState"].startswith("Running")]

    def containers(self, service: str) -> list[tuple[Node, str]]:
        """(node, container id) of the running tasks of a service."""
        out = []
        for n in self.nodes:
            r = n.docker("ps", "-q", "--filter", f"label=com.docker.swarm.service.name={service}", check=False,
                         timeout=20)
            out += [(n, cid) for cid in r.stdout.split()]
        return out

    def kill_task(self, service: str, node: Node | None = None, signal_name: str = "KILL") -> tuple[Node, str]:
        """Kill the container of one running task of ``service`` (on ``node`` if given): a crash."""
        for n, cid in self.containers(service):
            if node is None or n is node:
                n.docker("kill", "-s", signal_name, cid, check=False, timeout=30)
                log(f"killed {service} container {cid[:12]} on {n.name}")
                return n, cid
        raise LookupError(f"no running container of {service}" + (f" on {node.name}" if node else ""))

    def logs(self, service: str, tail: int = 40) -> str:
        r = self.manager.docker("service", "logs", "--no-trunc", "--tail", str(tail), service, check=False,
                                timeout=30)
        return (r.stdout + r.stderr)[-8000:]

    # ---- faults ---------------------------------------------------------------------------

    def cut_link(self, node: Node) -> None:
        """The node's cable is pulled: its veth end in the hub goes down (no traffic at all)."""
        ip("link", "set", node.name, "down", ns=HUB_NS)
        log(f"link of {node.name} cut")

    def restore_link(self, node: Node) -> None:
        ip("link", "set", node.name, "up", ns=HUB_NS)
        log(f"link of {node.name} restored")

    def partition(self, a: Node, b: Node) -> None:
        """a and b can no longer talk (both ways; each still reaches the rest): DROP in a's namespace."""
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            a.in_ns("iptables", "-I", chain, "1", flag, b.ip, "-m", "comment", "--comment", f"{PREFIX}-partition",
                    "-j", "DROP")
        log(f"partitioned {a.name} from {b.name}")

    def heal(self, a: Node, b: Node) -> bool:
        """Undo `partition(a, b)`; True if there was a partition to undo."""
        healed = False
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            rule = [chain, flag, b.ip, "-m", "comment", "--comment", f"{PREFIX}-partition", "-j", "DROP"]
            for _ in range(16):  # one rule per partition() call; never an endless loop
                if a.in_ns("iptables", "-C", *rule, check=False).returncode != 0:
                    break
                a.in_ns("iptables", "-D", *rule)
                healed = True
        if healed:
            log(f"healed {a.name} <-> {b.name}")
        return healed

    def heal_all(self) -> None:
        """Every link up, every partition undone (a test's faults never outlive it)."""
        for n in self.nodes:
            if not self.link_up(n):
                self.restore_link(n)
            for other in self.nodes:
                if other is not n:
                    self.heal(n, other)

    def link_up(self, node: Node) -> bool:
        return "UP" in ip("-br", "link", "show", node.name, ns=HUB_NS).stdout.split()[1]


# ---- the grid on the swarm ----------------------------------------------------------------------

# ---- one swarm for the session ---------------------------------------------------------------

_shared: Swarm | None = None


def shared_swarm(images: list[str], manager_only: list[str] = ()) -> Swarm:
    """The session's swarm of 3 nodes (loaded images offline), built on first use, with ``images``
    on every node and ``manager_only`` on the manager. The test modules marked ``shared_swarm``
    (tests/test_swarm.py, tests/test_swarm_tls.py) take turns on it, each deploying its own stack
    and removing it after: the swarm and the image loading (~70-90 s here) are paid once. The
    conftest brings it down after the last test so marked that runs in a row (`release_shared`);
    Swarm.up's atexit hook is the last resort."""
    global _shared
    if _shared is None or _shared._down:
        s = Swarm(3, offline=True)
        try:
            s.up()
            s.distribute(list(images), "load", manager_only=list(manager_only))
        except BaseException:
            s.down()
            raise
        _shared = s
        return s
    more, more_manager = set(images) - _shared.images, set(manager_only) - _shared.manager_images - _shared.images
    if more or more_manager:
        _shared.distribute(sorted(more), "load", manager_only=sorted(more_manager))
    return _shared


def release_shared() -> None:
    global _shared
    if _shared is not None:
        s, _shared = _shared, None
        s.down()


def grid_view(url: str, timeout: float = 3.0) -> dict:
    r = httpx.get(url.rstrip("/") + "/v1/grid", timeout=timeout)
    r.raise_for_status()
    return r.json()


def router_urls(swarm: Swarm, service: str, port: int = 9090) -> list[str]:
    """The host-mode published router of every node running one (max one per node)."""
    return [f"http://{n.ip}:{port}" for n in swarm.task_nodes(service)]


def task_nodes_by_id(swarm: Swarm, stack: str) -> dict[str, Node]:
    """Task id -> the node it runs on, for every running task of the stack."""
    out = {}
    for svc in swarm.services(stack):
        for t in swarm.tasks(svc):
            out[t["ID"]] = swarm.node(t["Node"])
    return out


def member_task_id(member_url: str) -> str:
    """Members announce http://{{.Task.Name}}:PORT; a task's name ends in its id (SERVICE.SLOT.ID)."""
    host = member_url.split("//", 1)[1].rsplit(":", 1)[0]
    return host.rsplit(".", 1)[-1]


# ---- by hand ----------------------------------------------------------------------------------

def _main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "help"
    if cmd == "down":
        cleanup_leftovers()
        print("cleaned up")
        return 0
    if cmd == "measure":
        images = [f"larql-{r}:{TAG}" for r in ("router", "ffn", "embed", "edge", "prometheus")]
        results = {}
        for method in ("load", "registry"):
            with Swarm() as s:
                results[method] = s.distribute(images, method)
        for k, v in results.items():
            print(f"{k:10s} {v:6.1f}s")
        return 0
    if cmd == "up":
        s = Swarm()
        s.up()
        print(f"swarm up; manager socket: {s.manager.sock}\nCtrl-C tears it down")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            s.down()
        return 0
    print(__doc__)
    return 0 if cmd == "help" else 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
