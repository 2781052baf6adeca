"""Connection exhaustion: the server started under the usual soft open-file limit of 1,024 (hard limit above it) holds
1,100 idle connections and still answers `/health` and a generation request, without flooding its log."""
import socket, sys, time
from pathlib import Path
import httpx, pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from soak import LoggedServer, tiny_model, settle

def open_files_limit(pid) -> tuple[int, int]:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]; return int(soft), int(hard)

def idle_connections(port, n, with_request_every=2) -> list[socket.socket]:
    "`n` open connections; every other one has made one keep-alive request and read its answer, the rest sent nothing."
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % with_request_every == 0:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(4096)
        socks.append(s)
    return socks

def test_1100_idle_connections_under_ulimit_1024():
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2400: pytest.skip(f"needs a hard open-file limit of at least 2400 here (have {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 2400), hard))  # this process holds the client ends
    srv = LoggedServer("--model", tiny_model(), "--num-blocks", "256", "--max-model-len", "256", "--log-level", "warning",
                       nofile=(1024, 4096))
    socks = []
    try:
        soft_now, hard_now = open_files_limit(srv.proc.pid)
        t0 = time.perf_counter()
        socks = idle_connections(srv.port, 1100)
        opened = time.perf_counter() - t0
        h = httpx.get(srv.base + "/health", timeout=20)
        g = httpx.post(srv.base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        time.sleep(2.0)              # held a while: nothing may spin on accept errors meanwhile
        h2 = httpx.get(srv.base + "/health", timeout=20)
        log_lines = len(srv.log_text().splitlines())
        print(f"\nconnections: server open-file limit raised to {soft_now}/{hard_now}; 1100 idle connections opened in {opened:.1f} s; "
              f"/health {h.status_code}, completion {g.status_code}, /health again {h2.status_code}; server log {log_lines} lines")
        assert soft_now == hard_now == 4096            # the server raised its soft limit to the hard one
        assert h.status_code == 200 and h2.status_code == 200
        assert g.status_code == 200 and g.json()["usage"]["completion_tokens"] == 4
        assert log_lines < 300
    finally:
        for s in socks: s.close()
        assert srv.stop() == 0

def test_connections_over_the_limit_get_503_at_once():
    "With `--limit-concurrency 40`, connections past the cap are answered 503 at once and the server recovers when they go."
    srv = LoggedServer("--model", tiny_model(), "--num-blocks", "256", "--max-model-len", "256", "--log-level", "warning",
                       "--limit-concurrency", "40")
    socks = []
    try:
        socks = idle_connections(srv.port, 45, with_request_every=10**9)
        t = time.perf_counter()
        r = httpx.get(srv.base + "/health", timeout=10)
        dt = time.perf_counter() - t
        assert r.status_code == 503 and dt < 5
        for s in socks: s.close()
        socks = []
        time.sleep(0.5)
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
        g = httpx.post(srv.base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert g.status_code == 200 and settle(srv.base)["kv_blocks_used"] == 0
        print(f"\nlimit-concurrency 40: 45 idle connections, the next request got 503 in {dt*1e3:.0f} ms; served again after they closed")
    finally:
        for s in socks: s.close()
        assert srv.stop() == 0
