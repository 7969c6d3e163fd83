"""`healthlog serve` as a process: start-up, shutdown order, crashes, CLI, config, logs.

Real subprocesses are started and killed (SIGTERM, SIGKILL); real data directories
are inspected afterwards.  Names carry seed scenario IDs (ING-n.m) where one applies.
"""

import http.client
import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading

import pytest

import healthlog
from conftest import (HAE_HEADERS, ROOT, TOKEN, Client, archive_files, db_rows, hae_body,
                      parse_logfmt, require_python, run_cli, wait_for)


def messages(lines) -> list:
    return [parse_logfmt(line).get("msg") for line in lines]


# -- start-up and shutdown ---------------------------------------------------------


def test_ing_6_2_sigterm_stops_http_before_the_worker_and_exits_0(serve_process, data_dir):
    proc = serve_process(data_dir)
    assert proc.port > 0  # --listen 127.0.0.1:0 logs the port actually bound
    assert proc.client.request("GET", "/healthz", token=False)[0] == 200
    assert proc.client.ingest(hae_body())[0] == 200
    assert proc.terminate() == 0
    msgs = messages(proc.log_lines())
    order = [msgs.index(m) for m in ("stop requested", "http stopped", "fold thread stopped",
                                     "stopped")]
    assert order == sorted(order)
    assert not [line for line in proc.log_lines() if "level=ERROR" in line]


def test_sigint_stops_cleanly_too(serve_process, data_dir):
    import signal

    proc = serve_process(data_dir)
    assert proc.terminate(signal.SIGINT) == 0


class BusyFoldWorker(healthlog.FoldWorker):
    """A worker whose pass lasts until the test ends it, longer than any stop budget (it
    ignores the stop flag the way a long fold of one delivery does: the flag is checked
    between deliveries)."""

    def __init__(self, config):
        super().__init__(config)
        self.entered, self.release = threading.Event(), threading.Event()

    def run_pass(self, conn):
        self.entered.set()
        self.release.wait(60)
        return 0


def test_ing_6_3_stop_budget_exceeded_is_a_warning_not_an_error(make_config, logs):
    config = make_config(stop_budget_s=0.5)
    service = healthlog.Service(config, announce=lambda token: None)
    service.worker = worker = BusyFoldWorker(config)
    service.start()
    try:
        worker.wake()
        assert worker.entered.wait(30), "the fold pass did not start"
        finished = service.stop()
        # stop() gave up at its budget, not at the end of the pass: the pass still runs.
        assert finished is False
        assert worker.thread.is_alive() and not worker.release.is_set()
    finally:
        worker.release.set()
        worker.thread.join(30)
    [warn] = logs.find("did not stop within the budget", level="WARN")
    assert warn["budget_s"] == "0.5"
    assert logs.find("", level="ERROR") == []


