"""Every code block of README.md and docs/ runs, as written (the rules: docs/development.md).

Each page's `python` blocks run in order in one empty namespace, as they would pasted into a
fresh Python (imports included), in a temporary working directory; blocks inside a collapsed
`??? example` (an indented fence) run too, and hold a page's setup.
`<!-- docs-test: setup ... -->` comments hold hidden code run at their place in a copy of the
namespace: checks and skips, whose names the page's blocks never see (a name a reader's block
uses must be defined on the page, where the reader sees it). `<!-- docs-test: skip REASON -->`
before a block leaves it out, `<!-- docs-test: slow REASON -->` anywhere on a page moves
its test to `-m slow`, and `<!-- docs-test: devices N -->` runs the page in a subprocess with
N virtual CPU devices (a mesh's examples). `console` blocks are sessions: each
`$ python -m offlax plan ...` line runs the command line in this process and its output must be
the lines that follow it. Other fence languages (bash, text, none) are shown, not run.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w-]*)")
_MARK = re.compile(r"^\s*<!-- docs-test: (setup|skip|slow|devices)\b(.*)$")


@dataclasses.dataclass
class Block:
  lang: str  # "python" (a block or a hidden setup) or "console"
  code: str
  line: int  # of the first line of code in the page, for tracebacks
  skip: bool = False
  hidden: bool = False  # a `docs-test: setup` comment


@dataclasses.dataclass
class Page:
  blocks: list[Block]
  slow: bool = False
  devices: int = 1


def parse(text: str) -> Page:
  """A page's blocks in order, and how its test runs."""
  lines = text.split("\n")
  page = Page([])
  blocks, skip_next, i = page.blocks, False, 0
  while i < len(lines):
    mark, fence = _MARK.match(lines[i]), _FENCE.match(lines[i])
    if mark and mark.group(1) == "setup":
      end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->")
      blocks.append(Block("python", "\n".join(lines[i + 1 : end]), i + 2, hidden=True))
      i = end
    elif mark and mark.group(1) == "devices":
      page.devices = int(mark.group(2).split()[0])
    elif mark:
      page.slow = page.slow or mark.group(1) == "slow"
      skip_next = skip_next or mark.group(1) == "skip"
    elif fence:
      indent, ticks, lang = fence.groups()
      end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks)
      body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
      blocks.append(Block(lang, "\n".join(body), i + 2, skip=skip_next))
      skip_next, i = False, end
    i += 1
  return page


def _page_params():
  for page in PAGES:
    marks = [pytest.mark.slow] if parse(page.read_text()).slow else []
    yield pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks)


def needs(argv: list[str]) -> str | None:
  """What a `python -m offlax plan` command needs that is not installed, or None.

  `--model NAME` reads a Tunix model config unless NAME is a file of shapes or a checkpoint's
  folder: the README's commands install no Tunix (CI's second venv does).
  """
  model = argv[argv.index("--model") + 1] if "--model" in argv[:-1] else None
  if model is None or model.endswith(".json") or os.path.exists(model):
    return None
  try:
    import tunix  # noqa: F401
  except ImportError:
    return f"--model {model} needs Tunix (pip install -c constraints.txt google-tunix)"
  return None


def run_console(code: str, where: str, skipped: list[str] | None = None) -> int:
  """Runs each `$ python -m offlax plan` of a session; returns how many ran.

  A command that needs what is not installed is left out, and named in `skipped`.
  """
  from offlax.__main__ import main

  ran = 0
  for command, expected in re.findall(r"^\$ (.*)\n((?:(?!\$ ).*\n?)*)", code, re.M):
    argv = shlex.split(command)
    if argv[:4] != ["python", "-m", "offlax", "plan"] or {"--measure", "--compile"} & set(argv):
      continue  # other commands need a store or a GPU compiler: shown, not run
    if (missing := needs(argv)) is not None:
      if skipped is None:
        pytest.skip(f"{where}: {missing}")
      skipped.append(f"{where}: {missing}")
      continue
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      main(argv[3:])
    assert out.getvalue().rstrip("\n") == expected.rstrip("\n"), f"{where}: $ {command}"
    ran += 1
  return ran


@pytest.mark.parametrize("page", list(_page_params()))
def test_code_blocks_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # what the blocks write (plots, stores) lands here
  devices = parse(page.read_text()).devices
  if devices == 1:
    run_page(page)
    return
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_docs; "
  code += f"test_docs.run_page(test_docs.ROOT / {str(page.relative_to(ROOT))!r})"
  env = {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": str(ROOT)}
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-4000:]


