"""Security (RELY-7): authentication, secrets, file system, logs and headers of a real server.

Every test runs a real Cheroot server on 127.0.0.1:0 over a real data directory, with
health data already stored (canary device names and values folded into the store), and
looks at what comes back and what is left behind: answers, log records at every level,
the SQLite files' bytes, the archive's ``.meta.json`` files and the whole temp tree.
"""

import base64
import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import os
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import (TOKEN, RawAnswer, assert_no_leaks, journal_rows, raw_request, wait_for)

DEVICE = "Quillon\u2019s Oura Ring"
VALUE = 8.642097531
WORKOUT = "Canarywalk Xylophone"
MEDICATION = "Canarymycin 50 mg Oral Tablet"
SYMPTOM = "Canaryache"
METRIC = "canary_metric_qwxz"
CANARIES = [DEVICE, "Quillon", "8.642097531", WORKOUT, MEDICATION, "Canarymycin", SYMPTOM]
"""This file's own health data: device names, a value, names a user typed."""

DATA_CANARIES = CANARIES + [METRIC, "Zebulon", "72.123456789", "Anton"]
"""Nothing of this may come back without the token."""

AUTOMATION = {"automation-name": "Security tracker", "automation-aggregation": "Minutes",
              "automation-id": "5F1E2D3C-4B5A-4968-8776-A5B4C3D2E1F0"}


# -- HTTP over a raw socket: any bytes in the head, every header of the answer -------------


# -- health data to protect ----------------------------------------------------------------


def canary_body(value: float = VALUE, units: str = "count", bad: bool = False) -> bytes:
    """Metrics, a workout and records whose device names, a value and user-typed names are
    this file's canaries; ``bad`` adds a medication and a metric point whose time cannot
    be read (named in a WARN)."""
    rng = random.Random(11)
    phone = hf.Phone(sources=DEVICE)
    day = hf.DEFAULT_DAY
    body = hf.metrics_payload(11, ("heart_rate", "step_count"), day,
                              dt.datetime.combine(day, dt.time(1)), phone=phone, rng=rng)
    body["data"]["metrics"].append({"name": METRIC, "units": units, "data": [
        {"date": "2024-03-08 00:%02d:00 -0800" % minute, "qty": value, "source": DEVICE}
        for minute in range(5)]})
    workout = hf.workout_v2(11, dt.datetime.combine(day, dt.time(18)), name=WORKOUT,
                            phone=phone, route_points=4, rng=rng)
    workout["activeEnergyBurned"]["qty"] = value
    medication = hf.medications(rng, dt.datetime.combine(day, dt.time(8)), phone=phone)
    for item in medication:
        item["displayText"], item["dosage"] = MEDICATION, value
    symptom = hf.symptoms(rng, dt.datetime.combine(day, dt.time(12)), phone=phone, count=1)
    symptom[0]["name"], symptom[0]["severity"] = SYMPTOM, "Severe %s" % value
    if bad:
        medication.append(dict(medication[0], start="not a time", end=None))
        body["data"]["metrics"][-1]["data"].append({"date": {"x": DEVICE}, "qty": value})
    body["data"].update(workouts=[workout], medications=medication, symptoms=symptom)
    return hf.dumps_hae(body)


def ingest(service, body: bytes, headers: dict = None, path: str = "/api/ingest") -> RawAnswer:
    answer = raw_request(service, "POST", path, dict(AUTOMATION, **(headers or {})), body,
                         token=True)
    assert answer.status == 200, answer.text()
    return answer


def drained(service) -> None:
    """Nothing pending and the fold pass returned: a fold's records (its WARNs, "delivery
    folded") are written after its commit, so an empty backlog alone is too early."""
    def none_pending() -> bool:
        answer = raw_request(service, "GET", "/healthz")
        if answer.status != 200:
            return False
        health = json.loads(answer.body)
        return health["backlog"] == 0 and health["worker"] == "idle"

    wait_for(none_pending, timeout=30, what="nothing pending and the fold pass returned")


@pytest.fixture
def stocked(service):
    """A server with health data stored: canary bodies folded into the store."""
    ingest(service, canary_body())
    ingest(service, hf.dumps_hae(hf.canary_payload(2)))
    drained(service)
    catalog = raw_request(service, "GET", "/api/catalog", token=True)
    assert catalog.status == 200 and METRIC.encode() in catalog.body  # data to leak is there
    return service


def assert_no_data(answer: RawAnswer, what: str) -> None:
    text = answer.text()
    for canary in DATA_CANARIES + [TOKEN]:
        assert canary not in text, "%s leaks %r: %s" % (what, canary, text[:500])


def signed_in_cookie(service) -> str:
    """The session cookie a real sign-in sets (name=value)."""
    answer = raw_request(service, "POST", "/login",
                         {"Content-Type": "application/x-www-form-urlencoded"},
                         ("token=" + TOKEN).encode())
    assert answer.status == 303, answer.text()
    return answer.headers["set-cookie"].split(";", 1)[0]


# -- RELY-7.1: nothing without the token -------------------------------------------------

METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
PATHS = ("/api/ingest", "/api/ingest/phone", "/api/catalog", "/api/points?metric=" + METRIC,
         "/api/points?metric=%s&format=csv" % METRIC,
         "/api/points?metric=%s&bucket=day" % METRIC, "/api/deliveries",
         "/api/deliveries?limit=500", "/metrics", "/", "/login", "/logout", "/static/app.js",
         "/static/app.css", "/healthz", "/no/such/route", "/api/", "/api/catalog/",
         "//api/catalog", "/API/CATALOG", "/api/catalog%2f", "/api/points/../catalog",
         "/api/catalog?token=" + TOKEN, "/static/../api/catalog", "/index.html")
PUBLIC = {("GET", "/healthz"), ("HEAD", "/healthz"), ("GET", "/"), ("HEAD", "/"),
          ("GET", "/static/app.js"), ("HEAD", "/static/app.js"),
          ("GET", "/static/app.css"), ("HEAD", "/static/app.css")}
"""What answers 200 without the token: liveness, the sign-in page and its script and
style. No setting of healthlog makes /metrics public (Config has none)."""


def test_rely_7_1_no_route_but_healthz_and_the_sign_in_page_answers_without_the_token(stocked):
    """WHEN every route is asked with every method and no credentials, THEN only /healthz,
    the sign-in page and its static files answer 200 (none with data), /logout only
    redirects, and everything else is 401/403/404/405/400 with no data in the answer."""
    assert not any(f.name.lower().startswith("public") or "metrics_public" in f.name
                   for f in dataclasses.fields(healthlog.Config))
    seen = {}
    for method in METHODS:
        for path in PATHS:
            body = b'{"data": {"metrics": []}}' if method in ("POST", "PUT", "PATCH") else None
            answer = raw_request(stocked, method, path, body=body)
            seen[(method, path)] = answer.status
            assert_no_data(answer, "%s %s" % (method, path))
            if (method, path) in PUBLIC:
                assert answer.status == 200, (method, path, answer.text())
            elif (method, path) == ("POST", "/logout"):
                assert answer.status == 303 and "Max-Age=0" in answer.headers["set-cookie"]
            else:
                assert answer.status in (400, 401, 403, 404, 405), (method, path, answer.text())
    assert seen[("GET", "/api/catalog")] == seen[("GET", "/metrics")] == 401
    assert seen[("POST", "/api/ingest")] == seen[("GET", "/api/deliveries")] == 401
    page = raw_request(stocked, "GET", "/")
    assert b'name="token"' in page.body and b'id="catalog"' not in page.body  # sign-in only
    assert json.loads(raw_request(stocked, "GET", "/healthz").body).keys() == {
        "status", "version", "backlog", "worker", "failed_after_attempts"}
    assert len(journal_rows(stocked.config.data_dir)) == 2  # nothing was ingested without the token


# -- RELY-7.2: wrong credentials and forged cookies -----------------------------------------

WRONG = [
    {"Authorization": "Bearer wrong-token"},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
    {"Authorization": "Bearer      "},
    {"Authorization": "Bearer " + TOKEN[:-1]},
    {"Authorization": "Bearer " + TOKEN + "x"},
    {"Authorization": "Bearer " + TOKEN.upper()},
    {"Authorization": "Bearer " + TOKEN[:10] + " " + TOKEN[10:]},
    {"Authorization": "Bearer " + TOKEN + " " + TOKEN},
    {"Authorization": "Bearer\t" + TOKEN},
    {"Authorization": "Basic " + base64.b64encode((":" + TOKEN).encode()).decode()},
    {"Authorization": "Basic " + TOKEN},
    {"Authorization": "Token " + TOKEN},
    {"Authorization": TOKEN},
    {"Authorization": "Bearer " + TOKEN[:-1] + "\u00e9"},
    {"Authorization": b"Bearer " + TOKEN.encode()[:-1] + "\u00e9".encode()},
    {"Authorization": b"Bearer " + TOKEN.encode() + b"\x00"},
    {"X-API-Key": "wrong"},
    {"X-API-Key": ""},
    {"X-API-Key": TOKEN[:-1]},
    {"X-API-Key": TOKEN[1:]},
    {"X-Api-Key": TOKEN + "x"},
    {"Api-Key": TOKEN},
    {"X-Auth-Token": TOKEN},
    {"Token": TOKEN},
    {"Cookie": "token=" + TOKEN},
    {"Cookie": "healthlog_session=" + TOKEN},
]
DATA_ROUTES = [("GET", "/api/catalog"), ("GET", "/api/points?metric=" + METRIC),
               ("GET", "/api/deliveries"), ("GET", "/metrics"), ("POST", "/api/ingest")]


