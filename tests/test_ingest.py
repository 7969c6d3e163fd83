"""Ingest over a real Cheroot server: status codes, archive, journal, deadlines.

Every test runs a real server on 127.0.0.1:0 against a real data directory; the
archive and the journal are inspected afterwards.  Names carry the seed scenario
IDs (ING-n.m, the user's original requirements; see openspec/README.md) or the openspec
scenario they prove.
"""

import hashlib
import json
import socket
import sqlite3
import threading
import time

import pytest

import healthlog
from conftest import (HAE_HEADERS, TOKEN, Client, archive_files, db_rows, hae_body, raw_post,
                      read_response, wait_for)


# -- 200 -------------------------------------------------------------------------


def test_ing_1_1_answer_200_after_archive_and_row_delivery_pending(paused_service, data_dir):
    client = Client(*paused_service.address)
    body = hae_body()
    status, payload = client.ingest(body, headers=HAE_HEADERS)
    assert status == 200
    assert payload == {"delivery_id": 1, "status": "pending"}
    [row] = db_rows(data_dir)
    assert row["id"] == 1
    assert row["parse_status"] == "pending"
    assert row["body_bytes"] == len(body)
    assert row["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert (data_dir / row["archive_path"]).read_bytes() == body
    assert row["received_at"].endswith("Z") and len(row["received_at"]) == 27
    paused_service.worker.gate.set()
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")


def test_ing_1_2_answer_does_not_wait_for_the_fold(paused_service, data_dir):
    # The fold thread is held: the 200 arrives although no fold has even started, so
    # the answer time cannot contain the fold time.
    client = Client(*paused_service.address)
    point = '{"date":"2026-05-19 10:%02d:00 -0700","qty":%d.25,"source":"iPhone"}'
    body = ('{"data":{"metrics":[{"name":"step_count","units":"count","data":[%s]}]}}'
            % ",".join(point % (i % 60, i) for i in range(20000))).encode()
    status, payload = client.ingest(body, headers=HAE_HEADERS)
    assert (status, payload["status"]) == (200, "pending")
    assert db_rows(data_dir)[0]["parse_status"] == "pending"
    paused_service.worker.gate.set()
    row = wait_for(lambda: [r for r in db_rows(data_dir) if r["parse_status"] != "pending"])[0]
    assert row["parse_status"] == "parsed" and row["points"] == 20000


def test_ing_2_1_accepted_delivery_waits_pending_in_database(paused_service, data_dir):
    client = Client(*paused_service.address)
    for _ in range(3):
        assert client.ingest(hae_body(), headers=HAE_HEADERS)[0] == 200
    rows = db_rows(data_dir)
    assert [r["parse_status"] for r in rows] == ["pending"] * 3
    assert client.request("GET", "/healthz", token=False)[1]["backlog"] == 3
    paused_service.worker.gate.set()
    wait_for(lambda: [r["parse_status"] for r in db_rows(data_dir)] == ["parsed"] * 3)
    assert client.request("GET", "/healthz", token=False)[1]["backlog"] == 0


def test_ingest_9_1_keeps_automation_headers_on_row_and_in_meta(service, client, data_dir):
    status, payload = client.ingest(hae_body(), headers=HAE_HEADERS,
                                    path="/api/ingest/phone-metrics")
    assert status == 200
    [row] = db_rows(data_dir)
    assert row["automation_name"] == "Health tracker"
    assert row["automation_id"] == HAE_HEADERS["automation-id"]
    assert row["automation_aggregation"] == "Days"
    assert row["automation_period"] == "Previous 7 Days"
    assert row["session_id"] == HAE_HEADERS["session-id"]
    assert row["path_name"] == "phone-metrics"
    meta_path = data_dir / row["archive_path"].replace(".json", ".meta.json")
    meta_text = meta_path.read_text(encoding="utf-8")
    meta = json.loads(meta_text)
    assert meta["received_at"] == row["received_at"]
    assert meta["headers"] == HAE_HEADERS
    assert meta["path_name"] == "phone-metrics"
    assert meta["body_sha256"] == row["body_sha256"]
    assert TOKEN not in meta_text and "Bearer" not in meta_text


def test_ingest_9_2_utf8_automation_name_is_kept_as_text(service, data_dir):
    host, port = service.address
    body = hae_body()
    with socket.create_connection((host, port)) as sock:
        request = raw_post(port, body).replace(
            b"\r\n\r\n", "\r\nautomation-name: Здоровье\r\n\r\n".encode(), 1)
        sock.sendall(request)
        assert read_response(sock)[0] == 200
    assert db_rows(data_dir)[0]["automation_name"] == "Здоровье"


def test_ingest_3_2_accepts_x_api_key(service, client, data_dir):
    status, _ = client.ingest(hae_body(), token=False, headers={"X-API-Key": TOKEN})
    assert status == 200
    assert len(db_rows(data_dir)) == 1


def test_ingest_1_1_chunked_body_is_archived_byte_identical(service, data_dir):
    host, port = service.address
    body = hae_body() * 1  # one chunk per line, as a streaming client would send
    chunks = body.split(b"\n")
    wire = b"".join(b"%x\r\n%s\r\n" % (len(c) + 1, c + b"\n") for c in chunks[:-1])
    wire += b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunks[-1]), chunks[-1])
    head = ("POST /api/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" % TOKEN)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head.encode() + wire)
        status, payload = read_response(sock)
    assert status == 200, payload
    [row] = db_rows(data_dir)
    assert (data_dir / row["archive_path"]).read_bytes() == body