def test_ingest_1_4_ing_2_2_sigkill_during_concurrent_ingest_loses_no_acknowledged_delivery(
        serve_process, data_dir):
    proc = serve_process(data_dir)
    acked = []  # (delivery_id, body)
    lock = threading.Lock()
    stop = threading.Event()

    def poster(seed):
        n = 0
        while not stop.is_set():
            n += 1
            body = hae_body(canary_value=seed * 1000 + n)
            if n % 4 == 0:  # a few larger bodies, so some are mid-upload at the kill
                body = body[:-3] + b', "pad" : "' + b"x" * (1 << 20) * (seed % 3 + 1) + b'"}}'
            try:
                status, payload = Client("127.0.0.1", proc.port).ingest(body,
                                                                        headers=HAE_HEADERS)
            except (OSError, http.client.HTTPException):  # killed mid-answer: not acked
                continue
            if status == 200:
                with lock:
                    acked.append((payload["delivery_id"], body))

    threads = [threading.Thread(target=poster, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        # Killed once a dozen deliveries are acknowledged: every poster is then in full
        # flight, some of them mid-upload (was: after 2 s, however many that made).
        wait_for(lambda: len(acked) >= 12, timeout=120,
                 what="a dozen acknowledged deliveries")
    finally:
        proc.kill()
        stop.set()
        for t in threads:
            t.join(30)
    assert len(acked) >= 12

    restarted = serve_process(data_dir)
    rows = {row["id"]: row for row in db_rows(data_dir)}
    for delivery_id, body in acked:
        row = rows[delivery_id]
        assert (data_dir / row["archive_path"]).read_bytes() == body
    # ING-2.2: whatever the kill left pending, the next start folds.
    wait_for(lambda: not [r for r in db_rows(data_dir) if r["parse_status"] == "pending"])
    statuses = {r["id"]: r["parse_status"] for r in db_rows(data_dir)}
    # (the padded bodies carry an uncovered key "pad", so they are partial)
    assert all(statuses[delivery_id] in ("parsed", "partial") for delivery_id, _ in acked)
    assert not list((data_dir / "tmp").iterdir())  # half uploads were cleared at start
    # Every archived body has its metadata beside it; bodies without a row are orphans
    # (the kill came between the rename and the insert): reindex adopts them.
    bodies = [f for f in archive_files(data_dir) if f.endswith(".json")
              and not f.endswith(".meta.json")]
    for body_path in bodies:
        assert (data_dir / body_path.replace(".json", ".meta.json")).exists()
    assert len(bodies) >= len(acked)
    conn = sqlite3.connect(str(data_dir / "healthlog.sqlite3"))
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    assert restarted.client.ingest(hae_body())[0] == 200
    assert restarted.terminate() == 0


def test_ing_5_2_backlog_at_start_is_named_in_one_info_record(start_service, data_dir, logs):
    service = start_service(paused=True)
    client = Client(*service.address)
    for _ in range(3):
        assert client.ingest(hae_body())[0] == 200
    service.stop()
    logs.stream.truncate(0)
    logs.stream.seek(0)
    start_service()
    wait_for(lambda: logs.find("waiting to be folded"), what="the backlog record")
    [record] = logs.find("waiting to be folded")
    assert record["level"] == "INFO"
    assert record["backlog"] == "3"


def test_healthz_reports_the_backlog_after_a_restart(start_service):
    service = start_service(paused=True)
    client = Client(*service.address)
    assert client.ingest(hae_body())[0] == 200
    service.stop()
    service = start_service(paused=True)
    assert Client(*service.address).request("GET", "/healthz", token=False)[1]["backlog"] == 1


# -- the data directory ------------------------------------------------------------


def test_data_directory_is_created_private_with_its_folders(service, data_dir):
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert (data_dir / "archive").is_dir() and (data_dir / "tmp").is_dir()
    conn = sqlite3.connect(str(data_dir / "healthlog.sqlite3"))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == healthlog.SCHEMA_VERSION
    conn.close()


def test_ingest_13_1_second_serve_on_one_data_directory_is_refused(serve_process, data_dir):
    first = serve_process(data_dir)
    result = run_cli("serve", "--data", data_dir, "--listen", "127.0.0.1:0", "--token", TOKEN)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "in use" in result.stderr
    assert "Traceback" not in result.stderr
    assert first.client.request("GET", "/healthz", token=False)[0] == 200
    assert first.terminate() == 0


def test_ingest_13_1_lock_is_refused_in_process_too(start_service, make_config):
    start_service()
    with pytest.raises(healthlog.DataDirLocked):
        healthlog.Service(make_config(), announce=lambda t: None).start()


def test_ingest_14_1_newer_database_schema_is_refused_naming_both_versions(data_dir):
    data_dir.mkdir(parents=True)
    conn = sqlite3.connect(str(data_dir / "healthlog.sqlite3"))
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    result = run_cli("serve", "--data", data_dir, "--listen", "127.0.0.1:0", "--token", TOKEN)
    assert result.returncode == 2
    assert "99" in result.stderr and str(healthlog.SCHEMA_VERSION) in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_ingest_15_2_token_is_generated_once_private_and_reused(make_config, data_dir):
    announced = []
    config = make_config(token=None)
    service = healthlog.Service(config, announce=announced.append)
    service.start()
    try:
        token_file = data_dir / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(announced) == 1 and len(token) >= 32
        assert "Authorization: Bearer " + token in announced[0]
        assert Client(*service.address, token=token).ingest(hae_body())[0] == 200
        assert Client(*service.address, token="x" * 40).ingest(hae_body())[0] == 401
    finally:
        service.stop()
    again = healthlog.Service(config, announce=announced.append)
    again.start()
    again.stop()
    assert len(announced) == 2 and token not in announced[1]
    assert "Bearer <the token in %s>" % token_file in announced[1]


def test_ingest_15_1_first_start_prints_the_hae_setup_hint_once_and_never_logs_the_token(tmp_path):
    data_dir = tmp_path / "data"
    log_path = tmp_path / "serve.log"
    with open(str(log_path), "wb") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "healthlog.py"), "serve", "--data",
                                 str(data_dir), "--listen", "127.0.0.1:0"],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        # "serving" is logged once the token is announced and the server listens.
        wait_for(lambda: proc.poll() is not None or "serving" in messages(
            log_path.read_text(errors="replace").splitlines()), timeout=60,
            what="serve logs that it is serving")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    err = log_path.read_text()
    token = (data_dir / "token").read_text().strip()
    assert proc.returncode == 0
    assert "Authorization: Bearer " + token in out and "/api/ingest" in out
    assert token not in err
    settings = [line.split(":")[0].strip() for line in out.splitlines()
                if line.strip().startswith(("Export Format:", "Export Version:",
                                            "Time Grouping:", "Batch Requests:"))]
    assert settings == ["Export Format", "Export Version", "Time Grouping", "Batch Requests"]
    assert "Export Format:  JSON" in out and "Export Version: v2" in out
    assert re.search(r"http://127\.0\.0\.1:\d+/\n", out)  # the dashboard, where it listens