def forged_cookies(token: bytes) -> list:
    """Session cookie values that must not sign anyone in: no session was started for
    any of them (the first is even signed rightly), and the rest are altered, expired,
    foreign, replayed or of the form of earlier versions."""
    future = int(time.time()) + 86400
    sid = "0123456789abcdef" * 2
    genuine = healthlog.session_value(token, sid, future)
    _, expiry, signature = genuine.split(".")
    flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    legacy = hmac.new(token, ("session:%d" % future).encode(), hashlib.sha256).hexdigest()
    return [
        "", "garbage", ".", "..", genuine, TOKEN, "%s.%d.%s" % (sid, future, "0" * 64),
        healthlog.session_value(b"another-token", sid, future),
        healthlog.session_value(token, sid, int(time.time()) - 10),  # expired
        "%s.%s.%s" % (sid, expiry, flipped), "%s.%s.%s" % (sid, expiry, signature.upper()),
        genuine + "x", genuine[:-1], "%s.%d.%s" % (sid, future + 1, signature),  # replayed
        "%s.9%s.%s" % (sid, expiry, signature), "%s.+%s.%s" % (sid, expiry, signature),
        "%d.%s" % (future, legacy),  # the cookie of earlier versions
        "%s.%s" % (expiry, hmac.new(token, b"session", hashlib.sha256).hexdigest()),
        "%s.%s" % (expiry, hashlib.sha256(token).hexdigest()),
        genuine + "\u00e9",
    ]


def test_rely_7_2_wrong_tokens_and_forged_cookies_get_401_or_403_never_data(stocked):
    """WHEN data routes and ingest are asked with wrong, empty, split, re-cased or
    misplaced tokens, or with forged, expired, replayed or re-signed session cookies,
    THEN every answer is 401 (400 where the server refuses the header itself), or 403
    for cross-site sign-in, and none carries data; the genuine cookie (control) works
    on read routes only."""
    stocked.app.guesses = Unlimited()  # each wrong token is compared: RELY-7.8 limits them
    body = canary_body(value=1.5)
    for headers in WRONG:
        for method, path in DATA_ROUTES:
            answer = raw_request(stocked, method, path, headers,
                                 body if method == "POST" else None)
            nul = any(isinstance(v, bytes) and b"\x00" in v for v in headers.values())
            assert answer.status in ((400, 401) if nul else (401,)), (headers, path,
                                                                      answer.text())
            assert_no_data(answer, "%s %s with %r" % (method, path, headers))
    for value in forged_cookies(TOKEN.encode()):
        cookie = {"Cookie": ("healthlog_session=" + value).encode("utf-8")}
        for method, path in DATA_ROUTES:
            answer = raw_request(stocked, method, path, cookie, body if method == "POST" else None)
            assert answer.status == 401, (value, path, answer.text())
            assert_no_data(answer, "%s %s with cookie %r" % (method, path, value))
        page = raw_request(stocked, "GET", "/", cookie)
        assert b'name="token"' in page.body, value  # the sign-in page, not the dashboard
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        answer = raw_request(stocked, "POST", "/login", dict(
            headers, **{"Content-Type": "application/x-www-form-urlencoded"}),
            ("token=" + TOKEN).encode())
        assert answer.status == 403 and "set-cookie" not in answer.headers, answer.text()
    wrong_form = raw_request(stocked, "POST", "/login", {
        "Content-Type": "application/x-www-form-urlencoded"}, b"token=" + TOKEN[:-1].encode())
    assert wrong_form.status == 401 and "set-cookie" not in wrong_form.headers
    genuine = {"Cookie": signed_in_cookie(stocked)}
    assert raw_request(stocked, "GET", "/api/catalog", genuine).status == 200  # the control
    assert b'name="token"' not in raw_request(stocked, "GET", "/", genuine).body
    assert raw_request(stocked, "POST", "/api/ingest", genuine, body).status == 401
    assert len(journal_rows(stocked.config.data_dir)) == 2, (
        "a delivery was accepted with a wrong credential")


# -- RELY-7.3: constant-time comparison -------------------------------------------------------


class ShortCircuit(healthlog.App):
    """The calibration: authenticate with ``!=``, which stops at the first differing byte,
    so the test can show that its instrument catches a comparison that is not
    constant-time."""

    def authenticate(self, environ, cookie=False):
        offered = environ["HTTP_X_API_KEY"].strip()
        if offered.encode("latin-1", "replace") != self._token:
            raise healthlog.Unauthorized()


def _long_token_case() -> tuple:
    """(token, [wrong environs: first byte and last byte, by Bearer and X-API-Key])."""
    token = "k" * (1 << 16)
    return token, [{"HTTP_AUTHORIZATION": "Bearer " + "j" + token[1:]},
                   {"HTTP_AUTHORIZATION": "Bearer " + token[:-1] + "j"},
                   {"HTTP_X_API_KEY": "j" + token[1:]},
                   {"HTTP_X_API_KEY": token[:-1] + "j"}]


class Unlimited(healthlog.GuessLimiter):
    """No delay and no lockout, and never a burst's first failure (no WARN): the tests
    compare many wrong tokens, which the limiter of RELY-7.8 would otherwise slow and
    then stop after ten failures."""

    def refused_for(self, address):
        return 0.0

    def failed(self, address):
        return 2, 0.0


def _bare_app(cls, token: str) -> healthlog.App:
    app = cls.__new__(cls)  # only the token and the limiter are needed: no routes, no server
    app.set_token(token)
    app.guesses = Unlimited()
    return app


class _NoShortCircuit(bytes):
    """The token as the app holds it, refusing every operator comparison: only a
    comparison that reads its bytes through the buffer protocol, as
    hmac.compare_digest does, gets at them."""

    def _refuse(self, other):
        raise AssertionError("the token was compared with an operator that can stop at"
                             " the first differing byte")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __hash__ = bytes.__hash__


