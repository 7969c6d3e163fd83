"""Freshness (openspec/specs/freshness/spec.md): each automation's and metric's state, the
coverage of each local day, the notices of ``serve --notify``, and where a person sees them,
through a real Service (Cheroot on 127.0.0.1:0) and real HTTP.

Time is the service's injected clock (``Config.clock``), which the tests move: a delivery
is received at the clock's time and the states are judged against it, so no test waits for
a threshold to pass. Notices go to a real HTTP receiver on 127.0.0.1:0 written here, which
answers 200, answers 500, or never answers.

Bodies are built with tests/hae_factory.py (HAE's shapes, headers and timestamps: a phone
in Europe/Berlin); every expected value is computed here from what the test posted, in its
own words: the median of its own gaps, the thresholds by the spec's rule, the local hours
written in its own points.
"""

import datetime as dt
import http.server
import io
import json
import os
import re
import statistics
import subprocess
import sys
import threading

import pytest

import hae_factory as hf
import healthlog
from conftest import TOKEN, Client, Clock, LocalServer, db_rows, wait_for
from read_helpers import local_iso

PHONE = hf.Phone(zone=hf.BERLIN, sources="single")
T0 = dt.datetime(2025, 6, 2, 6, 0, tzinfo=dt.timezone.utc).timestamp()  # a Monday, 08:00 CEST
MIN, HOUR, DAY = 60, 3600, 86400
MINUTES = hf.Automation("Minutes", "Minutes", "Since Last Sync")
DAYS = hf.Automation("Days", "Days", "Today")
#: What a notice must never carry: the device names and values of the posted points, and
#: the token.
SECRETS = (hf.OWNER_WATCH, hf.CANARY_SOURCE, "Anton", "Zebulon", repr(hf.CANARY_QTY), "72.1",
           TOKEN)