def run_page(page: pathlib.Path) -> None:
  """Runs a page's blocks in order in one namespace, in the current directory.

  A console command that needs what is not installed (Tunix) is left out and the rest of the
  page runs; the test then skips, naming what it left out.
  """
  namespace: dict = {"__name__": "__docs__"}  # empty: each page imports what it uses
  skipped: list[str] = []
  for block in parse(page.read_text()).blocks:
    where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{block.line}"
    if block.skip:
      continue
    if block.lang == "python":
      tree = ast.parse(block.code, filename=where)
      ast.increment_lineno(tree, block.line - 1)
      # a hidden block's names stay out of the page's namespace: a reader never sees them
      exec(compile(tree, str(page), "exec"), dict(namespace) if block.hidden else namespace)
    elif block.lang == "console":
      run_console(block.code + "\n", where, skipped)
  if skipped:
    pytest.skip(f"the rest of the page ran; left out: {'; '.join(skipped)}")


def test_parse_finds_setup_skip_slow_and_console():
  text = (
    "<!-- docs-test: slow (compiles a lot) -->\n"
    "<!-- docs-test: setup\nx = 1\n-->\n"
    "```python\ny = x + 1\n```\n"
    "<!-- docs-test: skip (needs a GPU) -->\n"
    "  ```python\n  raise SystemExit\n  ```\n"
    "```console\n$ python -m offlax plan --help\n```\n"
    "```bash\nrm -rf /\n```\n"
    "<!-- docs-test: devices 8 -->\n"
  )
  page = parse(text)
  blocks = page.blocks
  assert page.slow and page.devices == 8
  assert [(b.lang, b.code, b.skip) for b in blocks] == [
    ("python", "x = 1", False),
    ("python", "y = x + 1", False),
    ("python", "raise SystemExit", True),
    ("console", "$ python -m offlax plan --help", False),
    ("bash", "rm -rf /", False),
  ]
  assert [b.line for b in blocks[:2]] == [3, 6]


def test_parse_runs_a_collapsed_setup_and_isolates_a_hidden_one(tmp_path):
  """A `??? example` block's indented fence runs; a hidden setup's names do not leak."""
  text = (
    '??? example "Setup (run this first)"\n\n'
    "    ```python\n    x = 1\n\n    if x:\n      y = 2\n    ```\n\n"
    "<!-- docs-test: setup\nassert x == 1\nz = 3\n-->\n"
    "```python\nw = x + y\n```\n"
  )
  blocks = parse(text).blocks
  assert [(b.code, b.hidden) for b in blocks] == [
    ("x = 1\n\nif x:\n  y = 2", False),
    ("assert x == 1\nz = 3", True),
    ("w = x + y", False),
  ]
  page = tmp_path / "page.md"
  page.write_text(text)
  run_page(page)  # the collapsed block defines x and y; the hidden one sees x
  page.write_text(text + "```python\nprint(z)\n```\n")
  with pytest.raises(NameError, match="'z'"):
    run_page(page)  # a name only a hidden setup defines is not on the page


def test_a_console_session_must_match():
  session = "$ python -m offlax plan --params 1M --device-mem 24GB --host-mem 8GB\nwrong\n"
  with pytest.raises(AssertionError, match="plan --params 1M"):
    run_console(session, "here")


def test_readme_opens_with_the_two_commands():
  """The front page's first block: install and run the quickstart, then the test command; CI
  runs these two lines as they are (`.ci/run` reads them from the README, it does not copy)."""
  readme = (ROOT / "README.md").read_text()
  first = parse(readme).blocks[0]
  install, test = first.code.split("\n")
  assert first.lang == "bash" and readme.index("```") < readme.index("\n## ")
  assert install.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
  assert install.endswith("pip install -e . && python examples/quickstart.py")
  assert (ROOT / "examples" / "quickstart.py").exists()
  assert test == "pip install -e '.[test]' && python -m pytest -m \"not slow\" -q"
  ci = ROOT / ".ci" / "run"
  assert "OFFLAX_CI_PRINT_README" in ci.read_text()  # (else running it would run all of CI)
  env = {**os.environ, "OFFLAX_CI_PRINT_README": "1"}
  out = subprocess.run([str(ci)], env=env, capture_output=True, text=True, check=True).stdout
  assert out.split("\n") == [install, test, ""]


