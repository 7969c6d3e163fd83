"""Behind a reverse proxy (RELY-7.8, RELY-7.11, RELY-7.12): a stranger's wrong tokens never
keep the phone's deliveries or the owner's sign-in out, with or without ``--trusted-proxy``.

The proxy is a real one, in this file: an HTTP server on 127.0.0.1 that forwards every
request to a real Cheroot ``serve`` from 127.0.0.1 and appends the client's address to
``X-Forwarded-For``, as nginx's ``$proxy_add_x_forwarded_for`` and Caddy do.  Clients reach
it from their own loopback addresses (127.0.0.2 the stranger, 127.0.0.3 the owner's phone
and browser), so without ``--trusted-proxy`` every one of them is 127.0.0.1 to healthlog.
"""

import http.client
import http.server
import threading

import pytest

import hae_factory as hf
import healthlog
from conftest import TOKEN, LocalServer, db_rows, raw_request, wait_for

STRANGER, PHONE, OTHER = "127.0.0.2", "127.0.0.3", "127.0.0.4"
WRONG = {"Authorization": "Bearer wrong-" + TOKEN}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


class Proxy(LocalServer):
    """A forwarding proxy: ``address`` is where clients connect."""

    def __init__(self, upstream: tuple):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "x-forwarded-for")}
                chain = self.headers.get("X-Forwarded-For")
                client = self.client_address[0]
                headers["X-Forwarded-For"] = chain + ", " + client if chain else client
                headers["Connection"] = "close"
                conn = http.client.HTTPConnection(*upstream, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    payload = answer.read()
                    self.send_response(answer.status)
                    for name, value in answer.getheaders():
                        if name.lower() not in ("connection", "transfer-encoding",
                                                "content-length"):
                            self.send_header(name, value)
                finally:
                    conn.close()
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(payload)
                self.close_connection = True

            do_GET = do_POST = forward

            def log_message(self, *args):
                pass

        super().__init__(Handler, name="test-proxy")


@pytest.fixture
def behind_proxy(start_service):
    """(start(trusted) -> (service, proxy)); every proxy is closed after the test."""
    proxies = []

    def start(trusted: str = None):
        overrides = {}
        if trusted:
            overrides["trusted_proxies"] = healthlog.parse_trusted_proxies(trusted, "test")
        service = start_service(**overrides)
        proxy = Proxy(service.address)
        proxies.append(proxy)
        return service, proxy

    yield start
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def quick_guesses(monkeypatch):
    """The pause before a wrong token's 401 capped at 10 ms instead of 2 s: the sixth to
    tenth wrong tokens of a burst otherwise wait 3.1 s in all. For the tests of whose
    address is counted and locked out, not of the pauses, which RELY-7.8 checks
    (tests/test_security.py); the limiter counts and locks out as it always does."""
    monkeypatch.setattr(healthlog, "GUESS_DELAY_MAX_S", 0.01)


def stranger_guesses(proxy, stop: threading.Event, answers: list, headers=None) -> list:
    """Three threads of wrong tokens through the proxy until ``stop`` (at most 60 each)."""
    def guess():
        for _ in range(60):
            if stop.is_set():
                return
            answers.append(raw_request(proxy, "GET", "/api/catalog", dict(WRONG, **(headers or {})),
                                       source=STRANGER).status)

    threads = [threading.Thread(target=guess) for _ in range(3)]
    for thread in threads:
        thread.start()
    return threads


def phone_and_owner(proxy) -> tuple:
    """The phone's eight deliveries and the owner's two sign-ins, in the stranger's storm."""
    posts = [raw_request(proxy, "POST", "/api/ingest", {"automation-name": "Proxy test"},
                         hf.dumps_hae(hf.canary_payload(n)), token=True, source=PHONE).status
             for n in range(8)]
    sign_ins = [raw_request(proxy, "POST", "/login", FORM, ("token=" + TOKEN).encode(),
                            source=PHONE) for _ in range(2)]
    return posts, sign_ins


@pytest.mark.parametrize("trusted", [None, "127.0.0.1"], ids=["untrusted", "trusted"])
def test_rely_7_11_a_stranger_behind_the_proxy_never_keeps_the_phone_out(
        behind_proxy, logs, trusted):
    """WHEN a stranger sends wrong tokens through the proxy, from three connections at
    once, while the phone posts eight deliveries and the owner signs in twice through the
    same proxy, THEN every delivery is 200 and journaled, every sign-in sets its cookie,
    and the stranger was refused (429) once locked out; with --trusted-proxy the lockout
    and its WARNs name the stranger's own address, without it the proxy's, and one WARN
    says how to name the proxy."""
    service, proxy = behind_proxy(trusted)
    # The stranger first locks its address out (ten wrong tokens), then keeps guessing
    # beside the phone, as in the report: a right token must still get through.
    for _ in range(healthlog.GUESSES_BEFORE_LOCKOUT):
        raw_request(proxy, "GET", "/api/catalog", WRONG, source=STRANGER)
    stop, answers = threading.Event(), []
    threads = stranger_guesses(proxy, stop, answers)
    try:
        # the guesses really under way beside the phone (as many answered as threads)
        wait_for(lambda: len(answers) >= len(threads), what="the stranger's first answers")
        posts, sign_ins = phone_and_owner(proxy)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert posts == [200] * 8
    assert [a.status for a in sign_ins] == [303, 303]
    assert all("healthlog_session=" in a.headers["set-cookie"] for a in sign_ins)
    assert answers and set(answers) <= {401, 429} and 429 in answers
    assert len(db_rows(service.config.data_dir)) == 8
    locked = logs.find("too many failed authentications", level="WARN")
    assert [r["address"] for r in locked] == [STRANGER if trusted else "127.0.0.1"]
    # Another client of the proxy: counted apart only when the proxy is trusted.
    other = raw_request(proxy, "GET", "/api/catalog", WRONG, source=OTHER).status
    assert other == (401 if trusted else 429)
    assert raw_request(proxy, "GET", "/api/catalog", token=True, source=OTHER).status == 200
    hints = logs.find("not named in --trusted-proxy", level="WARN")
    assert [r["address"] for r in hints] == ([] if trusted else ["127.0.0.1"])  # said once


def test_rely_7_11_a_hop_the_client_wrote_is_never_believed(behind_proxy, logs, quick_guesses):
    """WHEN the stranger writes its own X-Forwarded-For (an innocent address) and the
    trusted proxy appends the stranger's real one, THEN the failures count against the
    real one: the innocent address is neither locked out nor named."""
    service, proxy = behind_proxy("127.0.0.1")
    spoof = {"X-Forwarded-For": "198.51.100.23"}
    for _ in range(healthlog.GUESSES_BEFORE_LOCKOUT + 1):
        raw_request(proxy, "GET", "/api/catalog", dict(WRONG, **spoof), source=STRANGER)
    warnings = logs.find("authentication", level="WARN")
    assert {r["address"] for r in warnings} == {STRANGER}
    assert service.app.guesses.refused_for(STRANGER) > 0
    assert service.app.guesses.refused_for("198.51.100.23") == 0


@pytest.mark.parametrize("trusted", [None, "127.0.0.1"], ids=["no-proxy-named",
                                                              "another-proxy-named"])
@pytest.mark.parametrize("header", ["X-Forwarded-For: 203.0.113.7",
                                    "Forwarded: for=203.0.113.7;proto=https",
                                    "X-Real-IP: 203.0.113.7"])
def test_rely_7_12_forwarding_headers_from_an_untrusted_address_are_ignored_and_said_once(
        start_service, logs, quick_guesses, trusted, header):
    """WHEN a client that is no trusted proxy sends wrong tokens with a spoofed
    forwarding header, straight to serve, THEN its own address is counted and locked
    out, never the address in the header, and one WARN names it with the hint."""
    overrides = {}
    if trusted:
        overrides["trusted_proxies"] = healthlog.parse_trusted_proxies(trusted, "test")
    service = start_service(**overrides)
    name, _, value = header.partition(": ")
    for _ in range(healthlog.GUESSES_BEFORE_LOCKOUT + 1):
        raw_request(service, "GET", "/api/catalog", dict(WRONG, **{name: value}), source=OTHER)
    assert raw_request(service, "GET", "/api/catalog", {name: value}, token=True,
                       source=OTHER).status == 200
    locked = logs.find("too many failed authentications", level="WARN")
    assert [r["address"] for r in locked] == [OTHER]
    hints = logs.find("not named in --trusted-proxy", level="WARN")
    assert [r["address"] for r in hints] == [OTHER]
    assert "--trusted-proxy ADDRESS" in hints[0]["msg"]
    assert service.app.guesses.refused_for("203.0.113.7") == 0


@pytest.mark.parametrize("environ, expected", [
    ({"HTTP_X_FORWARDED_FOR": "203.0.113.7"}, "203.0.113.7"),
    ({"HTTP_X_FORWARDED_FOR": "198.51.100.1, 203.0.113.7"}, "203.0.113.7"),
    ({"HTTP_X_FORWARDED_FOR": "203.0.113.7, 10.0.0.5"}, "203.0.113.7"),  # a trusted hop
    ({"HTTP_X_FORWARDED_FOR": "203.0.113.7:5123"}, "203.0.113.7"),
    ({"HTTP_X_FORWARDED_FOR": "[2001:db8::17]:4711"}, "2001:db8::17"),
    ({"HTTP_X_FORWARDED_FOR": "2001:db8::17"}, "2001:db8::17"),
    ({"HTTP_X_FORWARDED_FOR": "::ffff:203.0.113.7"}, "203.0.113.7"),
    ({"HTTP_X_FORWARDED_FOR": "not-an-address"}, "127.0.0.1"),  # no address: the proxy's
    ({"HTTP_FORWARDED": "for=203.0.113.7;proto=https"}, "203.0.113.7"),
    ({"HTTP_FORWARDED": 'for=198.51.100.1, for="[2001:db8::17]:4711"'}, "2001:db8::17"),
    ({"HTTP_FORWARDED": "proto=https;For=203.0.113.7"}, "203.0.113.7"),
    ({"HTTP_FORWARDED": "for=_hidden"}, "127.0.0.1"),
    ({"HTTP_X_FORWARDED_FOR": "203.0.113.7", "HTTP_FORWARDED": "for=198.51.100.1"},
     "203.0.113.7"),
    ({}, "127.0.0.1"),  # a trusted peer without headers is the client itself
    ({"HTTP_X_FORWARDED_FOR": "10.0.0.5"}, "10.0.0.5"),  # every hop trusted: the farthest
])
def test_rely_7_11_the_client_is_the_nearest_untrusted_hop(environ, expected):
    trusted = healthlog.parse_trusted_proxies("127.0.0.1, 10.0.0.0/8", "test")
    assert healthlog.client_address(dict(environ, REMOTE_ADDR="127.0.0.1"), trusted) == (
        expected, False)
    untrusted = healthlog.client_address(dict(environ, REMOTE_ADDR="192.0.2.9"), trusted)
    assert untrusted == ("192.0.2.9", bool(environ))


@pytest.mark.parametrize("text", ["", " , ", "localhost", "10.0.0.0/33", "1.2.3.4.5"])
def test_rely_7_11_a_trusted_proxy_that_is_no_address_stops_serve(text):
    with pytest.raises(healthlog.ConfigError, match="--trusted-proxy"):
        healthlog.parse_trusted_proxies(text, "--trusted-proxy")
