"""The socket ``minivllm serve`` listens on: its connections send at once (no Nagle).

With Nagle's algorithm on, a small write waits in the kernel until the peer ACKs
the previous one, and a peer that has just sent a request (the router after its
``/tokenize``) delays that ACK. A stream's first chunk, written right after the
headers, then reached the router tens of milliseconds after the server sent it.
asyncio disables Nagle (``TCP_NODELAY``) only on sockets that say they are TCP,
so the listening socket must.
"""

import socket
import threading
import time

import httpx
import uvicorn

from minivllm.entrypoints.openai.api_server import _bind


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"first", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _serve(sock):
    server = uvicorn.Server(uvicorn.Config(_app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return server, thread


def test_every_accepted_connection_has_nagle_off():
    sock = _bind("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    server, thread = _serve(sock)
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        with httpx.Client(trust_env=False) as client:  # keep-alive: the connection stays
            for _ in range(2):
                r = client.get(url)
                assert r.status_code == 200 and r.content == b"first"
            conns = list(server.server_state.connections)
            assert len(conns) == 1  # the kept-alive one both requests used
            accepted = conns[0].transport.get_extra_info("socket")
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