def _addresses_from_ip() -> list:
    """The machine's LAN addresses as `ip` (iproute2) reads them, apart from healthlog."""
    shown = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True,
                           timeout=30)
    found = []
    for line in shown.stdout.splitlines():
        fields = line.split()
        family, address = fields[2], fields[3].split("/")[0]
        if family == "inet" and not address.startswith("127."):
            found.append(address)
        elif family == "inet6" and "scope global" in line:
            found.append(address)
    return found


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2's ip is not installed")
def test_ingest_15_3_the_start_banner_names_every_address_a_phone_can_use(tmp_path):
    config = healthlog.Config(data_dir=tmp_path)
    lan = _addresses_from_ip()
    assert sorted(healthlog.local_addresses()) == sorted(lan)
    everywhere = healthlog.start_banner(config, "0.0.0.0", 8765, None)
    dashboards = re.findall(r"^  (http://\S+)/$", everywhere, re.M)
    assert dashboards == ["http://%s" % healthlog.format_address(a, 8765)
                          for a in healthlog.local_addresses()] + ["http://127.0.0.1:8765"]
    ingest = re.search(r"URL:\s+(\S+)", everywhere).group(1)
    assert ingest.endswith(":8765/api/ingest") and "127.0.0.1" not in ingest or not lan
    assert "http://[::1]:8765/" in healthlog.start_banner(config, "::", 8765, None)
    one = healthlog.start_banner(config, "192.0.2.7", 9000, None)
    assert re.findall(r"^  (http://\S+)/$", one, re.M) == ["http://192.0.2.7:9000"]
    given = healthlog.start_banner(healthlog.Config(data_dir=tmp_path, token="g" * 20),
                                   "0.0.0.0", 8765, None)
    assert "g" * 20 not in given and "<the token you gave>" in given


# -- configuration and the command line ----------------------------------------------


def test_config_defaults_then_environment_then_flags(tmp_path):
    parser = healthlog.build_parser()
    env = {"HOME": str(tmp_path), "HEALTHLOG_DATA": str(tmp_path / "env-data"),
           "HEALTHLOG_LISTEN": "127.0.0.1:9000", "HEALTHLOG_TOKEN": "env-token"}
    config = healthlog.build_config(parser.parse_args(["serve"]), {"HOME": str(tmp_path)})
    assert config.data_dir == tmp_path / ".local" / "share" / "healthlog"
    assert (config.host, config.port, config.token) == ("0.0.0.0", 8765, None)
    assert config.max_body_bytes == 256 << 20
    config = healthlog.build_config(parser.parse_args(["serve"]), env)
    assert (config.data_dir, config.port, config.token) == (tmp_path / "env-data", 9000,
                                                            "env-token")
    args = parser.parse_args(["serve", "--data", str(tmp_path / "flag"), "--listen",
                              "[::1]:0", "--token", "flag-token", "--max-body-mib", "3"])
    config = healthlog.build_config(args, env)
    assert (config.data_dir, config.host, config.port) == (tmp_path / "flag", "::1", 0)
    assert config.token == "flag-token" and config.max_body_bytes == 3 << 20
    xdg = healthlog.build_config(parser.parse_args(["serve"]),
                                 {"XDG_DATA_HOME": str(tmp_path / "xdg")})
    assert xdg.data_dir == tmp_path / "xdg" / "healthlog"


@pytest.mark.parametrize("args", [
    ["serve", "--listen", "nonsense"],
    ["serve", "--listen", "127.0.0.1:99999"],
    ["serve", "--token", " "],
    ["serve", "--max-body-mib", "0"],
    ["serve", "--no-such-flag"],
    ["no-such-command"],
    [],
])
def test_usage_and_configuration_errors_exit_2_with_one_line(tmp_path, args):
    result = run_cli(*args, env=dict(os.environ, HOME=str(tmp_path)))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    if args:
        assert result.stderr.count("\n") == 1, result.stderr