def test_rely_7_3_the_token_is_compared_whole_by_hmac_compare_digest(monkeypatch):
    """RELY-7.3 without a stopwatch: WHEN tokens wrong in their first byte and in their
    last (Bearer, X-API-Key) and the right one are authenticated, THEN each is compared
    once, by hmac.compare_digest, whole against the whole token, and no ``==``, ``!=``
    or ordering touches the token; the calibration, a short-circuiting ``!=``, is caught
    by the same instrument.

    A wrong token then takes as long wrong in its first byte as in its last because the
    comparison reads every byte either way (compare_digest's contract).  This replaces a
    test that timed the two with a 10 % band: on a busy machine it skipped itself, so it
    could not fail there, and a timing band is noise elsewhere."""
    token, environs = _long_token_case()
    app = _bare_app(healthlog.App, token)
    app._token = _NoShortCircuit(app._token)
    calls = []
    compare = hmac.compare_digest

    def watched(a, b):
        calls.append((bytes(a), bytes(b)))
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", watched)
    for environ in environs:
        offered = (environ.get("HTTP_AUTHORIZATION", "").partition(" ")[2]
                   or environ.get("HTTP_X_API_KEY"))
        del calls[:]
        with pytest.raises(healthlog.Unauthorized):
            app.authenticate(environ)
        assert calls == [(offered.encode(), token.encode())], "not one whole compare_digest"
    del calls[:]
    app.authenticate({"HTTP_X_API_KEY": token})
    assert calls == [(token.encode(), token.encode())]

    naive = _bare_app(ShortCircuit, token)  # the calibration: the instrument sees a `!=`
    naive._token = _NoShortCircuit(naive._token)
    with pytest.raises(AssertionError, match="first differing byte"):
        naive.authenticate(environs[2])


# -- RELY-7.8: wrong tokens are slowed, then refused, per address; a right one never -----


def test_rely_7_8_the_guess_limiter_delays_then_locks_out_and_forgets(monkeypatch):
    """The limiter's schedule, on an injected clock: five failures answered at once, the
    next ones after 0.1, 0.2, 0.4, 0.8, 1.6 s, from the eleventh 429 at once (None) for a
    lockout of 30 s after the tenth that doubles with each further failure up to 15
    minutes; a quiet burst gap forgets; each address counts alone, and at most 4096 are
    remembered; at most two wrong answers wait at once."""
    now = [1000.0]
    limiter = healthlog.GuessLimiter(clock=lambda: now[0])
    delays = [limiter.failed("10.0.0.1")[1] for _ in range(9)]
    assert delays == [0, 0, 0, 0, 0, 0.1, 0.2, 0.4, 0.8]
    assert limiter.refused_for("10.0.0.1") == 0
    assert limiter.failed("10.0.0.1") == (10, 1.6)
    assert limiter.refused_for("10.0.0.1") == 30.0
    assert limiter.refused_for("10.0.0.2") == 0  # another address is not touched
    assert limiter.failed("10.0.0.1") == (11, None)  # locked: 429 at once
    assert limiter.refused_for("10.0.0.1") == 60.0
    now[0] += 61
    assert limiter.refused_for("10.0.0.1") == 0
    assert limiter.failed("10.0.0.1") == (12, 2.0)  # the same burst, answered after a wait
    assert limiter.refused_for("10.0.0.1") == 120.0
    for _ in range(10):
        now[0] += 10_000
        limiter.failed("10.0.0.9")  # a failure every few hours: never a burst
    assert limiter.refused_for("10.0.0.9") == 0
    for _ in range(9):
        limiter.failed("10.0.0.1")
    assert limiter.refused_for("10.0.0.1") == 0  # hours later: a new burst, counted anew
    assert limiter.failed("10.0.0.1")[0] == 10
    assert limiter.refused_for("10.0.0.1") == healthlog.GUESS_LOCKOUT_S
    for _ in range(5000):  # a storm: every wrong token during the lockout counts
        limiter.failed("10.0.0.1")
    assert limiter.refused_for("10.0.0.1") == healthlog.GUESS_LOCKOUT_MAX_S
    assert limiter.failed("10.0.0.1") == (5011, None)
    with limiter.waiting() as first, limiter.waiting() as second, limiter.waiting() as third:
        assert (first, second, third) == (True, True, False)
    with limiter.waiting() as again:
        assert again  # the places were given back
    monkeypatch.setattr(healthlog, "GUESS_ADDRESSES_MAX", 3)
    for n in range(10):
        limiter.failed("10.0.1.%d" % n)
    assert len(limiter._failures) == 3


