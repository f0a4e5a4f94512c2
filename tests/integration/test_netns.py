"""Network namespaces as nodes: links are made per namespace, so specs that share node names
coexist, and a link left by a namespace deleted under a running process is replaced."""

import json
import shutil
import subprocess

import pytest

from dspark.infra import netns
from dspark.infra.spec import load_spec

from ..conftest import skip_or_fail


def _spec(tmp_path, tag: str, subnet: int):
    # Both specs name their nodes infer-0 and train-0, as every spec in infra/ does.
    doc = {
        "name": f"netns-{tag}",
        "kind": "netns",
        "nodes": [
            {
                "name": "infer-0",
                "role": "inference",
                "netns": f"dsnt-{tag}-i0",
                "address": f"10.{subnet}.0.10",
            },
            {
                "name": "train-0",
                "role": "training",
                "netns": f"dsnt-{tag}-t0",
                "address": f"10.{subnet}.0.20",
            },
        ],
        "network": {"bridge": f"dsnt-{tag}-br"},
    }
    path = tmp_path / f"{tag}.yaml"
    path.write_text(json.dumps(doc))
    return load_spec(path)


def _eth0_addresses(ns: str) -> list[str]:
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "addr", "show", "eth0"], capture_output=True, text=True
    )
    if out.returncode != 0:
        return []
    infos = [a for link in json.loads(out.stdout) for a in link.get("addr_info", [])]
    return [a["local"] for a in infos if a["family"] == "inet"]


@pytest.fixture
def namespaces():
    why = netns.missing()
    if why:
        skip_or_fail(f"network namespaces: {why}")
    made = []
    yield made
    for spec in made:
        netns.down(spec)


def test_two_specs_with_the_same_node_names_coexist(namespaces, tmp_path):
    a, b = _spec(tmp_path, "a", 81), _spec(tmp_path, "b", 82)
    namespaces += [a, b]
    netns.up(a)
    netns.up(b)
    for spec in (a, b):
        for node in spec.nodes:
            assert _eth0_addresses(node.netns) == [node.address]
    if shutil.which("ping"):  # the addresses are checked above either way
        ping = ["ip", "netns", "exec", "dsnt-a-t0", "ping", "-c1", "-W2", "10.81.0.10"]
        assert subprocess.run(ping, capture_output=True).returncode == 0
    netns.down(a)
    assert not {n.netns for n in a.nodes} & netns.existing()
    for node in b.nodes:  # taking a down leaves b's links alone
        assert _eth0_addresses(node.netns) == [node.address]


def test_a_link_left_by_a_held_namespace_is_replaced(namespaces, tmp_path):
    spec = _spec(tmp_path, "c", 83)
    namespaces.append(spec)
    netns.up(spec)
    node = spec.nodes[0]
    # A process still in the namespace keeps it, and its veth pair, alive after the name goes.
    holder = subprocess.Popen(["ip", "netns", "exec", node.netns, "sleep", "60"])
    try:
        subprocess.run(["ip", "netns", "del", node.netns], check=True)
        netns.up(spec)
        assert _eth0_addresses(node.netns) == [node.address]
    finally:
        holder.kill()
        holder.wait()
