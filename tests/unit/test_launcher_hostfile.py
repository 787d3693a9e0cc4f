"""Hostfile parsing: accepted forms and every error with its message."""

import pytest

from zerospeed.launcher import hostfile
from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.hostfile import parse_hostfile, read_hostfile
from zerospeed.utils.errors import ConfigError

FORMAT = "expected 'HOSTNAME slots=N' with N >= 1 (e.g. 'worker-0 slots=8'); '#' starts a comment"


def test_plain_lines_in_file_order():
    hosts = parse_hostfile("worker-1 slots=8\nworker-0 slots=4\n")
    assert hosts == {"worker-1": 8, "worker-0": 4}
    assert list(hosts) == ["worker-1", "worker-0"]


def test_comments_blank_lines_and_whitespace():
    text = "# my cluster\n\n  worker-0   slots=2  # the fast one\n \t\nworker-1\tslots=16\n# end"
    assert parse_hostfile(text) == {"worker-0": 2, "worker-1": 16}


def test_ip_addresses_and_fqdn_hosts():
    assert parse_hostfile("10.0.0.1 slots=1\nnode.example.com slots=3") == {"10.0.0.1": 1, "node.example.com": 3}


@pytest.mark.parametrize(
    "line",
    [
        "worker-0",
        "worker-0 slots=",
        "worker-0 slots=x",
        "worker-0 slots=4 gpus=2",
        "slots=4",
        "worker-0 slot=4",
        "worker-0 slots=-1",
        "worker-0 slots=0",
    ],
)
def test_bad_line_names_source_line_and_format(line):
    with pytest.raises(LauncherError) as info:
        parse_hostfile(f"# header\nok slots=1\n{line}\n", source="/etc/ds_hosts")
    assert str(info.value) == f"/etc/ds_hosts:3: bad line {line!r}: {FORMAT}"


def test_duplicate_host_names_both_lines():
    with pytest.raises(LauncherError) as info:
        parse_hostfile("a slots=1\nb slots=2\n\na slots=2\n")
    assert str(info.value) == (
        "hostfile:4: host 'a' is listed twice (first on line 1); list each host once with its total slot count"
    )


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here\n   # nor here\n"])
def test_no_hosts(text):
    with pytest.raises(LauncherError) as info:
        parse_hostfile(text, source="hf")
    assert str(info.value) == f"hf: no hosts found; {FORMAT}"


def test_error_is_a_config_error_and_value_error():
    with pytest.raises(ConfigError):
        parse_hostfile("bad")
    with pytest.raises(ValueError):
        parse_hostfile("bad")


def test_read_named_file(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("w0 slots=2\nw1 slots=2\n")
    assert read_hostfile(str(path)) == {"w0": 2, "w1": 2}


def test_read_named_file_errors_name_the_path(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("w0 slots=2\nw1 two\n")
    with pytest.raises(LauncherError, match=f"^{path}:2: bad line 'w1 two'"):
        read_hostfile(str(path))


def test_named_file_must_exist(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(LauncherError) as info:
        read_hostfile(missing)
    assert str(info.value) == f"--hostfile {missing!r} does not exist; {FORMAT}"


def test_missing_default_file_means_local_only(tmp_path, monkeypatch):
    monkeypatch.setattr(hostfile, "DEFAULT_HOSTFILE", str(tmp_path / "hostfile"))
    assert read_hostfile(None) is None


def test_existing_default_file_is_used(tmp_path, monkeypatch):
    (tmp_path / "hostfile").write_text("w0 slots=3\n")
    monkeypatch.setattr(hostfile, "DEFAULT_HOSTFILE", str(tmp_path / "hostfile"))
    assert read_hostfile(None) == {"w0": 3}


def test_default_path_is_deepspeeds():
    assert hostfile.DEFAULT_HOSTFILE == "/job/hostfile"