class Receiver(LocalServer):
    """A notice receiver on 127.0.0.1:0: answers 200 (``ok``), 500 (``fail``) or nothing
    until it is closed (``hang``); keeps every request's headers and body."""

    def __init__(self, mode: str = "ok"):
        self.mode = mode
        self.requests = []
        self.release = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the standard library's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.requests.append((dict(self.headers), body))
                if receiver.mode == "hang":
                    receiver.release.wait(30)
                    return
                self.send_response(200 if receiver.mode == "ok" else 500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(Handler, name="test-receiver")

    @property
    def url(self) -> str:
        return self.origin + "/healthlog-topic"

    def notices(self) -> list:
        """(Title header or JSON title, body text) of each request, in arrival order."""
        out = []
        for headers, body in list(self.requests):
            text = body.decode("utf-8")
            if headers.get("Content-Type", "").startswith("application/json"):
                out.append((json.loads(text)["title"], text))
            else:
                out.append((headers.get("Title"), text))
        return out

    def close(self):
        self.release.set()
        super().close()


@pytest.fixture
def receivers():
    made = []

    def make(mode: str = "ok") -> Receiver:
        made.append(Receiver(mode))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


class PushingPhone:
    """A phone pushing through HAE automations into a started Service, at the clock's time."""

    def __init__(self, service, clock: Clock, data_dir):
        self.service, self.clock, self.data_dir = service, clock, data_dir
        self.client = Client(*service.address)
        self.posted = []  # (automation, received at, {metric: [points]})

    def post(self, automation, metrics: dict, at: float, path: str = "/api/ingest",
             headers: bool = True) -> int:
        self.clock.now = at
        body = hf.dumps_hae(hf.envelope(metrics=[hf.metric(name, points)
                                                 for name, points in metrics.items()]))
        status, answer = self.client.ingest(
            body, path=path, headers=hf.headers_for(automation) if headers
            else {"Content-Type": "application/json"})
        assert status == 200, answer
        self.posted.append((automation, at, metrics))
        wanted = answer["delivery_id"]
        wait_for(lambda: all(r["parse_status"] != "pending" for r in db_rows(self.data_dir)
                             if r["id"] <= wanted), what="delivery %d folded" % wanted)
        # Judged once at the delivery's time, as serve's notifier judges between two real
        # deliveries minutes apart: a notice is due on a change the notifier saw, and its
        # thread (every 50 ms here) may not run between two deliveries a busy machine
        # posts in a few milliseconds.
        self.freshness()
        return wanted

    def get(self, path: str):
        status, answer = self.client.request("GET", path)
        assert status == 200, answer
        return answer

    def freshness(self, at: float = None) -> dict:
        if at is not None:
            self.clock.now = at
        return self.get("/api/freshness")

    def states(self, at: float = None) -> dict:
        fresh = self.freshness(at)
        out = {a["name"] or a["id"]: a["state"] for a in fresh["automations"]}
        out.update(("%s/%s" % (m["metric"], m["layer"]), m["state"]) for m in fresh["metrics"])
        return out


def points_every(name: str, start: float, end: float, every: float = MIN, phone=PHONE,
                 source: str = hf.OWNER_WATCH) -> list:
    """HAE points of ``name`` at ``start``, ``start + every``, … before ``end``."""
    out = []
    at = start
    while at < end:
        if name == "heart_rate":
            fields = {"Min": 61, "Avg": hf.CANARY_QTY, "Max": 88}
        else:
            fields = {"qty": hf.CANARY_QTY}
        point = {"date": phone.time(at)}
        point.update(fields)
        point["source"] = source
        out.append(point)
        at += every
    return out


def utc_text(epoch: float) -> str:
    """The journal's time (a last delivery is a received_at: six digits of microseconds,
    READ-5.6), written here from the epoch."""
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def berlin_text(epoch: float) -> str:
    """An instant on the phone's clock (Europe/Berlin in June: +02:00), as the server writes
    a local time: ``2025-06-02T08:10:00+02:00``."""
    return dt.datetime.fromtimestamp(epoch, dt.timezone(dt.timedelta(hours=2))).isoformat()


def median_gap(times: list) -> float:
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def moment_median(gaps: list) -> float:
    """The spec's usual spacing: the gap at which the gaps no longer than it cover half of
    the time all of them cover."""
    covered = 0
    for gap in sorted(gaps):
        covered += gap
        if 2 * covered >= sum(gaps):
            return gap


def threshold(usual: float, late_after: float) -> float:
    """The spec's rule: three usual intervals, never less than --late-after."""
    return max(3 * usual, late_after)


def start(start_service, clock, data_dir, **overrides) -> PushingPhone:
    # A notice's timeout as serve's (10 s): a receiver that answers late on a busy machine
    # would else be posted the same notice again (a retry after a timeout).
    values = dict(clock=clock, freshness_check_s=0.05, notify_timeout_s=10.0,
                  notify_retry_s=(0.05, 0.1, 0.2))
    values.update(overrides)
    return PushingPhone(start_service(**values), clock, data_dir)


def no_secrets(receiver: Receiver) -> None:
    for headers, body in receiver.requests:
        text = json.dumps(headers) + body.decode("utf-8")
        for secret in SECRETS:
            assert secret not in text, "a notice carries %r: %s" % (secret, text)


# ---------------------------------------------------------------------------------------
# Automations


def test_fresh_1_1_an_automation_that_stops_is_late_after_its_threshold_once_and_back_once(
        start_service, data_dir, receivers, logs):
    clock, receiver = Clock(T0), receivers("ok")
    late_after = 45 * MIN
    phone = start(start_service, clock, data_dir, notify_url=receiver.url,
                  late_after_s=late_after)
    times = [T0 + k * 5 * MIN for k in range(6)]
    for at in times:
        phone.post(MINUTES, {"heart_rate": points_every("heart_rate", at - 5 * MIN, at),
                             "step_count": points_every("step_count", at - 5 * MIN, at, 2 * MIN)},
                   at)
    usual = median_gap(times)
    assert usual == 300
    limit = threshold(usual, late_after)  # 45 min: --late-after is longer than 3 x 5 min
    fresh = phone.freshness(times[-1] + limit)
    [automation] = fresh["automations"]
    assert automation == {"id": MINUTES.id, "name": "Minutes",
                          "last_delivery": utc_text(times[-1]), "usual_interval_s": usual,
                          "state": "on_time"}
    newest = points_every("heart_rate", times[-1] - 5 * MIN, times[-1])[-1]["date"]
    assert {(m["metric"], m["layer"]): (m["newest_point"], m["state"])
            for m in fresh["metrics"]}[("heart_rate", "minutes")] == (local_iso(newest), "fresh")
    assert phone.states(times[-1] + limit + 1)["Minutes"] == "late"
    [(title, body)] = wait_for(receiver.notices, what="the late notice")
    assert title == "healthlog: 'Minutes' is late"
    assert "Minutes" in body and "Manual Export" in body and "re-send is always safe" in body
    assert "2025-06-02" in body  # the dates to export: its last delivery's day, and today
    assert logs.find("an automation is late", "WARN")
    # Back: one more notice, and no second "late" before it (the receiver keeps the order).
    back = times[-1] + limit + 2 * HOUR
    phone.post(MINUTES, {"heart_rate": points_every("heart_rate", back - 5 * MIN, back),
                         "step_count": points_every("step_count", back - 5 * MIN, back, 2 * MIN)},
               back)
    assert phone.states()["Minutes"] == "on_time"
    notices = wait_for(lambda: receiver.notices() if len(receiver.notices()) >= 2 else None,
                       what="the notice that it is back")
    assert [title for title, _ in notices] == ["healthlog: 'Minutes' is late",
                                               "healthlog: 'Minutes' is back"]
    # on the phone's clock, as every notice speaks (FRESH-1.5): 06:25 UTC is 08:25 in Berlin
    assert notices[0][1].startswith(
        "'Minutes' has sent nothing since Mon 2025-06-02 08:25 +02:00")
    assert "delivered again" in notices[1][1]
    no_secrets(receiver)
    assert receiver.requests[0][0]["Content-Type"].startswith("text/plain")
    # a metric whose automation stopped is not stale: the automation's notice says it all
    assert not any("stopped" in title for title, _ in receiver.notices())


def test_fresh_1_2_of_two_automations_only_the_one_that_stops_is_late(
        start_service, data_dir, receivers):
    clock, receiver = Clock(T0), receivers("ok")
    late_after = HOUR
    phone = start(start_service, clock, data_dir, notify_url=receiver.url,
                  late_after_s=late_after)
    minute_times = [T0 + k * 5 * MIN for k in range(6)]
    day_times = [T0 + k * 20 * MIN for k in range(10)]  # every 20 min for 3 h
    today = hf.local_midnight(hf.BERLIN, dt.date(2025, 6, 2))
    for at in sorted(set(minute_times) | set(day_times)):
        if at in minute_times:
            phone.post(MINUTES, {"step_count": points_every("step_count", at - 5 * MIN, at)}, at)
        if at in day_times:  # today so far and the two days before (a day apart)
            phone.post(DAYS, {"step_count": [points_every("step_count", today - k * DAY,
                                                          today - k * DAY + 1)[0]
                                             for k in (2, 1, 0)]}, at)
    limits = {"Minutes": threshold(median_gap(minute_times), late_after),
              "Days": threshold(median_gap(day_times), late_after)}
    assert limits == {"Minutes": HOUR, "Days": HOUR}
    # Minutes stopped at 25 min; Days went on until 3 h: only Minutes is late.
    states = phone.states(day_times[-1] + 1)
    assert states == {"Minutes": "late", "Days": "on_time", "step_count/minutes": "fresh",
                      "step_count/days": "fresh"}
    fresh = phone.freshness()
    assert {a["name"]: a["usual_interval_s"] for a in fresh["automations"]} == {
        "Minutes": 300, "Days": 1200}
    assert [title for title, _ in wait_for(receiver.notices, what="a notice")] == [
        "healthlog: 'Minutes' is late"]
    # Days is late once it too is silent longer than its own threshold.
    assert phone.states(day_times[-1] + limits["Days"] + 1)["Days"] == "late"
    notices = wait_for(lambda: receiver.notices() if len(receiver.notices()) >= 2 else None,
                       what="the second notice")
    assert [title for title, _ in notices] == ["healthlog: 'Minutes' is late",
                                               "healthlog: 'Days' is late"]


def test_fresh_1_3_without_headers_the_path_names_the_automation_then_one_anonymous(
        start_service, data_dir):
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir, late_after_s=HOUR)
    nightly = [T0 + k * 10 * MIN for k in range(4)]
    anonymous = [T0 - 31 * MIN + k * 15 * MIN for k in range(3)]
    for at, path in sorted([(at, "/api/ingest/nightly") for at in nightly]
                           + [(at, "/api/ingest") for at in anonymous]):
        phone.post(None, {"step_count": points_every("step_count", at - 2 * MIN, at)}, at,
                   path=path,
                   headers=False)
    fresh = phone.freshness(max(nightly + anonymous) + MIN)
    assert sorted(fresh["automations"], key=lambda a: a["id"]) == [
        {"id": "/api/ingest", "name": None, "last_delivery": utc_text(anonymous[-1]),
         "usual_interval_s": median_gap(anonymous), "state": "on_time"},
        {"id": "/api/ingest/nightly", "name": "nightly", "last_delivery": utc_text(nightly[-1]),
         "usual_interval_s": median_gap(nightly), "state": "on_time"}]
    # A header-less automation is judged like any other.
    states = phone.states(anonymous[-1] + threshold(median_gap(anonymous), HOUR) + 1)
    assert states["/api/ingest"] == "late"
    assert states["nightly"] == "on_time"  # its threshold ends half an hour later