def test_ingest_1_1_large_body_is_archived_byte_identical(service, client, data_dir):
    point = b'{"date":"2026-05-19 00:%02d:00 -0700","qty":0.76856774374845116,"source":"x"}'
    points = b",".join(point % (i % 60) for i in range(60000))
    body = b'{"data":{"metrics":[{"name":"step_count","units":"count","data":[' + points + b"]}]}}"
    assert len(body) > 4 << 20
    assert client.ingest(body)[0] == 200
    [row] = db_rows(data_dir)
    assert (data_dir / row["archive_path"]).read_bytes() == body


# -- nothing written: 401, 400, 413, 415, 503 ------------------------------------


def assert_nothing_written(data_dir):
    assert db_rows(data_dir) == []
    assert archive_files(data_dir) == []


def assert_error_shape(payload, status, code):
    assert payload == {"error": {"status": status, "code": code,
                                 "message": payload["error"]["message"]}}
    assert payload["error"]["message"]
    text = json.dumps(payload)
    for leak in ("Zebulon", "72.123456789", "CANARY-BODY-TEXT", TOKEN):
        assert leak not in text


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-token-wrong-token"},
    {"Authorization": "Basic " + TOKEN},
    {"X-API-Key": TOKEN[:-1]},
], ids=["missing", "wrong", "basic-scheme", "wrong-api-key"])
def test_ingest_3_1_401_without_the_token_writes_nothing(service, client, data_dir, headers):
    status, payload = client.ingest(hae_body(), token=False, headers=headers)
    assert status == 401
    assert_error_shape(payload, 401, "unauthorized")
    assert_nothing_written(data_dir)


@pytest.mark.parametrize("body", [
    b"CANARY-BODY-TEXT not json",
    b'{"data": {"metrics": [1, 2,]}}',
    b'[{"data": {}}]',
    b'{"metrics": []}',
    b'{"data": [1, 2]}',
    b'{"data": "CANARY-BODY-TEXT"}',
    b'{"data": {"metrics": [{"qty": NaN}]}}',
    b'{"data": {}} trailing',
    '{"data": {"name": "caf\u00e9"}}'.encode("latin-1"),
    b'"data"',
    b'{"data": {"metrics": [{"qty": 1e400}]}}',
    b'{"data": {"metrics": [{"qty": -2.5E+999}]}}',
    b'{"data": {"metrics": [{"qty": 123456789012345678901234567890}]}}',
    b'{"data": {"metrics": [{"qty": Infinity}]}}',
    b'{"data": {"metrics": [{"source": "\\ud83d watch"}]}}',
], ids=["text", "syntax", "array", "no-data", "data-array", "data-string", "nan",
        "trailing", "latin1", "string", "float-overflow", "negative-overflow", "int-over-64-bits",
        "infinity", "lone-surrogate"])
def test_ingest_4_1_400_for_a_body_that_is_not_hae_json_writes_nothing(service, client, data_dir,
                                                                   body):
    status, payload = client.ingest(body)
    assert status == 400
    assert_error_shape(payload, 400, "bad_request")
    assert_nothing_written(data_dir)


