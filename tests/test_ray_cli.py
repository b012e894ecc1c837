"""The Ray command line without a Ray cluster (Ray not installed: `tandem serve --launcher ray`
exits 2 with one line naming the extra, and so do `experiment --ray` and `plan --ray`), and hostile --ray-*
values (one line, exit 2, before anything starts)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.cli.main import main

RAY_MISSING = "needs Ray, which is not installed: pip install 'tandem[ray]'"


@pytest.fixture
def ckpt(tmp_path) -> str:
    """A folder that passes serve's checkpoint check (config.json); nothing is loaded before the errors tested."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture
def no_ray(monkeypatch):
    """`import ray` fails in this process, as where Ray is not installed."""
    monkeypatch.setitem(sys.modules, "ray", None)


def test_serve_launcher_ray_without_ray_installed_exits_2_with_one_line(ckpt, tmp_path):
    """Protects the one-line refusal in a real process: a `ray` that cannot be imported (a module shadowing it on
    PYTHONPATH raises ImportError, as a missing package does) makes `tandem serve --launcher ray` print exactly one
    line naming the extra and exit 2."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "ray.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--model", ckpt, "--launcher", "ray"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"tandem: error: --launcher ray {RAY_MISSING}\n"


@pytest.mark.parametrize("argv, flag", [
    (["experiment", "--preset", "demo", "--ray", "--no-progress"], "--ray"),
    (["plan", "--gpus", "8", "--workload", "toolbench", "--ray", "--no-progress"], "--ray"),
])
def test_sweeps_with_ray_without_ray_installed_exit_2_with_one_line(no_ray, tmp_path, capsys, argv, flag):
    """Protects the one-line refusal for the sweeps: --ray without Ray is one line naming the extra, exit 2."""
    if argv[0] == "experiment":
        argv = argv + ["--out", str(tmp_path / "rep")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"tandem: error: {flag} {RAY_MISSING}\n"


@pytest.mark.parametrize("address, says", [
    ("nonsense", "is not 'auto' or HOST:PORT"),
    ("10.0.0.1:0", "is not 'auto' or HOST:PORT"),
    ("10.0.0.1:65536", "is not 'auto' or HOST:PORT"),
    ("host:port", "is not 'auto' or HOST:PORT"),
    (":6379", "is not 'auto' or HOST:PORT"),
    ("bad host!:6379", "is not a host name or IP address"),
    ("a;rm -rf /:6379", "is not a host name or IP address"),
    ("x" * 300 + ":6379", "is not a host name or IP address"),
])
def test_a_bad_ray_address_is_one_line_and_exit_2(ckpt, capsys, address, says):
    """Protects hostile input: a malformed --ray-address is refused by the parser (no connection tried)."""
    assert main(["serve", "--model", ckpt, "--launcher", "ray", "--ray-address", address]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem: error: argument --ray-address: ") and says in err


@pytest.mark.parametrize("extra, says", [
    (["--ray-address", "auto"], "--ray-address applies to --launcher ray"),
    (["--ray-place", "decode=node_d"], "--ray-place applies to --launcher ray"),
    (["--ray-namespace", "x"], "--ray-namespace applies to --launcher ray"),
    (["--launcher", "ray", "--ray-place", "router=node_r"], "expected ROLE=RESOURCE with ROLE prefill, decode or"),
    (["--launcher", "ray", "--ray-place", "decode=GPU"], "'GPU' is not a custom Ray resource name"),
    (["--launcher", "ray", "--ray-place", "decode=a b"], "'a b' is not a custom Ray resource name"),
    (["--launcher", "k8s"], "argument --launcher: invalid choice: 'k8s'"),
])
def test_stray_or_bad_ray_flags_are_one_line_and_exit_2(ckpt, capsys, extra, says):
    """Protects the flags' checks: --ray-* without --launcher ray, and bad --ray-place values."""
    assert main(["serve", "--model", ckpt, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_ray_address_without_ray_on_a_sweep_is_refused(tmp_path, capsys):
    """Protects --ray-address on a sweep: it needs --ray (exit 2, one line)."""
    assert main(["experiment", "--preset", "demo", "--ray-address", "auto", "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == "tandem: error: --ray-address applies to --ray\n"


def test_nothing_listening_at_the_ray_address_is_one_line_and_exit_2(tmp_path, capsys):
    """Protects against ray.init's minutes of retries: an address where nothing listens is refused at once
    (a TCP probe), one line, exit 2."""
    pytest.importorskip("ray", reason="Ray is not installed: connecting needs it")
    import socket
    with socket.socket() as s:                 # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["experiment", "--preset", "demo", "--ray", "--ray-address", f"127.0.0.1:{port}", "--no-progress",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem: error: no Ray cluster at 127.0.0.1:{port} (") and err.count("\n") == 1
