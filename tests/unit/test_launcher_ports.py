"""zerospeed.utils.ports: free ports outside the kernel's ephemeral range (Note in the module)."""

import socket

import pytest

from zerospeed.utils import ports


def _listener(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("0.0.0.0", port))
    s.listen()
    return s


def test_ports_lie_outside_the_ephemeral_range_bind_and_never_repeat():
    lo, hi = ports.ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:  # the kernel's own, read independently
        assert (lo, hi) == tuple(int(x) for x in f.read().split())
    drawn = [ports.free_port() for _ in range(200)]
    assert len(set(drawn)) == 200
    assert all(not lo <= p <= hi and 20000 <= p <= 65535 for p in drawn)
    for p in drawn[:20]:
        _listener(p).close()  # each binds on every address


def test_a_port_in_use_or_handed_out_is_skipped(monkeypatch):
    busy = ports.free_port()
    spare = busy + 1 if busy < 65535 else busy - 1
    if not ports.bindable("0.0.0.0", spare):
        pytest.skip(f"port {spare} is in use on this host")
    monkeypatch.setattr(ports, "_windows", lambda: [(min(busy, spare), max(busy, spare))])
    ports._ISSUED.discard(busy)  # from here on it is in use by a listener, not in this process's record
    # (earlier tests of this process may have drawn `spare` too; it binds, so it counts as free here —
    # a whole-suite CI run once failed on that: the window then held no port free_port would give)
    ports._ISSUED.discard(spare)
    with _listener(busy):
        assert ports.free_port() == spare
    assert ports.free_port() == busy  # free again, and not yet handed out
    # both now handed out; the window holds nothing else, so the kernel chooses (from its range)
    lo, hi = ports.ephemeral_range()
    assert lo <= ports.free_port() <= hi


def test_no_room_outside_the_range_falls_back_to_the_kernel(tmp_path, monkeypatch):
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", wide)
    assert ports._windows() == []
    assert 1024 <= ports.free_port() <= 65535
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "absent")
    assert ports.ephemeral_range() == (32768, 60999)  # Linux's default where the kernel does not say