def test_ingest_4_1_numbers_that_parse_alike_everywhere_are_accepted(service, client,
                                                                    data_dir):
    body = (b'{"data": {"metrics": [{"name": "x", "units": "u", "data": [{"qty": 1.5e-300,'
            b' "n": 9223372036854775807, "m": -9223372036854775808, "e": 1.7976931348623157e308,'
            b' "date": "2026-05-19 00:00:00 -0700"}]}]}}')
    assert client.ingest(body)[0] == 200
    assert len(db_rows(data_dir)) == 1


def test_ingest_4_2_400_for_an_empty_body(service, client, data_dir):
    status, payload = client.ingest(b"")
    assert status == 400
    assert_error_shape(payload, 400, "bad_request")
    assert_nothing_written(data_dir)


def test_ingest_4_3_400_for_a_bad_ingest_name(service, client, data_dir):
    status, payload = client.ingest(hae_body(), path="/api/ingest/bad%20name")
    assert status == 400
    assert_error_shape(payload, 400, "bad_request")
    assert_nothing_written(data_dir)


def test_ingest_5_1_413_by_content_length_writes_nothing(start_service, data_dir):
    service = start_service(max_body_bytes=1 << 20)
    host, port = service.address
    # Only the head: the answer must come from Content-Length alone, before any body byte
    # (sending the body too raced the server's early answer and close: a broken pipe).
    head = ("POST /api/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (TOKEN, (1 << 20) + 2)).encode()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head)
        status, payload = read_response(sock)
    assert status == 413
    assert_error_shape(payload, 413, "payload_too_large")
    assert_nothing_written(data_dir)


def test_ingest_5_2_413_while_streaming_a_chunked_body_writes_nothing(start_service, data_dir):
    service = start_service(max_body_bytes=1 << 20)
    host, port = service.address
    head = ("POST /api/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            "Transfer-Encoding: chunked\r\n\r\n" % TOKEN).encode()
    piece = b" " * 65536
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head)
        try:
            for _ in range(40):  # 2.5 MiB offered; the server stops reading at 1 MiB
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except OSError:
            pass
        status, payload = read_response(sock)
    assert status == 413
    assert_error_shape(payload, 413, "payload_too_large")
    assert_nothing_written(data_dir)


@pytest.mark.parametrize("content_type", [
    "multipart/form-data; boundary=xyz", "text/csv", "text/csv; charset=utf-8",
    "application/csv"])
def test_ingest_6_1_415_for_csv_or_multipart_writes_nothing(service, client, data_dir,
                                                            content_type):
    status, payload = client.ingest(b"date,qty\n2026-05-19,1\n",
                                    headers={"Content-Type": content_type})
    assert status == 415
    assert_error_shape(payload, 415, "unsupported_media_type")
    assert "JSON" in payload["error"]["message"]
    assert_nothing_written(data_dir)


def test_ingest_12_1_503_while_stopping_writes_nothing(service, client, data_dir):
    service.stopping.set()  # the flag stop() raises before closing the listener
    status, payload = client.ingest(hae_body())
    assert status == 503
    assert_error_shape(payload, 503, "stopping")
    assert_nothing_written(data_dir)


def test_ingest_10_1_every_http_error_has_the_one_json_shape(service, client):
    assert_error_shape(client.request("GET", "/no/such/route")[1], 404, "not_found")
    assert_error_shape(client.request("GET", "/api/ingest")[1], 405, "method_not_allowed")
    assert_error_shape(client.request("POST", "/healthz", body=b"{}")[1], 405,
                       "method_not_allowed")


# -- 500: the row cannot be written ----------------------------------------------


def test_ing_9_1_busy_database_while_recording_is_logged_with_its_marker(
        service, client, data_dir, write_locks, logs):
    write_locks(data_dir / healthlog.DB_NAME)
    status, payload = client.ingest(hae_body())
    assert status == 500
    assert_error_shape(payload, 500, "internal_error")
    [record] = logs.find("delivery row not written", level="ERROR")
    assert record["busy"] == "true"
    # The body stays in the archive as an orphan, at the path the record names.
    assert (data_dir / record["archive_path"]).read_bytes() == hae_body()
    assert db_rows(data_dir, "SELECT count(*) AS n FROM delivery")[0]["n"] == 0


def test_ing_9_1_other_cause_while_recording_carries_no_busy_marker(
        service, client, data_dir, logs):
    conn = sqlite3.connect(str(data_dir / "healthlog.sqlite3"))
    conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON delivery "
                 "BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
    conn.commit()
    conn.close()
    status, payload = client.ingest(hae_body())
    assert status == 500
    [record] = logs.find("delivery row not written", level="ERROR")
    assert record["busy"] == "false"
    assert (data_dir / record["archive_path"]).exists()


# -- the connection and the deadlines ----------------------------------------------


def test_ing_1_3_dropped_connection_after_the_body_still_records_the_delivery(
        start_service, data_dir):
    # A second connection holds the write lock, so the handler is still waiting to
    # insert when the client leaves; the lock is released only after it has gone.
    service = start_service(paused=True, busy_timeout_s=60.0)
    holder = sqlite3.connect(str(data_dir / "healthlog.sqlite3"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    host, port = service.address
    body = hae_body()
    sock = socket.create_connection((host, port))
    sock.sendall(raw_post(port, body))
    # The body is in the archive: the handler has read all of it and now waits to insert.
    wait_for(lambda: [p for p in archive_files(data_dir) if p.startswith("archive/")
                      and not p.endswith(".meta.json")], what="the body is archived")
    client_port = sock.getsockname()[1]
    sock.close()
    wait_for(lambda: _server_sees_the_client_gone(port, client_port),
             what="the server's end of the connection sees the client gone")
    holder.execute("ROLLBACK")
    holder.close()
    rows = wait_for(lambda: db_rows(data_dir), timeout=30, what="the delivery row")
    assert len(rows) == 1
    assert rows[0]["parse_status"] == "pending"
    assert (data_dir / rows[0]["archive_path"]).read_bytes() == body


TCP_CLOSE_WAIT = "08"
"""The state of /proc/net/tcp for a socket whose peer has closed its end."""


def _server_sees_the_client_gone(server_port: int, client_port: int) -> bool:
    """Is the server's end of the loopback connection from ``client_port`` in CLOSE_WAIT
    (the client's FIN has arrived)?"""
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            local, remote, state = line.split()[1:4]
            if (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)) == (
                    server_port, client_port):
                return state == TCP_CLOSE_WAIT
    return False


def test_ing_8_1_slow_upload_beyond_the_server_timeout_is_not_cut_off(start_service, data_dir):
    service = start_service(http_timeout_s=1.0, ingest_budget_s=30.0)
    host, port = service.address
    body = hae_body()
    request = raw_post(port, body)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(request[:-40])
        time.sleep(2.5)  # a stall longer than the server-wide timeout
        sock.sendall(request[-40:])
        status, payload = read_response(sock)
    assert status == 200, payload
    assert (data_dir / db_rows(data_dir)[0]["archive_path"]).read_bytes() == body


def test_ingest_7_1_deadline_exceeded_gives_408_and_writes_nothing(start_service, data_dir):
    # The 408 must come from the route's 1 s deadline: the server-wide timeout and the
    # stall limit are 120 s, and the client waits at most 30 s for the answer (a liveness
    # ceiling 30 times the deadline, not a speed figure).
    service = start_service(http_timeout_s=120.0, ingest_stall_s=120.0, ingest_budget_s=1.0)
    host, port = service.address
    request = raw_post(port, hae_body())
    with socket.create_connection((host, port)) as sock:
        sock.sendall(request[:-40])
        sock.settimeout(30.0)
        status, payload = read_response(sock)
    assert status == 408
    assert_error_shape(payload, 408, "request_timeout")
    assert_nothing_written(data_dir)


SERVER_CLOSES_WITHIN_S = 20.0
"""How long ING-8.2's clients wait for the server to close a silent connection: a
liveness ceiling 20 times the 1 s server timeout that must close it, and far below the
120 s of the ingest budget and the head deadline that must not apply."""


def _closed_within(sock: socket.socket, ceiling: float) -> bool:
    """Read until the server closes the connection; False if it is still open after
    ``ceiling`` seconds of silence."""
    sock.settimeout(ceiling)
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        return False
    return True


def test_ing_8_2_other_routes_keep_the_server_timeout(start_service, monkeypatch):
    monkeypatch.setattr(healthlog, "HEAD_DEADLINE_S", 120.0)
    service = start_service(http_timeout_s=1.0, ingest_budget_s=120.0)
    host, port = service.address
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        assert _closed_within(sock, SERVER_CLOSES_WITHIN_S)


def test_ing_8_2_keep_alive_after_ingest_returns_to_the_server_timeout(start_service,
                                                                       monkeypatch):
    monkeypatch.setattr(healthlog, "HEAD_DEADLINE_S", 120.0)
    service = start_service(http_timeout_s=1.0, ingest_budget_s=120.0)
    host, port = service.address
    with socket.create_connection((host, port)) as sock:
        sock.sendall(raw_post(port, hae_body()))
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and then silence
        assert _closed_within(sock, SERVER_CLOSES_WITHIN_S)


def test_ingest_4_4_truncated_body_is_not_archived(service, data_dir):
    host, port = service.address
    request = raw_post(port, hae_body())
    with socket.create_connection((host, port)) as sock:
        sock.sendall(request[:-20])
        sock.shutdown(socket.SHUT_WR)
        # The server has met the early end and is done with the request once it closes
        # its end (a half upload is removed before the answer).
        assert _closed_within(sock, 30.0), "the server kept a truncated upload open"
    assert_nothing_written(data_dir)


def test_ingest_1_2_concurrent_ingests_each_get_their_own_row_and_file(start_service, data_dir):
    # A realistic busy timeout: twelve FULL-sync inserts queue behind each other and
    # behind the fold thread's transactions on a loaded machine.
    service = start_service(busy_timeout_s=10.0)
    host, port = service.address
    bodies = [hae_body(canary_value=72.123456789 + i) for i in range(12)]
    results = [None] * len(bodies)

    def post(i):
        results[i] = Client(host, port).ingest(bodies[i])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r[0] == 200 for r in results), results
    rows = {r["id"]: r for r in db_rows(data_dir)}
    for i, (_, payload) in enumerate(results):
        row = rows[payload["delivery_id"]]
        assert (data_dir / row["archive_path"]).read_bytes() == bodies[i]
    assert len(set(r["received_at"] + r["archive_path"] for r in rows.values())) == 12


# -- healthz ---------------------------------------------------------------------


def test_ingest_11_1_healthz_needs_no_token_and_reports_backlog_and_worker(service, client):
    status, payload = client.request("GET", "/healthz", token=False)
    assert status == 200
    assert payload["status"] == "ok"
    assert payload["backlog"] == 0
    assert payload["worker"] in ("idle", "folding", "starting")
    assert payload["version"] == healthlog.__version__


def test_ingest_8_1_500_when_the_archive_cannot_be_written_records_nothing(service, client,
                                                                       data_dir, logs):
    # A file where this year's archive folder belongs: a real filesystem failure.
    year = healthlog.utc_now().strftime("%Y")
    (data_dir / "archive" / year).write_bytes(b"")
    status, payload = client.ingest(hae_body())
    assert status == 500
    assert_error_shape(payload, 500, "internal_error")
    assert db_rows(data_dir) == []
    assert archive_files(data_dir) == ["archive/" + year]  # only the obstacle itself
    [record] = logs.find("archive write failed", level="ERROR")
    assert record["error"] in ("NotADirectoryError", "FileExistsError")


def test_ingest_3_3_token_in_the_query_string_is_refused_and_never_logged(service, client,
                                                                           data_dir, logs):
    for query in ("?token=", "?api_key="):
        status, payload = client.ingest(hae_body(), path="/api/ingest" + query + TOKEN,
                                        token=False)
        assert status == 401
        assert_error_shape(payload, 401, "unauthorized")
    assert_nothing_written(data_dir)
    assert not [line for line in logs.lines() if TOKEN in line or "token=" in line]


def test_ingest_1_3_half_uploads_left_by_a_dead_process_are_cleared_at_start(
        make_config, data_dir):
    (data_dir / "tmp").mkdir(parents=True)
    (data_dir / "tmp" / "upload-deadbeef.part").write_bytes(b'{"data": {"metr')
    service = healthlog.Service(make_config(), announce=lambda token: None)
    service.start()
    try:
        assert list((data_dir / "tmp").iterdir()) == []
        assert archive_files(data_dir) == []
        assert db_rows(data_dir) == []
    finally:
        service.stop()
