"""The benchmark's server processes ask torch for huge pages (dspark.serve.endpoints.server_env):
the setting is in their environment before torch's first allocation, and a user's value wins."""

import re
import subprocess
import sys
from pathlib import Path

from dspark.serve.endpoints import server_env
from tests.conftest import skip_or_fail

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# What a server process does first: import the server module and torch, then allocate 64 MB.
PROBE = """
import dspark.serve.server, torch
x = torch.ones(16 << 20)
print(next(l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")))
"""


def huge_kb(env: dict[str, str]) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    return int(re.search(r"(\d+) kB", out).group(1))


def test_a_users_setting_wins(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert server_env()["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert server_env()["THP_MEM_ALLOC_ENABLE"] == "0"


def test_a_server_process_gets_huge_pages_and_none_without_the_setting(monkeypatch):
    if not THP.exists() or "[madvise]" not in THP.read_text():
        skip_or_fail(f"{THP}: huge pages here are not granted on request (madvise)")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert huge_kb(server_env()) >= 32 << 10  # most of the 64 MB tensor on 2 MB pages
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert huge_kb(server_env()) == 0
