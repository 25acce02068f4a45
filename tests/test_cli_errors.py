"""What `capture-proxy export` and `inspect` say when they cannot do what was asked: an output
name `export` does not write, a missing output folder, a store or rollout that is not there
(exit status 2 for both commands), a record that does not verify (exit status 1 for both), a
three-slash store URL meant as an absolute path. One sentence on stderr each, without a
KeyError's quotes, and nothing written. Both store kinds, run in-process through `main`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main
from capture_proxy.errors import error_text
from tests.support.sink_factories import ParquetCase, Session, SinkCase, SQLiteCase


async def sealed_store(kind: str, tmp_path: Path) -> tuple[str, SinkCase, list[str]]:
    """A store with one sealed rollout ``done`` of two calls: its URL, its case, the call ids."""
    case: SinkCase
    if kind == "sqlite":
        sqlite = SQLiteCase(tmp_path)
        case, url = sqlite, f"sqlite:///{sqlite.path}"
    else:
        parquet = ParquetCase(tmp_path)
        case, url = parquet, f"parquet:///{parquet.location}"
    session = Session("done")
    ids = []
    for _ in range(2):
        record = session.next()[0]
        await case.sink.stage(record)
        ids.append(record.call_id)
    await case.sink.close()
    assert await asyncio.to_thread(main, ["seal", url, "done"]) == 0
    return url, case, ids


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(params=["sqlite", "parquet"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, SinkCase, list[str]]:
    return await sealed_store(request.param, tmp_path)


def test_export_refuses_an_output_name_it_does_not_write(
    store: tuple[str, SinkCase, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = store
    capsys.readouterr()
    for name, said in (("x.csv", "not a .csv file"), ("table", "not a name without a suffix")):
        code, out, err = run(["export", url, str(tmp_path / name)], capsys)
        assert (code, out) == (2, "")
        assert err.startswith(f"capture-proxy export: {tmp_path / name}: export writes Parquet")
        assert said in err
        assert "--format" in err
        assert err.count("\n") == 1
        assert not (tmp_path / name).exists()
    # Asked outright, any name is written in the format asked for.
    assert run(["export", url, str(tmp_path / "x.csv"), "--format", "parquet"], capsys)[0] == 0
    assert pq.read_table(tmp_path / "x.csv").column("rollout_id").to_pylist() == ["done"] * 2
    for name in ("x.parquet", "x.jsonl", "x.ndjson"):
        assert run(["export", url, str(tmp_path / name)], capsys)[0] == 0


def test_export_names_a_missing_output_folder(
    store: tuple[str, SinkCase, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = store
    capsys.readouterr()
    missing = tmp_path / "no-such-folder"
    code, out, err = run(["export", url, str(missing / "x.parquet")], capsys)
    assert (code, out) == (2, "")
    assert err == (
        f"capture-proxy export: output: the folder {missing} does not exist "
        f"(for {missing / 'x.parquet'}); create it first\n"
    )
    cursor = missing / "cursor.json"
    code, _, err = run(
        ["export", url, str(tmp_path / "x.parquet"), "--cursor", str(cursor)], capsys
    )
    assert code == 2
    assert err.startswith(f"capture-proxy export: --cursor: the folder {missing} does not exist")
    assert not missing.exists()
    assert not (tmp_path / "x.parquet").exists()  # refused before anything was read


def test_not_found_is_exit_2_in_export_and_inspect_without_key_error_quotes(
    store: tuple[str, SinkCase, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = store
    capsys.readouterr()
    out_file = tmp_path / "x.parquet"
    # An unknown rollout: a Parquet store's reader raises KeyError('nope'), SQLite's a KeyError
    # with a sentence; both read the same, without the quotes str(KeyError) adds.
    for argv in (
        ["export", url, str(out_file), "--rollout", "nope"],
        ["inspect", url, "--rollout", "nope"],
    ):
        code, out, err = run(argv, capsys)
        assert (code, out) == (2, "")
        assert err == f"capture-proxy {argv[0]}: no rollout 'nope' in {url}\n"
    assert not out_file.exists()
    missing = f"sqlite:///{tmp_path / 'missing.db'}"
    for argv in (["export", missing, str(out_file)], ["inspect", missing]):
        code, out, err = run(argv, capsys)
        assert (code, out) == (2, "")
        assert err.startswith(f"capture-proxy {argv[0]}: no capture-proxy store at ")
        assert err.count("\n") == 1
    assert run(["inspect", url, "--call", "nope"], capsys)[0] == 2
    assert not out_file.exists()
    assert not (tmp_path / "missing.db").exists()


def test_a_record_that_does_not_verify_is_exit_1_in_export_and_inspect(
    store: tuple[str, SinkCase, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, case, ids = store
    case.tamper(ids[1], "tokens")
    capsys.readouterr()
    out_file = tmp_path / "x.parquet"
    code, out, err = run(["export", url, str(out_file)], capsys)
    # The rollout that does not verify is left out, each problem said, exit 1 (the file holds
    # the rollouts that verify: docs/contract.md, "What verified means").
    assert code == 1
    assert out.startswith("wrote 0 row(s) of 0 rollout(s)")
    assert "left out 1 rollout(s): 1 that do not verify" in err
    assert f"does not verify: {ids[1]}: digest mismatch" in err
    code, out, err = run(["inspect", url, "--verify"], capsys)
    assert code == 1
    assert ids[1] in out
    # One call's view checks that call: the damaged one fails, the one beside it does not.
    code, out, _ = run(["inspect", url, "--call", ids[1]], capsys)
    assert code == 1
    assert "FAILED: " in out
    assert run(["inspect", url, "--call", ids[0]], capsys)[0] == 0
    # Without verification the same store exports: the check is what failed, nothing else.
    assert run(["export", url, str(out_file), "--no-verify"], capsys)[0] == 0


def test_a_three_slash_store_meant_as_absolute_is_named_with_the_url_to_write(
    store: tuple[str, SinkCase, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _, _ = store
    capsys.readouterr()
    path = url.split(":///", 1)[1]  # absolute
    scheme = url.split(":", 1)[0]
    three = f"{scheme}:///{path.lstrip('/')}"  # what one writes meaning the absolute path
    monkeypatch.chdir(tmp_path)
    for argv in (["export", three, "x.parquet"], ["inspect", three]):
        code, out, err = run(argv, capsys)
        assert (code, out) == (2, "")
        assert f"{three} is relative to the working folder (three slashes)" in err
        assert f"for it write {scheme}:////{path.lstrip('/')}" in err
        assert err.count("\n") == 1
    # Four slashes are the absolute path.
    assert run(["inspect", f"{scheme}:////{path.lstrip('/')}"], capsys)[0] == 0


def test_a_key_error_reads_as_its_sentence() -> None:
    assert (
        error_text(KeyError("no rollout 'x' in sqlite:///a.db"))
        == "no rollout 'x' in sqlite:///a.db"
    )
    assert error_text(KeyError("x")) == "x"
    assert error_text(ValueError("bad")) == "bad"
