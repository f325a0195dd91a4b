"""The deployment files the repository ships (cloud/deploy): nginx accepts the site as an
operator installs it, and the systemd unit and the container recipe start `sakura serve`
with arguments its parser accepts."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from sakura.cloud.origins import DEPLOY, NGINX_LOCATIONS, NGINX_SITE, nginx_binary

from sakura.cli import build_parser


def test_nginx_accepts_the_site_as_installed(tmp_path: Path):
    binary = nginx_binary()
    assert binary, "nginx is not installed (scripts/_env.sh installs nginx-light)"
    (tmp_path / "snippets").mkdir()
    shutil.copy(NGINX_LOCATIONS, tmp_path / "snippets" / "sakura-packs.locations")
    shutil.copy(NGINX_SITE, tmp_path / "sakura-packs")
    (tmp_path / "nginx.conf").write_text(f"""pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
events {{ }}
http {{
    access_log off;
    include {tmp_path}/sakura-packs;
}}
""")
    check = subprocess.run([binary, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "syntax is ok" in check.stderr


def _serve_args(argv: list[str]):
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    return args


def test_systemd_unit_runs_sakura_serve_with_valid_arguments():
    unit = (DEPLOY / "systemd" / "sakura-serve.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert argv[0].endswith("/sakura")
    args = _serve_args(argv[1:])
    assert args.dir == "/srv/sakura/catalog" and args.port == 8000
    assert "Restart=on-failure" in unit and "ReadOnlyPaths=/srv/sakura/catalog" in unit


def test_container_recipe_runs_sakura_serve_with_valid_arguments():
    import json

    recipe = (DEPLOY / "container" / "Containerfile").read_text()
    entry = json.loads(next(line for line in recipe.splitlines()
                            if line.startswith("ENTRYPOINT ")).removeprefix("ENTRYPOINT "))
    cmd = json.loads(next(line for line in recipe.splitlines()
                          if line.startswith("CMD ")).removeprefix("CMD "))
    assert entry[0] == "sakura"
    args = _serve_args(entry[1:] + cmd)
    assert args.host == "0.0.0.0" and args.dir == "/catalog"
    for folder in ("sakura", "cloud", "codec", "dit", "edge", "traces"):
        assert f"COPY {folder} ./{folder}" in recipe
