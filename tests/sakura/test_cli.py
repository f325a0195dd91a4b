"""The `sakura` front door keeps its contract on every command.

Bad arguments print the command's usage and exit 2 before any work; bad input prints exactly
one ``sakura: error: ...`` line and exits 1; nothing prints a traceback; ``--json PATH``
writes JSON (``-``: standard output holds nothing else); ``--version``; help on every
option; ``sakura --help`` loads nothing heavy (no torch, no web stack).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sakura import __version__
from sakura.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "fastapi", "uvicorn", "aiohttp", "skimage", "matplotlib", "transformers",
         "diffusers", "executorch", "onnxruntime", "boto3", "safetensors", "zstandard")
SERVER = "http://127.0.0.1:9"
EDIT = ["edit", "--server", SERVER, "--template", "t", "--prompt", "p", "--no-state"]


def run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sakura.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=kw.pop("cwd", ROOT), **kw)


def invoke(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("sakura: error:")]


# argv (with {tmp} for the test's folder) -> what the message names
USAGE_ERRORS = [
    ([], "usage: sakura"),
    (["frobnicate"], "invalid choice"),
    (["build", "--no-such-option"], "unrecognized arguments"),
    (["bench"], "usage: sakura bench"),
    (["pack"], "usage: sakura pack"),
    (["traces"], "usage: sakura traces"),
    (["render"], "usage: sakura render"),
    (["serve", "--port", "99999"], "99999 is not a TCP port"),
    (["serve", "--port", "-1"], "is not a TCP port"),
    (["serve", "--port", "http"], "'http' is not an integer"),
    (["serve"], "give the published catalog directory"),
    (["serve", "{tmp}", "--s3-endpoint", "http://127.0.0.1:1"], "--s3-endpoint needs --s3-bucket"),
    (["serve", "{tmp}", "--s3-endpoint", "ftp://x"], "is not an http(s) URL"),
    (["serve", "{tmp}", "--log-level", "loud"], "invalid choice"),
    (["edit", "--server", "not-a-url", "--template", "t", "--prompt", "p", "--out", "o.png"],
     "'not-a-url' is not an http(s) URL"),
    (["edit", "--server", "http://127.0.0.1:99999", "--template", "t", "--prompt", "p",
      "--out", "o.png"], "is not a URL"),
    ([*EDIT, "--out", "{tmp}/o.png", "--startup-fraction", "2"], "must be a number in [0, 1]"),
    ([*EDIT, "--out", "{tmp}/o.png", "--startup-fraction", "nan"], "must be a number in [0, 1]"),
    ([*EDIT, "--out", "{tmp}/o.png", "--rate", "-5"], "--rate: must be > 0"),
    ([*EDIT, "--out", "{tmp}/o.png", "--rate", "5", "--trace", "x"], "not allowed with"),
    ([*EDIT, "--out", "{tmp}/o.jpg"], "is not a .png file name"),
    ([*EDIT, "--out", "{tmp}/o.png", "--threads", "0"], "--threads: must be >= 1"),
    ([*EDIT, "--out", "{tmp}/o.png", "--scale", "0"], "--scale: must be > 0"),
    ([*EDIT, "--out", "{tmp}/o.png", "--start", "-1"], "--start: must be >= 0"),
    ([*EDIT, "--out", "{tmp}/o.png", "--policy", "best"], "invalid choice"),
    ([*EDIT, "--out", "{tmp}/o.png", "--model-path", "{tmp}"], "--model-path needs --model"),
    ([*EDIT, "--out", "{tmp}/o.png", "--model", "sakura-flux2", "--reference", "r.png"],
     "--reference: sakura-flux2 was trained without reference images"),
    ([*EDIT, "--out", "{tmp}/o.png", "--pack", "zip"], "unknown codec 'zip'"),
    (["edit", "--server", SERVER, "--prompt", "p", "--out", "o.png"], "--template"),
    (["traces", "stats", "--window", "0", "x"], "--window: must be > 0"),
    (["traces", "stats"], "the following arguments are required: PATH"),
    (["bench", "link", "--max-mbps", "0"], "--max-mbps: must be > 0"),
    (["build", "--codecs", "zip", "--out", "{tmp}/packs"], "--codecs: unknown codec 'zip'"),
    (["build", "--codecs", ",", "--out", "{tmp}/packs"], "give at least one codec"),
    (["build", "--blocks-per-shard", "0"], "--blocks-per-shard: must be >= 1"),
    (["build", "--profile-psnr", "-1"], "--profile-psnr: must be >= 0"),
    (["build", "--model-path", "{tmp}", "--out", "{tmp}/packs"], "--model-path needs --model"),
    (["build", "--model", "flux2", "--out", "{tmp}/packs"], "needs --model-path"),
    (["build", "--model", "flux2", "--model-path", "{tmp}", "--weights", "w"],
     "--weights is the shipped model's"),
    (["bench", "codec"], "the following arguments are required: --json"),
    (["bench", "codec", "--json", "x", "--steps", "0"], "--steps: must be >= 1"),
    (["bench", "codec", "--json", "x", "--cache", "a", "--synthetic"], "not allowed with"),
    (["bench", "serve", "--json", "x", "--clients", "0"], "--clients: must be >= 1"),
    (["bench", "serve", "--json", "x", "--duration", "-1"], "--duration: must be > 0"),
    (["bench", "native", "--json", "x", "--shards", "0"], "--shards: must be >= 1"),
    (["bench", "native"], "give --json PATH (or --export DIR)"),
    (["bench", "phone", "--json", "x", "--keys", "x86,gpu"], "--keys: unknown key gpu"),
    (["bench", "phone", "--json", "x", "--keys", "bundle", "--bundle-record", "{tmp}/no.json"],
     "--bundle-record: cannot read"),
    (["bench", "kv", "--threads", "0"], "--threads: must be >= 1"),
    (["bench", "adapters", "--models", "nope"], "unknown model(s) nope"),
    (["bench", "edit", "--json", "x", "--runs", "0"], "--runs: must be >= 1"),
    (["bench", "edit", "--json", "", "--quick"], "give a file path, or - for standard output"),
    (["bench", "backends", "--json", "x", "--backends", "tpu"], "invalid choice"),
    (["bench", "flashdiff", "--workers", "0"], "--workers: must be >= 1"),
    (["render", "replay", "--requests", "0"], "--requests: must be >= 1"),
    (["render", "serve", "--port", "70000"], "is not a TCP port"),
    (["replay", "--out", "o", "--startup-fraction", "1.5"], "must be a number in [0, 1]"),
    (["replay", "--out", "o", "--starts", "0"], "--starts: must be >= 1"),
    (["replay", "--out", "o", "--max-load", "-1"], "--max-load: must be >= 0"),
    (["replay", "--regime", "fast", "--out", "o"], "invalid choice"),
    (["report"], "the following arguments are required: DIR"),
    (["train", "--t-uniform", "2"], "--t-uniform: must be a number in [0, 1]"),
    (["train", "--steps", "0"], "--steps: must be >= 1"),
    (["demo", "--start", "-1"], "--start: must be >= 0"),
    (["pack", "inspect"], "the following arguments are required: TARGET"),
]


@pytest.mark.parametrize("argv,needle", USAGE_ERRORS, ids=lambda v: " ".join(v) if
                         isinstance(v, list) else None)
def test_bad_arguments_exit_2_with_the_usage(argv, needle, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, out, err = invoke(argv, capsys)
    assert code == 2, (argv, err)
    assert "usage: sakura" in err and needle in err, (argv, err)
    assert "Traceback" not in err
    assert not (tmp_path / "packs").exists()  # nothing built, nothing published


def _published(tmp_path: Path) -> Path:
    d = tmp_path / "published"
    d.mkdir()
    (d / "catalog.json").write_text('{"version": 1, "templates": {}}')
    return d


INPUT_ERRORS = [
    (["build", "{tmp}/missing.json", "--out", "{tmp}/packs"], "catalog not found"),
    (["build", "--templates", "face-cook,nope", "--out", "{tmp}/packs"],
     "unknown template id(s) nope"),
    (["build", "--weights", "{tmp}/missing.safetensors", "--out", "{tmp}/packs"],
     "--weights: no such file"),
    (["build", "--model", "flux2", "--model-path", "{tmp}/nowhere", "--out", "{tmp}/packs"],
     "--model-path: no such folder"),
    (["pack", "inspect", "{tmp}/missing"], "no such file or folder"),
    (["pack", "inspect", "{tmp}"], "holds no pack manifest"),
    (["pack", "inspect", "{tmp}/bad.pack"], "not a SAKURA pack"),
    (["traces", "stats", "{tmp}/missing.txt"], "does not exist"),
    (["traces", "stats", "{tmp}/notes.trace"], "unrecognised first line"),
    (["serve", "{tmp}/nope"], "is not a directory"),
    (["serve", "{tmp}"], "has no catalog.json"),
    (["serve", "{tmp}/published", "--tokens-file", "{tmp}/short-tokens"], "at least 16"),
    ([*EDIT, "--out", "{tmp}/o.png", "--reference", "{tmp}/missing.png"],
     "--reference: no such file"),
    ([*EDIT, "--out", "{tmp}/o.png", "--trace", "{tmp}/missing.txt"], "--trace: no such file"),
    ([*EDIT, "--out", "{tmp}/o.png", "--catalog", "{tmp}/missing.json"], "catalog not found"),
    (["edit", "--server", SERVER, "--template", "nope", "--prompt", "p", "--out", "{tmp}/o.png",
      "--catalog", str(ROOT / "dit" / "catalog")], "template 'nope' is not in the catalog"),
    (["bench", "kv", "--template", "nope"], "template 'nope' is not in the shipped catalog"),
    (["bench", "codec", "--json", "{tmp}/o.json", "--cache", "{tmp}/missing.safetensors"],
     "cannot read cache"),
    (["bench", "backends", "--json", "{tmp}/o.json", "--template", "nope"],
     "template 'nope' is not in the shipped catalog"),
    (["bench", "edit", "--json", "{tmp}/o.json", "--catalog-dir", "{tmp}/nope"],
     "--catalog-dir: no such folder"),
    (["bench", "model", "--weights", "{tmp}/missing.safetensors"], "--weights: no such file"),
    (["demo", "--template", "nope"], "template 'nope' is not in the shipped catalog"),
    (["replay", "{tmp}/missing.yaml", "--out", "{tmp}/o"], "does not exist"),
    (["report", "{tmp}/nothing"], "not a replay results folder"),
    (["render", "replay", "--weights", "{tmp}/missing.safetensors"], "--weights: no such file"),
    (["bench", "flashdiff", "--serve-size", "130"], "--serve-size: must be a multiple of 4"),
]


@pytest.mark.parametrize("argv,needle", INPUT_ERRORS, ids=lambda v: " ".join(v) if
                         isinstance(v, list) else None)
def test_bad_input_is_one_error_line(argv, needle, tmp_path, capsys):
    _published(tmp_path)
    (tmp_path / "short-tokens").write_text("short\n")
    (tmp_path / "bad.pack").write_bytes(b"NOPE" + b"\0" * 100)
    (tmp_path / "notes.trace").write_text("hello world\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, out, err = invoke(argv, capsys)
    assert code == 1, (argv, err)
    lines = error_lines(err)
    assert len(lines) == 1 and needle in lines[0], (argv, err)
    assert "Traceback" not in err
    assert not (tmp_path / "packs" / "catalog.json").exists()  # nothing published


def test_bad_arguments_cost_nothing_heavy():
    """Usage errors are found before torch (or the web stack) is even imported."""
    cases = [USAGE_ERRORS[i][0] for i in range(len(USAGE_ERRORS))
             if "codec" not in USAGE_ERRORS[i][1] and "--models" not in USAGE_ERRORS[i][0]
             and "--model" not in USAGE_ERRORS[i][0]]
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from sakura.cli import main
        codes = []
        for argv in {json.dumps([[a.format(tmp="/nonexistent") for a in c] for c in cases])}:
            with contextlib.redirect_stderr(io.StringIO()):
                try:
                    codes.append(main(argv))
                except SystemExit as exc:
                    codes.append(exc.code)
        print(json.dumps({{"codes": codes,
                           "heavy": [m for m in {list(HEAVY)!r} if m in sys.modules]}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc["codes"]) == {2} and len(doc["codes"]) == len(cases) > 40
    assert doc["heavy"] == []


def test_help_of_every_command_loads_nothing_heavy():
    parser_paths = [[]] + [p for p in _command_paths(build_parser()) if p]
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from sakura.cli import main
        for argv in {json.dumps(parser_paths)}:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main(argv + ["--help"])
                except SystemExit as exc:
                    assert exc.code == 0, argv
            assert out.getvalue().startswith("usage: sakura"), argv
        print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    assert len(parser_paths) > 25


def _command_paths(parser, prefix=()):
    yield list(prefix)
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield from _command_paths(sub, (*prefix, name))


def test_every_option_and_command_has_help():
    import argparse

    missing = []

    def walk(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                missing.extend(f"{parser.prog} {n}" for n in action.choices if n not in helped)
                for sub in action.choices.values():
                    walk(sub)
            elif action.help is None:
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser())
    assert missing == []


def test_json_goes_to_a_file_or_to_stdout_alone(tmp_path, capsys):
    trace = tmp_path / "link.down"  # Mahimahi: one 1500-byte opportunity per ms = 12 Mbit/s
    trace.write_text("".join(f"{t}\n" for t in range(1, 4001)))
    code, out, err = invoke(["traces", "stats", str(trace), "--json", "-"], capsys)
    assert code == 0 and not err
    (row,) = json.loads(out)  # stdout holds the JSON and nothing else
    assert row["median_mbps"] == pytest.approx(12.0)
    target = tmp_path / "sub" / "stats.json"
    code, out, _ = invoke(["traces", "stats", str(trace), "--json", str(target)], capsys)
    assert code == 0 and out == ""
    assert json.loads(target.read_text()) == [row]
    code, out, _ = invoke(["traces", "stats", str(trace)], capsys)
    assert code == 0 and out.splitlines()[0].split()[:2] == ["trace", "format"]


def test_the_clis_copies_of_package_constants_agree():
    """The cli modules name a few package constants themselves (importing them would import
    torch or the builder at `sakura --help`); they must stay equal."""
    from sakura.cloud.build import DEFAULT_CODECS
    from sakura.cloud.cli import BUILD_CODECS
    from sakura.dit.adapters.bench import KINDS
    from sakura.dit.adapters.cli import BENCH_MODELS
    from sakura.dit.cli import DEFAULT_TRAIN_DIR, SHIPPED_CATALOG, template_ids
    from sakura.dit.templates import DEFAULT_CATALOG, load_catalog
    from sakura.dit.train import TrainConfig
    from sakura.edge.backends import BACKENDS
    from sakura.edge.cli import BACKEND_MODULES, MAX_INFLIGHT, RETRY_WINDOW_S
    from sakura.edge.retry import RetryPolicy
    from sakura.edge.runtime import EditOptions

    assert BUILD_CODECS == DEFAULT_CODECS and BENCH_MODELS == KINDS
    assert SHIPPED_CATALOG == DEFAULT_CATALOG and template_ids() == list(load_catalog())
    assert Path(DEFAULT_TRAIN_DIR) == Path(TrainConfig().out_dir)
    assert set(BACKEND_MODULES) == set(BACKENDS) - {"torch"}
    assert MAX_INFLIGHT == EditOptions.max_inflight
    assert RETRY_WINDOW_S == RetryPolicy.window_s


def test_bench_cli_times_every_help(tmp_path, capsys):
    out = tmp_path / "cli.json"
    code, printed, _ = invoke(["bench", "cli", "--json", str(out), "--repeats", "1",
                               "--commands", ",build,bench kv"], capsys)
    assert code == 0 and "slowest" in printed
    doc = json.loads(out.read_text())
    assert set(doc["commands"]) == {"sakura", "build", "bench kv"}
    for t in doc["commands"].values():
        assert t["wall_s_median"] >= t["cpu_s_median"] * 0.5 > 0
    assert len(doc["loadavg_before"]) == 3 and doc["cpus"] >= 1
    code, _, err = invoke(["bench", "cli", "--json", str(out), "--commands", "nope"], capsys)
    assert code == 2 and "unknown command(s) nope" in err


def test_traces_stats_takes_the_named_sets_traces_list_shows(tmp_path, monkeypatch, capsys):
    for name in ("a", "b"):
        (tmp_path / "mahimahi").mkdir(exist_ok=True)
        (tmp_path / "mahimahi" / f"{name}.down").write_text("".join(f"{t}\n" for t in
                                                                    range(1, 2001)))
    monkeypatch.setenv("SAKURA_TRACES", str(tmp_path))
    monkeypatch.chdir(tmp_path / "mahimahi")  # (a folder named like a set would win)
    code, out, _ = invoke(["traces", "list", "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["sets"]["mahimahi"] == 2
    code, out, _ = invoke(["traces", "stats", "mahimahi", "--json", "-"], capsys)
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["a.down", "b.down"]
    code, _, err = invoke(["traces", "stats", "wifi"], capsys)
    assert code == 1 and error_lines(err) == [
        f"sakura: error: trace set 'wifi' is empty under {tmp_path} (wifi/*_wifi.csv)"]


def test_version(capsys):
    code, out, _ = invoke(["--version"], capsys)
    assert code == 0 and out.strip() == f"sakura {__version__}"


def test_a_closed_pipe_ends_quietly(tmp_path):
    trace = tmp_path / "link.down"
    trace.write_text("".join(f"{t}\n" for t in range(1, 2001)))
    proc = subprocess.Popen([sys.executable, "-m", "sakura.cli", "traces", "stats", str(trace),
                             str(trace), "--json", "-"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # the reader is gone before the first write (as `| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141  # as a shell reports a process ended by SIGPIPE
    assert err == ""


@pytest.mark.parametrize("signame, code, line", [("SIGTERM", 143, "sakura: terminated"),
                                                   ("SIGINT", 130, "sakura: interrupted")])
def test_a_stop_is_one_line_even_with_a_half_built_object(signame, code, line):
    """The signal lands while an object is half built (as an asyncio loop whose ``__init__``
    a SIGTERM cut before its self-pipe, seen in CI): its failing ``__del__`` runs when the
    stop's traceback goes, and the user still sees only the one line. Ctrl-C as from a
    terminal: a shell without job control starts background commands with SIGINT ignored,
    and the child inherits that (a CI started with `&` failed here), so the script restores
    Python's own handler first."""
    script = textwrap.dedent(f"""
        import argparse, os, signal, sys
        from sakura import cli

        signal.signal(signal.SIGINT, signal.default_int_handler)

        class HalfBuilt:
            def __init__(self):
                os.kill(os.getpid(), signal.{signame})  # the stop lands in here
                self.pipe = 1

            def __del__(self):
                self.pipe  # AttributeError: never set

        def build_parser():
            p = argparse.ArgumentParser(prog="sakura")
            p.set_defaults(func=lambda args: HalfBuilt())
            return p

        cli.build_parser = build_parser
        sys.exit(cli.main([]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert (proc.returncode, proc.stderr) == (code, line + "\n")


def test_server_start_up_failures_are_one_error_line(tmp_path):
    published = _published(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = run("serve", str(published), "--port", str(port), timeout=60)
    assert r.returncode == 1
    assert error_lines(r.stderr) == [
        f"sakura: error: cannot listen on 127.0.0.1:{port}: Address already in use (another "
        "server is listening there: pick another --port)"]
    assert "Traceback" not in r.stderr
    r = run("serve", str(published), "--host", "192.0.2.1", timeout=60)  # not this machine's
    assert r.returncode == 1
    assert error_lines(r.stderr) == [
        "sakura: error: cannot listen on 192.0.2.1:8000: Cannot assign requested address (no "
        "such address on this machine: check --host)"]
    assert "Traceback" not in r.stderr


def _blocked(modules: tuple[str, ...], argv: list[str]) -> str:
    """Python source running ``sakura argv`` as if ``modules`` were not installed."""
    return (f"import sys\nfor m in {modules!r}: sys.modules[m] = None\n"
            f"from sakura.cli import main\nsys.exit(main({argv!r}))\n")


def test_an_unknown_template_is_refused_before_torch_loads(tmp_path):
    """`sakura edit` asks the server's catalog for the template before it imports torch or
    loads the model (with the Python runtime; the native one checks its module first)."""
    published = _published(tmp_path)
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from sakura.cloud.runner import serve_in_thread
        from sakura.cloud.server import create_app
        from sakura.cloud.storage import LocalStorage
        from sakura.cli import main
        err = io.StringIO()
        with serve_in_thread(create_app(LocalStorage({str(published)!r}))) as url:
            with contextlib.redirect_stderr(err):
                code = main(["edit", "--server", url, "--template", "nope", "--prompt", "p",
                             "--out", {str(tmp_path / "o.png")!r}, "--no-state",
                             "--runtime", "python"])
        print(json.dumps({{"code": code, "err": err.getvalue(),
                           "torch": "torch" in sys.modules}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["code"] == 1 and not doc["torch"]
    (line,) = error_lines(doc["err"])
    assert "unknown template 'nope'" in line


def test_a_missing_extra_is_named(tmp_path):
    cases = [
        (("boto3", "botocore"), ["serve", "--s3-bucket", "packs"],
         "sakura: error: --s3-bucket needs boto3, which is not installed: "
         "pip install 'sakura-kv[s3]'"),
        (("torch",), ["build", "--templates", "face-cook", "--out", str(tmp_path / "p")],
         "sakura: error: torch is not installed: pip install 'sakura-kv[model]'"),
        (("diffusers",), ["build", "--model", "flux2", "--model-path", str(tmp_path)],
         "sakura: error: --model needs diffusers, which is not installed: "
         "pip install 'sakura-kv[diffusers]'"),
        (("executorch",), [*EDIT, "--out", str(tmp_path / "o.png"), "--backend", "executorch"],
         "sakura: error: --backend executorch needs executorch, which is not installed: "
         "pip install 'sakura-kv[executorch]'"),
    ]
    for modules, argv, line in cases:
        r = subprocess.run([sys.executable, "-c", _blocked(modules, argv)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 1, (argv, r.stderr)
        assert error_lines(r.stderr) == [line], (argv, r.stderr)
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "p").exists()


def test_the_server_runs_without_torch(tmp_path):
    """The light core: `sakura serve` imports no torch (nor any model-side package)."""
    import httpx

    published = _published(tmp_path)
    blocked = ("torch", "safetensors", "transformers", "aiohttp", "zstandard", "skimage")
    proc = subprocess.Popen(
        [sys.executable, "-c", _blocked(blocked, ["serve", str(published), "--port", "0",
                                                  "--log-level", "warning"])],
        stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stderr.readline()
        assert line.startswith("sakura serve: listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        r = httpx.get(f"{url}/v1/templates", timeout=30)
        assert r.status_code == 200 and r.json()["templates"] == {}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_dependency_warnings_are_quiet_in_spawned_workers_too():
    """torchao's import logs a warning per kernel library it cannot load on this CPU build;
    every command silences it (``sakura.output.quiet_dependency_logs``), and so must each
    process a command spawns that imports it (``sakura replay``'s parallel pack builds
    printed the lines once per worker). Checked where the import does log without it."""
    pytest.importorskip("torchao")

    def stderr_of(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300).stderr

    loud = stderr_of("import torchao")
    if "torchao" not in loud:
        pytest.skip("torchao logs nothing on import here")
    quiet = stderr_of("from sakura.output import quiet_dependency_logs\n"
                      "quiet_dependency_logs()\nimport torchao")
    assert "torchao" not in quiet, quiet
