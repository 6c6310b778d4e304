"""The README's install, the way a newcomer runs it: a clone in a folder named ``sparsemap``,
the README's command in a fresh virtual environment, and Python started in the folder above.

There, the clone (a folder without ``__init__.py``) is a namespace package ``sparsemap`` to
Python's path search; an editable install must still give the real package. One test, of
about 30 s: pip sets up its isolated build environment as for any user; the compiled
modules of this checkout are copied into the clone, so the build reuses them (setup.py
does for an in-place module newer than its sources) instead of compiling for minutes.
The full build from a clean clone is what CI's run of the README's commands does.
"""
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import sparsemap

ROOT = pathlib.Path(sparsemap.__file__).resolve().parent.parent   # the checkout under test

SCRIPT = """\
import pathlib, sys
import numpy as np
import sparsemap as sm
from sparsemap import Factor, TreeFactor
r = sm.solve(TreeFactor(3), np.arange(16.0).reshape(4, 4))
assert isinstance(TreeFactor(3), Factor) and r.converged
print(pathlib.Path(sm.__file__).resolve())
"""


def readme_install_command():
    """The install half of the README's test command (its second line), as pip arguments."""
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    install = first_block.group(1).splitlines()[1].split("&&")[0]
    args = shlex.split(install)
    assert args[:2] == ["pip", "install"] and "-e" in args, install
    return args[1:]


def clone_into(dest):
    """The files a clone of this checkout has (its tracked files, as they are now, so
    uncommitted edits count), plus this checkout's compiled modules."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for pyx in (dest / "sparsemap").rglob("*.pyx"):
        built = ROOT / pyx.relative_to(dest).with_name(pyx.stem + suffix)
        if built.exists():
            shutil.copy(built, pyx.with_name(built.name))   # newer than the copied sources


def test_readme_install_of_a_clone_named_sparsemap_imports_from_the_folder_above(tmp_path):
    clone = tmp_path / "sparsemap"
    clone_into(clone)
    venv = tmp_path / "venv"
    # --system-site-packages: the test extra's dependencies (torch among them) are there
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True)
    python = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = subprocess.run([python, "-m", "pip", *readme_install_command()], cwd=clone, env=env,
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    installed = clone / "sparsemap" / "__init__.py"

    (tmp_path / "script.py").write_text(SCRIPT)
    runs = {"a script in the folder above": ([python, "script.py"], tmp_path),
            "python -c in the folder above": ([python, "-c", SCRIPT], tmp_path),
            "python -c in the clone": ([python, "-c", SCRIPT], clone),
            "python -c elsewhere": ([python, "-c", SCRIPT], venv)}
    for what, (cmd, cwd) in runs.items():
        run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        assert run.returncode == 0, f"{what}:\n{run.stderr[-3000:]}"
        assert pathlib.Path(run.stdout.strip()) == installed.resolve(), what