# Imported first by the subprocess of the next test (`-p without_extras`, before the conftest
# imports jax): Tunix, qwix, transformers and XLA's GPU compiler (its jax plugin) are not there.
_WITHOUT_EXTRAS = """
import importlib.abc, sys

HIDDEN = ("tunix", "qwix", "transformers", "safetensors",
          "jax_cuda12_plugin", "jax_cuda12_pjrt", "jax_plugins.xla_cuda12")

class Hide(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if any(name == h or name.startswith(h + ".") for h in HIDDEN):
      raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
    return None

sys.meta_path.insert(0, Hide())
"""


@pytest.mark.slow  # 20 s of subprocess; .ci/run runs the command in a bare venv
def test_readme_test_command_without_the_extras(tmp_path):
  """The README's test command where only `.[test]` is installed: collection completes, and the
  default cases that need Tunix or the GPU compiler skip, naming it (collection stopped at
  tests/tunix_inputs.py's `import qwix`; docs/planner.md failed on `--model qwen3_14b`)."""
  (tmp_path / "without_extras.py").write_text(_WITHOUT_EXTRAS)
  path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
  env = {**os.environ, "PYTHONPATH": path}
  pytest_ = [
    sys.executable,
    "-m",
    "pytest",
    "-n",
    "0",
    "-p",
    "without_extras",
    "-p",
    "no:cacheprovider",
  ]
  run = lambda *args: subprocess.run(
    [*pytest_, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
  )
  collected = run("-m", "not slow", "-q", "--collect-only")
  assert collected.returncode == 0, collected.stdout[-4000:] + collected.stderr[-2000:]
  assert " error" not in collected.stdout.splitlines()[-1], collected.stdout[-4000:]
  assert "could not import 'tunix'" in collected.stdout  # the hiding works
  pages = [
    f"tests/test_docs.py::test_code_blocks_run[docs/{p}.md]"
    for p in ("planner", "tunix_full_finetune")
  ]
  ran = run("-q", "-rs", *pages, "tests/test_gpu_compile.py")
  assert ran.returncode == 0, ran.stdout[-4000:]
  assert "docs/planner.md:" in ran.stdout and "--model qwen3_14b needs Tunix" in ran.stdout
  assert "could not import 'tunix'" in ran.stdout and "needs offlax[gpu-compile]" in ran.stdout
  assert " passed" not in ran.stdout.splitlines()[-1], ran.stdout[-2000:]  # all skipped


def test_a_command_that_needs_tunix_is_left_out_without_it(tmp_path, monkeypatch):
  """The rest of the page runs; the test skips, naming the command it left out."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setitem(sys.modules, "tunix", None)  # `import tunix` raises ImportError
  page = tmp_path / "page.md"
  page.write_text(
    "```console\n$ python -m offlax plan --model qwen3_14b --device-mem 24GB\nwhatever\n```\n"
    "```python\nopen('ran', 'w').close()\n```\n"
  )
  with pytest.raises(pytest.skip.Exception, match=r"page.md:2: --model qwen3_14b needs Tunix"):
    run_page(page)
  assert (tmp_path / "ran").exists()
  assert needs(["python", "-m", "offlax", "plan", "--params", "7B"]) is None
  assert needs(["python", "-m", "offlax", "plan", "--model", str(tmp_path)]) is None  # a folder


def test_readme_links_resolve():
  """mkdocs checks the links of docs/; the README is outside it."""
  readme = (ROOT / "README.md").read_text()
  links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
  local = [link for link in links if "://" not in link]
  assert local, "the front page links into docs/"
  assert [link for link in local if not (ROOT / link).exists()] == []


def test_every_public_name_has_an_api_entry():
  """Each name of the top level and of its namespaces, at its path (`offlax.errors.X`)."""
  import offlax

  api = (ROOT / "docs" / "api.md").read_text()
  documented = re.findall(r"^::: (offlax\.[\w.]+)$", api, re.M)
  namespaces = ("checkpoint", "errors", "extend")
  public = [f"offlax.{n}" for n in offlax.__all__ if n not in namespaces] + [
    f"offlax.{ns}.{n}" for ns in namespaces for n in getattr(offlax, ns).__all__
  ]
  assert sorted(documented) == sorted(public)
