"""server.py's limits, through raw sockets where a client library would not go: Host headers, slow and stalled
clients, bodies over the limit, malformed bodies, the connection cap, and a port already taken."""

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from serving.process import ROOT, ServerProcess, free_port


@pytest.fixture(scope="module")
def limited(v1_1_checkpoint):
    """On every interface, answering for the name t5.internal only (and any
    address), with no key (so it warns); 1 s to send headers or a body, 4
    connections, 10,000-byte bodies."""
    running = ServerProcess("--model", str(v1_1_checkpoint.mlx_dir), "--host", "0.0.0.0",
                            "--allowed-hosts", "t5.internal", "--read-timeout", "1",
                            "--max-connections", "4", "--max-body-bytes", "10000")
    yield running
    assert running.stop() == 0


def raw(server: ServerProcess, data: bytes, wait: float = 5.0) -> bytes:
    """What the server answers to these bytes on a connection of their own, until it closes it (or `wait` s pass)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        s.sendall(data)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    answer = b""
    try:
        while chunk := s.recv(65536):
            answer += chunk
    except TimeoutError:
        pass
    return answer


def error_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_on_every_interface_without_a_key_it_warns_and_serves_by_the_model_as_named(limited, v1_1_checkpoint):
    assert "has no --api-key" in limited.output()
    names = httpx.get(limited.url + "/v1/models").json()["data"]
    assert [m["id"] for m in names] == [str(v1_1_checkpoint.mlx_dir)]  # vLLM's way: --model as given


def test_a_host_header_it_does_not_answer_for_is_refused(limited):
    """DNS rebinding: a page on evil.example resolved to this machine sends
    Host: evil.example. An address cannot be rebound: probes by IP pass."""
    body = {"model": "default", "prompt": "x", "max_tokens": 1}
    for host in ("evil.example:8080", "t5.internal.evil.example", "t5.internal:http"):
        refused = httpx.post(limited.url + "/v1/completions", json=body, headers={"Host": host})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_host", host
    for host in ("t5.internal", f"T5.Internal:{limited.port}", f"127.0.0.1:{limited.port}", "10.1.2.3", "[::1]:80"):
        assert httpx.post(limited.url + "/v1/completions", json=body, headers={"Host": host}).status_code == 200, host


@pytest.mark.parametrize("header, name", [("localhost", "localhost"), ("LocalHost:8080", "localhost"), ("[::1]", "::1"),
                                          ("[::1]:8080", "::1"), ("[::1]junk", None), ("a:b", None), ("[::1", None)])
def test_a_host_header_is_read_as_a_name_and_a_port_or_refused(header, name):
    from serving.guard import host_name

    assert host_name(header) == name


def test_a_connection_whose_headers_stall_is_closed_after_the_read_timeout(limited):
    """Closed with nothing to answer, and not before the 1 s timeout (never closed, recv raises after 10 s)."""
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and no more
        started = time.monotonic()
        assert s.recv(65536) == b""  # the end of the stream: closed
        assert time.monotonic() - started > 0.5  # a busy machine can only lengthen it


def test_a_body_that_stalls_gets_a_408(limited):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    status, error = error_of(raw(limited, head + b'{"model": "default"'))
    assert status == 408 and "did not arrive within 1 s" in error["message"]


def test_a_chunked_body_over_the_limit_gets_a_413(limited):
    """No Content-Length to refuse it by: it is counted as it comes."""
    def chunks():
        for _ in range(30):
            yield b'{"model": "default", "prompt": "' + b"x" * 500

    response = httpx.post(limited.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "over 10,000 bytes" in response.json()["error"]["message"]


def test_each_route_reads_a_body_up_to_its_own_limit(limited):
    """The text routes up to --max-body-bytes; a path no route takes, 4,096
    bytes: a large body sent there is refused before it is read."""
    padding = {"model": "default", "prompt": "x", "max_tokens": 1, "user": "u" * 8000}  # about 8 kB
    assert httpx.post(limited.url + "/v1/completions", json=padding).status_code == 200
    refused = httpx.post(limited.url + "/v1/nowhere", json=padding)
    assert refused.status_code == 413 and "over 4,096 bytes" in refused.json()["error"]["message"]
    assert httpx.post(limited.url + "/v1/nowhere", json={"x": 1}).status_code == 404


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/completions", b'{"model": "\xc3\x28"}', 400),  # not UTF-8
    ("POST", "/v1/completions", b"[" * 3000 + b"]" * 3000, 400),  # nested past the recursion limit of Python < 3.12
    ("GET", "/v1/nowhere", None, 404),
    ("DELETE", "/v1/completions", None, 405),
], ids=["invalid utf-8", "deeply nested", "404", "405"])
def test_every_error_has_openais_shape(limited, method, path, body, status):
    response = httpx.request(method, limited.url + path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    if body and not (body.startswith(b"[") and sys.version_info >= (3, 12)):  # 3.12 reads 3000 levels: a list
        assert "could not be read as JSON (not UTF-8, or nested too deeply)" in response.json()["error"]["message"]


def test_connections_beyond_the_cap_get_a_503_in_openais_shape(limited):
    """4 open connections are served, a fifth is not (idle ones are closed
    after the 1 s read timeout): its 503 is OpenAI's error, and closes."""
    held = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(3)]
    try:
        assert httpx.get(limited.url + "/health").status_code == 200  # the fourth
        held.append(socket.create_connection(("127.0.0.1", limited.port)))
        refused = httpx.get(limited.url + "/health")  # the fifth
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "server_error" and "--max-connections" in refused.json()["error"]["message"]
    finally:
        for s in held:
            s.close()
    deadline = time.time() + 5
    while httpx.get(limited.url + "/health").status_code != 200 and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(limited.url + "/health").status_code == 200


def test_a_port_already_taken_exits_at_once_with_an_error():
    """Not a process that logs the error in uvicorn's thread and lives on,
    answering nothing; and before the models load (there are none here)."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        done = subprocess.run([sys.executable, "server.py", "--model", "no/such-model", "--port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_the_listening_socket_names_tcp_so_streamed_chunks_are_not_held_for_delayed_acks():
    """asyncio sets TCP_NODELAY only on connections of a socket made with
    IPPROTO_TCP; without it each chunk after a stream's first waited for the
    client's delayed ACK (40 ms on Linux: first tokens at 44 ms, not 17)."""
    import server

    sock = server.listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_the_metrics_carry_vllms_prefix_or_the_one_given():
    """vLLM's `vllm:` by default, so that its dashboards read them unchanged; --metrics-prefix t5: gives the names
    this server had before; a prefix no Prometheus name may start with is refused before anything loads."""
    from serving.metrics import Metrics

    assert b"vllm:num_requests_running" in Metrics("m").exposition(None)[0]
    text = Metrics("m", prefix="t5:").exposition(None)[0]
    assert b"t5:num_requests_running" in text and b"vllm:" not in text
    done = subprocess.run([sys.executable, "server.py", "--model", "no/such-model", "--metrics-prefix", "9bad-"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--metrics-prefix '9bad-' cannot start a Prometheus metric's name" in done.stderr