def test_fresh_1_5_an_automation_that_writes_nothing_new_is_told_its_dates_on_the_phones_clock(
        start_service, data_dir, receivers):
    """A phone in Los Angeles (-08:00 in December): 'Health' sends heart rate every hour, and
    a safety net ('Previous 7 Days') re-sends the same points, so its runs write nothing new
    and it carries no metric. It stops at 12:00 on the phone; at 17:38 on the phone (01:38
    UTC the next day) it is late, and every word said of it is on the phone's clock: its
    last delivery at 12:00 -08:00, and the day to export is the phone's 2026-12-05 only,
    not the UTC 2026-12-06; the status and the coverage calendar's today agree."""
    clock, receiver = Clock(T0), receivers("ok")
    phone = start(start_service, clock, data_dir, notify_url=receiver.url, late_after_s=HOUR)
    la = hf.Phone(zone=hf.PACIFIC, sources="single")
    health = hf.Automation("Health", "Minutes", "Since Last Sync")
    net = hf.Automation("Safety net", "Minutes", "Previous 7 Days")
    first = dt.datetime(2026, 12, 5, 16, 0, tzinfo=dt.timezone.utc).timestamp()  # 08:00 there
    for k in range(10):  # 08:00 to 17:00 on the phone
        at = first + k * HOUR
        sent = {"heart_rate": points_every("heart_rate", at - HOUR, at, 10 * MIN, phone=la)}
        phone.post(health, sent, at)
        if k <= 4:  # the safety net re-sends what Health wrote, until 12:00 on the phone
            phone.post(net, sent, at + MIN)
    carriers = {(m["metric"], m["layer"]) for m in phone.freshness()["metrics"]}
    assert carriers == {("heart_rate", "minutes")}
    last_net = first + 4 * HOUR + MIN  # 12:01 -08:00, 20:01 UTC
    now = dt.datetime(2026, 12, 6, 1, 38, tzinfo=dt.timezone.utc).timestamp()
    fresh = phone.freshness(now)
    states = {a["name"]: (a["state"], a["last_delivery"]) for a in fresh["automations"]}
    assert states == {"Health": ("on_time", utc_text(first + 9 * HOUR)),
                      "Safety net": ("late", utc_text(last_net))}
    [(title, body)] = wait_for(receiver.notices, what="the late notice")
    assert title == "healthlog: 'Safety net' is late"
    assert "has sent nothing since Sat 2026-12-05 12:01 -08:00" in body
    assert "export 2026-12-05." in body and "2026-12-06" not in body and "UTC" not in body
    status = healthlog.collect_status(healthlog.Config(data_dir=data_dir, late_after_s=HOUR,
                                                       clock=lambda: now))
    [notice] = status["attention"]
    assert notice["since"] == "2026-12-05T12:01:00-08:00"
    assert notice["action"].endswith("and export 2026-12-05. A re-send is always safe here:"
                                     " healthlog keeps each point once.")
    assert phone.get("/api/coverage")["today"] == "2026-12-05"


def nightly_deliveries(phone: PushingPhone) -> list:
    """Three header-less deliveries of steps to /api/ingest/nightly, ten minutes apart from
    T0; their times."""
    times = [T0 + k * 10 * MIN for k in range(3)]
    for at in times:
        phone.post(None, {"step_count": points_every("step_count", at - 2 * MIN, at)}, at,
                   path="/api/ingest/nightly", headers=False)
    return times