def test_rely_7_8_wrong_tokens_from_one_address_are_slowed_then_refused(service, logs):
    """WHEN one address sends wrong tokens, by Bearer, by X-API-Key and by the sign-in
    form, THEN the eleventh and later are answered 429 with Retry-After, while the right
    token from the same address is served at once by every route (ingest, a read, the
    sign-in form) and another address is served; the burst is two WARN records, its
    first failure and the lockout, and every other failure's access-log record is
    DEBUG."""
    bearer = {"Authorization": "Bearer wrong-" + TOKEN}
    answers = [raw_request(service, "GET", "/api/catalog", bearer) for _ in range(4)]
    answers += [raw_request(service, "GET", "/api/catalog", {"X-API-Key": "x" * 20})
                for _ in range(3)]
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    answers += [raw_request(service, "POST", "/login", form, b"token=wrong") for _ in range(2)]
    answers += [raw_request(service, "POST", "/api/ingest", bearer, hf.dumps_hae(
        hf.canary_payload(1)))]
    assert [a.status for a in answers] == [401] * 10
    refused = [raw_request(service, "GET", "/api/catalog", bearer),
               raw_request(service, "POST", "/api/ingest", {"X-API-Key": "y" * 20}, b"{}"),
               raw_request(service, "POST", "/login", form, b"token=wrong-again")]
    assert [a.status for a in refused] == [429, 429, 429]
    for answer in refused:
        assert 1 <= int(answer.headers["retry-after"]) <= healthlog.GUESS_LOCKOUT_MAX_S
        assert "set-cookie" not in answer.headers
    assert json.loads(refused[0].body)["error"]["code"] == "too_many_requests"
    served = [raw_request(service, "GET", "/api/catalog", token=True),
              raw_request(service, "POST", "/api/ingest", {"X-API-Key": TOKEN},
                          hf.dumps_hae(hf.canary_payload(2))),
              raw_request(service, "POST", "/login", form, ("token=" + TOKEN).encode())]
    assert [a.status for a in served] == [200, 200, 303]
    assert "healthlog_session=" in served[2].headers["set-cookie"]
    assert raw_request(service, "GET", "/api/catalog", bearer).status == 429  # still locked
    assert raw_request(service, "GET", "/api/catalog", token=True, source="127.0.0.2").status == 200
    assert raw_request(service, "GET", "/api/catalog", source="127.0.0.2").status == 401  # no token
    warnings = [r for r in logs.records() if r.get("level") == "WARN"]
    assert [r["msg"] for r in warnings] == [
        "authentication failed; more failures from this address are counted, not logged",
        "too many failed authentications: wrong tokens from the address are refused for a"
        " while (a right one is still served)"]
    assert warnings[0]["address"] == "127.0.0.1" and warnings[1]["failures"] == "10"
    access = [r for r in logs.find("http request") if r["status"] in ("401", "429")]
    loud = [r for r in access if r["level"] != "DEBUG"]
    assert len(access) == 15 and [r["status"] for r in loud] == ["401", "401", "401"]


def test_rely_7_8_a_right_token_leaves_the_burst_counted(service, logs):
    """A right token between wrong ones is served, and does not hand the address a fresh
    burst (behind a shared address that would be the stranger's): the failures go on
    counting, one WARN for the burst."""
    bearer = {"Authorization": "Bearer wrong-" + TOKEN}
    for _ in range(2):
        for _ in range(healthlog.GUESSES_FREE):
            assert raw_request(service, "GET", "/api/catalog", bearer).status == 401
        assert raw_request(service, "GET", "/api/catalog", token=True).status == 200
    assert len(logs.find("authentication failed", level="WARN")) == 1
    assert service.app.guesses.failed("127.0.0.1")[0] == 2 * healthlog.GUESSES_FREE + 1


# -- RELY-7.9: signing out ends the session on the server ------------------------------------


def test_rely_7_9_sign_out_ends_that_session_and_sign_out_everywhere_ends_all(stocked, logs):
    """WHEN three browsers sign in and one signs out, THEN its cookie opens nothing any
    more, even sent again as it was, while the others still work; WHEN one of them then
    signs out everywhere, THEN no cookie opens anything, and a new sign-in works."""
    first, second, third = (signed_in_cookie(stocked) for _ in range(3))
    assert len({first, second, third}) == 3
    for cookie in (first, second, third):
        assert raw_request(stocked, "GET", "/api/catalog", {"Cookie": cookie}).status == 200
    out = raw_request(stocked, "POST", "/logout", {"Cookie": first})
    assert out.status == 303 and "max-age=0" in out.headers["set-cookie"].lower()
    assert raw_request(stocked, "GET", "/api/catalog", {"Cookie": first}).status == 401
    assert b'name="token"' in raw_request(stocked, "GET", "/", {"Cookie": first}).body
    assert raw_request(stocked, "GET", "/api/catalog", {"Cookie": second}).status == 200
    everywhere = raw_request(stocked, "POST", "/logout?everywhere=1", {"Cookie": second})
    assert everywhere.status == 303
    for cookie in (first, second, third):
        assert raw_request(stocked, "GET", "/api/catalog", {"Cookie": cookie}).status == 401
    assert [r["everywhere"] for r in logs.find("signed out", level="INFO")] == ["false", "true"]
    fresh = signed_in_cookie(stocked)
    assert raw_request(stocked, "GET", "/api/catalog", {"Cookie": fresh}).status == 200
    page = raw_request(stocked, "GET", "/", {"Cookie": fresh}).body
    assert b'formaction="/logout?everywhere=1"' in page
    cross = raw_request(stocked, "POST", "/logout?everywhere=1", {"Cookie": fresh,
                                                              "Sec-Fetch-Site": "cross-site"})
    assert cross.status == 403
    assert raw_request(stocked, "GET", "/api/catalog", {"Cookie": fresh}).status == 200


