"""Out of file descriptors (issue 26): the server under a HARD open-file limit of 1,024 (it cannot raise it) holds
1,100 idle connections, answers `/health` within a second and a generation request while they are held, and its
log grows by less than 100 KB; after they close it is healthy with every KV block free. On each event loop it may
run: asyncio (which logs every failed accept() by default) and uvloop when installed (which drops what waits)."""
import importlib.util, os, re, resource, socket, sys, time
from pathlib import Path
import httpx, pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from soak import LoggedServer, tiny_model, settle

N = 1100
LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])

def open_files_limit(pid) -> tuple[int, int]:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"): return tuple(int(x) for x in line.split()[3:5])

def hold(port, n) -> list[socket.socket]:
    "`n` connections that send nothing."
    socks = []
    for _ in range(n):
        s = socket.socket(); s.settimeout(10); s.connect(("127.0.0.1", port)); socks.append(s)
    return socks

def still_open(socks) -> int:
    "How many of `socks` the server has not closed (a closed one reads as EOF or a reset)."
    n = 0
    for s in socks:
        s.settimeout(0)
        try: n += s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError: n += 1
        except OSError: pass
    return n

def timed_get(url) -> tuple[int, float, float]:
    "GET `url` on a new connection: (status, seconds to connect, seconds in all)."
    host, port = url.split("//")[1].split("/")[0].split(":")
    t = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        c = time.perf_counter() - t
        s.sendall(f"GET /{url.split('/', 3)[3]} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536): data += chunk
    return int(data.split(b" ", 2)[1]), c, time.perf_counter() - t

def shown(probes) -> list[str]:
    return [f"{c} in {dt*1e3:.0f} ms (connect {ct*1e3:.0f})" for c, ct, dt in probes]

def limited_server(loop, *args) -> LoggedServer:
    "The tiny model served under a hard open-file limit of 1,024, with a head timeout longer than the test (what keeps it answering is the cap)."
    return LoggedServer("--model", tiny_model(), "--num-blocks", "64", "--max-model-len", "256", "--loop", loop,
                        "--timeout-request-head", "60", *args, nofile=(1024, 1024))

def somaxconn() -> str:
    try: return Path("/proc/sys/net/core/somaxconn").read_text().strip()
    except OSError: return "?"

@pytest.fixture(scope="module", autouse=True)
def client_files():
    "This process holds the client ends: 1,100 sockets need a soft limit above the usual 1,024."
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = N + 256
    if hard != resource.RLIM_INFINITY and hard < need: pytest.fail(f"the test client needs an open-file limit of {need} (hard limit here: {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

@pytest.mark.parametrize("loop", LOOPS)
def test_1100_idle_connections_under_a_hard_ulimit_of_1024(loop):
    t_start = time.perf_counter()
    srv = limited_server(loop)
    socks = []
    try:
        t_start = time.perf_counter() - t_start
        test_limits = open_files_limit(srv.proc.pid)
        started = srv.log_text()
        log0 = srv.log.stat().st_size
        t0 = time.perf_counter(); socks = hold(srv.port, N); opened = time.perf_counter() - t0
        burst = [timed_get(srv.base + "/health") for _ in range(5)]           # right away, while all 1,100 are held
        g = httpx.post(srv.base + "/v1/completions", json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True}, timeout=30)
        server_fds, open_now = len(os.listdir(f"/proc/{srv.proc.pid}/fd")), still_open(socks)
        time.sleep(2.0)                                                       # held a while: nothing may spin on accept errors
        held = [timed_get(srv.base + "/health") for _ in range(3)]
        grown_held = srv.log.stat().st_size - log0
        for s in socks: s.close()
        socks = []
        time.sleep(0.5)
        after = timed_get(srv.base + "/health")
        g2 = httpx.post(srv.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=30)
        stats = settle(srv.base)
        metrics = httpx.get(srv.base + "/metrics", timeout=10)
        grown = srv.log.stat().st_size - log0
        print(f"\n{loop}: started in {t_start:.0f} s; server open-file limit {test_limits}; {N} idle connections opened in {opened:.2f} s; "
              f"/health during the burst: {shown(burst)}, then while held: "
              f"{[f'{c} in {dt*1e3:.0f} ms' for c, _, dt in held]} (somaxconn {somaxconn()}); completion {g.status_code}; "
              f"server holding {server_fds} descriptors, {open_now} of the {N} connections still open; "
              f"log +{grown_held} B while held, +{grown} B in all; after release /health {after[0]}, chat {g2.status_code}, "
              f"KV blocks used {stats['kv_blocks_used']}")
        assert test_limits == (1024, 1024)
        assert "open-file limit 1024" in started and "up to " in started      # the cap is printed at start
        # the server answers each within a second of the connection being made; a connection made during the burst of
        # 1,100 may first wait out the kernel's SYN retransmit (1 s) when its accept queue is momentarily full, which is
        # the kernel's and not the server's: that is timed apart. Once the burst is in, every probe takes under a second
        assert all(c == 200 for c, _, _ in burst + held) and max(dt - ct for _, ct, dt in burst + held) < 1.0
        assert max(dt for _, _, dt in held) < 1.0
        assert g.status_code == 200 and g.json()["usage"]["completion_tokens"] == 8
        assert server_fds < 1024 and open_now > 800                          # the server held most of them, within its limit
        assert grown < 100_000
        assert after[0] == 200 and g2.status_code == 200 and metrics.status_code == 200
        assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0
    finally:
        for s in socks: s.close()
        assert srv.stop() == 0

def test_out_of_descriptors_at_accept_still_answers():
    "With no reserve, accept() itself fails for want of descriptors: asyncio would stop accepting for a second at each failure."
    srv = limited_server("asyncio", "--fd-reserve", "0")
    socks = []
    try:
        socks = hold(srv.port, N)
        health = [timed_get(srv.base + "/health") for _ in range(5)]
        time.sleep(1.5)
        for s in socks: s.close()
        socks = []
        stats = settle(srv.base)
        log = srv.log_text()
        failed = [int(x) for x in re.findall(r"(\d+) failed accept\(\) calls", log)]
        print(f"\n/health: {shown(health)}; failed accept() calls {failed}")
        assert sum(failed) > 0                                                # the case this test is about did happen
        assert all(c == 200 for c, _, _ in health) and max(dt - ct for _, ct, dt in health) < 1.0
        assert stats["kv_blocks_used"] == 0
    finally:
        for s in socks: s.close()
        assert srv.stop() == 0