def import_as_nightly(phone: PushingPhone, export, points: list, saved: float = None) -> None:
    """``healthlog import --name nightly`` of a Manual Export of these steps (the file's
    time ``saved`` when given: its place in the journal), waited for until folded."""
    export.write_bytes(hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", points)])))
    if saved is not None:
        os.utime(str(export), (saved, saved))
    rows = len(db_rows(phone.data_dir)) + 1
    assert healthlog.run_import(phone.service.config, [str(export)], "Minutes", "nightly",
                                out=io.StringIO()) == 0
    phone.service.worker.wake()
    wait_for(lambda: [r["parse_status"] for r in db_rows(phone.data_dir)] == ["parsed"] * rows,
             what="the import folded")


def test_fresh_1_4_imports_are_not_an_automations_deliveries(start_service, data_dir,
                                                             tmp_path):
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir, late_after_s=HOUR)
    times = nightly_deliveries(phone)
    before = phone.freshness(times[-1] + 5 * MIN)
    # A Manual Export of newer points, imported by hand with the same name, whose file is
    # newer than every delivery: its points count, it is no delivery of "nightly".
    newest = times[-1] + 3 * MIN
    import_as_nightly(phone, tmp_path / "export.json",
                      points_every("step_count", newest - MIN, newest + 1))
    after = phone.freshness()
    assert after["automations"] == before["automations"]
    [metric] = after["metrics"]
    assert metric["newest_point"] == local_iso(PHONE.time(newest))


def test_fresh_1_6_an_import_is_told_apart_once_a_late_disk_is_mounted(
        start_service, data_dir, tmp_path):
    """An import's ``.meta.json`` is on the archive's disk: while serve waits for that disk
    the import looks like a delivery of the path it was imported under, and once the disk
    is mounted freshness is again what it was before (not for as long as serve runs)."""
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir, late_after_s=HOUR)
    times = nightly_deliveries(phone)
    saved = times[-1] + 4 * MIN  # the export's file time: its place in the journal
    import_as_nightly(phone, tmp_path / "export.json",
                      points_every("step_count", T0 - DAY, T0 - DAY + 1), saved)
    judged_at = times[-1] + 5 * MIN
    before = phone.freshness(judged_at)
    assert [(a["id"], a["last_delivery"]) for a in before["automations"]] == [
        ("/api/ingest/nightly", utc_text(times[-1]))]
    assert phone.service.stop()
    archive, disk = data_dir / healthlog.ARCHIVE_DIR, tmp_path / "the-disk"
    archive.rename(disk)  # the disk is not mounted when serve starts
    again = PushingPhone(start_service(clock=clock, late_after_s=HOUR), clock, data_dir)
    away = again.freshness()
    assert [a["last_delivery"] for a in away["automations"]] == [utc_text(saved)]
    disk.rename(archive)  # mounted
    assert again.freshness() == before


# ---------------------------------------------------------------------------------------
# Metrics


def test_fresh_2_1_a_metric_that_stops_while_its_automation_delivers_is_stale_once(
        start_service, data_dir, receivers):
    clock, receiver = Clock(T0), receivers("ok")
    late_after = HOUR
    phone = start(start_service, clock, data_dir, notify_url=receiver.url,
                  late_after_s=late_after)
    # First delivery: four weekly weigh-ins (the last two days ago) and the morning so far.
    weighed = [T0 - 2 * DAY - k * 7 * DAY for k in range(4)]
    phone.post(MINUTES, {"weight_body_mass": [points_every("weight_body_mass", at, at + 1)[0]
                                              for at in sorted(weighed)],
                         "heart_rate": points_every("heart_rate", T0 - HOUR, T0),
                         "step_count": points_every("step_count", T0 - HOUR, T0, 5 * MIN)}, T0)
    # Then every 15 minutes: steps always, heart rate only for the first half hour (the
    # Watch taken off).
    times = [T0 + k * 15 * MIN for k in range(1, 11)]
    hr_until = T0 + 30 * MIN
    for at in times:
        metrics = {"step_count": points_every("step_count", at - 15 * MIN, at, 5 * MIN)}
        if at <= hr_until:
            metrics["heart_rate"] = points_every("heart_rate", at - 15 * MIN, at)
        phone.post(MINUTES, metrics, at)
    newest_hr = hr_until - MIN  # a point every minute up to the delivery
    hr_limit = threshold(60, late_after)  # points a minute apart: --late-after
    weight_limit = threshold(7 * DAY, late_after)  # 21 days: a weekly weigh-in
    # Not stale until a delivery comes after the deadline: the one at hr_until + 75 min.
    deliveries_after = [at for at in times if at > newest_hr + hr_limit]
    assert deliveries_after  # the automation kept delivering past the deadline
    states = phone.states(times[-1])
    assert states == {"Minutes": "on_time", "heart_rate/minutes": "stale",
                      "step_count/minutes": "fresh", "weight_body_mass/minutes": "fresh"}
    assert T0 - weighed[0] + (times[-1] - T0) < weight_limit
    [(title, body)] = wait_for(receiver.notices, what="the stale notice")
    assert title == "healthlog: Heart rate (minutes) has stopped"
    assert body.startswith("Heart rate (minutes): nothing since Mon 2025-06-02 08:29 +02:00"
                           " while 'Minutes' keeps delivering.")
    assert "Manual Export" in body and "2025-06-02" in body
    # The Watch is back: one notice, and nothing else was said in between.
    back = times[-1] + 15 * MIN
    phone.post(MINUTES, {"heart_rate": points_every("heart_rate", back - 15 * MIN, back),
                         "step_count": points_every("step_count", back - 15 * MIN, back, 5 * MIN)},
               back)
    assert phone.states()["heart_rate/minutes"] == "fresh"
    notices = wait_for(lambda: receiver.notices() if len(receiver.notices()) >= 2 else None,
                       what="the notice that heart rate is back")
    assert [title for title, _ in notices] == ["healthlog: Heart rate (minutes) has stopped",
                                               "healthlog: Heart rate (minutes) is back"]
    no_secrets(receiver)


