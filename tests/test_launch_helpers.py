"""The process and port checks the book and the server tests use (entrypoints/launch.py)."""

import socket
import subprocess
import sys

from minivllm.entrypoints.launch import free_port, port_is_free, process_gone


def test_process_gone_waits_for_a_real_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not process_gone(proc.pid, timeout_s=0)  # alive now
    finally:
        proc.kill()
        proc.wait()
    assert process_gone(proc.pid, timeout_s=5)


def test_port_is_free_sees_a_listener():
    port = free_port()
    assert port_is_free(port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not port_is_free(port)
    assert port_is_free(port)
