"""The environment report: it runs here, has every section, and its probes give the right answers."""

import pytest

from zerospeed.env_report import collect, cpu_flags, format_report, main, o_direct_works, vector_extensions

SECTIONS = ["versions", "accelerator", "communication", "cpu", "pinned memory", "async I/O"]


def test_report_sections_and_values(tmp_path):
    import torch

    report = collect(tmp_path)
    assert list(report) == SECTIONS
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["zerospeed"] != "not installed"
    assert report["communication"]["gloo"] == "True"
    assert report["accelerator"]["accelerator"] in ("cpu", "cuda")
    assert set(report["cpu"]) >= {"model", "cores", "AVX2", "AVX-512F", "AMX tile"}
    assert report["async I/O"]["path"] == str(tmp_path)
    assert report["pinned memory"]["pinned memory"].startswith(("works", "unavailable"))


def test_main_prints_every_section(capsys, tmp_path):
    assert main(["--path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for section in SECTIONS:
        assert f"-- {section} " in out
    assert format_report({"a": {"k": "v"}}) == "-- a " + "-" * 59 + "\nk  v"


def test_cpu_flags_parsing():
    text = "processor: 0\nmodel name: X\nflags\t\t: fpu avx2 avx512f amx_tile\nprocessor: 1\nflags : sse\n"
    flags = cpu_flags(text)
    assert flags == {"fpu", "avx2", "avx512f", "amx_tile"}
    assert vector_extensions(flags) == {
        "AVX2": "yes",
        "AVX-512F": "yes",
        "AVX-512 BF16": "no",
        "AMX tile": "yes",
        "AMX BF16": "no",
    }


def test_o_direct_probe(tmp_path):
    ok, detail = o_direct_works(tmp_path)
    assert (ok, detail) == (True, "works") or "fails" in detail
    assert list(tmp_path.iterdir()) == []  # the probe file is removed
    ok, detail = o_direct_works(tmp_path / "missing")
    assert not ok and detail.startswith(f"cannot create a file under {tmp_path / 'missing'}")


@pytest.mark.parametrize("argv", [["--help"]])
def test_help_exits_cleanly(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "O_DIRECT" in capsys.readouterr().out