def test_fresh_2_2_a_weekly_metric_is_stale_only_after_three_of_its_weeks(
        start_service, data_dir):
    clock = Clock(T0)
    late_after = 6 * HOUR
    phone = start(start_service, clock, data_dir, late_after_s=late_after)
    weighed = sorted(T0 - k * 7 * DAY for k in range(5))
    phone.post(MINUTES, {"weight_body_mass": [points_every("weight_body_mass", at, at + 1)[0]
                                              for at in weighed]}, T0)
    limit = threshold(median_gap(weighed), late_after)
    assert limit == 21 * DAY
    # The automation delivers (steps), the scale stays unused.
    days = [T0 + k * DAY for k in (1, 10, 20, 21, 22)]
    for at in days:
        phone.post(MINUTES, {"step_count": points_every("step_count", at - HOUR, at, 10 * MIN)}, at)
    expected = {}
    for at in days:
        expected[at] = "stale" if at > weighed[-1] + limit else "fresh"
    seen = {at: phone.states(at)["weight_body_mass/minutes"] for at in days}
    assert seen == expected
    assert list(seen.values()) == ["fresh"] * 4 + ["stale"]


def test_fresh_2_3_a_delivery_not_folded_yet_says_nothing_of_what_it_carries(
        start_service, data_dir, receivers):
    clock, receiver = Clock(T0), receivers("ok")
    service = start_service(paused=True, clock=clock, freshness_check_s=0.05,
                            notify_url=receiver.url, late_after_s=HOUR)
    phone = PushingPhone(service, clock, data_dir)
    service.worker.gate.set()
    times = [T0 + k * 15 * MIN for k in range(4)]
    for at in times:
        phone.post(MINUTES, {"heart_rate": points_every("heart_rate", at - 15 * MIN, at)}, at)
    late = times[-1] + 2 * HOUR  # past heart rate's deadline (a point a minute: 1 h)
    service.worker.hold()  # the fold waits: the next delivery stays pending
    clock.now = late
    status, answer = phone.client.ingest(
        hf.dumps_hae(hf.envelope(metrics=[hf.metric("heart_rate", points_every(
            "heart_rate", late - 15 * MIN, late))])), headers=hf.headers_for(MINUTES))
    assert status == 200 and answer["status"] == "pending"
    states = phone.states()
    assert states == {"Minutes": "on_time", "heart_rate/minutes": "fresh"}
    service.worker.gate.set()
    wait_for(lambda: all(r["parse_status"] == "parsed" for r in db_rows(data_dir)),
             what="the delivery folded")
    assert phone.states()["heart_rate/minutes"] == "fresh"
    # A delivery without it, once folded past its threshold, does say it stopped: the
    # usual spacing is the gap a moment of its time falls in (here the 1 h 46 min pause).
    starts = sorted({at for a in times + [late] for at in range(int(a - 15 * MIN), int(a), MIN)})
    usual = moment_median([b - a for a, b in zip(starts, starts[1:])])
    assert usual == (late - 15 * MIN) - (times[-1] - MIN)  # the pause
    after = starts[-1] + threshold(usual, HOUR) + MIN
    phone.post(MINUTES, {"step_count": points_every("step_count", after - 5 * MIN, after)}, after)
    assert phone.states()["heart_rate/minutes"] == "stale"
    # (Minutes itself was late for a moment: five silent hours, then that delivery.)
    about_hr = wait_for(lambda: [t for t, _ in receiver.notices() if "Heart rate" in t],
                        what="the notice of heart rate")
    assert about_hr == ["healthlog: Heart rate (minutes) has stopped"]


# ---------------------------------------------------------------------------------------
# Notices


def late_once(phone: PushingPhone, late_after: float) -> float:
    """Three deliveries five minutes apart, then the clock past their threshold; returns
    the moment judged."""
    times = [T0 + k * 5 * MIN for k in range(3)]
    for at in times:
        phone.post(MINUTES, {"step_count": points_every("step_count", at - 5 * MIN, at)}, at)
    when = times[-1] + threshold(median_gap(times), late_after) + 1
    assert phone.states(when)["Minutes"] == "late"
    return when


def test_fresh_3_1_a_notifier_that_answers_500_is_retried_and_ingest_goes_on(
        start_service, data_dir, receivers, logs):
    clock, receiver = Clock(T0), receivers("fail")
    phone = start(start_service, clock, data_dir, notify_url=receiver.url, late_after_s=HOUR,
                  notify_retry_s=(0.05,) * 200)
    when = late_once(phone, HOUR)
    wait_for(lambda: len(receiver.requests) >= 3, what="three attempts")
    assert len({body for _, body in receiver.requests}) == 1  # the same notice each time
    warns = logs.find("notice not delivered", "WARN")
    assert warns and warns[0]["error"] == "http_500" and "retry_in_s" in warns[0]
    assert receiver.url not in "\n".join(logs.lines())  # the address may hold a secret
    # Ingest and the fold go on while the notice fails.
    phone.post(DAYS, {"step_count": points_every("step_count", when - HOUR, when)}, when + 1)
    # (the receiver keeps a request before it answers; the failure counts once answered)
    text = wait_for(lambda: (lambda t: int(re.search(
        r"^healthlog_notice_failures_total (\d+)$", t, re.M).group(1)) >= 3 and t)(
        phone.client.request("GET", "/metrics")[1].decode()), what="three failures counted")
    assert "healthlog_notices_sent_total 0" in text
    receiver.mode = "ok"
    wait_for(lambda: "healthlog_notices_sent_total 1" in phone.client.request(
        "GET", "/metrics")[1].decode(), what="the notice sent once the receiver takes it")


