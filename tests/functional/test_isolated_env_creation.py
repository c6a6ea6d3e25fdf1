"""Creating isolated environments for real (a venv and an offline pip install each, ~1 s each on 2 cores)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.distributed.isolated_env import (
    SPEC_FILE,
    IsolatedEnvError,
    IsolatedEnvSpec,
    ensure_isolated_env,
    env_dir,
    log_path,
)

pytestmark = pytest.mark.functional


def _local_wheel(tmp_path: Path, init: str = "VALUE = 42\n", name: str = "hello-isolated", version: str = "1.0",
                 requires: tuple[str, ...] = ()) -> Path:
    """A minimal wheel built by hand (`init`: its module's code): pip installs it offline, with
    nothing to build."""
    import zipfile

    module = name.replace("-", "_")
    wheel = tmp_path / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{module}/__init__.py": init,
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(name, text)
    return wheel


def _offline_spec(requirement: str) -> IsolatedEnvSpec:
    return IsolatedEnvSpec(
        "unit-test", (requirement,), pip_args=("--no-index",),
        check_imports=(), upgrade_pip=False,
    )


def test_two_concurrent_creators_build_once_and_share_it(tmp_path):
    spec = _offline_spec(str(_local_wheel(tmp_path)))
    root = tmp_path / "envs"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from posttrain.distributed.isolated_env import IsolatedEnvSpec, ensure_isolated_env
        spec = IsolatedEnvSpec({spec.name!r}, {spec.requirements!r}, pip_args={spec.pip_args!r}, upgrade_pip=False)
        print("PYTHON", ensure_isolated_env(spec, Path({str(root)!r})))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    pythons = {line.split(" ", 1)[1] for out, _ in outputs for line in out.splitlines() if line.startswith("PYTHON")}
    assert pythons == {str(env_dir(spec, root) / "bin" / "python")}
    # One process built it; the other waited for the lock (or found it complete) and reused it.
    assert sum("creating isolated environment" in err for _, err in outputs) == 1
    assert (env_dir(spec, root) / SPEC_FILE).is_file()
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]  # nothing half-built left behind
    python = next(iter(pythons))
    import os

    assert subprocess.run([python, "-c", "import hello_isolated; print(hello_isolated.VALUE)"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout.strip() == "42"
    # Not compiled at install; compiled on that first import and kept, even under PYTHONDONTWRITEBYTECODE.
    assert [p.name.split(".")[0] for p in env_dir(spec, root).rglob("hello_isolated/__pycache__/*.pyc")] == ["__init__"]
    # Asking again is instant and builds nothing.
    lines = []
    assert str(ensure_isolated_env(spec, root, log=lines.append)) == python and lines == []


def test_a_failed_creation_names_the_package_and_the_log(tmp_path):
    spec = _offline_spec("posttrain-no-such-package==1.0")
    root = tmp_path / "envs"
    with pytest.raises(IsolatedEnvError) as error:
        ensure_isolated_env(spec, root, log=lambda line: None)
    message = str(error.value)
    assert "pip could not install posttrain-no-such-package==1.0" in message
    assert str(log_path(spec, root)) in message and log_path(spec, root).is_file()
    assert not env_dir(spec, root).exists()
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_the_build_shows_its_steps_and_pips_lines(tmp_path):
    """On a terminal (`show_pip`): each step, then pip's lines naming the package; the log keeps all."""
    spec = _offline_spec(str(_local_wheel(tmp_path)))
    root = tmp_path / "envs"
    lines: list[str] = []
    ensure_isolated_env(spec, root, log=lines.append, show_pip=True, progress_every_s=3600)
    steps = [line for line in lines if line.startswith("[posttrain]   ") and not line.startswith("[posttrain]     ")]
    assert steps == ["[posttrain]   creating the virtual environment...",
                     "[posttrain]   installing 1 pinned requirement..."]
    pip_lines = [line.removeprefix("[posttrain]     ") for line in lines if line.startswith("[posttrain]     ")]
    assert pip_lines[0].startswith("Processing ") and pip_lines[0].endswith("hello_isolated-1.0-py3-none-any.whl")
    assert pip_lines[1:] == ["Installing collected packages: hello-isolated", "Successfully installed hello-isolated-1.0"]
    assert lines[-1].startswith("[posttrain] isolated environment 'unit-test' ready in ")
    log = log_path(spec, root).read_text()
    assert "$ " in log and "Installing collected packages: hello-isolated" in log and "Successfully installed" in log


def test_off_a_terminal_a_long_step_says_how_long_and_pips_last_line(tmp_path, monkeypatch):
    """Without pip's lines (CI logs): a line every `progress_every_s` with the time so far and the
    package pip named last. The import check lasts until such a line has been written (a file
    the log makes), so the step is slow however fast the machine is."""
    marker = tmp_path / "said"
    wait = (
        "import os, time\n"
        "deadline = time.monotonic() + 300\n"
        "while not os.path.exists(os.environ['HELLO_ISOLATED_WAIT_FOR']) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    monkeypatch.setenv("HELLO_ISOLATED_WAIT_FOR", str(marker))
    spec = IsolatedEnvSpec("unit-test", (str(_local_wheel(tmp_path, wait)),), pip_args=("--no-index",),
                           check_imports=("hello_isolated",), upgrade_pip=False)
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("[posttrain]   still checking that hello_isolated imports ("):
            marker.touch()

    ensure_isolated_env(spec, tmp_path / "envs", log=log, show_pip=False, progress_every_s=0.5)
    assert marker.exists() and lines[-1].startswith("[posttrain] isolated environment 'unit-test' ready in ")
    assert not [line for line in lines if line.startswith("[posttrain]     ")]  # no pip line of its own
    still = [line for line in lines if line.startswith("[posttrain]   still ")]
    assert all(re.fullmatch(r"\[posttrain\]   still [a-z0-9 _]+ \(\d+ s(; .+)?\)", line) for line in still), still
    assert any(line.startswith("[posttrain]   still checking that hello_isolated imports (") for line in still)
    # Once pip has named a package, the install step's lines say which (before, the time alone).
    named = [line for line in still if "installing 1 pinned requirement (" in line and "; " in line]
    assert all(re.search(r"; (Processing .*hello_isolated-1.0-py3-none-any.whl|Installing collected packages: "
                         r"hello-isolated|Successfully installed hello-isolated-1.0)\)$", line) for line in named), named


def test_a_shared_distribution_is_linked_not_installed_and_never_uninstalled(tmp_path):
    """The main environment's copy of a pinned distribution is linked in before pip runs, and pip
    takes it as installed. When another of its builds is needed after all, pip installs that one
    into the environment, leaves the main copy alone (outside the environment) and the link goes."""
    from posttrain.distributed.shared_packages import shared_from_main

    wheels, main_site = tmp_path / "wheels", tmp_path / "main-site"
    wheels.mkdir()
    main_wheel = _local_wheel(tmp_path, "WHERE = 'main'\n", name="hello-shared", version="1.0+main")
    _local_wheel(wheels, "WHERE = 'other'\n", name="hello-shared", version="1.0+other")
    _local_wheel(wheels, "", name="hello-user", version="1.0", requires=("hello-shared==1.0",))
    _local_wheel(wheels, "", name="hello-picky", version="1.0", requires=("hello-shared==1.0+other",))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(main_site), str(main_wheel)], check=True)
    (main_site / "hello_isolated").mkdir()  # another distribution of the main environment: must not show

    def build(*requirements: str) -> tuple[IsolatedEnvSpec, str, list[str]]:
        spec = IsolatedEnvSpec(
            "unit-test", requirements, pip_args=("--no-index", "--find-links", str(wheels)), upgrade_pip=False,
            shared=shared_from_main(requirements, site_dirs=[str(main_site)]))
        lines: list[str] = []
        return spec, str(ensure_isolated_env(spec, tmp_path / "envs", log=lines.append)), lines

    def where(python: str) -> str:
        return subprocess.run([python, "-c", "import hello_shared, importlib.util as u; "
                               "print(hello_shared.WHERE, u.find_spec('hello_isolated'))"],
                              capture_output=True, text=True, check=True).stdout.strip()

    spec, python, lines = build("hello-shared==1.0", "hello-user==1.0")
    assert [d.name for d in spec.shared] == ["hello-shared"]
    assert "[posttrain]   sharing hello-shared 1.0+main with the main environment (linked, not installed)" in lines
    assert "Requirement already satisfied: hello-shared==1.0" in log_path(spec, tmp_path / "envs").read_text()
    assert where(python) == "main None"  # the main copy, and nothing else of the main environment
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert not list(site.glob("hello_shared*")) and list(site.glob("hello_user-1.0.dist-info"))

    spec, python, _ = build("hello-shared==1.0", "hello-picky==1.0")
    assert [d.name for d in spec.shared] == ["hello-shared"]
    assert "Not uninstalling hello-shared" in log_path(spec, tmp_path / "envs").read_text()
    assert where(python) == "other None"
    assert (main_site / "hello_shared" / "__init__.py").read_text() == "WHERE = 'main'\n"  # untouched
    assert not list((tmp_path / "envs" / "shared" / env_dir(spec, Path("/")).name).iterdir())  # its links gone

    # A failed build leaves neither the environment nor its links, and the main copy as it was.
    with pytest.raises(IsolatedEnvError, match="pip could not install posttrain-no-such-package==1.0"):
        build("hello-shared==1.0", "posttrain-no-such-package==1.0")
    assert sorted(p.name for p in (tmp_path / "envs" / "shared").iterdir()) == sorted(
        p.name for p in (tmp_path / "envs").iterdir() if p.is_dir() and p.name != "shared")
    assert (main_site / "hello_shared" / "__init__.py").read_text() == "WHERE = 'main'\n"