def test_environment_errors_exit_2_with_one_line(tmp_path):
    data_dir = tmp_path / "data"
    (data_dir / "archive").mkdir(parents=True)
    (data_dir / "healthlog.lock").mkdir()  # a lock path that cannot be opened as a file
    for command in (["reindex"], ["serve", "--listen", "127.0.0.1:0", "--token", TOKEN]):
        result = run_cli(*command, "--data", data_dir)
        assert result.returncode == 2, (command, result.stderr)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_failed_commit_leaves_no_transaction_open(tmp_path):
    conn = sqlite3.connect(str(tmp_path / "t.sqlite3"), isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    conn.execute("CREATE TABLE child (parent_id INTEGER REFERENCES parent (id)"
                 " DEFERRABLE INITIALLY DEFERRED)")
    with pytest.raises(sqlite3.IntegrityError):
        with healthlog.write_txn(conn):
            conn.execute("INSERT INTO child VALUES (42)")  # fails only at COMMIT
    assert not conn.in_transaction  # the write lock is not kept
    with healthlog.write_txn(conn):
        conn.execute("INSERT INTO parent VALUES (1)")
    conn.close()


def test_version_flag_prints_the_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == "healthlog " + healthlog.__version__


def test_port_in_use_is_a_configuration_error(service, make_config):
    host, port = service.address
    result = run_cli("serve", "--data", make_config().data_dir.parent / "other", "--listen",
                     "127.0.0.1:%d" % port, "--token", TOKEN)
    assert result.returncode == 2
    assert "cannot listen" in result.stderr and "Traceback" not in result.stderr


def test_ingest_13_2_status_counts_deliveries_and_prints_the_fingerprint(paused_service,
                                                                       data_dir, capsys):
    client = Client(*paused_service.address)
    for _ in range(2):
        assert client.ingest(hae_body())[0] == 200
    assert healthlog.main(["status", "--data", str(data_dir)]) == 0
    text = capsys.readouterr().out
    assert "deliveries: 2 (pending 2, parsed 0, partial 0, failed 0)" in text
    assert "backlog: 2" in text and "archive: 2 bodies" in text
    [fp_line] = [line for line in text.splitlines() if line.startswith("fingerprint: ")]
    assert len(fp_line.split()[1]) == 64
    assert healthlog.main(["status", "--data", str(data_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["deliveries"]["pending"] == 2 and status["backlog"] == 2
    assert status["archive_files"] == 2 and status["fingerprint"] == fp_line.split()[1]
    assert status["oldest_pending_age_s"] >= 0


def test_status_without_a_database_exits_2(tmp_path):
    result = run_cli("status", "--data", tmp_path / "empty")
    assert result.returncode == 2
    assert "no healthlog database" in result.stderr and "Traceback" not in result.stderr


# -- logs ------------------------------------------------------------------------------


def test_log_fields_are_escaped_so_a_foreign_name_cannot_break_a_line(logs):
    hostile = 'a"b\nlevel=ERROR msg=forged\u2028x\x1b[31m'
    healthlog.log_event(40, "hostile", name=hostile, names=["x y", "z"])
    [line] = [text for text in logs.stream.getvalue().split("\n") if "hostile" in text]
    assert "\u2028" not in line and "\x1b" not in line
    record = parse_logfmt(line)
    assert record["name"] == hostile  # one line, and the value survives intact
    assert record["msg"] == "hostile" and record["level"] == "ERROR"
    assert json.loads(record["names"]) == ["x y", "z"]


def test_json_log_format_writes_the_same_fields_one_object_per_line(serve_process, data_dir):
    proc = serve_process(data_dir, "--log-format", "json")
    assert proc.client.ingest(hae_body())[0] == 200
    proc.terminate()
    records = [json.loads(line) for line in proc.log_lines()]
    [serving] = [r for r in records if r["msg"] == "serving"]
    assert serving["level"] == "INFO" and serving["listen"].startswith("127.0.0.1:")
    assert all({"time", "level", "msg"} <= set(r) for r in records)


# -- the built .pyz --------------------------------------------------------------------


@pytest.mark.parametrize("version", ["3.9", "3.13"])
def test_pyz_serves_healthz_and_ingest_with_nothing_installed(pyz, serve_process, tmp_path,
                                                              version):
    python = require_python(version, required=bool(os.environ.get("HEALTHLOG_REQUIRE_PYENV")))
    data_dir = tmp_path / ("data-" + version)
    proc = serve_process(data_dir, python=[python, "-S"], program=pyz)
    status, payload = proc.client.request("GET", "/healthz", token=False)
    assert status == 200 and payload["status"] == "ok"
    assert proc.client.ingest(hae_body())[0] == 200
    assert proc.terminate() == 0
    [row] = db_rows(data_dir)
    assert (data_dir / row["archive_path"]).read_bytes() == hae_body()