def test_fresh_3_2_a_notifier_that_hangs_never_holds_ingest_or_the_fold(
        start_service, data_dir, receivers, logs):
    clock, receiver = Clock(T0), receivers("hang")
    phone = start(start_service, clock, data_dir, notify_url=receiver.url, late_after_s=HOUR,
                  notify_timeout_s=0.3)
    when = late_once(phone, HOUR)
    wait_for(lambda: receiver.requests, what="the notice under way")
    # While the notifier waits for an answer, a delivery is answered and folded.
    phone.post(DAYS, {"step_count": points_every("step_count", when - HOUR, when)}, when + 1)
    wait_for(lambda: [r for r in logs.find("notice not delivered", "WARN")
                      if r["error"] == "timeout"], what="the timeout's WARN")
    wait_for(lambda: len(receiver.requests) >= 2, what="a retry")


def test_fresh_3_3_a_json_notice_is_one_object_of_names_and_times(
        start_service, data_dir, receivers):
    clock, receiver = Clock(T0), receivers("ok")
    phone = start(start_service, clock, data_dir, notify_url=receiver.url, late_after_s=HOUR,
                  notify_format="json")
    late_once(phone, HOUR)
    [(headers, body)] = wait_for(lambda: list(receiver.requests), what="the notice")
    assert headers["Content-Type"] == "application/json"
    notice = json.loads(body)
    assert notice == {
        "kind": "automation", "subject": MINUTES.id, "state": "late",
        "title": "healthlog: 'Minutes' is late", "text": notice["text"],
        "action": notice["action"], "since": berlin_text(T0 + 10 * MIN)}
    assert "Manual Export" in notice["action"]
    no_secrets(receiver)


class BacklogFirstWorker(healthlog.FoldWorker):
    """The real fold worker, whose ``start()`` returns only once its first pass has folded
    what was waiting: the fastest a backlog can be folded after a start."""

    def start(self) -> None:
        super().start()
        wait_for(lambda: all(r["parse_status"] != "pending"
                             for r in db_rows(self._config.data_dir)), what="the backlog folded")


def test_fresh_3_4_a_restart_repeats_no_notice_and_misses_none(start_service, data_dir,
                                                                receivers, logs):
    """'Days' is late and told so; a 'Minutes' delivery that stops heart rate is journaled
    but not folded when serve stops. The next serve says nothing again of 'Days', and tells
    of heart rate once its backlog is folded, even when that fold ends before a notifier
    thread could first judge: the states judged at a start are the store as it was found."""
    clock, receiver = Clock(T0), receivers("ok")
    settings = dict(clock=clock, notify_url=receiver.url, late_after_s=HOUR,
                    freshness_check_s=0.05, notify_timeout_s=10.0,
                    notify_retry_s=(0.05, 0.1, 0.2))
    service = start_service(paused=True, **settings)
    service.worker.gate.set()
    phone = PushingPhone(service, clock, data_dir)
    day_times = [T0 + k * 20 * MIN for k in range(3)]
    hr_times = [T0 + k * 15 * MIN for k in range(3)]
    steps_times = [T0 + k * 15 * MIN for k in range(3, 5)]
    for at in sorted(day_times + hr_times + steps_times):
        if at in day_times:
            phone.post(DAYS, {"step_count": points_every("step_count", at - MIN, at)}, at)
        if at in hr_times:
            phone.post(MINUTES, {"heart_rate": points_every("heart_rate", at - 15 * MIN, at)},
                       at)
        if at in steps_times:
            phone.post(MINUTES, {"step_count": points_every("step_count", at - 15 * MIN, at,
                                                            5 * MIN)}, at)
    days_late = day_times[-1] + threshold(median_gap(day_times), HOUR) + MIN
    hr_deadline = hr_times[-1] - MIN + threshold(60, HOUR)  # its newest point + 1 h
    assert steps_times[-1] < hr_deadline < days_late
    assert phone.states(days_late) == {"Days": "late", "Minutes": "on_time",
                                       "heart_rate/minutes": "fresh",
                                       "step_count/days": "fresh",
                                       "step_count/minutes": "fresh"}
    wait_for(receiver.notices, what="the late notice")
    # A delivery past heart rate's deadline, without it, waits unfolded when serve stops.
    service.worker.hold()
    status, answer = phone.client.ingest(hf.dumps_hae(hf.envelope(metrics=[hf.metric(
        "step_count", points_every("step_count", days_late - 15 * MIN, days_late,
                                   5 * MIN))])), headers=hf.headers_for(MINUTES))
    assert status == 200 and answer["status"] == "pending"
    assert service.stop()
    started = len(logs.find("notices on", "INFO"))
    again = PushingPhone(start_service(worker=BacklogFirstWorker, **settings), clock, data_dir)
    baseline = logs.find("notices on", "INFO")[started:]
    assert [(r["late"], r["stale"]) for r in baseline] == [("1", "0")]
    assert again.states()["heart_rate/minutes"] == "stale"
    notices = wait_for(lambda: receiver.notices() if len(receiver.notices()) >= 2 else None,
                       what="the notice of heart rate")
    assert [title for title, _ in notices] == ["healthlog: 'Days' is late",
                                               "healthlog: Heart rate (minutes) has stopped"]
    no_secrets(receiver)


