"""Naming the peers of handshakes libzmq ended before the watch could read their address, from
the kernel's table of connections the coordinator closed (gpumesh/closedconns.py)."""

from __future__ import annotations

from gpumesh.closedconns import MATCH_WINDOW, ClosedConnections, parse_time_wait

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
PORT = 0x1F40  # 8000


def row(local: str, remote: str, state: str = "06") -> str:
    return f"   0: {local} {remote} {state} 00000000:00000000 03:00000000 00000000     0\n"


def test_time_wait_entries_on_our_port_are_read_in_both_families():
    v4 = HEADER + row("0100007F:1F40", "0261FA0A:D431") + row("0100007F:1F40", "0361FA0A:D432", "01")
    v4 += row("0100007F:1F41", "0461FA0A:D433") + "garbage line\n"
    assert parse_time_wait(v4, PORT) == [("10.250.97.2", 0xD431)]
    v6 = HEADER + row("00000000000000000000000000000000:1F40",
                      "0000000000000000FFFF00000261FA0A:D431")  # ::ffff:10.250.97.2
    v6 += row("00000000000000000000000000000000:1F40", "B80D0120000000000000000001000000:0050")
    assert parse_time_wait(v6, PORT) == [("10.250.97.2", 0xD431), ("2001:db8::1", 0x50)]


class Table:
    def __init__(self, path):
        self.path = path
        self.rows: list[str] = []

    def write(self) -> None:
        self.path.write_text(HEADER + "".join(self.rows))

    def add(self, remote_ip_hex: str, port: int) -> None:
        self.rows.append(row("0100007F:1F40", f"{remote_ip_hex}:{port:04X}"))
        self.write()


ATTACKER, FRIEND = "0261FA0A", "0361FA0A"  # 10.250.97.2, 10.250.97.3


def test_each_closed_connection_names_at_most_one_failure(tmp_path):
    now = [0.0]
    table = Table(tmp_path / "tcp")
    table.write()
    closed = ClosedConnections(PORT, [str(table.path)], clock=lambda: now[0])
    assert closed.take(3) == []  # nothing closed yet
    for port in range(3):
        table.add(ATTACKER, 40000 + port)
    assert closed.take(2) == ["10.250.97.2", "10.250.97.2"]
    assert closed.take(5) == ["10.250.97.2"]  # the third, once
    assert closed.take(5) == []  # still in TIME_WAIT, but already used


def test_a_failure_the_watch_named_itself_sets_its_own_entry_aside(tmp_path):
    now = [0.0]
    table = Table(tmp_path / "tcp")
    closed = ClosedConnections(PORT, [str(table.path)], clock=lambda: now[0])
    closed.named("10.250.97.3")  # the friend's failed handshake was named by the monitor
    table.add(FRIEND, 40001)
    table.add(ATTACKER, 40002)
    assert closed.take(2) == ["10.250.97.2"]  # the friend's entry is its named failure's own


def test_old_entries_and_old_names_expire(tmp_path):
    now = [0.0]
    table = Table(tmp_path / "tcp")
    closed = ClosedConnections(PORT, [str(table.path)], clock=lambda: now[0])
    table.add(ATTACKER, 40003)
    assert closed.take(0) == []  # seen now, with no failure to name
    now[0] = MATCH_WINDOW + 1  # nothing asked for it within the window: it is not used later
    assert closed.take(1) == []
    closed.named("10.250.97.2")
    now[0] = 2 * MATCH_WINDOW + 2
    table.add(ATTACKER, 40004)  # the name expired too: this new entry names a new failure
    assert closed.take(1) == ["10.250.97.2"]


def test_no_table_names_nothing(tmp_path):
    closed = ClosedConnections(PORT, [str(tmp_path / "missing")])
    assert closed.take(4) == []


def test_names_of_peers_that_hang_up_first_are_not_kept_for_good(tmp_path):
    # A peer that closes first leaves no entry of this side's to set aside: every failure the
    # watch named kept 32 bytes until 200,000 peers (behind --public, all are 127.0.0.1).
    now = [0.0]
    closed = ClosedConnections(PORT, [str(tmp_path / "missing")], clock=lambda: now[0])
    for i in range(20_000):
        now[0] = i * 0.001  # 20 s of 1,000 failed handshakes a second, from one address
        closed.named("127.0.0.1")
    assert len(closed._named["127.0.0.1"]) <= int(MATCH_WINDOW / 0.001) + 1
    for i in range(20_000):  # and from as many addresses
        closed.named(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    now[0] += 2 * MATCH_WINDOW
    closed.take(1)
    assert len(closed._named) <= 10_000