def test_rely_7_9_an_ended_session_stays_ended_across_a_restart(start_service):
    """Sessions live in the database: one signed out before a restart stays out after it,
    and one still open is still open."""
    service = start_service()
    kept, ended = signed_in_cookie(service), signed_in_cookie(service)
    assert raw_request(service, "POST", "/logout", {"Cookie": ended}).status == 303
    assert service.stop()
    again = start_service(data_dir=service.config.data_dir)
    assert raw_request(again, "GET", "/api/catalog", {"Cookie": kept}).status == 200
    assert raw_request(again, "GET", "/api/catalog", {"Cookie": ended}).status == 401


# -- RELY-7.10: a token anyone could guess is refused ----------------------------------------


@pytest.mark.parametrize("where", ["flag", "environment", "token file"])
def test_rely_7_10_serve_refuses_a_token_shorter_than_16_characters(where, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    command = [sys.executable, "-m", "healthlog", "serve", "--data", str(data),
               "--listen", "127.0.0.1:0"]
    env = dict(os.environ)
    if where == "flag":
        command += ["--token", "1"]
    elif where == "environment":
        env["HEALTHLOG_TOKEN"] = "short-token-15ch"[:15]
    else:
        (data / healthlog.TOKEN_NAME).write_text("0123456789abcde\n")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "a token needs at least 16 characters" in line and "random one" in line
    assert "0123456789abcde" not in line and "short-token" not in line
    assert not (data / healthlog.DB_NAME).exists() or where == "token file"


def test_rely_7_10_a_16_character_token_and_the_generated_one_are_taken(start_service):
    assert start_service(token="0123456789abcdef").address
    generated = start_service(token=None, data_dir=Path(tempfile.mkdtemp()) / "data")
    token = (generated.config.data_dir / healthlog.TOKEN_NAME).read_text().strip()
    assert len(token) >= 43  # 32 random bytes, URL-safe base64


# -- RELY-7.4: the token never written anywhere ---------------------------------------------


def test_rely_7_4_the_token_never_reaches_a_log_record_the_journal_or_an_answer(
        start_service, data_dir, tmp_path, logs):
    """WHEN the token is used rightly (Bearer, X-API-Key, sign-in form) and wrongly
    (extended, in the query string, in a cookie, in an over-long or malformed header)
    with logging at DEBUG, THEN no log record at any level, no byte of the SQLite files,
    no archived .meta.json, no other file and no answer (headers included) holds it."""
    service = start_service(log_level="DEBUG")
    answers = [
        ingest(service, canary_body()),
        raw_request(service, "POST", "/api/ingest/phone", dict(AUTOMATION, **{"X-API-Key": TOKEN}),
                    canary_body(value=2.5)),
        raw_request(service, "POST", "/api/ingest", {"Authorization": "Bearer " + TOKEN + "x"},
                    canary_body()),
        raw_request(service, "GET", "/api/catalog?token=" + TOKEN),
        raw_request(service, "GET", "/api/points?metric=%s&api_key=%s" % (METRIC, TOKEN),
                    token=True),
        raw_request(service, "GET", "/api/catalog", {"Cookie": "healthlog_session=" + TOKEN}),
        raw_request(service, "GET", "/metrics", {"X-API-Key": TOKEN + TOKEN}),
        raw_request(service, "POST", "/login",
                    {"Content-Type": "application/x-www-form-urlencoded"},
                    ("token=" + TOKEN).encode()),
        raw_request(service, "POST", "/login",
                    {"Content-Type": "application/x-www-form-urlencoded"},
                    ("token=" + TOKEN + "x").encode()),
        raw_request(service, "POST", "/login",
                    {"Content-Type": "application/x-www-form-urlencoded"},
                    ("token=" + TOKEN + "&" + "x" * 5000).encode()),
        raw_request(service, "GET", "/api/catalog", {"X-Padding": "p" * (70 << 10)}, token=True),
        raw_request(service, "GET", "/api/catalog", {"Bad Header Line": TOKEN}, token=True),
        raw_request(service, "POST", "/api/ingest", {"Content-Length": "x" + TOKEN}, b"{}",
                    token=True),
        raw_request(service, "POST", "/api/ingest", {"Content-Type": "text/csv"}, b"a,b",
                    token=True),
        raw_request(service, "GET", "/api/points?metric=" + TOKEN, token=True),
    ]
    drained(service)
    answers.append(raw_request(service, "GET", "/api/deliveries?limit=500", token=True))
    answers.append(raw_request(service, "GET", "/metrics", token=True))
    assert answers[0].status == answers[1].status == 200
    for answer in answers:
        assert TOKEN not in answer.text(), answer.text()[:500]
    assert any(" level=DEBUG " in line for line in logs.lines())
    for line in logs.lines():
        assert TOKEN not in line, "the token is logged: %s" % line
    service.stop()
    found = []
    for path in sorted(tmp_path.rglob("*")):
        if path.is_file() and TOKEN.encode() in path.read_bytes():
            found.append(str(path.relative_to(tmp_path)))
    assert not found, "files holding the token: %s" % found
    metas = list((data_dir / "archive").rglob("*.meta.json"))
    assert len(metas) == 2 and all(json.loads(m.read_text())["headers"] for m in metas)
    assert (data_dir / healthlog.DB_NAME).stat().st_size > 0
    assert not (data_dir / healthlog.TOKEN_NAME).exists()  # given, so never written


def test_rely_7_4_a_token_put_in_the_url_path_is_neither_logged_nor_stored(
        start_service, data_dir, tmp_path, logs):
    """WHEN a client puts the token in the URL path instead of a header (``/<token>``,
    ``/api/ingest/<token>``: a plausible HAE misconfiguration, and the token is a valid
    ingest name), THEN no log record, journal row or .meta.json holds the token."""
    service = start_service(log_level="DEBUG")
    raw_request(service, "GET", "/" + TOKEN)
    raw_request(service, "GET", "/api/catalog/" + TOKEN)
    raw_request(service, "POST", "/api/ingest/" + TOKEN, AUTOMATION, canary_body(), token=True)
    raw_request(service, "POST", "/api/ingest/" + TOKEN, AUTOMATION, canary_body())
    drained(service)
    leaks = [line for line in logs.lines() if TOKEN in line]
    service.stop()
    found = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                   if p.is_file() and TOKEN.encode() in p.read_bytes())
    assert not leaks and not found, "the token in the path is kept: logs %s, files %s" % (
        leaks, found)