# ---------------------------------------------------------------------------------------
# Rebuilt by reindex


def test_fresh_4_1_reindex_leaves_freshness_and_coverage_as_they_were(start_service, data_dir,
                                                                      make_config):
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir, late_after_s=HOUR)
    for k in range(4):
        at = T0 + k * 10 * MIN
        metrics = {"step_count": points_every("step_count", at - 10 * MIN, at, 2 * MIN)}
        if k < 2:
            metrics["heart_rate"] = points_every("heart_rate", at - 10 * MIN, at)
        phone.post(MINUTES, metrics, at)
    today = hf.local_midnight(hf.BERLIN, dt.date(2025, 6, 2))
    for k in range(3):
        phone.post(DAYS, {"step_count": points_every("step_count", today - k * DAY,
                                                     today - k * DAY + 1)},
                   T0 + k * 7 * MIN)
    phone.post(None, {"step_count": points_every("step_count", T0, T0 + MIN)}, T0 + 3 * MIN,
               path="/api/ingest/nightly", headers=False)
    clock.now = T0 + 5 * HOUR
    reads = ("/api/freshness", "/api/coverage", "/api/coverage?tz=UTC")
    before = [phone.get(path) for path in reads]
    assert {a["state"] for a in before[0]["automations"]} >= {"late", "new"}
    assert phone.service.stop()
    assert healthlog.run_reindex(make_config(), out=io.StringIO()) == 0
    again = PushingPhone(start_service(clock=clock, late_after_s=HOUR), clock, data_dir)
    assert [again.get(path) for path in reads] == before


# ---------------------------------------------------------------------------------------
# Coverage


def test_fresh_5_1_coverage_counts_local_hours_and_days_with_a_missing_and_a_thin_day(
        start_service, data_dir):
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir)
    first = dt.date(2025, 5, 26)
    days = [first + dt.timedelta(days=k) for k in range(8)]
    missing, thin = days[3], days[5]
    posted = {}  # local date text -> set of local hours written
    instants = []  # every heart-rate point's start, epoch seconds
    for day in days:
        midnight = hf.local_midnight(hf.BERLIN, day)
        hours = [] if day == missing else range(9, 12) if day == thin else range(7, 23)
        hr = [p for h in hours for p in points_every("heart_rate", midnight + h * HOUR,
                                                     midnight + h * HOUR + 20 * MIN, 10 * MIN)]
        for p in hr:
            posted.setdefault(p["date"][:10], set()).add(p["date"][11:13])
            instants.append(dt.datetime.strptime(p["date"], "%Y-%m-%d %H:%M:%S %z").timestamp())
        metrics = {"heart_rate": hr} if hr else {"step_count": []}
        phone.post(MINUTES, metrics, midnight + 23 * HOUR)
        if day != missing:
            phone.post(DAYS, {"step_count": points_every("step_count", midnight, midnight + 1)},
                       midnight + 23 * HOUR + MIN)
    clock.now = hf.local_midnight(hf.BERLIN, days[-1]) + 23 * HOUR + 30 * MIN
    answer = phone.get("/api/coverage?from=%s&to=%s" % (first, days[-1]))  # both in
    dates = [day.isoformat() for day in days]
    assert answer["days"] == dates and answer["today"] == dates[-1] and answer["tz"] == "local"
    assert (answer["from"], answer["to"]) == (dates[0], dates[-1])
    rows = {(r["metric"], r["layer"]): r for r in answer["rows"]}
    hr = rows[("heart_rate", "minutes")]
    counts = [len(posted.get(date, ())) for date in dates]
    assert hr["kind"] == "hours" and hr["values"] == counts
    usual = statistics.median([c for c in counts[:-1] if c])
    expected = []
    for date, count in zip(dates, counts):
        expected.append("today" if date == dates[-1] else "missing" if not count
                        else "thin" if count < usual / 2 else "ok")
    assert hr["states"] == expected
    assert expected.count("missing") == 1 and expected.count("thin") == 1
    assert [(g["from"], g["to"], g["states"]) for g in hr["gaps"]] == [
        (missing.isoformat(), missing.isoformat(), ["missing"]),
        (thin.isoformat(), thin.isoformat(), ["thin"])]
    assert "Manual Export" in hr["gaps"][0]["action"] and hr["automation"] == "Minutes"
    steps = rows[("step_count", "days")]
    assert steps["kind"] == "present"
    assert steps["values"] == [day != missing for day in days]
    assert steps["states"][3] == "missing" and steps["gaps"][0]["from"] == missing.isoformat()
    # One action per automation and run of days: a Manual Export sends all its metrics.
    assert [(f["automation"], f["from"], f["to"], f["metrics"]) for f in answer["fill"]] == [
        ("Days", missing.isoformat(), missing.isoformat(), ["Steps (days)"]),
        ("Minutes", missing.isoformat(), missing.isoformat(), ["Heart rate (minutes)"]),
        ("Minutes", thin.isoformat(), thin.isoformat(), ["Heart rate (minutes)"])]
    # In UTC the same points fall on the same dates here (07:00-23:00 CEST is 05:00-21:00 UTC)
    # but in other hours.
    utc = phone.get("/api/coverage?from=%s&to=%s&tz=UTC" % (first, days[-1]))
    assert {(r["metric"], r["layer"]): r["values"] for r in utc["rows"]}[
        ("heart_rate", "minutes")] == counts
    # India's half-hour offset: every UTC hour straddles two local hours (read from points).
    india = phone.get("/api/coverage?from=%s&to=%s&tz=%%2B05:30" % (first, days[-1]))
    local = {}
    for at in instants:
        moment = dt.datetime.fromtimestamp(at + 19800, dt.timezone.utc)
        local.setdefault(moment.date().isoformat(), set()).add(moment.hour)
    assert {(r["metric"], r["layer"]): r["values"] for r in india["rows"]}[
        ("heart_rate", "minutes")] == [len(local.get(date, ())) for date in dates]
    # Without a range: the four weeks ending today, by the clock.
    default = phone.get("/api/coverage")
    assert default["days"][-1] == dates[-1] and len(default["days"]) == 28


