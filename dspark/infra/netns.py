"""Network namespaces as nodes: each gets a veth pair into one bridge, an address, loopback.

    root namespace:  bridge (dspark-br0) <- veth host ends (dsv-<hash of the namespace name>)
    node namespace:  veth peer renamed eth0 with the node's address, and lo

Creation is idempotent and undone in reverse; everything needs root and iproute2 (`ip`).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import zlib
from pathlib import Path

from dspark.errors import ResourceError
from dspark.infra.spec import ClusterSpec, Node
from dspark.procs import die_with_parent


def missing() -> str | None:
    """Why namespaces cannot be made here, or None (probed: root in a container may still lack
    CAP_SYS_ADMIN or CAP_NET_ADMIN)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"dspark-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise ResourceError(f"ip {' '.join(args)}: {msg[0] if msg else f'exit {r.returncode}'}")
    return r


def _host_end(node: Node) -> str:
    """The root-namespace end of the node's veth pair. Named after the namespace, which is
    unique on the machine, not after the node: two specs may both have a node `infer-0`, and
    their links must not collide. A hash, because names are capped at 15 bytes (IFNAMSIZ)."""
    return f"dsv-{zlib.crc32(node.netns.encode()):08x}"


def bridge_address(spec: ClusterSpec) -> str:
    """The host's address on the nodes' subnet (its first): services in the root namespace
    (MLflow, Prefect) are reachable there, and the host reaches the nodes."""
    net = ipaddress.IPv4Interface(f"{spec.nodes[0].address}/{spec.network.prefix_len}").network
    return str(next(net.hosts()))


def existing() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}


def up(spec: ClusterSpec) -> None:
    """Create the bridge, the namespaces and their links (whatever of it is not there yet)."""
    if spec.kind != "netns":
        return
    why = missing()
    if why:
        raise ResourceError(f"spec {spec.name}: {why}")
    net = spec.network
    if _ip("link", "show", net.bridge, check=False).returncode != 0:
        _ip("link", "add", net.bridge, "type", "bridge")
    gateway = f"{bridge_address(spec)}/{net.prefix_len}"
    if gateway not in _ip("addr", "show", net.bridge).stdout:
        _ip("addr", "add", gateway, "dev", net.bridge)  # the host's own address on the subnet
    _ip("link", "set", net.bridge, "up")
    have = existing()
    for node in spec.nodes:
        ns, host = node.netns, _host_end(node)
        if ns not in have:
            _ip("netns", "add", ns)
        if _ip("-n", ns, "link", "show", "eth0", check=False).returncode != 0:
            # A host end without its peer here is left from a namespace that was deleted while
            # a process still held it: replace the pair.
            _ip("link", "del", host, check=False)
            _ip("link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", host, "alias", f"{spec.name}/{node.name}")
        _ip("link", "set", host, "master", net.bridge)
        _ip("link", "set", host, "up")
        addr = f"{node.address}/{net.prefix_len}"
        if addr not in _ip("-n", ns, "addr", "show", "eth0").stdout:
            _ip("-n", ns, "addr", "add", addr, "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def down(spec: ClusterSpec) -> None:
    """Remove what `up` made; absent pieces are fine."""
    if spec.kind != "netns" or missing():
        return
    have = existing()
    for node in spec.nodes:
        if node.netns in have:
            _ip("netns", "del", node.netns, check=False)  # takes its veth end with it
        _ip("link", "del", _host_end(node), check=False)
    _ip("link", "del", spec.network.bridge, check=False)


def current() -> str | None:
    """The name of the namespace this process is in, or None for the root one."""
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    run = Path("/run/netns")
    for entry in run.glob("*") if run.is_dir() else []:
        try:
            if entry.stat().st_ino == mine:
                return entry.name
        except OSError:
            continue
    return None


def reexec_on(node: Node, argv: list[str]) -> int:
    """Run this CLI again, with `argv`, inside `node`'s namespace; return its exit code.

    The child has a process group of its own, so a signal for ours (Ctrl-C, a cancelled flow
    run) reaches it once, passed on by us, and we wait while it acts on it: it may be
    checkpointing (dspark.stopping). If we die first, it gets SIGTERM."""
    child = subprocess.Popen(
        namespace_cmd(node.netns, [sys.executable, "-m", "dspark", *argv]),
        process_group=0,
        preexec_fn=die_with_parent,
    )

    def pass_on(signum, _frame):
        child.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler or signal.SIG_DFL)


def namespace_cmd(netns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv]
