"""The Mooncake master is ready only when it holds its own port, not when anything answers."""

import os
import socket
import subprocess
import sys

import pytest

from dspark.transport.master import MooncakeMaster, listens_on
from dspark.transport.stores import TransportError


def test_listens_on_names_the_owner_of_the_port():
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        port = mine.getsockname()[1]
        assert not listens_on(os.getpid(), port)  # bound is not listening
        mine.listen()
        assert listens_on(os.getpid(), port)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert not listens_on(child.pid, port)  # someone else's listener
        finally:
            child.kill()
            child.wait()
    assert not listens_on(os.getpid(), port)


def test_a_master_whose_port_was_taken_fails_to_start():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(TransportError, match=f"did not start on 127.0.0.1:{port}"):
            MooncakeMaster.start(port=port, ready_timeout=5)


def test_a_master_starts_and_holds_its_port():
    with MooncakeMaster.start() as master:
        assert listens_on(master.process.pid, master.port)
    assert master.process.returncode is not None