def test_fresh_5_2_coverage_refuses_a_range_it_cannot_read(service):
    client = Client(*service.address)
    for query in ("from=2025-13-01", "from=2025-06-02&to=2025-06-01", "to=yesterday",
                  "from=2024-01-01&to=2025-06-01", "tz=Mars/Olympus"):
        status, answer = client.request("GET", "/api/coverage?" + query)
        assert status == 400, (query, answer)
        assert answer["error"]["code"] == "bad_request"
    assert client.request("GET", "/api/coverage", token=False)[0] == 401
    assert client.request("GET", "/api/freshness", token=False)[0] == 401


# ---------------------------------------------------------------------------------------
# Where a person sees it


def test_fresh_6_1_metrics_has_gauges_of_every_automation_and_metric(start_service, data_dir):
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir, late_after_s=HOUR)
    when = late_once(phone, HOUR)
    text = phone.client.request("GET", "/metrics")[1].decode()
    who = 'automation="%s",name="Minutes"' % MINUTES.id
    assert "healthlog_automation_last_delivery_timestamp_seconds{%s} %r" % (
        who, T0 + 10 * MIN) in text
    assert "healthlog_automation_late{%s} 1" % who in text
    assert "healthlog_automation_threshold_seconds{%s} %r" % (who, float(HOUR)) in text
    newest = dt.datetime.strptime(points_every("step_count", T0 + 5 * MIN,
                                               T0 + 10 * MIN)[-1]["date"],
                                  "%Y-%m-%d %H:%M:%S %z").timestamp()
    assert 'healthlog_metric_newest_point_timestamp_seconds{metric="step_count",' \
           'layer="minutes"} %r' % newest in text
    assert 'healthlog_metric_stale{metric="step_count",layer="minutes"} 0' in text
    assert "healthlog_notices_sent_total" not in text  # no --notify, no notifier
    clock.now = when - 2
    assert "healthlog_automation_late{%s} 0" % who in phone.client.request(
        "GET", "/metrics")[1].decode()


def test_fresh_6_2_status_lists_what_is_late_or_stale(start_service, data_dir):
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir, late_after_s=HOUR)
    late_once(phone, HOUR)
    config = healthlog.Config(data_dir=data_dir, late_after_s=HOUR,
                              clock=lambda: T0 + 3 * HOUR)
    status = healthlog.collect_status(config)
    assert [a["state"] for a in status["freshness"]["automations"]] == ["late"]
    text = healthlog.format_status(status)
    assert "automations: Minutes late" in text
    assert "late: 'Minutes' has sent nothing since Mon 2025-06-02 08:10 +02:00" in text
    assert "Manual Export" in text
    # The command itself, beside the running service, at the real clock (a year on).
    result = subprocess.run([sys.executable, "-m", "healthlog", "status", "--data",
                             str(data_dir), "--late-after", "2d"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "automations: Minutes late" in out and "(late after 2 d)" in out


def test_fresh_6_3_healthz_stays_about_the_server(start_service, data_dir):
    clock = Clock(T0)
    phone = start(start_service, clock, data_dir, late_after_s=HOUR)
    late_once(phone, HOUR)
    status, health = phone.client.request("GET", "/healthz", token=False)
    assert status == 200 and health["status"] == "ok"
    assert set(health) == {"status", "version", "backlog", "worker", "failed_after_attempts"}


def test_fresh_6_4_serve_takes_late_after_and_notify(tmp_path, serve_process, receivers):
    receiver = receivers("ok")
    serve = serve_process(tmp_path / "data", "--late-after", "45m", "--notify", receiver.url,
                          "--notify-format", "json")
    client = serve.client
    for _ in range(3):  # three runs seconds apart: --late-after is the threshold
        assert client.ingest(hf.dumps_hae(hf.envelope(metrics=[])),
                             headers=hf.headers_for(MINUTES))[0] == 200
    text = client.request("GET", "/metrics")[1].decode()
    assert 'healthlog_automation_threshold_seconds{automation="%s",name="Minutes"} 2700.0' \
           % MINUTES.id in text
    assert "healthlog_notices_sent_total 0" in text
    assert serve.terminate() == 0
    assert any("notices on" in line and "127.0.0.1" in line for line in serve.log_lines())
    assert not any(receiver.url in line for line in serve.log_lines())
    # Values serve refuses, each with a one-line error (exit 2), read as serve reads them.
    for flags in (["--late-after", "6 hours"], ["--late-after", "0s"],
                  ["--notify", "ftp://example.org/x"]):
        args = healthlog.build_parser().parse_args(["serve"] + flags)
        with pytest.raises(healthlog.ConfigError):
            healthlog.build_config(args, {})
    with pytest.raises(SystemExit) as exit_:
        healthlog.build_parser().parse_args(["serve", "--notify-format", "xml"])
    assert exit_.value.code == 2
    args = healthlog.build_parser().parse_args(["serve"])
    config = healthlog.build_config(args, {"HEALTHLOG_LATE_AFTER": "90s",
                                           "HEALTHLOG_NOTIFY": receiver.url})
    assert (config.late_after_s, config.notify_url, config.notify_format) == (
        90.0, receiver.url, "text")