# -- RELY-7.5: path-like names ---------------------------------------------------------------

HEADER_NAMES = ["../../etc/passwd", "..", "/etc/passwd", "a/b", "C:\\Windows\\win.ini",
                "%2e%2e%2f%2e%2e%2f", "../" * 80, "x" * 10000, b"nul\x00byte", "\u2028..\u2028",
                "~/.ssh/authorized_keys", "archive/../../escape", ".", "-rf"]
PATH_NAMES = ["..", "%2e%2e", "%2E%2E", ".", "...", "a/b", "a%2Fb", "a%2fb", "..%2F..%2Fescape",
              "%2e%2e%2f%2e%2e%2fescape", "../../escape", "%00", "a%00b", "a" * 65, "a" * 64,
              "%252e%252e", "~root", "-", "a\\b", "a%5Cb", "con", ".hidden", "x;y", "x%20y",
              "%c0%ae%c0%ae", "%e2%80%a8"]
STEM = re.compile(r"archive/\d{4}/\d{2}/\d{2}/\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{8}(\.meta)?\.json")


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


def test_rely_7_5_path_like_names_never_touch_the_file_system_outside_the_archive(
        start_service, data_dir, tmp_path):
    """WHEN automation headers carry path-like, NUL, separator or 10 000-character values
    and /api/ingest/<name> is asked with .., %2e%2e, slashes, encoded slashes, NUL and
    over-long names, THEN each answer is 200, 400 or 404, every new file is an archive
    body or .meta.json named by its receive time, nothing appears anywhere else under the
    temp tree, and an accepted name is stored as the name, not used as a path."""
    service = start_service()
    ingest(service, canary_body())  # the folders exist before the snapshot
    drained(service)
    outside = tmp_path.parent
    before, before_outside = _tree(tmp_path), set(os.listdir(str(outside)))
    body = b'{"data":{"metrics":[]}}'
    accepted = {}
    for name in HEADER_NAMES:
        for header in healthlog.AUTOMATION_HEADERS:
            answer = raw_request(service, "POST", "/api/ingest", dict(AUTOMATION, **{header: name}),
                                 body, token=True)
            assert answer.status in (200, 400), (header, name, answer.text())
            if answer.status == 200:
                accepted[json.loads(answer.body)["delivery_id"]] = (header, name)
    for name in PATH_NAMES:
        answer = raw_request(service, "POST", "/api/ingest/" + name, AUTOMATION, body, token=True)
        assert answer.status in (200, 400, 404), (name, answer.text())
        if answer.status == 200:
            name = urllib.parse.unquote(name)  # the server decodes the path
            accepted[json.loads(answer.body)["delivery_id"]] = ("path", name)
            assert re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name), name  # only valid names
    drained(service)
    service.stop()
    after = _tree(tmp_path)
    new = sorted(set(after) - set(before))
    strays = [p for p in new if not (p.startswith("data/archive/") and (
        STEM.fullmatch(p[len("data/"):]) or (tmp_path / p).is_dir()))]
    assert not strays, "files outside the archive: %s" % strays
    assert set(os.listdir(str(outside))) == before_outside
    assert not any((data_dir / "tmp").iterdir())
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
    try:
        rows = {row[0]: row[1:] for row in conn.execute(
            "SELECT id, path_name, automation_name, archive_path FROM delivery")}
    finally:
        conn.close()
    assert len([p for p in new if p.endswith(".meta.json")]) == len(accepted)
    for delivery_id, (where, name) in accepted.items():
        path_name, automation_name, archive_path = rows[delivery_id]
        assert STEM.fullmatch(archive_path), archive_path
        if where == "path":
            assert path_name == name
        elif where == "automation-name" and isinstance(name, str):
            assert automation_name == name.strip()[:healthlog.HEADER_VALUE_MAX]


