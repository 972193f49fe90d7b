"""README's two commands stay true."""

import re
import tomllib

from conftest import REPO


def commands():
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)[:2]


def test_ci_runs_readme_test_command():
    main_job, tests = commands()
    ci = (REPO / ".ci" / "run").read_text()
    assert tests in ci.splitlines()
    script = re.fullmatch(r"bash (\S+)", tests).group(1)
    lines = (REPO / script).read_text().splitlines()
    assert "bash scripts/install-test-deps.sh" in lines
    # the venv's pytest, README's arguments passed on, test files spread over the workers (xdist is
    # in the test extra, so a fresh venv has it)
    assert lines[-1] == 'exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"'
    assert any(dep.startswith("pytest-xdist==") for dep in tomllib.loads((REPO / "pyproject.toml").read_text())
               ["project"]["optional-dependencies"]["test"])


STUB = "#!/bin/sh\necho \"$(basename \"$0\") $*\" >> {log}\n{then}\n"


def deps_run(tmp_path, *, hide: bool, uid: int | None = None, sudo: bool = True):
    """scripts/install-test-deps.sh on this machine with bwrap and PostgreSQL hidden (``hide``) in a
    private mount namespace, apt-get (and sudo) replaced by stubs that log their command line."""
    import shutil
    import subprocess

    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap missing: apt-get install bubblewrap (scripts/install-test-deps.sh installs it)"
    stubs, log = tmp_path / "stubs", tmp_path / "calls.log"
    stubs.mkdir(parents=True)
    (stubs / "apt-get").write_text(STUB.format(log=log, then=""))
    if sudo:
        (stubs / "sudo").write_text(STUB.format(log=log, then='exec "$@"'))
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    argv = [bwrap, "--dev-bind", "/", "/", "--bind", str(tmp_path), str(tmp_path)]
    if hide:
        argv += ["--ro-bind", "/dev/null", bwrap, "--tmpfs", "/usr/lib/postgresql"]
    if uid is not None:
        argv += ["--unshare-user", "--uid", str(uid)]
    env = {"PATH": f"{stubs}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([*argv, "bash", str(REPO / "scripts" / "install-test-deps.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, (log.read_text().splitlines() if log.exists() else [])


def test_the_test_script_installs_what_is_missing_and_says_so(tmp_path):
    done, calls = deps_run(tmp_path / "nothing", hide=False)
    assert done.returncode == 0 and done.stderr == "" and calls == []
    done, calls = deps_run(tmp_path / "root", hide=True)
    assert done.returncode == 0, done.stderr
    assert "installing bubblewrap postgresql (apt-get install bubblewrap postgresql)" in done.stderr
    assert calls == ["apt-get update -qq", "apt-get install -y -qq --no-install-recommends bubblewrap postgresql"]
    done, calls = deps_run(tmp_path / "user", hide=True, uid=1000)
    assert done.returncode == 0 and calls[0] == "sudo apt-get update -qq", (done.stderr, calls)
    done, calls = deps_run(tmp_path / "nosudo", hide=True, uid=1000, sudo=False)
    assert done.returncode == 1 and calls == []
    assert "not root and no sudo; as root run: apt-get install -y bubblewrap postgresql" in done.stderr
