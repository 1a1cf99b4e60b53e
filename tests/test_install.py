"""`pip install -e .` as the README gives it: the clone's folder name does not shadow offlax."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_editable_install_is_a_path_entry():
  """setuptools writes a .pth path entry (not an import hook) for a package-dir of {"": "."}.

  An import hook comes after Python's own path finder, which takes a folder named
  `offlax` in the working directory (the clone, no __init__.py) as a namespace package
  first; a path entry's regular package wins over it (setuptools' editable_wheel
  `_select_strategy`: a static .pth where package_dir is {"": dir} and the layout simple).
  """
  import tomllib

  config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  assert config["package-dir"] == {"": "."}
  assert config["packages"]["find"]["include"] == ["offlax*"]


@pytest.mark.slow  # test_planner.py::test_cli runs the command by default
def test_plan_runs_from_the_folder_holding_a_clone_named_offlax(tmp_path):
  parent = tmp_path / "work"
  parent.mkdir()
  os.symlink(ROOT, parent / "offlax")  # `git clone ... offlax`, then run from its parent
  site = tmp_path / "site"
  site.mkdir()
  (site / "__editable__.offlax-0.1.0.pth").write_text(f"{ROOT}\n")  # what the install writes
  code = textwrap.dedent(f"""
    import runpy, site, sys
    site.addsitedir({str(site)!r})  # as at start-up, after the working directory
    sys.argv = ["python -m offlax", *sys.argv[1:]]
    runpy.run_module("offlax", run_name="__main__", alter_sys=True)
  """)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["JAX_PLATFORMS"] = "cpu"
  for args in (["plan", "--help"], ["plan", "--params", "1e9", "--device-mem", "80GB",
                                    "--host-mem", "64GB"]):  # fmt: skip
    result = subprocess.run(
      [sys.executable, "-c", code, *args], cwd=parent, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AttributeError" not in result.stderr
  assert "offlax plan: 1,000,000,000 params" in result.stdout