# -- RELY-7.6: no health data in the log above DEBUG ---------------------------------------


def test_rely_7_6_no_value_or_device_name_reaches_a_log_record_above_debug(
        start_service, logs):
    """WHEN bodies with canary device names, values, a workout name, a medication and a
    symptom are folded, sent again changed (collisions), in other units (unit conflicts),
    with unreadable points and an unknown aggregation header (all WARNs), THEN those
    WARNs are written but no record above DEBUG holds a canary."""
    service = start_service(log_level="DEBUG")
    ingest(service, canary_body())
    drained(service)
    ingest(service, canary_body(value=VALUE + 1, bad=True))  # collisions, bad points
    ingest(service, canary_body(value=VALUE + 2, units="kcal"))  # units differ
    ingest(service, canary_body(value=VALUE + 3), {"automation-aggregation": "Fortnightly"})
    drained(service)
    records = logs.records()
    messages = {r["msg"] for r in records if r["level"] == "WARN"}
    for needed in ("collision", "units differ", "points without a readable time",
                   "names no known grouping"):
        assert any(needed in m for m in messages), (needed, messages)
    bad = [r for r in records if r["msg"].startswith("points without a readable time")]
    assert "medications/\u2026" in bad[0]["metrics"]  # named by section, not by content
    assert_no_leaks(logs.lines(), extra=CANARIES)
    assert any(r["level"] == "DEBUG" for r in records)


# -- RELY-7.7: headers of every answer, cookie flags -------------------------------------------


def test_rely_7_7_every_answer_carries_the_security_headers_and_cookies_are_httponly_samesite(
        stocked):
    """WHEN the page, the sign-in page, the API, static files, /healthz and errors are
    asked, THEN each answer has Content-Security-Policy (default-src 'none', no framing),
    X-Content-Type-Options: nosniff, Referrer-Policy: no-referrer and X-Frame-Options:
    DENY; the sign-in and sign-out cookies are HttpOnly; SameSite=Strict; Path=/, Secure
    only behind https, and hold no token."""
    cookie = signed_in_cookie(stocked)
    answers = {
        "sign-in page": raw_request(stocked, "GET", "/"),
        "dashboard": raw_request(stocked, "GET", "/", {"Cookie": cookie}),
        "catalog": raw_request(stocked, "GET", "/api/catalog", token=True),
        "points": raw_request(stocked, "GET", "/api/points?metric=" + METRIC, token=True),
        "csv": raw_request(stocked, "GET", "/api/points?format=csv&metric=" + METRIC, token=True),
        "deliveries": raw_request(stocked, "GET", "/api/deliveries", {"Cookie": cookie}),
        "metrics": raw_request(stocked, "GET", "/metrics", token=True),
        "static": raw_request(stocked, "GET", "/static/app.js"),
        "healthz": raw_request(stocked, "GET", "/healthz"),
        "ingest": raw_request(stocked, "POST", "/api/ingest", AUTOMATION, b'{"data":{}}',
                              token=True),
        "400": raw_request(stocked, "POST", "/api/ingest", AUTOMATION, b"[]", token=True),
        "401": raw_request(stocked, "GET", "/api/catalog"),
        "404": raw_request(stocked, "GET", "/nope"),
        "405": raw_request(stocked, "GET", "/api/ingest"),
        "415": raw_request(stocked, "POST", "/api/ingest", {"Content-Type": "text/csv"}, b"a",
                           token=True),
        "unknown metric": raw_request(stocked, "GET", "/api/points?metric=nope", token=True),
    }
    expected = dict(healthlog.SECURITY_HEADERS)
    assert "default-src 'none'" in expected["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in expected["Content-Security-Policy"]
    assert "unsafe-inline" not in expected["Content-Security-Policy"]
    for what, answer in answers.items():
        assert answer.headers.get("content-security-policy") == expected[
            "Content-Security-Policy"], what
        assert answer.headers.get("x-content-type-options") == "nosniff", what
        assert answer.headers.get("referrer-policy") == "no-referrer", what
        assert answer.headers.get("x-frame-options") == "DENY", what
        assert len(answer.all("content-security-policy")) == 1, what
    assert answers["dashboard"].status == answers["catalog"].status == 200
    for what in ("sign-in page", "dashboard", "catalog", "points", "deliveries", "metrics"):
        assert answers[what].headers.get("cache-control") == "no-store", what
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    plain = raw_request(stocked, "POST", "/login", form, ("token=" + TOKEN).encode())
    behind_tls = raw_request(stocked, "POST", "/login",
                             dict(form, **{"X-Forwarded-Proto": "https"}),
                             ("token=" + TOKEN).encode())
    signed_out = raw_request(stocked, "POST", "/logout", {"Cookie": cookie})
    for answer, secure in ((plain, False), (behind_tls, True), (signed_out, False)):
        [set_cookie] = answer.all("set-cookie")
        flags = [part.strip().lower() for part in set_cookie.split(";")[1:]]
        assert "httponly" in flags and "samesite=strict" in flags and "path=/" in flags, flags
        assert ("secure" in flags) is secure, flags
        assert TOKEN not in set_cookie
    assert "max-age=0" in signed_out.headers["set-cookie"].lower()
